"""Checkpoint tensors into parameters: read shard by shard, slice before reading, place by layout.

A checkpoint is read one safetensors file at a time, memory-mapped; a tensor is read only when a
parameter asks for it and then only the slice this rank keeps (`CheckpointTensor[index]`), so a
rank never holds a whole checkpoint, or another rank's shard, in memory.

Each parameter carries a `weight_loader(param, tensor, **shard) -> elements written`: the default
copies a tensor of the parameter's shape; the packed and parallel layers attach the loaders below,
which check the tensor's full shape against the config, pick the slice and the place (rows of a
packed qkv or gate_up, this rank's columns of a tensor-parallel projection, this rank's experts).
The loader adds up what each parameter was given, so a part the checkpoint lacks is found.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from adpfleet.runtime.model.errors import ModelLoadError


class CheckpointTensor(Protocol):
    """A tensor not read yet: its shape, and `[index]` reads just that slice (torch.Tensor fits)."""
    shape: tuple[int, ...]

    def __getitem__(self, index) -> torch.Tensor: ...


class WeightMismatch(Exception):
    """A checkpoint tensor that does not fit its parameter (the loader adds the file and name)."""


class _SafetensorsSlice:
    def __init__(self, handle, name: str):
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._slice[index]


def read_checkpoint(file: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, unread tensor) of one safetensors file, memory-mapped while it is iterated."""
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
    with handle as f:
        for name in f.keys():
            yield name, _SafetensorsSlice(f, name)


def read(tensor: CheckpointTensor, expected: tuple[int, ...], index=slice(None)) -> torch.Tensor:
    """Checks the tensor's full shape, then reads only `index` of it."""
    if tuple(tensor.shape) != tuple(expected):
        raise WeightMismatch(f"has shape {tuple(tensor.shape)}, config.json implies {tuple(expected)}")
    return tensor[index]


def default_loader(param: torch.Tensor, tensor: CheckpointTensor) -> int:
    param.data.copy_(read(tensor, tuple(param.shape)))
    return param.numel()


def packed_loader(sizes: dict[str, int]):
    """Stacked projections (q/k/v of one matmul) along dim 0: `part` names the block."""
    offsets, start = {}, 0
    for part, size in sizes.items():
        offsets[part], start = (start, start + size), start + size

    def load(param, tensor, part: str) -> int:
        lo, hi = offsets[part]
        return param.data[lo:hi].copy_(read(tensor, (hi - lo, *param.shape[1:]))).numel()
    return load


def column_parallel_loader(full: int, lo: int, hi: int, parts: tuple[str, ...]):
    """A tensor-parallel up projection, rows [lo, hi) of each of `parts` stacked: the checkpoint
    has each part whole ([full, in]); this rank reads its rows."""
    local = hi - lo

    def load(param, tensor, part: str) -> int:
        k = parts.index(part)
        return param.data[k * local:(k + 1) * local].copy_(read(tensor, (full, param.shape[1]), slice(lo, hi))).numel()
    return load


def row_parallel_loader(full: int, lo: int, hi: int):
    """A tensor-parallel down projection: the checkpoint's [out, full]; this rank reads columns."""
    def load(param, tensor) -> int:
        return param.data.copy_(read(tensor, (param.shape[0], full), (slice(None), slice(lo, hi)))).numel()
    return load


def expert_loader(num_experts: int, first: int, last: int, parts: tuple[str, ...] = ()):
    """Experts [first, last) of `num_experts` stacked on dim 0, each of `parts` stacked on dim 1.
    A tensor is one expert's part (`expert`, `part`) or all experts at once (no shard ids); other
    ranks' experts are never read."""
    def load(param, tensor, expert: int | None = None, part: str | None = None) -> int:
        per_expert = tuple(param.shape[1:])
        if expert is None:
            return param.data.copy_(read(tensor, (num_experts, *per_expert), slice(first, last))).numel()
        if expert >= num_experts:
            raise WeightMismatch(f"is for expert {expert}, but config.json has num_local_experts={num_experts}")
        if not first <= expert < last:
            return 0  # another rank's expert
        dest = param.data[expert - first]
        if part is not None:
            rows = per_expert[0] // len(parts)
            k = parts.index(part)
            dest = dest[k * rows:(k + 1) * rows]
        return dest.copy_(read(tensor, tuple(dest.shape))).numel()
    return load


def set_loader(param: torch.nn.Parameter, loader) -> None:
    param.weight_loader = loader


_INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "trunc_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def empty_parameters(dtype: torch.dtype):
    """Parameters created inside are allocated in `dtype` (no float32 copy first) and not
    randomly initialised (the checkpoint overwrites them; initialising them took three quarters
    of a load), as transformers does when it loads."""
    import torch.nn.init as init

    before, saved = torch.get_default_dtype(), {name: getattr(init, name) for name in _INIT_FUNCTIONS}
    torch.set_default_dtype(dtype)
    for name in _INIT_FUNCTIONS:
        setattr(init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        torch.set_default_dtype(before)
        for name, fn in saved.items():
            setattr(init, name, fn)
