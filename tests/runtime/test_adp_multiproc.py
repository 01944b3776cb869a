"""Real rank processes joined by gloo: parity with one rank, and the ADP stall A/B."""

import time

import pytest

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.sampling import SamplingParams

from adpfleet.runtime.executor.offline import OfflineRanks as Ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "a", "ADP ranks step in lockstep; " * 6, "0123456789" * 3, "zz"]


@pytest.mark.parametrize("model, draft_tokens", [("tiny", 0), ("tiny-dense", 0), ("tiny", 2)])
def test_two_ranks_generate_the_same_greedy_tokens_as_one(model, draft_tokens):
    """Also with speculative decoding on the two ranks (and not on the one): expert-parallel MoE
    collectives with multi-token decode queries and 3-token padding dummies."""
    single = LLMEngine(EngineConfig(model=model, kv_blocks=64))
    expected = [r.output_token_ids for r in single.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    ranks = Ranks(2, model, kv_blocks=64, max_num_tokens=48, draft_tokens=draft_tokens)
    try:
        ids = [ranks.submit(p, max_tokens=12, ignore_eos=True) for p in PROMPTS]
        assert ranks.wait(ids, 120)
        assert [ranks.tokens[i] for i in ids] == expected
        # both ranks did real work: the router spread the requests
        assert ranks.stats(0).prompt_tokens > 0 and ranks.stats(1).prompt_tokens > 0
        if draft_tokens:
            assert sum(ranks.stats(r).spec_decode_accepted_tokens for r in (0, 1)) > 0
    finally:
        ranks.close()


def starving_fleet(pad: bool, pull_after_s: float = 0.2) -> tuple[Ranks, str, list[str]]:
    """Two context ranks with 8 blocks of 16 tokens each. Rank 0 ends up holding 7 blocks for a
    transfer (pulled `pull_after_s` after it was held) and is handed a request that needs 4; rank 1
    has a long prompt to chunk through and then starves the same way. One block stays free on
    each rank: the dummy must be affordable."""
    ranks = Ranks(2, "tiny", role="context", pad_empty_batch=pad, kv_blocks=8, tokens_per_block=16,
                  max_num_tokens=32, transfer="simulated", transfer_latency_s=pull_after_s)
    ranks.group.wait_ready(120)
    held = ranks.submit([7] * 100, rank=0, max_tokens=1)
    assert ranks.wait([held], 60)  # its 7 blocks now wait to be pulled
    starved = ranks.submit([8] * 60, rank=0, max_tokens=1)
    work = [ranks.submit([9] * 100, rank=1, max_tokens=1), ranks.submit([10] * 40, rank=1, max_tokens=1)]
    return ranks, starved, work


def wait_for(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_with_padding_the_starved_rank_recovers_and_everything_completes():
    ranks, starved, work = starving_fleet(pad=True)
    try:
        assert ranks.wait([starved, *work], 60)
        assert all(ranks.done[i].finish_reason == "length" for i in [starved, *work])
        assert wait_for(lambda: ranks.stats(0).empty_batch_iterations > 0, 5)
        s0 = ranks.stats(0)
        assert s0.padding_dummies[("post_schedule", "committed")] > 0  # the trigger fired and was survived
    finally:
        ranks.close()


def test_without_padding_the_fleet_stalls_with_work_pending():
    # held until its lease (60 s): vetoed passes still release held KV, so only a hold that is
    # not pulled keeps rank 0 starved — and, without padding, every rank frozen
    ranks, starved, work = starving_fleet(pad=False, pull_after_s=3600)
    try:
        # the empty batch on rank 0 vetoes every pass, everywhere
        assert wait_for(lambda: ranks.stats(0).empty_batch_iterations >= 50, 30)
        before = [(ranks.stats(r).prompt_tokens, ranks.stats(r).generation_tokens) for r in (0, 1)]
        vetoed = ranks.stats(1).forward_vetoed
        assert not ranks.wait([starved, *work], 3)
        after = [(ranks.stats(r).prompt_tokens, ranks.stats(r).generation_tokens) for r in (0, 1)]
        assert after == before  # no progress at all...
        assert ranks.stats(1).forward_vetoed > vetoed  # ...while rank 1 keeps being vetoed
        assert ranks.stats(1).requests_running + ranks.stats(1).requests_waiting > 0  # with work pending
        assert ranks.stats(0).kv_transfers_in_flight == 7  # the held blocks wait for their pull
        assert sum(n for (phase, _), n in ranks.stats(0).padding_dummies.items() if phase == "post_schedule") == 0
    finally:
        ranks.close()
