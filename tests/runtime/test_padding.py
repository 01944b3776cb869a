"""The padding rules (runtime/executor/padding.py), one test per rule, each able to fail when its
rule is deleted or inverted (tools/mutants/padding.yaml checks that). Real engine and model;
the peer ranks are a scripted vote, or real executors in lockstep (tests/runtime/lockstep.py)."""

import logging

import pytest

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.kv_cache import NoFreeBlocksError
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import Request, RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor.adp_executor import ADPExecutor
from adpfleet.runtime.executor.collectives import SingleRank
from adpfleet.runtime.executor.kv_hold import KVHold, LedgerPuller
from adpfleet.runtime.executor.padding import DUMMY_REQUEST_ID, Padding
from adpfleet.runtime.model.loader import load_model
from lockstep import LockstepFleet

MODEL = load_model("tiny-dense")
OUTCOMES = ("committed", "rolled_back", "unaffordable", "failed")


class FakeVote:
    """Rank 0 of 2; the peer's contributions are scripted: it has work (`peer_work`) and votes
    `peer_size` requests of `peer_tokens` tokens."""

    rank, world_size = 0, 2

    def __init__(self, peer_size: int = 1, peer_tokens: int = 1, peer_work: int = 1):
        self.peer_size, self.peer_tokens, self.peer_work = peer_size, peer_tokens, peer_work
        self.calls = 0
        self.votes = []
        self._vote_next = False

    def all_gather_ints(self, values):
        self.calls += 1
        if not self._vote_next:  # the fetch all-gather: [active, stop]; a vote follows if the fleet has work
            self._vote_next = bool(values[0] or self.peer_work)
            return [list(values), [self.peer_work, 0]]
        self._vote_next = False
        self.votes.append(values)
        return [list(values), [self.peer_size, self.peer_tokens]]


def engine(**kw) -> LLMEngine:
    cfg = dict(model="tiny-dense", kv_blocks=4, tokens_per_block=4, max_num_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=MODEL)


def occupy(e: LLMEngine, blocks: int) -> Request:
    """Take `blocks` KV blocks (as prompts held for transfers do) outside the active list."""
    held = Request("held", [1] * (blocks * 4), SamplingParams(max_tokens=1))
    e.kv.grow(held, blocks * e.kv.tokens_per_block)
    return held


def starve(e: LLMEngine, held_blocks: int = 3) -> Request:
    """Hold `held_blocks` KV blocks and queue a request that does not fit in what is left: the
    rank is active but schedules an empty batch."""
    occupy(e, held_blocks)
    return e.add_request([5] * 6, SamplingParams(max_tokens=2), "starved")  # 2 blocks


def dummies(e, phase="post_schedule"):
    return {o: e.stats.padding_dummies[(phase, o)] for o in OUTCOMES}


def record_forwards(e: LLMEngine) -> list[dict]:
    """What each forward ran: its prefill and decode chunks (tokens, dummy or not) and pad_to."""
    seen = []
    real_forward = e.runner.forward

    def forward(batch, pad_to=None):
        seen.append({"context": [(r.dummy_phase, n, len(r.block_table)) for r, n in batch.context],
                     "generation": [(r.dummy_phase, batch.decode_query_len, len(r.block_table))
                                    for r in batch.generation],
                     "pad_to": pad_to})
        return real_forward(batch, pad_to)

    e.runner.forward = forward
    return seen


# -- pre-schedule padding --------------------------------------------------------------------------

def test_an_idle_rank_gets_a_one_token_context_dummy_while_the_fleet_has_work():
    e = engine()
    vote = FakeVote()
    forwards = record_forwards(e)
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 1]] and result.ran
    assert forwards[0]["context"] == [("pre_schedule", 1, 1)] and forwards[0]["generation"] == []
    assert e.stats.empty_batch_iterations == 0  # its batch (the dummy) was not empty
    assert dummies(e, "pre_schedule")["committed"] == 1 and sum(dummies(e).values()) == 0
    assert e.stats.prompt_tokens == 0 and e.stats.generation_tokens == 0 and not result.outputs
    assert not e.active and e.kv.num_used_blocks == 0  # torn down after the forward


