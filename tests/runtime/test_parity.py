"""Token-for-token and logit parity with Hugging Face transformers on the same weights, for every
registered architecture (a new one is tested here without editing this file).

Runs on --device in --dtype (bench/gpu_check.sh runs it on CUDA in both); the reference is
transformers on the same device in the same dtype. Tolerances:
- float32: every logit within atol 2e-4, rtol 1e-4;
- bfloat16: 8 bits of mantissa and a different order of summation move logits (magnitude up to
  ~7 here) by up to ~0.1, and now and then flip a Mixtral routing choice, which changes that
  position's logits as a whole. So per position, the relative L2 error of the logit vector is at
  most 0.05 on at least 90% of positions, with a median at most 0.025 (measured on the CPU:
  medians 0.012-0.016, worst positions 0.02-0.042 without a flip, 0.4-0.55 at the one or two
  positions of a flip). A wrong mask, RoPE or cache slot breaks most positions by far more.
Greedy tokens are compared in float32 only: in bfloat16 a near-tie may legitimately flip.
"""

import pytest
import torch

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.model import attention
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.registry import architectures

from hf_models import chunked_logits, save_hf_model

FLOAT32 = dict(atol=2e-4, rtol=1e-4)
BF16_ROW_ERROR, BF16_ROWS_WITHIN, BF16_MEDIAN_ROW_ERROR = 0.05, 0.9, 0.025


def assert_logits_close(ours: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(ours, expected, **FLOAT32)
        return
    row_error = (ours.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    within = (row_error <= BF16_ROW_ERROR).float().mean().item()
    assert within >= BF16_ROWS_WITHIN and row_error.median() <= BF16_MEDIAN_ROW_ERROR, (
        f"{dtype}: {within:.0%} of positions within a relative error of {BF16_ROW_ERROR} (need "
        f"{BF16_ROWS_WITHIN:.0%}), median {row_error.median():.4f}; per position: {row_error.tolist()}")


@pytest.fixture(scope="module", params=list(architectures()))
def models(request, tmp_path_factory, device, dtype):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, path).to(device, dtype)
    return path, hf, load_model(path, device=device, dtype=dtype)


@pytest.fixture(params=attention.DECODE_BACKENDS)
def decode_backend(request, device, monkeypatch):
    """Every decode of the test runs through this backend."""
    if request.param == "kernel" and device != "cpu":
        pytest.skip("the C++ kernel runs on the CPU; CUDA decodes use the torch backend")
    monkeypatch.setattr(attention, "default_decode_backend", lambda _device: request.param)
    return request.param


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens], device=hf.device)).logits[0].float()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_four_architectures_are_registered():
    assert {"llama", "mixtral", "qwen2", "qwen3"} <= set(architectures())


def test_prefill_logits_match_transformers(models, dtype):
    _, hf, ours = models
    tokens = prompt(37, seed=1)
    assert_logits_close(chunked_logits(ours, tokens, chunk=len(tokens)), hf_logits(hf, tokens), dtype)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_logits_match_transformers(models, dtype, chunk):
    _, hf, ours = models
    tokens = prompt(37, seed=2)
    assert_logits_close(chunked_logits(ours, tokens, chunk=chunk), hf_logits(hf, tokens), dtype)


def test_paged_decode_across_block_boundaries_matches_transformers(models, dtype, decode_backend):
    _, hf, ours = models
    tokens = prompt(30, seed=3)  # 4-token blocks: decode crosses several block boundaries
    ours_logits = chunked_logits(ours, tokens[:7], chunk=7, decode=tokens[7:], tokens_per_block=4)
    assert_logits_close(ours_logits, hf_logits(hf, tokens), dtype)


@pytest.mark.parametrize("decode_query_len", [2, 3])
def test_decode_steps_with_draft_tokens_match_transformers(models, dtype, decode_backend, decode_query_len):
    # 1 + draft tokens per step, causal within the step: every position's logits as one pass each.
    _, hf, ours = models
    tokens = prompt(7 + 8 * decode_query_len, seed=4)
    ours_logits = chunked_logits(ours, tokens[:7], chunk=7, decode=tokens[7:], tokens_per_block=4,
                                 decode_query_len=decode_query_len)
    assert_logits_close(ours_logits, hf_logits(hf, tokens), dtype)


def greedy_reference(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import transformers

    hf.generation_config.eos_token_id = None  # run every prompt the full length, as ignore_eos does
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
    with torch.no_grad():  # the mask says every token counts: a 0 (the pad id) in a prompt is a token too
        return [hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)[0, len(p):].tolist()
                for p in prompts for ids in [torch.tensor([p], device=hf.device)]]


