"""Llama: the dense decoder every other architecture here starts from."""

from adpfleet.runtime.model.registry import Architecture, ConfigReader, WeightRule

# q/k/v fill one stacked projection and gate/up another, as one matmul each (weights and biases).
DENSE_WEIGHTS = (
    WeightRule(r"self_attn\.(?P<part>[qkv])_proj\.", "self_attn.qkv_proj."),
    WeightRule(r"mlp\.gate_proj\.", "mlp.gate_up_proj.", part="gate"),
    WeightRule(r"mlp\.up_proj\.", "mlp.gate_up_proj.", part="up"),
)


def config(c: ConfigReader) -> dict:
    if c.flag("mlp_bias"):
        c.refuse("mlp_bias", "the MLP has no bias")
    bias = c.flag("attention_bias")
    return {"qkv_bias": bias, "o_bias": bias}


ARCHITECTURE = Architecture("llama", "LlamaForCausalLM", config, DENSE_WEIGHTS)
