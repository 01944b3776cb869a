"""Capacity (guaranteed no evict, head-of-line) and micro-batch (caps, chunking) scheduling."""

from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.request import Request, RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.engine.scheduler import Scheduler, SchedulerConfig


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
