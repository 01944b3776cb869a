"""The executor's control-plane collectives: a small all-gather of integers per call.

`TorchCollectives` uses torch.distributed (gloo on CPU, NCCL on CUDA); `SingleRank` is the
no-ADP case. Both count their calls, so the cost of the loop in collectives is measurable.
"""

from __future__ import annotations

import torch


class SingleRank:
    rank, world_size = 0, 1

    def __init__(self):
        self.calls = 0

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        self.calls += 1
        return [list(values)]


class TorchCollectives:
    def __init__(self, rank: int, world_size: int, device: str = "cpu", group=None):
        self.rank, self.world_size, self.device, self.group = rank, world_size, device, group
        self.calls = 0

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch.distributed as dist

        self.calls += 1
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        return out.view(self.world_size, len(values)).tolist()
