"""Qwen2: Llama with a bias on the q, k and v projections (none on o)."""

from adpfleet.runtime.model.architectures.llama import DENSE_WEIGHTS
from adpfleet.runtime.model.registry import Architecture, ConfigReader


def config(c: ConfigReader) -> dict:
    if c.flag("use_sliding_window"):
        c.refuse("use_sliding_window", "every layer attends to the whole context")
    return {"qkv_bias": True}


ARCHITECTURE = Architecture("qwen2", "Qwen2ForCausalLM", config, DENSE_WEIGHTS)
