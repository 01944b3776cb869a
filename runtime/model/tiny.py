"""Built-in tiny models: deterministic random weights in Hugging Face layout, no download.

`tiny` has the Mixtral layout (so expert parallelism is exercised) and `tiny-dense` the Llama
layout. Both use the byte-level tokenizer and a 4,096-token context.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from adpfleet.model_uri import BUILTIN_MODELS
from adpfleet.runtime.model.config import ModelConfig
from adpfleet.runtime.tokenizer import BOS, EOS  # the byte-level tokenizer's, whose models these are

if TYPE_CHECKING:
    import torch

TINY_MODELS = BUILTIN_MODELS


def load_model_config(spec: str | Path) -> ModelConfig:
    """The config of a built-in tiny model by name, or of a Hugging Face model directory, without
    its weights and without torch (what a server's front end and the router validate and tokenize with)."""
    return tiny_config(str(spec)) if str(spec) in TINY_MODELS else ModelConfig.from_dir(spec)


def tiny_config(name: str) -> ModelConfig:
    raw = {
        "model_type": "mixtral" if name == "tiny" else "llama",
        "vocab_size": 320, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": BOS, "eos_token_id": EOS,
    }
    if name == "tiny":
        raw.update(num_local_experts=4, num_experts_per_tok=2)
    return ModelConfig.from_dict(raw, source=f"built-in model {name!r}")


def tiny_checkpoint(name: str, seed: int = 0) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and Hugging Face-named weights of a built-in model, the same for every seed user."""
    import torch  # here: the config above is read without torch (the router's tokenizer)

    cfg = tiny_config(name)
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim

    def rand(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rand(cfg.vocab_size, h, std=1.0),
         "model.norm.weight": 1 + rand(h, std=0.1), "lm_head.weight": rand(cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = 1 + rand(h, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(h, std=0.1)
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            w[p + f"self_attn.{proj}_proj.weight"] = rand(rows, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, q)
        if cfg.is_moe:
            w[p + "block_sparse_moe.gate.weight"] = rand(cfg.num_local_experts, h, std=0.3)
            for e in range(cfg.num_local_experts):
                w[p + f"block_sparse_moe.experts.{e}.w1.weight"] = rand(i, h)
                w[p + f"block_sparse_moe.experts.{e}.w3.weight"] = rand(i, h)
                w[p + f"block_sparse_moe.experts.{e}.w2.weight"] = rand(h, i)
        else:
            w[p + "mlp.gate_proj.weight"] = rand(i, h)
            w[p + "mlp.up_proj.weight"] = rand(i, h)
            w[p + "mlp.down_proj.weight"] = rand(h, i)
    return cfg, w
