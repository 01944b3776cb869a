"""The uniform-decode invariant and padded metadata (the vLLM dummy-run crash)."""

import pytest
import torch

from adpfleet.runtime.engine import attention_metadata
from adpfleet.runtime.engine.attention_metadata import AttentionMetadata, SeqChunk
from adpfleet.runtime.model.attention import UniformDecodeError, check_uniform_decode, paged_attention


def test_padded_dummy_batch_keeps_tokens_equal_to_requests_times_query_len():
    for qlen in (1, 2, 3):
        for pad in (1, 2, 5, 8):
            _, _, meta = attention_metadata.build([], tokens_per_block=4, decode_query_len=qlen, pad_to_tokens=pad)
            assert meta.num_tokens == pad  # every rank reaches exactly the agreed count
            assert meta.num_decode_tokens == meta.num_decodes * qlen
            check_uniform_decode(meta)


def test_padding_a_real_batch_adds_only_dummy_decodes():
    real = [SeqChunk([5, 6, 7], 0, [3], False), SeqChunk([9], 4, [2, 4], True)]
    ids, pos, meta = attention_metadata.build(real, tokens_per_block=4, pad_to_tokens=8)
    assert (meta.num_actual_reqs, meta.num_actual_tokens) == (2, 4)
    assert (meta.num_prefills, meta.num_decodes, meta.num_tokens) == (1, 5, 8)
    assert ids.tolist()[:4] == [5, 6, 7, 9] and pos.tolist()[:4] == [0, 1, 2, 4]
    assert meta.slot_mapping.tolist()[4:] == [0, 0, 0, 0]  # dummies write the null block only


def test_backend_rejects_padded_requests_with_unpadded_tokens():
    # The pre-fix construction: 2 padded decode requests, but the unpadded token count (1).
    bad = AttentionMetadata(num_prefills=0, num_prefill_tokens=0, num_decodes=2, num_decode_tokens=1,
                            decode_query_len=1, num_actual_reqs=0, num_actual_tokens=1)
    with pytest.raises(UniformDecodeError, match="num_decode_tokens=1 for num_decodes=2"):
        check_uniform_decode(bad)
    q = torch.zeros(1, 2, 4)
    kv = torch.zeros(1, 1, 4)
    bad.slot_mapping = torch.zeros(1, dtype=torch.long)
    with pytest.raises(UniformDecodeError):
        paged_attention(q, kv, kv, torch.zeros(4, 1, 4), torch.zeros(4, 1, 4), bad, 1.0)


def test_backend_runs_a_consistent_padded_batch():
    _, _, meta = attention_metadata.build([], tokens_per_block=4, pad_to_tokens=2)
    q, k = torch.randn(2, 2, 4), torch.randn(2, 1, 4)
    out = paged_attention(q, k, k.clone(), torch.zeros(8, 1, 4), torch.zeros(8, 1, 4), meta, 0.5)
    assert out.shape == q.shape and torch.isfinite(out).all()


def test_padding_dummies_with_a_query_longer_than_a_block_read_only_the_null_block():
    # 1 + 5 draft tokens per step with 4-token blocks: a dummy's query spans two (null) blocks
    _, _, meta = attention_metadata.build([], tokens_per_block=4, decode_query_len=6, pad_to_tokens=15)
    assert (meta.num_decodes, meta.num_tokens) == (2, 15)  # 2 dummy decodes + a 3-token dummy prefill
    assert meta.slot_mapping.lt(4).all() and meta.decode_block_tables.eq(0).all()
    q, k = torch.randn(15, 2, 4), torch.randn(15, 1, 4)
    out = paged_attention(q, k, k.clone(), torch.zeros(8, 1, 4), torch.zeros(8, 1, 4), meta, 0.5)
    assert torch.isfinite(out).all()
