"""Model configuration read from a Hugging Face `config.json`, for every registered architecture.

The fields every decoder here shares are read below; each architecture's module (see
`registry.py`) maps the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from adpfleet.runtime.model.errors import ModelLoadError
from adpfleet.runtime.model.registry import ConfigReader, architecture

__all__ = ["ModelConfig", "ModelLoadError", "read_config_json"]


def read_config_json(path: str | Path) -> dict:
    """The JSON object of a model directory's `config.json`, or ModelLoadError (InvalidModel) saying why not."""
    file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not file.is_file():
        raise ModelLoadError(f"{file} is missing: a model directory needs a Hugging Face config.json")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} must hold a JSON object")
    return raw


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # a bias on the q, k and v projections
    o_bias: bool = False  # a bias on the output projection
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE
    num_local_experts: int = 0  # 0: dense MLP
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        arch = architecture(raw.get("model_type"), source)
        c = ConfigReader(raw, source)
        heads = c.positive_int("num_attention_heads")
        hidden = c.positive_int("hidden_size")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        if raw.get("hidden_act", "silu") != "silu":
            c.refuse("hidden_act", "the MLP is SwiGLU (silu)")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        eos = raw.get("eos_token_id")
        return cls(
            model_type=arch.model_type,
            vocab_size=c.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=c.positive_int("intermediate_size"),
            num_hidden_layers=c.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=c.positive_int("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            tie_word_embeddings=c.flag("tie_word_embeddings"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ()),
            **arch.config(c),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_config_json(path), str(Path(path) / "config.json"))

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face loader accepts for the same model."""
        raw = {
            "model_type": self.model_type,
            "architectures": [architecture(self.model_type).hf_class],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.o_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        if self.is_moe:
            raw.update(num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok)
        return raw
