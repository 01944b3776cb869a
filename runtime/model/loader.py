"""Load a CausalLM from a Hugging Face directory (`config.json` + `*.safetensors`).

Checkpoint names are the Hugging Face ones. Stacked parameters (qkv, gate/up, experts) are filled
piece by piece, and each rank keeps only its shard of the MLP and its own experts. Parameters
start as NaN, so a tensor the checkpoint lacks is found and named, not silently left random.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from adpfleet.runtime.model.config import ModelConfig, ModelLoadError
from adpfleet.runtime.model.llama import CausalLM
from adpfleet.runtime.model.parallel import SINGLE, ParallelContext
from adpfleet.runtime.model.tiny import TINY_MODELS, tiny_checkpoint

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    return files


def load_model(spec: str | Path, par: ParallelContext = SINGLE, device: str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> CausalLM:
    """A built-in tiny model by name, or a Hugging Face model directory."""
    if str(spec) in TINY_MODELS:
        cfg, weights = tiny_checkpoint(str(spec), seed)
        return assemble(cfg, [(Path(f"<built-in {spec}>"), weights.items())], par, device, dtype)
    from safetensors import safe_open

    path = Path(spec)
    cfg = ModelConfig.from_dir(path)

    def tensors(file: Path):
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    return assemble(cfg, [(file, tensors(file)) for file in checkpoint_files(path)], par, device, dtype)


def assemble(cfg: ModelConfig, sources, par: ParallelContext, device: str, dtype: torch.dtype) -> CausalLM:
    """Build the model and fill it from (file, iterable of (name, tensor)) pairs."""
    model = CausalLM(cfg, par)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
        params = dict(model.named_parameters(remove_duplicate=False))
        for file, named in sources:
            for name, tensor in named:
                if not _IGNORED.match(name):
                    _load_tensor(cfg, par, params, name, tensor, file)
    for name, p in model.named_parameters():
        if torch.isnan(p).any():
            raise ModelLoadError(f"the checkpoint has no weights for parameter {name!r} "
                                 f"(expected for {cfg.model_type} with {cfg.num_hidden_layers} layers)")
    return model.to(device=device, dtype=dtype).eval()


def _load_tensor(cfg: ModelConfig, par: ParallelContext, params: dict, name: str,
                 tensor: torch.Tensor, file: Path) -> None:
    def put(target: str, value: torch.Tensor, index=slice(None), expected=None) -> None:
        if target not in params:
            raise ModelLoadError(f"{file}: tensor {name!r} does not match the config "
                                 f"(no parameter {target!r}; is config.json from another model?)")
        dest = params[target].data[index]
        want = expected if expected is not None else tuple(dest.shape)
        if tuple(value.shape) != tuple(want):
            raise ModelLoadError(f"{file}: tensor {name!r} has shape {tuple(value.shape)}, "
                                 f"config.json implies {tuple(want)}")
        if expected is not None:  # value is the full tensor; keep this rank's shard
            value = value[_shard_of(value, dest)]
        dest.copy_(value)

    def _shard_of(full: torch.Tensor, dest: torch.Tensor):
        for dim in range(full.dim()):
            if full.shape[dim] != dest.shape[dim]:
                lo, hi = par.shard(full.shape[dim], name)
                return (slice(None),) * dim + (slice(lo, hi),)
        return slice(None)

    top = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if name in top:
        return put(top[name], tensor)
    m = _LAYER.match(name)
    if not m:
        raise ModelLoadError(f"{file}: unexpected tensor {name!r} for a {cfg.model_type} model")
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= cfg.num_hidden_layers:
        raise ModelLoadError(f"{file}: tensor {name!r} is for layer {layer}, but config.json has "
                             f"num_hidden_layers={cfg.num_hidden_layers}")
    pre = f"layers.{layer}."
    q, kv, inter, hidden = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.intermediate_size, cfg.hidden_size
    rows = {"self_attn.q_proj.weight": slice(0, q), "self_attn.k_proj.weight": slice(q, q + kv),
            "self_attn.v_proj.weight": slice(q + kv, q + 2 * kv)}
    if rest in rows:
        return put(pre + "self_attn.qkv_proj.weight", tensor, rows[rest])
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"):
        return put(pre + rest, tensor)
    if not cfg.is_moe and rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        local = params[pre + "mlp.down_proj.weight"].shape[1]
        if rest == "mlp.down_proj.weight":
            return put(pre + rest, tensor, expected=(hidden, inter))
        half = slice(0, local) if rest == "mlp.gate_proj.weight" else slice(local, 2 * local)
        return put(pre + "mlp.gate_up_proj.weight", tensor, half, expected=(inter, hidden))
    if cfg.is_moe:
        if rest in ("block_sparse_moe.gate.weight", "mlp.gate.weight"):
            return put(pre + "mlp.gate.weight", tensor)
        first, last = par.shard(cfg.num_local_experts, "num_local_experts")
        e = _EXPERT.match(rest)
        if e:
            expert, which = int(e.group(1)), e.group(2)
            if expert >= cfg.num_local_experts:
                raise ModelLoadError(f"{file}: tensor {name!r} is for expert {expert}, but config.json "
                                     f"has num_local_experts={cfg.num_local_experts}")
            if not first <= expert < last:
                return  # another rank's expert
            if which == "w2":
                return put(pre + "mlp.down", tensor, expert - first)
            half = slice(0, inter) if which == "w1" else slice(inter, 2 * inter)
            return put(pre + "mlp.gate_up", tensor, (expert - first, half))
        fused = {"mlp.experts.gate_up_proj": ("mlp.gate_up", (cfg.num_local_experts, 2 * inter, hidden)),
                 "mlp.experts.down_proj": ("mlp.down", (cfg.num_local_experts, hidden, inter))}
        if rest in fused:  # the fused layout newer transformers keeps in memory
            target, full = fused[rest]
            return put(pre + target, tensor, expected=full)
    raise ModelLoadError(f"{file}: unexpected tensor {name!r} for a {cfg.model_type} model")
