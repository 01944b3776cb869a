"""Capacity (guaranteed no evict, head-of-line — for prompts and for pulled KV alike) and
micro-batch (caps, chunking) scheduling."""

import itertools
import random

import pytest

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import Request, RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.engine.scheduler import Scheduler, SchedulerConfig
from lockstep import LockstepFleet, TableModel, cycle_table
from progress_sim import PulledKV


def req(name, prompt, max_tokens=4, state=RequestState.WAITING):
    r = Request(name, list(range(prompt)), SamplingParams(max_tokens=max_tokens))
    r.state = state
    return r


def scheduler(blocks=64, tpb=4, **cfg):
    kv = KVCacheManager(blocks, tpb)
    return Scheduler(kv, SchedulerConfig(**cfg)), kv


def test_admission_stops_at_the_first_request_that_does_not_fit():
    s, kv = scheduler(blocks=6, tpb=4)
    small1, big, small2 = req("s1", 4), req("big", 16), req("s2", 4)  # 2, 5, 2 blocks
    batch, admitted = s.schedule([small1, big, small2], [])
    assert admitted == [small1]  # big does not fit (4 left); s2 would, but waits behind it
    assert big.state is RequestState.WAITING and small2.state is RequestState.WAITING
    assert [r for r, _ in batch.context] == [small1]


def test_token_budget_chunks_long_prompts():
    s, _ = scheduler(max_num_tokens=10)
    long, short = req("long", 25), req("short", 3)
    batch, _ = s.schedule([long, short], [])
    assert [(r.request_id, n) for r, n in batch.context] == [("long", 10)]
    assert batch.num_tokens == 10


def test_generation_is_scheduled_before_prompt_chunks_within_the_budget():
    s, kv = scheduler(max_num_tokens=6)
    gens = [req(f"g{i}", 2, state=RequestState.GENERATION) for i in range(2)]
    for g in gens:
        kv.reserve(g)
        kv.grow(g, 2)
        g.num_computed_tokens = 2
        g.output_token_ids = [5]
    prompt = req("p", 20)
    batch, _ = s.schedule([prompt], gens)
    assert batch.generation == gens
    assert [(r.request_id, n) for r, n in batch.context] == [("p", 4)]


def test_batch_size_cap_limits_requests():
    s, _ = scheduler(max_batch_size=2, max_num_tokens=100)
    batch, admitted = s.schedule([req("a", 3), req("b", 3), req("c", 3)], [])
    assert len(batch.requests) == 2
    assert len(admitted) == 3  # admission is capacity-bound, batching is cap-bound


def test_revert_gives_back_the_tentative_allocation():
    s, kv = scheduler(blocks=8, tpb=4)
    r = req("a", 9)
    batch, _ = s.schedule([r], [])
    assert len(r.block_table) == 3
    s.revert(batch)
    assert r.block_table == [] and kv.num_used_blocks == 0
    assert kv.num_available_blocks == 8 - kv.blocks_for(r.max_total_tokens)  # still admitted


def test_pulled_requests_are_admitted_head_of_line_too():
    s, kv = scheduler(blocks=6, tpb=4)
    small1, big, small2 = req("s1", 4), req("big", 16), req("s2", 4)  # 2, 5, 2 blocks, their KV pulled
    placed = []
    assert s.capacity.admit_pulled([small1, big, small2], placed.append) == [small1]  # s2 fits, but waits
    assert placed == [small1] and small1.reserved_blocks == 2 and small2.reserved_blocks == 0
    assert kv.num_available_blocks == 6 - 2


# The review's reproduction: 2 ranks, 16 blocks of 4 tokens, one 40 + 16-token request behind a
# 6 + 6-token one, and another small one every 3 passes. Without the rule a generation rank placed
# whatever fit: a small request always held the blocks the large one needed, and it was never
# placed in 400 passes (the aggregated role admitted it at pass 5).
@pytest.mark.parametrize("role", ["aggregated", "generation"])
def test_a_large_request_is_not_starved_by_a_stream_of_small_ones(role):
    table = cycle_table(random.Random(0), 320, 32)
    engines = [LLMEngine(EngineConfig(model="tiny-dense", kv_blocks=16, tokens_per_block=4), model=TableModel(table))
               for _ in range(2)]
    e, ids = engines[0], itertools.count()

    def request(prompt_len, max_tokens):
        n = next(ids)
        rid, prompt = f"r{n}", [(7 * i + n) % 32 for i in range(prompt_len)]
        r = e.make_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)
        if role == "generation":  # its prompt ran on a context server: it comes with its KV
            r.remote_kv, r.first_token_id, r.kv_payload = ("ctx:1", rid), table[prompt[-1]], PulledKV(prompt_len)
        return r

    fleet = LockstepFleet(engines)
    try:
        for p in range(400):
            new = [request(6, 6)] if p % 3 == 0 else []
            if p == 0:
                large = request(40, 16)  # behind the first small one
                new.append(large)
            fleet.step({0: new})
            if large.state is not RequestState.WAITING:
                break
        assert p <= 6, f"the large request waited {p} passes"
    finally:
        fleet.close()