def test_no_pre_schedule_dummy_without_adp():
    e = engine()
    padding = Padding(e, adp=False)
    padding.pre_schedule_pad()
    assert padding.dummy is None and not e.active


def test_no_pre_schedule_dummy_on_a_rank_with_a_real_request():
    e = engine()
    e.add_request([5, 6], SamplingParams(max_tokens=2))
    vote = FakeVote()
    forwards = record_forwards(e)
    ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 2]] and forwards[0]["context"] == [(None, 2, 1)]
    assert sum(dummies(e, "pre_schedule").values()) == 0


def test_no_second_pre_schedule_dummy_while_the_singleton_is_live():
    e = engine()
    padding = Padding(e, adp=True)
    padding.pre_schedule_pad()
    first = padding.dummy
    padding.pre_schedule_pad()
    assert padding.dummy is first and e.active == [first] and e.kv.num_used_blocks == 1


def test_the_pre_schedule_dummy_is_rolled_back_when_the_fleet_cannot_queue():
    e = engine()
    ex = ADPExecutor(e, FakeVote(peer_size=0, peer_tokens=0))
    result = ex.step()
    assert not result.ran and e.stats.forward_vetoed == 1
    assert dummies(e, "pre_schedule") == {"committed": 0, "rolled_back": 1, "unaffordable": 0, "failed": 0}
    assert ex.padding.dummy is None and not e.active and e.kv.num_used_blocks == 0


def test_an_unaffordable_pre_schedule_dummy_is_counted_and_logged_not_rolled_back(caplog):
    e = engine(padding_reserve=False)
    occupy(e, 4)  # no block left, and no reserve
    vote = FakeVote()
    ex = ADPExecutor(e, vote)
    with caplog.at_level(logging.WARNING, "adpfleet.runtime.executor.padding"):
        ex.step()
        ex.step()
    assert vote.votes == [[0, 0], [0, 0]]
    assert dummies(e, "pre_schedule") == {"committed": 0, "rolled_back": 0, "unaffordable": 2, "failed": 0}
    assert sum(dummies(e).values()) == 0  # post-schedule padding leaves an idle rank alone
    assert len([r for r in caplog.records if "pre-schedule padding" in r.message]) == 1  # logged once


def test_a_failing_pre_schedule_allocation_degrades_to_an_empty_vote(monkeypatch):
    e = engine()
    monkeypatch.setattr(e.kv, "grow", lambda req, n: (_ for _ in ()).throw(RuntimeError("allocator broke")))
    vote = FakeVote()
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[0, 0]] and not result.ran and dummies(e, "pre_schedule")["failed"] == 1
    assert not e.active and e.kv.num_used_blocks == 0


def test_the_pre_schedule_dummy_may_use_the_padding_reserve():
    e = engine()
    ADPExecutor(e, FakeVote())
    occupy(e, 3)  # everything but the reserve
    vote = FakeVote()
    assert ADPExecutor(e, vote).step().ran and vote.votes == [[1, 1]]


# -- post-schedule padding -------------------------------------------------------------------------

def test_an_empty_batch_gets_a_generation_dummy_and_the_pass_runs():
    e = engine()
    starve(e)
    vote = FakeVote()
    forwards = record_forwards(e)
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 1]]  # this rank voted one request of one token, not 0
    assert result.ran and e.stats.forward_steps == 1 and e.stats.empty_batch_iterations == 1
    # a decode of the dummy on its own block — not a context chunk
    assert forwards[0]["generation"] == [("post_schedule", 1, 1)] and forwards[0]["context"] == []
    assert dummies(e) == {"committed": 1, "rolled_back": 0, "unaffordable": 0, "failed": 0}
    assert all(not r.is_dummy for r in e.active) and e.kv.num_used_blocks == 3  # torn down after the forward


