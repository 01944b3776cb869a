"""Engine configuration: one plain dataclass, filled from the command line or by tests."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        # a rank process runs on its own GPU: "cuda:<index>" (the CLI takes plain "cuda")
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available on this machine")

    @property
    def decode_query_len(self) -> int:
        return 1 + self.draft_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_args(cls, args) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
