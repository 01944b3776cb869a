"""The padding rules, one test per rule, on the real engine with a fake vote (no processes)."""

import pytest

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.kv_cache import NoFreeBlocksError
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import Request, RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor.adp_executor import ADPExecutor
from adpfleet.runtime.executor.collectives import SingleRank
from adpfleet.runtime.model.loader import load_model

MODEL = load_model("tiny-dense")


class FakeVote:
    """Rank 0 of 2; the peer's contributions are scripted: it always has work and votes `peer_size`."""

    rank, world_size = 0, 2

    def __init__(self, peer_size: int = 1, peer_tokens: int = 1):
        self.peer_size, self.peer_tokens = peer_size, peer_tokens
        self.calls = 0
        self.votes = []

    def all_gather_ints(self, values):
        self.calls += 1
        if self.calls % 2:  # the fetch all-gather: [active, stop]
            return [list(values), [1, 0]]
        self.votes.append(values)
        return [list(values), [self.peer_size, self.peer_tokens]]


def engine(**kw) -> LLMEngine:
    cfg = dict(model="tiny-dense", kv_blocks=4, tokens_per_block=4, max_num_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=MODEL)


def starve(e: LLMEngine, held_blocks: int = 3) -> Request:
    """Hold `held_blocks` KV blocks (as transfers in flight would) and queue a request that does
    not fit in what is left: the rank is active but schedules an empty batch."""
    held = Request("held", [1] * (held_blocks * 4), SamplingParams(max_tokens=1))
    e.kv.reserve(held, held_blocks * 4)
    e.kv.grow(held, held_blocks * 4)
    return e.add_request([5] * 6, SamplingParams(max_tokens=2), "starved")  # 2 blocks


def dummies(e, phase="post_schedule"):
    return {o: e.stats.padding_dummies[(phase, o)] for o in ("committed", "rolled_back", "unaffordable", "failed")}


def test_an_empty_batch_gets_a_generation_dummy_and_the_pass_runs():
    e = engine()
    starve(e)
    vote = FakeVote()
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 1]]  # this rank voted one request of one token, not 0
    assert result.ran and e.stats.forward_steps == 1 and e.stats.empty_batch_iterations == 1
    assert dummies(e)["committed"] == 1
    assert all(not r.is_dummy for r in e.active) and e.kv.num_used_blocks == 3  # torn down after the forward


def test_the_dummy_costs_one_decode_token_plus_draft_tokens():
    e = engine(draft_tokens=2, kv_blocks=5)
    starve(e, held_blocks=4)
    vote = FakeVote()
    ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 3]]


def test_no_dummy_when_the_batch_is_not_empty():
    e = engine()
    e.add_request([5, 6], SamplingParams(max_tokens=2))
    vote = FakeVote()
    ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 2]] and dummies(e) == dict.fromkeys(dummies(e), 0)


def test_no_dummy_when_adp_is_off():
    e = engine()
    starve(e)
    result = ADPExecutor(e, SingleRank()).step()
    assert not result.ran and e.stats.forward_steps == 0
    assert sum(e.stats.padding_dummies.values()) == 0


def test_no_post_schedule_dummy_without_active_requests_the_pre_schedule_one_covers_it():
    e = engine()
    vote = FakeVote()
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 1]] and result.ran  # a one-token context dummy
    assert dummies(e, "pre_schedule")["committed"] == 1 and sum(dummies(e).values()) == 0
    assert e.stats.prompt_tokens == 0 and e.stats.generation_tokens == 0 and not result.outputs


def test_no_dummy_at_max_num_active_requests():
    e = engine(max_num_active_requests=1)
    starve(e)
    vote = FakeVote()
    ADPExecutor(e, vote).step()
    assert vote.votes == [[0, 0]] and sum(dummies(e).values()) == 0


def test_no_second_dummy_while_the_singleton_is_live():
    e = engine()
    starve(e)
    ex = ADPExecutor(e, FakeVote())
    ex.padding.dummy = Request("adp-dummy", [0], SamplingParams(max_tokens=1), dummy_phase="post_schedule")
    e.fetch()
    batch = e.schedule_batch()
    assert batch.is_empty and e.num_active_real == 1
    ex.padding.post_schedule_pad(batch)
    assert batch.is_empty


def test_no_dummy_while_the_fill_gate_holds_forwards():
    e = engine()
    starve(e)
    vote = FakeVote()
    ADPExecutor(e, vote, fill_gate=lambda: True).step()
    assert vote.votes == [[0, 0]] and sum(dummies(e).values()) == 0