def test_the_generation_dummy_is_a_decode_query_of_one_plus_draft_tokens():
    e = engine(draft_tokens=2, kv_blocks=10, tokens_per_block=2)  # the reserve: 2 blocks of 2
    starve(e, held_blocks=6)  # 4 blocks free, 2 of them available: the request needs 5
    vote = FakeVote(peer_tokens=7)
    forwards = record_forwards(e)
    assert ADPExecutor(e, vote).step().ran
    assert vote.votes == [[1, 3]]
    # 3 query tokens, and KV for all 3 (2 blocks of 2)
    assert forwards[0]["generation"] == [("post_schedule", 3, 2)] and forwards[0]["pad_to"] == 7


def test_no_dummy_when_the_batch_is_not_empty():
    e = engine()
    e.add_request([5, 6], SamplingParams(max_tokens=2))
    vote = FakeVote()
    ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 2]] and dummies(e) == dict.fromkeys(OUTCOMES, 0)
    assert e.stats.empty_batch_iterations == 0


def test_no_dummy_when_adp_is_off():
    e = engine()
    starve(e)
    result = ADPExecutor(e, SingleRank()).step()
    assert not result.ran and e.stats.forward_steps == 0
    assert sum(e.stats.padding_dummies.values()) == 0


def test_no_dummy_when_post_schedule_padding_is_off():
    e = engine()
    starve(e)
    vote = FakeVote()
    result = ADPExecutor(e, vote, pad_empty_batch=False).step()
    assert vote.votes == [[0, 0]] and not result.ran and sum(dummies(e).values()) == 0


def test_no_post_schedule_dummy_on_an_idle_rank_even_when_pre_schedule_padding_could_not_pad():
    e = engine(padding_reserve=False)
    occupy(e, 4)
    ADPExecutor(e, FakeVote()).step()
    assert dummies(e, "pre_schedule")["unaffordable"] == 1
    assert dummies(e) == dict.fromkeys(OUTCOMES, 0)


def test_no_second_post_schedule_dummy_while_the_singleton_is_live():
    e = engine()
    starve(e)
    ex = ADPExecutor(e, FakeVote())
    live = Request(DUMMY_REQUEST_ID, [0], SamplingParams(max_tokens=1), dummy_phase="post_schedule")
    ex.padding.dummy = live
    e.fetch()
    batch = e.schedule_batch()
    assert batch.is_empty and e.num_active_real == 1
    ex.padding.post_schedule_pad(batch)
    assert batch.is_empty and ex.padding.dummy is live and e.kv.num_used_blocks == 3


def test_a_rank_at_max_num_active_requests_is_padded_too():
    e = engine(max_num_active_requests=1)
    starve(e)
    vote = FakeVote()
    result = ADPExecutor(e, vote).step()
    assert vote.votes == [[1, 1]] and result.ran and dummies(e)["committed"] == 1


def test_an_unaffordable_dummy_degrades_to_an_empty_batch_without_raising(caplog):
    e = engine(padding_reserve=False)
    starve(e, held_blocks=4)  # no block left at all
    vote = FakeVote()
    with caplog.at_level(logging.WARNING, "adpfleet.runtime.executor.padding"):
        result = ADPExecutor(e, vote).step()
    assert vote.votes == [[0, 0]] and not result.ran
    assert dummies(e) == {"committed": 0, "rolled_back": 0, "unaffordable": 1, "failed": 0}
    assert e.kv.num_used_blocks == 4 and any("post-schedule padding" in r.message for r in caplog.records)


@pytest.mark.parametrize("error, after_allocating", [(NoFreeBlocksError("adp-dummy", 1, 0), False),
                                                     (RuntimeError("allocator broke"), False),
                                                     (RuntimeError("broke half-way"), True)])
def test_allocation_errors_degrade_to_an_empty_batch_without_raising(monkeypatch, error, after_allocating):
    e = engine()
    starve(e)
    real_grow = e.kv.grow

    def grow(req, n):
        if req.is_dummy:
            if after_allocating:
                real_grow(req, n)
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


def test_a_pass_in_which_no_rank_has_a_batch_is_not_counted_as_vetoed():
    e = engine()
    starve(e)
    result = ADPExecutor(e, FakeVote(peer_size=0, peer_tokens=0), pad_empty_batch=False).step()
    assert not result.ran and e.stats.forward_vetoed == 0 and e.stats.empty_batch_iterations == 1


