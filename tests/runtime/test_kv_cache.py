"""KV block accounting: after any sequence of operations, used + free == total and nothing leaks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.runtime.engine.kv_cache import KVCacheManager, NoFreeBlocksError
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import SamplingParams


def req(name: str, prompt: int, max_tokens: int) -> Request:
    return Request(name, [1] * prompt, SamplingParams(max_tokens=max_tokens))


ops = st.lists(st.tuples(st.sampled_from(["add", "chunk", "decode", "rollback", "finish", "abort"]),
                         st.integers(0, 7), st.integers(1, 40), st.integers(1, 20)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_accounting_holds_for_any_sequence_of_operations(sequence):
    kv = KVCacheManager(num_blocks=24, tokens_per_block=4)
    live: dict[int, Request] = {}
    for op, slot, a, b in sequence:
        r = live.get(slot)
        if op == "add" and r is None:
            r = req(f"r{slot}", a, b)
            if kv.can_reserve(r):
                kv.reserve(r)
                live[slot] = r
        elif op in ("chunk", "decode") and r is not None:
            target = min(r.max_total_tokens, r.num_computed_tokens + (a if op == "chunk" else 1))
            kv.grow(r, target)  # within its reservation: never raises
            r.num_computed_tokens = target
        elif op == "rollback" and r is not None:
            kv.grow(r, min(r.max_total_tokens, r.num_computed_tokens + 1))
            kv.shrink(r, r.num_computed_tokens)
        elif op in ("finish", "abort") and r is not None:
            kv.free(r)
            del live[slot]
        held = sum(len(x.block_table) for x in live.values())
        assert kv.num_used_blocks + kv.num_free_blocks == kv.num_blocks
        assert kv.num_used_blocks == held
        promised = sum(x.reserved_blocks - len(x.block_table) for x in live.values())
        assert kv.num_available_blocks == kv.num_free_blocks - promised >= 0
        tables = [b for x in live.values() for b in x.block_table]
        assert len(tables) == len(set(tables)) and 0 not in tables  # no block shared, null block never given
    for r in live.values():
        kv.free(r)
    assert kv.num_free_blocks == kv.num_available_blocks == kv.num_blocks


def test_reserving_more_than_available_raises_a_typed_error():
    kv = KVCacheManager(num_blocks=4, tokens_per_block=4)
    kv.reserve(req("a", 8, 4))  # 3 blocks
    big = req("b", 4, 4)  # 2 blocks, 1 available
    assert not kv.can_reserve(big)
    with pytest.raises(NoFreeBlocksError) as err:
        kv.reserve(big)
    assert err.value.needed == 2 and err.value.available == 1 and "b" in str(err.value)


def test_growing_past_the_reservation_uses_only_unpromised_blocks():
    kv = KVCacheManager(num_blocks=3, tokens_per_block=4)
    a, b = req("a", 4, 4), req("b", 4, 4)
    kv.reserve(a)  # 2 blocks promised
    b_blocks_free = kv.num_available_blocks
    assert b_blocks_free == 1
    kv.grow(b, 4)  # no reservation: takes the one unpromised block
    with pytest.raises(NoFreeBlocksError):
        kv.grow(b, 5)
    kv.grow(a, 8)  # a's promise is still honoured
    assert kv.num_free_blocks == 0
