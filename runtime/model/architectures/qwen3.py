"""Qwen3: Llama with an RMSNorm over each head of q and k before RoPE, and no qkv bias."""

from adpfleet.runtime.model.architectures.llama import DENSE_WEIGHTS
from adpfleet.runtime.model.registry import Architecture, ConfigReader


def config(c: ConfigReader) -> dict:
    if c.flag("use_sliding_window"):
        c.refuse("use_sliding_window", "every layer attends to the whole context")
    bias = c.flag("attention_bias")
    return {"qk_norm": True, "qkv_bias": bias, "o_bias": bias}


ARCHITECTURE = Architecture("qwen3", "Qwen3ForCausalLM", config, DENSE_WEIGHTS)
