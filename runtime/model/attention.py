"""Paged attention: K/V are written to and read from a block-paged cache through block tables.

The backend takes an attention-metadata object built by the engine (prefill chunks first, then
decode requests) and holds it to the uniform-decode invariant: every decode request carries the
same number of query tokens, so `num_decode_tokens == num_decodes * decode_query_len`. Padding
code (dummy batches sized to the peers' token count) must build metadata that keeps it — the
vLLM dummy-run crash was metadata with padded requests but unpadded tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
        start = meta.num_prefill_tokens
        r, qlen = meta.num_decodes, meta.decode_query_len
        qd = q[start:start + meta.num_decode_tokens].view(r, qlen, *q.shape[1:]).transpose(1, 2)
        slots = meta.decode_slots  # [R, max_seq_len]
        kd = k_cache.index_select(0, slots.view(-1)).view(r, slots.shape[1], *k.shape[1:]).transpose(1, 2)
        vd = v_cache.index_select(0, slots.view(-1)).view(r, slots.shape[1], *k.shape[1:]).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                            enable_gqa=gqa)
        out[start:start + meta.num_decode_tokens] = od.transpose(1, 2).reshape(-1, *q.shape[1:])
    return out
