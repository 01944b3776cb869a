"""How the shared layers meet across attention-data-parallel ranks.

Attention is rank-local. The MLP is tensor-parallel and the MoE experts are expert-parallel, so
those layers first gather every rank's tokens, compute their shard over all of them, then sum
the shards and keep this rank's slice. Every rank must join with the same number of tokens: the
executor pads each rank's batch to the agreed maximum before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


CALLS = {"collectives": 0}  # counted for the benchmarks' collectives-per-pass figure


@dataclass(frozen=True)
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: object = None  # a torch.distributed process group; None for the default group

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of a dimension split evenly across ranks."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) is not divisible by the {self.world_size} ADP ranks")
        per = size // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H] on every rank -> [world_size * T, H], rank-major."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist
        CALLS["collectives"] += 1
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def reduce_to_local(self, y: torch.Tensor) -> torch.Tensor:
        """Sum partial results of all ranks over the gathered tokens, keep this rank's slice."""
        if self.world_size == 1:
            return y
        import torch.distributed as dist
        CALLS["collectives"] += 1
        dist.all_reduce(y, group=self.group)
        per = y.shape[0] // self.world_size
        return y[self.rank * per:(self.rank + 1) * per]


SINGLE = ParallelContext()
