"""Engine configuration: one plain dataclass, filled from the command line or by tests.

Its defaults are the engine's: the command line reads them from here, and a test keeps the
InferenceFleet CRD's engine defaults (the public contract) equal to them. Importing this module
does not import torch (the CLI imports it in the operator's image too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


@dataclass
class EngineConfig:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    kv_blocks: int = 512  # per rank
    tokens_per_block: int = 16
    max_num_tokens: int = 2048
    max_batch_size: int = 64
    max_num_active_requests: int = 256
    draft_tokens: int = 0  # speculative tokens per decode step (the decode query length is 1 + this)
    seed: int = 0

    def validate(self) -> None:
        for name in ("kv_blocks", "tokens_per_block", "max_num_tokens", "max_batch_size",
                     "max_num_active_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available on this machine")

    @property
    def decode_query_len(self) -> int:
        return 1 + self.draft_tokens

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def with_model(self, model: str) -> "EngineConfig":
        """The same settings for a resolved model (a URI's local directory)."""
        return dataclasses.replace(self, model=model)

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
