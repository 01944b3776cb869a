"""Model configuration read from a Hugging Face `config.json` (llama and mixtral)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mixtral")


class ModelLoadError(ValueError):
    """A model directory, config or checkpoint that cannot be loaded; the message names the culprit."""


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
    num_local_experts: int = 0  # 0: dense (Llama) MLP
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: unsupported model_type {model_type!r}; adpfleet runs {', '.join(SUPPORTED_MODEL_TYPES)}")

        def need(key: str) -> int:
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise ModelLoadError(f"{source}: '{key}' must be a positive integer, got {raw.get(key)!r}")
            return raw[key]

        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                                 f"num_key_value_heads ({kv_heads})")
        head_dim = raw.get("head_dim") or hidden // heads
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelLoadError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        moe = model_type == "mixtral"
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=need("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            num_local_experts=need("num_local_experts") if moe else 0,
            num_experts_per_tok=need("num_experts_per_tok") if moe else 0,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        file = Path(path) / "config.json"
        if not Path(path).is_dir():
            raise ModelLoadError(f"model directory {path} does not exist")
        if not file.is_file():
            raise ModelLoadError(f"{file} is missing: a model directory needs a Hugging Face config.json")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{file} must hold a JSON object")
        return cls.from_dict(raw, str(file))

    def to_hf_dict(self) -> dict:
        """The config.json a Hugging Face loader accepts for the same model."""
        raw = {
            "model_type": self.model_type,
            "architectures": ["MixtralForCausalLM" if self.is_moe else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
        }
        if self.is_moe:
            raw.update(num_local_experts=self.num_local_experts, num_experts_per_tok=self.num_experts_per_tok)
        return raw
