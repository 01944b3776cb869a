"""Decode attention over the paged cache, every backend against a dense float64 reference.

Runs on --device (cpu by default) in --dtype: float32 within 2e-5 of the reference, bfloat16
within 2e-2 (the inputs are rounded to bfloat16 first, so the bound covers the kernel's own
rounding only). The C++ kernel is CPU-only; on CUDA the torch backend is the one under test.
"""

import pytest
import torch

from adpfleet.runtime.engine import attention_metadata
from adpfleet.runtime.engine.attention_metadata import NULL_BLOCK, SeqChunk
from adpfleet.runtime.model import kernels
from adpfleet.runtime.model.attention import DECODE_BACKENDS, UniformDecodeError, decode_attention

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
HEAD_DIM, KV_HEADS, NUM_BLOCKS = 32, 2, 96


@pytest.fixture(params=DECODE_BACKENDS)
def backend(request, device):
    if request.param == "kernel" and device != "cpu":
        pytest.skip("the C++ kernel runs on the CPU; CUDA decodes use the torch backend")
    return request.param


def scattered_batch(lengths, query_len, tokens_per_block, seed=0):
    """Decode chunks whose blocks are scattered over the pool (as after many admissions)."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS, generator=g) + 1).tolist()  # never the null block
    chunks = []
    for n in lengths:  # n: tokens cached before this pass
        blocks = -(-(n + query_len) // tokens_per_block)
        chunks.append(SeqChunk([0] * query_len, n, [free.pop() for _ in range(blocks)], is_decode=True))
    return chunks


def random_inputs(meta, group, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    slots = (NUM_BLOCKS + 1) * meta.tokens_per_block
    k_cache, v_cache = (torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
    q = torch.randn(meta.num_decode_tokens, KV_HEADS * group, HEAD_DIM, generator=g).to(device, dtype)
    return q, k_cache, v_cache


def reference(q, k_cache, v_cache, chunks, query_len, tokens_per_block, scale):
    """Dense causal attention per request in float64: query j of a request at position
    start + j sees keys 0..start + j; query head h reads KV head h // group."""
    out = []
    group = q.shape[1] // k_cache.shape[1]
    for i, c in enumerate(chunks):
        length = c.start_pos + query_len
        slots = [c.block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
                 for p in range(length)]
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        qi = q[i * query_len:(i + 1) * query_len].double()  # [qlen, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        visible = torch.arange(length)[None, :] <= (c.start_pos + torch.arange(query_len))[:, None]
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(out)


@pytest.mark.parametrize("tokens_per_block", [4, 16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("query_len", [1, 3])
def test_decode_attention_matches_a_dense_reference(backend, device, dtype, query_len, group, tokens_per_block):
    # lengths: inside the first block, exactly whole blocks, one past, long, and a single request
    # much longer than the rest (the longest-first task order and the padded gather both see it)
    lengths = [0, 2, tokens_per_block - query_len, 3 * tokens_per_block, 3 * tokens_per_block + 1, 57, 200]
    chunks = scattered_batch(lengths, query_len, tokens_per_block)
    _, _, meta = attention_metadata.build(chunks, tokens_per_block, query_len, device=device)
    q, k_cache, v_cache = random_inputs(meta, group, dtype, device)
    out = decode_attention(q, k_cache, v_cache, meta, scale=HEAD_DIM ** -0.5, backend=backend)
    expected = reference(q, k_cache, v_cache, chunks, query_len, tokens_per_block, HEAD_DIM ** -0.5)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("query_len", [1, 2])
@pytest.mark.parametrize("group,head_dim", [(4, 64), (8, 40)])
@pytest.mark.parametrize("tokens_per_block", [4, 16])
def test_the_kernel_tiles_kv_groups_across_tiles_and_scattered_blocks(device, dtype, query_len, group, head_dim,
                                                                      tokens_per_block):
    # The kernel scores W keys at a time (16 with AVX-512, 8 below) for all query heads of a KV
    # head: lengths just under, at and past tile and block boundaries, several query heads per KV
    # head, a head_dim with (40) and without (64) a part-vector tail, blocks out of order with
    # unused ones between them. Every cache slot no request may read is NaN: a tile reaching past
    # a request's last token, or into a neighbour's block, turns its output into NaN.
    if device != "cpu":
        pytest.skip("the C++ kernel runs on the CPU")
    kernels.available() or pytest.skip("kernels not built")
    lengths = [6, 7, 8, 15, 16, 17, 31, 33, 47, 100]  # cached before the pass; + query_len each
    chunks = scattered_batch(lengths, query_len, tokens_per_block, seed=7)
    _, _, meta = attention_metadata.build(chunks, tokens_per_block, query_len, device=device)
    g = torch.Generator().manual_seed(8)
    shape = ((NUM_BLOCKS + 1) * tokens_per_block, KV_HEADS, head_dim)
    k_cache, v_cache = (torch.full(shape, float("nan")).to(dtype) for _ in range(2))
    for c in chunks:
        slots = [c.block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
                 for p in range(c.start_pos + query_len)]
        k_cache[slots] = torch.randn(len(slots), KV_HEADS, head_dim, generator=g).to(dtype)
        v_cache[slots] = torch.randn(len(slots), KV_HEADS, head_dim, generator=g).to(dtype)
    q = torch.randn(meta.num_decode_tokens, KV_HEADS * group, head_dim, generator=g).to(dtype)
    out = decode_attention(q, k_cache, v_cache, meta, scale=head_dim ** -0.5, backend="kernel")
    expected = reference(q, k_cache, v_cache, chunks, query_len, tokens_per_block, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("num_requests", [1, 2])
def test_few_long_requests_split_their_kv_heads_and_match(backend, device, dtype, num_requests):
    # Fewer requests than threads x 4: the kernel splits each request's KV heads across tasks.
    chunks = scattered_batch([300, 123][:num_requests], 2, 16, seed=3)
    _, _, meta = attention_metadata.build(chunks, 16, 2, device=device)
    q, k_cache, v_cache = random_inputs(meta, 2, dtype, device, seed=4)
    out = decode_attention(q, k_cache, v_cache, meta, scale=0.3, backend=backend)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, chunks, 2, 16, 0.3),
                               **TOLERANCE[dtype])


def test_padding_dummies_leave_the_real_requests_unchanged(backend, device, dtype):
    real = scattered_batch([5, 40], 2, 4, seed=5)
    _, _, meta = attention_metadata.build(real, 4, 2, device=device)
    _, _, padded = attention_metadata.build(real, 4, 2, pad_to_tokens=10, device=device)
    assert (padded.num_decodes, padded.num_decode_tokens) == (5, 10)
    assert padded.decode_block_tables[2:].eq(NULL_BLOCK).all()  # dummies read the null block only
    q, k_cache, v_cache = random_inputs(padded, 2, dtype, device, seed=6)
    out = decode_attention(q, k_cache, v_cache, padded, scale=0.2, backend=backend)
    alone = decode_attention(q[:4].clone(), k_cache, v_cache, meta, scale=0.2, backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:4], alone, **TOLERANCE[dtype])