def test_unaffordable_dummy_degrades_to_an_empty_batch_without_raising():
    e = engine()
    starve(e, held_blocks=4)  # no block left at all
    vote = FakeVote()
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[0, 0]] and not result.ran
    assert dummies(e)["unaffordable"] == 1 and e.kv.num_used_blocks == 4


@pytest.mark.parametrize("error", [NoFreeBlocksError("adp-dummy", 1, 0), RuntimeError("allocator broke")])
def test_allocation_errors_degrade_to_an_empty_batch_without_raising(monkeypatch, error):
    e = engine()
    starve(e)
    real_grow = e.kv.grow

    def grow(req, n):
        if req.is_dummy:
            raise error
        return real_grow(req, n)

    monkeypatch.setattr(e.kv, "grow", grow)
    vote = FakeVote()
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[0, 0]] and not result.ran and dummies(e)["failed"] == 1
    assert e.kv.num_used_blocks == 3 and not any(r.is_dummy for r in e.active)


def test_the_dummy_is_rolled_back_when_the_fleet_still_cannot_queue():
    e = engine()
    starve(e)
    vote = FakeVote(peer_size=0, peer_tokens=0)  # another rank stayed empty
    ex = ADPExecutor(e, vote)
    result = ex.step()
    assert not result.ran and e.stats.forward_vetoed == 1
    assert dummies(e)["rolled_back"] == 1 and ex.padding.dummy is None
    assert e.kv.num_used_blocks == 3 and not any(r.is_dummy for r in e.active)
    ex.step()  # the next pass may pad again: the singleton did not leak
    assert dummies(e)["rolled_back"] == 2


def test_the_allocation_rollback_skips_the_dummy():
    e = engine(kv_blocks=8)
    running = e.add_request([5] * 3, SamplingParams(max_tokens=4))
    ex = ADPExecutor(e, FakeVote())
    ex.step()  # prefill ran; `running` now generates
    assert running.state is RequestState.GENERATION
    batch = e.schedule_batch()
    dummy = Request("adp-dummy", [0], SamplingParams(max_tokens=1), state=RequestState.GENERATION,
                    dummy_phase="post_schedule")
    e.kv.grow(dummy, 1)
    batch.generation.append(dummy)
    e.scheduler.revert(batch)
    assert len(dummy.block_table) == 1  # untouched
    assert len(running.block_table) == e.kv.blocks_for(running.num_computed_tokens)


def test_dummies_never_respond_nor_count_as_progress():
    e = engine()
    starve(e)
    result = ADPExecutor(e, FakeVote()).step()
    assert result.outputs == [] and e.stats.prompt_tokens == 0 and e.stats.generation_tokens == 0
    assert e.stats.requests_running == 0 and e.stats.requests_waiting == 1


def test_an_idle_rank_runs_a_dummy_batch_padded_to_its_peers_token_count():
    e = engine()
    vote = FakeVote(peer_size=3, peer_tokens=7)
    seen = {}
    real_forward = e.runner.forward

    def forward(batch, pad_to=None):
        seen["pad_to"] = pad_to
        return real_forward(batch, pad_to)

    e.runner.forward = forward
    assert ADPExecutor(e, vote).step().ran
    assert seen["pad_to"] == 7


def test_admission_leaves_the_dummys_block_free_so_held_transfers_cannot_take_it():
    e = engine(kv_blocks=4)
    ADPExecutor(e, FakeVote())  # ADP with padding: one block kept back
    three = Request("three", [1] * 11, SamplingParams(max_tokens=1))  # 12 tokens: 3 blocks
    four = Request("four", [1] * 15, SamplingParams(max_tokens=1))  # 16 tokens: 4 blocks
    assert e.kv.can_reserve(three) and not e.kv.can_reserve(four)
    e.kv.reserve(three)
    e.kv.grow(three, 12)  # then held for a transfer: the rank is full for real requests
    dummy = Request("adp-dummy", [0], SamplingParams(max_tokens=1), dummy_phase="post_schedule")
    assert e.kv.available_for(dummy) == 1
    e.kv.grow(dummy, 1)
    assert e.kv.num_free_blocks == 0


def test_without_padding_there_is_no_reserve():
    e = engine(kv_blocks=4)
    ADPExecutor(e, FakeVote(), pad_empty_batch=False)
    assert e.kv.can_reserve(Request("four", [1] * 15, SamplingParams(max_tokens=1)))
