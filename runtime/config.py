"""Engine configuration: one plain dataclass, filled from the command line or by tests.

Its defaults are the engine's: the command line reads them from here, and a test keeps the
InferenceFleet CRD's engine defaults (the public contract) equal to them. Importing this module
does not import torch (the CLI imports it in the operator's image too).
"""

from __future__ import annotations

import dataclasses
import re
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
    # speculative decoding: draft tokens per decode step (the decode query is 1 + this many tokens),
    # proposed by prompt lookup (n-grams of prompt_lookup_max down to prompt_lookup_min tokens)
    draft_tokens: int = 0
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    # ADP: admission keeps the padding dummy's blocks free (off only to measure what it rescues)
    padding_reserve: bool = True
    # per rank: full KV blocks kept under their chained hash and shared by requests with the same
    # prefix (runtime/engine/kv_cache.py); off only to compare
    prefix_cache: bool = True
    seed: int = 0

    def validate(self) -> None:
        for name in ("kv_blocks", "tokens_per_block", "max_num_tokens", "max_batch_size",
                     "max_num_active_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        for name in ("draft_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (name != "draft_tokens"):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {int(name != 'draft_tokens')}, "
                                 f"got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"--prompt-lookup-min ({self.prompt_lookup_min}) must not exceed "
                             f"--prompt-lookup-max ({self.prompt_lookup_max})")
        if self.max_num_tokens < self.decode_query_len:
            raise ValueError(f"--max-num-tokens ({self.max_num_tokens}) must fit one decode query of "
                             f"1 + --draft-tokens = {self.decode_query_len} tokens")
        if self.max_request_tokens < 2:
            raise ValueError(f"--kv-blocks {self.kv_blocks} of {self.tokens_per_block} tokens leave no room for "
                             "a request beside the padding reserve and the draft lookahead")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        # a rank process runs on its own GPU: "cuda:<index>" (the CLI takes the words in DEVICES)
        if self.device not in DEVICES and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda"):  # torch only then: a CPU server's own process never imports it
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA device is available on this machine")

    @property
    def decode_query_len(self) -> int:
        return 1 + self.draft_tokens

    @property
    def max_request_tokens(self) -> int:
        """The most `prompt + max_tokens` one request may ask for, so that it fits an otherwise empty
        rank: the KV cache less the padding dummy's reserve and less the draft lookahead (the last
        decode query writes up to `draft_tokens` positions past the request's final token)."""
        reserve = -(-self.decode_query_len // self.tokens_per_block) if self.padding_reserve else 0
        return (self.kv_blocks - reserve) * self.tokens_per_block - self.draft_tokens

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
