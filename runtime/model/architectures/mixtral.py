"""Mixtral: Llama attention with a sparse mixture-of-experts MLP (experts sharded across ranks)."""

from adpfleet.runtime.model.architectures.llama import DENSE_WEIGHTS
from adpfleet.runtime.model.registry import Architecture, ConfigReader, WeightRule

WEIGHTS = DENSE_WEIGHTS[:1] + (
    WeightRule(r"block_sparse_moe\.gate\.", "mlp.gate."),
    # one tensor per expert, w1 = gate, w3 = up, w2 = down (the checkpoint layout)
    WeightRule(r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w1\.weight$", "mlp.gate_up", part="gate"),
    WeightRule(r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w3\.weight$", "mlp.gate_up", part="up"),
    WeightRule(r"block_sparse_moe\.experts\.(?P<expert>\d+)\.w2\.weight$", "mlp.down"),
    # all experts in one tensor (the layout newer transformers keeps in memory)
    WeightRule(r"mlp\.experts\.gate_up_proj$", "mlp.gate_up"),
    WeightRule(r"mlp\.experts\.down_proj$", "mlp.down"),
)


def config(c: ConfigReader) -> dict:
    return {"num_local_experts": c.positive_int("num_local_experts"),
            "num_experts_per_tok": c.positive_int("num_experts_per_tok")}


ARCHITECTURE = Architecture("mixtral", "MixtralForCausalLM", config, WEIGHTS)
