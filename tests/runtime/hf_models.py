"""Small random Hugging Face models saved to disk, and a way to run our model chunk by chunk."""

from __future__ import annotations

import torch

from adpfleet.runtime.engine import attention_metadata
from adpfleet.runtime.engine.attention_metadata import SeqChunk
from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import SamplingParams

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2)
# What each architecture's tiny config adds: the features its real checkpoints use.
EXTRA = {
    "llama": dict(rope_theta=500000.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1e6),  # small Qwen2 checkpoints have no lm_head
    "qwen3": dict(rope_theta=1e6),
}


def hf_config(model_type: str, **overrides):
    import transformers

    return transformers.AutoConfig.for_model(model_type, **{**COMMON, **EXTRA.get(model_type, {}), **overrides})


def save_hf_model(model_type: str, path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Build a random transformers model of this model_type, save it (sharded with an index if
    `max_shard_size` is given), return it (eval, float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, **overrides))
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: make every one count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
            elif name.endswith("norm.weight"):
                p.normal_(1, 0.2)
    model.eval()
    model.save_pretrained(str(path), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def chunked_logits(model, prompt: list[int], chunk: int, decode: list[int] = (), tokens_per_block: int = 4,
                   decode_query_len: int = 1):
    """Our model's logits for every position: the prompt in chunks of `chunk` tokens, then
    `decode` as paged decode steps of `decode_query_len` tokens each (a step with draft tokens:
    the query block is causal within itself). Returns [len(prompt) + len(decode), vocab]."""
    kv = KVCacheManager(num_blocks=64, tokens_per_block=tokens_per_block)
    cache = model.allocate_kv_cache((kv.num_blocks + 1) * tokens_per_block)
    req = Request("r", list(prompt), SamplingParams(max_tokens=len(decode) + 1))
    rows = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start:start + chunk]
        kv.grow(req, start + len(piece))
        rows.append(_run(model, cache, SeqChunk(piece, start, req.block_table, False), tokens_per_block))
    assert len(decode) % decode_query_len == 0
    for i in range(0, len(decode), decode_query_len):
        pos = len(prompt) + i
        kv.grow(req, pos + decode_query_len)
        step = SeqChunk(list(decode[i:i + decode_query_len]), pos, req.block_table, True)
        rows.append(_run(model, cache, step, tokens_per_block, decode_query_len))
    return torch.cat(rows)


def _run(model, cache, chunk: SeqChunk, tokens_per_block: int, decode_query_len: int = 1) -> torch.Tensor:
    device = next(model.parameters()).device
    ids, pos, meta = attention_metadata.build([chunk], tokens_per_block, decode_query_len, device=device)
    return model.compute_logits(model(ids, pos, meta, cache))