def test_the_allocation_rollback_of_a_vetoed_pass_never_touches_the_dummy():
    e = engine()
    starve(e)
    shrunk = []
    real_shrink = e.kv.shrink
    e.kv.shrink = lambda req, n: (shrunk.append(req.dummy_phase), real_shrink(req, n))
    ex = ADPExecutor(e, FakeVote(peer_size=0, peer_tokens=0))
    ex.step()
    assert dummies(e)["rolled_back"] == 1 and shrunk == []  # the padding code alone frees it


def test_dummies_never_respond_nor_count_as_progress():
    e = engine()
    starve(e)
    result = ADPExecutor(e, FakeVote()).step()
    assert result.outputs == [] and e.stats.prompt_tokens == 0 and e.stats.generation_tokens == 0
    assert e.stats.requests_running == 0 and e.stats.requests_waiting == 1


def test_an_idle_rank_runs_a_dummy_batch_padded_to_its_peers_token_count():
    e = engine()
    forwards = record_forwards(e)
    assert ADPExecutor(e, FakeVote(peer_size=3, peer_tokens=7)).step().ran
    assert forwards[0]["pad_to"] == 7


# -- the padding reserve ---------------------------------------------------------------------------

def test_admission_leaves_the_dummys_block_free_so_held_transfers_cannot_take_it():
    e = engine(kv_blocks=4)
    ADPExecutor(e, FakeVote())  # ADP with the reserve: one block kept back
    three = Request("three", [1] * 11, SamplingParams(max_tokens=1))  # 12 tokens: 3 blocks
    four = Request("four", [1] * 15, SamplingParams(max_tokens=1))  # 16 tokens: 4 blocks
    assert e.kv.can_reserve(three) and not e.kv.can_reserve(four)
    e.kv.reserve(three)
    e.kv.grow(three, 12)  # then held for a transfer: the rank is full for real requests
    dummy = Request("adp-dummy", [0], SamplingParams(max_tokens=1), dummy_phase="post_schedule")
    assert e.kv.available_for(dummy) == 1
    e.kv.grow(dummy, 1)
    assert e.kv.num_free_blocks == 0


@pytest.mark.parametrize("pad", [True, False])
def test_the_reserve_has_its_own_switch(pad):
    four = Request("four", [1] * 15, SamplingParams(max_tokens=1))
    e = engine(kv_blocks=4, padding_reserve=False)
    ADPExecutor(e, FakeVote(), pad_empty_batch=pad)
    assert e.kv.padding_reserve_blocks == 0 and e.kv.can_reserve(four)
    e = engine(kv_blocks=4)
    ADPExecutor(e, FakeVote(), pad_empty_batch=pad)  # the reserve alone, without padding, too
    assert e.kv.padding_reserve_blocks == 1 and not e.kv.can_reserve(four)


def test_the_reserve_is_one_decode_query_of_blocks():
    e = engine(kv_blocks=8, draft_tokens=5)  # a 6-token query: 2 blocks of 4
    ADPExecutor(e, FakeVote())
    assert e.kv.padding_reserve_blocks == 2


def test_no_reserve_without_adp():
    e = engine(kv_blocks=4)
    ADPExecutor(e, SingleRank())
    assert e.kv.padding_reserve_blocks == 0


# -- held KV is released on every pass, and the cap stall --------------------------------------------

def context_engine(**kw):
    puller = LedgerPuller()
    cfg = dict(model="tiny-dense", kv_blocks=4, tokens_per_block=4, max_num_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), model=MODEL, kv_hold=lambda kv: KVHold(kv, puller)), puller


def hold_prompt(e: LLMEngine, rid: str, blocks: int) -> None:
    """A finished prompt whose KV waits to be pulled (as a context server's)."""
    req = Request(rid, [1] * (blocks * 4), SamplingParams(max_tokens=1), num_computed_tokens=blocks * 4)
    e.kv.grow(req, blocks * 4)
    e.kv_hold.hold(req)