MIXED = [prompt(n, seed=10 + n) for n in (3, 17, 40, 9, 64, 1)]


def test_greedy_batch_of_mixed_lengths_is_token_identical(models, device, dtype, decode_backend):
    if dtype != torch.float32:
        pytest.skip("greedy tokens are compared in float32 (a bfloat16 near-tie may flip)")
    path, hf, _ = models
    engine = LLMEngine(EngineConfig(model=str(path), device=device, kv_blocks=128, tokens_per_block=4,
                                    max_num_tokens=48, max_batch_size=4))
    reqs = engine.generate(MIXED, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, req, expected in zip(MIXED, reqs, greedy_reference(hf, MIXED, 24)):
        assert req.output_token_ids == expected, f"prompt of {len(p)} tokens diverged"
    assert engine.kv.num_used_blocks == 0


SHARED = prompt(22, seed=20)  # a system prompt: 5 blocks of 4 tokens and 2 more


def prefix_waves(history: list[list[int]]):
    """Three waves of prompts on one engine, each wave after the last has finished: sharing a prefix
    that ends inside a block, exactly on a boundary (the whole prompt cached: its last block runs
    again), repeated whole, continued as the next turn of a conversation (its prompt and answer
    cached, decode blocks included), and after the small pool evicted some of it."""
    yield [SHARED + prompt(5, seed=21), prompt(17, seed=22)]
    yield [SHARED + prompt(3, seed=23), SHARED[:20], SHARED + prompt(5, seed=21)]
    yield [history[2] + prompt(4, seed=24), prompt(17, seed=22), SHARED[:9] + prompt(30, seed=25)]


@pytest.mark.parametrize("draft_tokens", [0, 2])
def test_greedy_outputs_are_the_same_with_the_prefix_cache_on_and_off(models, device, dtype, draft_tokens):
    if dtype != torch.float32:
        pytest.skip("greedy tokens are compared in float32 (a bfloat16 near-tie may flip)")
    path, _, _ = models
    engines = {on: LLMEngine(EngineConfig(model=str(path), device=device, kv_blocks=24, tokens_per_block=4,
                                          max_num_tokens=12, max_batch_size=4, draft_tokens=draft_tokens,
                                          prefix_cache=on)) for on in (True, False)}
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    history: list[list[int]] = []  # each finished request's prompt and answer
    for wave in prefix_waves(history):
        outputs = {on: [r.all_token_ids for r in e.generate(wave, params)] for on, e in engines.items()}
        assert outputs[True] == outputs[False]
        history += outputs[True]
    cached = engines[True]
    assert cached.stats.prefix_cache_hits >= 5 * 4 * 3 and cached.kv.evictions > 0
    assert cached.stats.prompt_tokens == engines[False].stats.prompt_tokens - cached.stats.prefix_cache_hits
    assert cached.kv.num_used_blocks == 0 and engines[False].stats.prefix_cache_queries == 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_adp_ranks_of_qwen3_generate_what_transformers_does(tmp_path, device, dtype):
    """Two real rank processes (gloo): the MLP is split across them (each rank reads only its
    half of gate/up/down from the checkpoint) and the requests are spread over both. Then the
    second turn of each conversation, on the rank that holds the first: each rank's prefix cache
    serves its prompt and answer."""
    if (device, dtype) != ("cpu", torch.float32):
        pytest.skip("gloo ranks on the CPU in float32 (NCCL needs one GPU per rank)")
    from adpfleet.runtime.executor.offline import OfflineRanks

    hf = save_hf_model("qwen3", tmp_path)
    prompts = MIXED[:4]
    ranks = OfflineRanks(2, str(tmp_path), kv_blocks=64, tokens_per_block=4, max_num_tokens=48)
    try:
        ids = [ranks.submit(p, rank=i % 2, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]
        assert ranks.wait(ids, 120)
        answers = [ranks.tokens[i] for i in ids]
        assert answers == greedy_reference(hf, prompts, 12)
        turns = [p + answer + prompt(5, seed=40 + i) for i, (p, answer) in enumerate(zip(prompts, answers))]
        ids = [ranks.submit(p, rank=i % 2, max_tokens=12, ignore_eos=True) for i, p in enumerate(turns)]
        assert ranks.wait(ids, 120)
        assert [ranks.tokens[i] for i in ids] == greedy_reference(hf, turns, 12)
        assert ranks.stats(0).prefix_cache_hits > 0 and ranks.stats(1).prefix_cache_hits > 0
    finally:
        ranks.close()
