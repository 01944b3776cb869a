"""Load a CausalLM from a Hugging Face directory (`config.json` + `*.safetensors`), for any
registered architecture.

The model is built directly in its dtype and on its device, its parameters allocated but not
initialised; then each checkpoint file is read in turn (memory-mapped, shard by shard) and each
tensor goes to the parameter its architecture maps it to, whose weight loader reads only the slice
this rank keeps and says how much it wrote. A parameter not wholly written at the end is one the
checkpoint lacks (or lacks a part of): it is named, never left uninitialised.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch

from adpfleet.runtime.model.causal_lm import CausalLM
from adpfleet.runtime.model.checkpoint import checkpoint_files
from adpfleet.runtime.model.config import ModelConfig, ModelLoadError
from adpfleet.runtime.model.parallel import SINGLE, ParallelContext
from adpfleet.runtime.model.registry import architecture
from adpfleet.runtime.model.tiny import TINY_MODELS, tiny_checkpoint
from adpfleet.runtime.model.weights import (CheckpointTensor, WeightMismatch, default_loader,
                                            empty_parameters, read_checkpoint)

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

Source = tuple[Path, Iterable[tuple[str, CheckpointTensor]]]


def load_model(spec: str | Path, par: ParallelContext = SINGLE, device: str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> CausalLM:
    """A built-in tiny model by name, or a Hugging Face model directory."""
    if str(spec) in TINY_MODELS:
        cfg, weights = tiny_checkpoint(str(spec), seed)
        return assemble(cfg, [(Path(f"<built-in {spec}>"), weights.items())], par, device, dtype)
    path = Path(spec)
    cfg = ModelConfig.from_dir(path)
    return assemble(cfg, ((file, read_checkpoint(file)) for file in checkpoint_files(path)), par, device, dtype)


def assemble(cfg: ModelConfig, sources: Iterable[Source], par: ParallelContext, device: str,
             dtype: torch.dtype) -> CausalLM:
    """Build the model and fill it from (file, iterable of (name, tensor)) pairs, one file at a time."""
    arch = architecture(cfg.model_type)
    with torch.device(device), empty_parameters(dtype):
        model = CausalLM(cfg, par)
    params = dict(model.named_parameters(remove_duplicate=False))
    written: dict[int, int] = {}  # elements written, by parameter (tied ones are one parameter)
    with torch.no_grad():
        for file, named in sources:
            for name, tensor in named:
                if not _IGNORED.search(name):
                    param, n = _load_tensor(cfg, arch.parameter_for(name), params, name, tensor, file)
                    written[id(param)] = written.get(id(param), 0) + n
    for name, p in model.named_parameters():
        if written.get(id(p), 0) < p.numel():
            raise ModelLoadError(f"the checkpoint has no weights for parameter {name!r} "
                                 f"(expected for {cfg.model_type} with {cfg.num_hidden_layers} layers)")
    return model.to(device=device, dtype=dtype).eval()


def _load_tensor(cfg: ModelConfig, target: tuple[str, dict], params: dict, name: str,
                 tensor: CheckpointTensor, file: Path) -> tuple[torch.nn.Parameter, int]:
    """The parameter the tensor went to and how many of its elements it wrote."""
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= cfg.num_hidden_layers:
        raise ModelLoadError(f"{file}: tensor {name!r} is for layer {layer.group(1)}, but config.json has "
                             f"num_hidden_layers={cfg.num_hidden_layers}")
    param_name, shard = target
    param = params.get(param_name)
    if param is None:
        raise ModelLoadError(f"{file}: unexpected tensor {name!r} for a {cfg.model_type} model "
                             f"(no parameter {param_name!r}; is config.json from another model?)")
    try:
        return param, getattr(param, "weight_loader", default_loader)(param, tensor, **shard)
    except WeightMismatch as e:
        raise ModelLoadError(f"{file}: tensor {name!r} {e}") from None