@pytest.mark.parametrize("peer_work", [1, 0], ids=["vetoed", "idle"])
def test_pulled_kv_is_released_on_a_pass_without_a_forward(peer_work):
    e, puller = context_engine()
    hold_prompt(e, "pulled", 3)
    if peer_work:  # a starved rank with padding off: the pass is vetoed
        e.add_request([5] * 6, SamplingParams(max_tokens=1), "starved")
    puller.complete("pulled")
    result = ADPExecutor(e, FakeVote(peer_work=peer_work), pad_empty_batch=False).step()
    assert not result.ran
    assert e.kv_hold.held == {} and e.kv.num_used_blocks == 0 and e.stats.kv_transfers_in_flight == 0


def test_a_context_rank_at_the_cap_with_its_kv_held_does_not_stall_the_fleet():
    """The cap stall, on two real executors: rank 0 is at max_num_active_requests with every
    request waiting for KV that finished prompts hold until they are pulled; rank 1 has work.
    Before the fix every pass was vetoed and nothing was ever reaped."""
    (e0, puller), (e1, _) = context_engine(max_num_active_requests=2), context_engine(max_num_active_requests=2)
    hold_prompt(e0, "held", 3)
    starved = [e0.add_request([5] * 6, SamplingParams(max_tokens=1), f"starved{i}") for i in range(3)]
    work = e1.add_request([6] * 9, SamplingParams(max_tokens=1), "work")
    fleet = LockstepFleet([e0, e1])
    try:
        fleet.step()
        assert e0.num_active_real == 2 and len(e0.pending) == 1  # at the cap, nothing fits
        assert work.is_finished and e1.stats.prompt_tokens == 9  # the peer progressed at once
        assert e0.stats.padding_dummies[("post_schedule", "committed")] == 1
        for rid in ["held"] + [r.request_id for r in starved]:  # pulled as soon as held from now on
            puller.complete(rid)
        for _ in range(6):
            fleet.step()
        assert all(r.is_finished for r in starved) and e0.stats.forward_vetoed == 0
    finally:
        fleet.close()


def test_a_placed_requests_first_token_is_emitted_before_the_passs_forward_and_its_buffer_released():
    import torch

    from adpfleet.runtime.executor.kv_transfer import KVPayload

    e = engine()
    forwards = record_forwards(e)
    k_cache = e.runner.kv_cache[0]
    req = Request("pulled", [5, 6, 7], SamplingParams(max_tokens=3))
    req.remote_kv, req.first_token_id = ("127.0.0.1:1", "h"), 9
    released = []
    shape = (k_cache.shape[0], 3, k_cache.shape[2], k_cache.shape[3])
    payload = KVPayload(torch.ones(shape), torch.ones(shape), on_release=lambda: released.append(True))
    req.kv_payload = payload
    emitted = []
    result = ADPExecutor(e, FakeVote()).step([req], emit=lambda outs: emitted.append((len(forwards), outs)))
    [(forwards_before, [first])] = emitted
    assert forwards_before == 0 and first.request_id == "pulled" and first.new_token_ids == [9]
    assert result.ran and all(o.request_id != "pulled" or o.new_token_ids != [9] for o in result.outputs)
    assert released == [True] and payload.k is None  # copied into the blocks, then given back


def test_a_pass_that_runs_observes_its_lockstep_imbalance_and_a_vetoed_one_does_not():
    e = engine()
    e.add_request([5] * 6, SamplingParams(max_tokens=2), "six")  # 6 prompt tokens against the peer's 2
    ADPExecutor(e, FakeVote(peer_size=1, peer_tokens=2)).step()
    assert (e.stats.pass_imbalance.count, e.stats.pass_imbalance.sum) == (1, 6 / 4)
    vetoed = engine()
    vetoed.add_request([5] * 6, SamplingParams(max_tokens=2), "six")
    ADPExecutor(vetoed, FakeVote(peer_size=0, peer_tokens=0, peer_work=1)).step()
    assert vetoed.stats.forward_vetoed == 1 and vetoed.stats.pass_imbalance.count == 0
