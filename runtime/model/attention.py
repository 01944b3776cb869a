"""Paged attention: K/V are written to and read from a block-paged cache through block tables.

The backend takes an attention-metadata object built by the engine (prefill chunks first, then
decode requests) and holds it to the uniform-decode invariant: every decode request carries the
same number of query tokens, so `num_decode_tokens == num_decodes * decode_query_len`. Padding
code (dummy batches sized to the peers' token count) must build metadata that keeps it — the
vLLM dummy-run crash was metadata with padded requests but unpadded tokens. Every decode path
checks it: `paged_attention` on entry, and the C++ kernel again at its own door.

Decodes read each request's K/V where it lives, through its block table:
- "kernel" (CPU, the default when the C++ kernels are built): `torch.ops.adpfleet.
  paged_decode_attention`, one task per request (or KV-head range) on torch's intra-op threads,
  no copy;
- "torch" (any device): the requests' blocks gathered into one padded batch, query heads grouped
  per KV head, and one SDPA call with a causal mask per request.
A decode query of `decode_query_len` tokens (1 + draft tokens) is causal within itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adpfleet.runtime.model import kernels

DECODE_BACKENDS = ("kernel", "torch")


class UniformDecodeError(AssertionError):
    """Decode requests whose token count is not a whole multiple of the request count."""


def check_uniform_decode(meta) -> None:
    if meta.num_decodes == 0:
        if meta.num_decode_tokens:
            raise UniformDecodeError(f"{meta.num_decode_tokens} decode tokens but no decode requests")
        return
    if (meta.num_decode_tokens % meta.num_decodes
            or meta.num_decode_tokens != meta.num_decodes * meta.decode_query_len):
        raise UniformDecodeError(
            f"uniform decode violated: num_decode_tokens={meta.num_decode_tokens} for "
            f"num_decodes={meta.num_decodes} with decode_query_len={meta.decode_query_len}")


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H, D]."""
    check_uniform_decode(meta)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]

    for i in range(meta.num_prefills):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        context_len = meta.context_lens[i]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)
        if context_len == 0:  # a whole prompt or first chunk: its own K/V suffice
            ki, vi = k[start:end], v[start:end]
            mask, causal = None, True
        else:  # a later chunk attends to the cached context too
            slots = meta.prefill_slots[i]
            ki, vi = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            qpos = torch.arange(end - start, device=q.device) + context_len
            mask = torch.arange(slots.numel(), device=q.device)[None, :] <= qpos[:, None]
            causal = False
        oi = F.scaled_dot_product_attention(
            qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[start:end] = oi.squeeze(0).transpose(0, 1)

    if meta.num_decodes:
        start, end = meta.num_prefill_tokens, meta.num_tokens
        out[start:end] = decode_attention(q[start:end], k_cache, v_cache, meta, scale)
    return out


def default_decode_backend(device: torch.device) -> str:
    return "kernel" if device.type == "cpu" and kernels.available() else "torch"


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                     backend: str | None = None) -> torch.Tensor:
    """The decode requests' attention over their cached K/V (this pass's included).
    q: [num_decodes * decode_query_len, H, D]; returns the same shape."""
    check_uniform_decode(meta)
    backend = backend or default_decode_backend(q.device)
    if backend == "kernel":
        if not kernels.available():
            raise RuntimeError("decode attention backend 'kernel': the adpfleet C++ kernels are not built "
                               "(run ./scripts/setup)")
        return torch.ops.adpfleet.paged_decode_attention(
            q.contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens,
            meta.tokens_per_block, scale)
    if backend != "torch":
        raise ValueError(f"decode attention backend {backend!r}: expected one of {DECODE_BACKENDS}")
    return _gathered_decode_attention(q, k_cache, v_cache, meta, scale)


def _gathered_decode_attention(q, k_cache, v_cache, meta, scale):
    """Whole blocks gathered into [R, blocks x tokens_per_block] keys, query heads grouped per KV
    head (one [group x query_len, keys] problem per KV head: no K/V repeat), one SDPA call."""
    r, qlen, bs = meta.num_decodes, meta.decode_query_len, meta.tokens_per_block
    heads, kv_heads, dim = q.shape[1], k_cache.shape[1], q.shape[2]
    group = heads // kv_heads
    blocks = meta.decode_block_tables.view(-1)
    width = meta.decode_block_tables.shape[1] * bs
    kd = k_cache.view(-1, bs, kv_heads, dim).index_select(0, blocks).view(r, width, kv_heads, dim).transpose(1, 2)
    vd = v_cache.view(-1, bs, kv_heads, dim).index_select(0, blocks).view(r, width, kv_heads, dim).transpose(1, 2)
    # rows ordered (group member, query token): [R, KVH, group * qlen, D]
    qd = q.view(r, qlen, kv_heads, group, dim).permute(0, 2, 3, 1, 4).reshape(r, kv_heads, group * qlen, dim)
    q_pos = meta.decode_seq_lens.long()[:, None] - qlen + torch.arange(qlen, device=q.device)  # [R, qlen]
    mask = torch.arange(width, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [R, qlen, keys]
    mask = mask.repeat(1, group, 1).unsqueeze(1)  # [R, 1, group * qlen, keys]
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return od.view(r, kv_heads, group, qlen, dim).permute(0, 3, 1, 2, 4).reshape(r * qlen, heads, dim)