def test_every_backend_refuses_padded_requests_with_unpadded_tokens(backend, device):
    # The vLLM dummy-run crash: 3 decode requests (2 of them padding) but the unpadded token count.
    chunks = scattered_batch([4, 0, 0], 1, 4)
    _, _, meta = attention_metadata.build(chunks, 4, 1, device=device)
    meta.num_decode_tokens = 1
    q, k_cache, v_cache = random_inputs(meta, 1, torch.float32, device)
    with pytest.raises(UniformDecodeError, match="num_decode_tokens=1 for num_decodes=3"):
        decode_attention(q, k_cache, v_cache, meta, scale=1.0, backend=backend)


def test_the_kernel_is_built_where_the_engine_runs_on_the_cpu(device):
    # ./scripts/setup builds it; without it every CPU decode silently takes the slower path.
    if device != "cpu":
        pytest.skip("CUDA decodes do not use the CPU kernel")
    assert kernels.available(), "the adpfleet C++ kernels are not built: run ./scripts/setup"


def test_a_cpu_engine_loads_the_kernels_when_it_is_built_not_in_its_first_decode(monkeypatch):
    # Compiling takes 10-15 s; a rank doing that in its first decode looks hung to the operator.
    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.engine.llm_engine import LLMEngine

    loads = []
    monkeypatch.setattr(kernels, "load", lambda verbose=False: loads.append(1))
    kernels.available.cache_clear()
    try:
        LLMEngine(EngineConfig(model="tiny-dense", kv_blocks=8))
        assert loads == [1]
    finally:
        kernels.available.cache_clear()


def test_the_kernel_refuses_tokens_that_are_not_requests_times_query_len():
    kernels.available() or pytest.skip("kernels not built")
    q, cache = torch.zeros(3, 2, 8), torch.zeros(16, 1, 8)
    tables, lens = torch.zeros(2, 1, dtype=torch.int32), torch.full((2,), 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="uniform decode violated: 3 tokens for 2 requests"):
        torch.ops.adpfleet.paged_decode_attention(q, cache, cache, tables, lens, 4, 1.0)


def test_the_kernel_refuses_a_block_outside_the_cache():
    kernels.available() or pytest.skip("kernels not built")
    q, cache = torch.zeros(1, 2, 8), torch.zeros(16, 1, 8)  # 4 blocks of 4 slots
    with pytest.raises(RuntimeError, match="names block 4, outside the cache"):
        torch.ops.adpfleet.paged_decode_attention(q, cache, cache, torch.tensor([[4]], dtype=torch.int32),
                                                  torch.tensor([1], dtype=torch.int32), 4, 1.0)
    with pytest.raises(RuntimeError, match="needs 2 blocks, its block table has 1"):
        torch.ops.adpfleet.paged_decode_attention(q, cache, cache, torch.tensor([[1]], dtype=torch.int32),
                                                  torch.tensor([5], dtype=torch.int32), 4, 1.0)
