"""Token-for-token and logit parity with Hugging Face transformers on the same weights, for every
registered architecture (a new one is tested here without editing this file)."""

import pytest
import torch

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.registry import architectures

from hf_models import chunked_logits, save_hf_model

ATOL = 2e-4


@pytest.fixture(scope="module", params=list(architectures()))
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(request.param, path)
    return path, hf, load_model(path)


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_four_architectures_are_registered():
    assert {"llama", "mixtral", "qwen2", "qwen3"} <= set(architectures())


def test_prefill_logits_match_transformers(models):
    _, hf, ours = models
    tokens = prompt(37, seed=1)
    torch.testing.assert_close(chunked_logits(ours, tokens, chunk=len(tokens)), hf_logits(hf, tokens),
                               atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_logits_match_transformers(models, chunk):
    _, hf, ours = models
    tokens = prompt(37, seed=2)
    torch.testing.assert_close(chunked_logits(ours, tokens, chunk=chunk), hf_logits(hf, tokens),
                               atol=ATOL, rtol=1e-4)


def test_paged_decode_across_block_boundaries_matches_transformers(models):
    _, hf, ours = models
    tokens = prompt(30, seed=3)  # 4-token blocks: decode crosses several block boundaries
    ours_logits = chunked_logits(ours, tokens[:7], chunk=7, decode=tokens[7:], tokens_per_block=4)
    torch.testing.assert_close(ours_logits, hf_logits(hf, tokens), atol=ATOL, rtol=1e-4)


def greedy_reference(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import transformers

    hf.generation_config.eos_token_id = None  # run every prompt the full length, as ignore_eos does
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), generation_config=gen_cfg)[0, len(p):].tolist() for p in prompts]


MIXED = [prompt(n, seed=10 + n) for n in (3, 17, 40, 9, 64, 1)]


def test_greedy_batch_of_mixed_lengths_is_token_identical(models):
    path, hf, _ = models
    engine = LLMEngine(EngineConfig(model=str(path), kv_blocks=128, tokens_per_block=4,
                                    max_num_tokens=48, max_batch_size=4))
    reqs = engine.generate(MIXED, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, req, expected in zip(MIXED, reqs, greedy_reference(hf, MIXED, 24)):
        assert req.output_token_ids == expected, f"prompt of {len(p)} tokens diverged"
    assert engine.kv.num_used_blocks == 0


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_adp_ranks_of_qwen3_generate_what_transformers_does(tmp_path):
    """Two real rank processes (gloo): the MLP is split across them (each rank reads only its
    half of gate/up/down from the checkpoint) and the requests are spread over both."""
    from adpfleet.runtime.executor.offline import OfflineRanks

    hf = save_hf_model("qwen3", tmp_path)
    prompts = MIXED[:4]
    ranks = OfflineRanks(2, str(tmp_path), kv_blocks=64, tokens_per_block=4, max_num_tokens=48)
    try:
        ids = [ranks.submit(p, max_tokens=12, ignore_eos=True) for p in prompts]
        assert ranks.wait(ids, 120)
        assert [ranks.tokens[i] for i in ids] == greedy_reference(hf, prompts, 12)
        assert ranks.stats(0).prompt_tokens > 0 and ranks.stats(1).prompt_tokens > 0
    finally:
        ranks.close()
