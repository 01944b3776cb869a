"""KV block accounting: after any sequence of operations, used + free == total and nothing leaks;
the prefix cache: chained hashes, reference counts, LRU eviction, a hit's skip, rollback, and a
pool full of cached blocks that admits as an empty one."""

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.runtime.engine.block_hash import ROOT, block_hashes, chain
from adpfleet.runtime.engine.kv_cache import KVCacheManager, NoFreeBlocksError
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import SamplingParams
from budgets import examples


def req(name: str, prompt: int, max_tokens: int) -> Request:
    return Request(name, [1] * prompt, SamplingParams(max_tokens=max_tokens))


ops = st.lists(st.tuples(st.sampled_from(["add", "chunk", "decode", "rollback", "finish", "abort"]),
                         st.integers(0, 7), st.integers(1, 40), st.integers(1, 20)), max_size=80)


@settings(max_examples=examples(200), deadline=None)
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


# -- the prefix cache ----------------------------------------------------------------------------
def computed(kv: KVCacheManager, r: Request, num_tokens: int) -> None:
    """A pass that ran r up to `num_tokens`: its blocks cover them, its full blocks enter the cache."""
    kv.grow(r, num_tokens)
    r.num_computed_tokens = num_tokens
    kv.cache_computed_blocks(r)


def served(kv: KVCacheManager, tokens: list[int], max_tokens: int = 1) -> Request:
    """A request admitted, its prompt run and finished: its full blocks stay cached, unreferenced."""
    r = Request(f"served-{tokens[:3]}", list(tokens), SamplingParams(max_tokens=max_tokens))
    assert kv.admit(r, r.max_total_tokens)
    computed(kv, r, len(tokens))
    kv.free(r)
    return r


def fresh(tokens: list[int], max_tokens: int = 4, name: str = "new") -> Request:
    return Request(name, list(tokens), SamplingParams(max_tokens=max_tokens))


def test_a_block_hash_is_chained_from_its_parent_so_it_names_the_whole_prefix():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2  # full blocks only
    assert a[1] == chain(chain(ROOT, [1, 2, 3, 4]), [5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # the same tokens in block 1 after another block 0
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a  # no per-process seed: the same everywhere
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2) != a


def test_a_new_request_starts_from_its_cached_prefix_and_always_computes_its_last_token():
    kv = KVCacheManager(num_blocks=16, tokens_per_block=4)
    first = served(kv, list(range(10)))  # 2 full blocks cached, the partial third is not
    assert kv.num_cached_blocks == 2 and kv.num_used_blocks == 0
    longer = fresh(list(range(8)) + [50, 51, 52])
    assert kv.admit(longer, longer.max_total_tokens)
    assert longer.num_computed_tokens == 8 and longer.remaining_prompt_tokens == 3
    assert longer.block_table[:2] == first_blocks(kv, list(range(8)))
    exact = fresh(list(range(8)))  # the whole prompt is cached: its last block runs again
    assert kv.admit(exact, exact.max_total_tokens) and exact.num_computed_tokens == 4
    other = fresh([99] + list(range(1, 8)) + [5])  # block 1's tokens match, block 0's do not
    assert kv.admit(other, other.max_total_tokens) and other.num_computed_tokens == 0


def first_blocks(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    return [kv._cached[h] for h in block_hashes(tokens, kv.tokens_per_block)]


def test_shared_blocks_are_reference_counted_and_freed_into_the_cache_by_the_last_holder():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    a = fresh([1, 2, 3, 4, 5], name="a")
    assert kv.admit(a, 6)
    computed(kv, a, 5)
    b = fresh([1, 2, 3, 4, 9], name="b")
    assert kv.admit(b, 6)
    shared = a.block_table[:2]
    assert b.block_table == shared and kv.num_used_blocks == 3  # a's 3 blocks, 2 of them b's too
    kv.free(a)
    assert kv.num_used_blocks == 2 and all(blk not in kv._evictable for blk in shared)
    kv.free(b)
    assert kv.num_used_blocks == 0 and set(kv._evictable) == set(shared) and kv.num_free_blocks == 8


def test_uncached_free_blocks_go_first_then_cached_ones_least_recently_released_tail_first():
    kv = KVCacheManager(num_blocks=5, tokens_per_block=2)
    old = served(kv, [1, 2, 3, 4, 5, 6])  # its 3 blocks cached, released first
    new = served(kv, [7, 8, 9])  # 1 block cached, released last
    old_blocks, new_blocks = first_blocks(kv, [1, 2, 3, 4, 5, 6]), first_blocks(kv, [7, 8])
    taker = fresh([0] * 2, name="taker")
    kv.grow(taker, 2)  # the one uncached free block (new's partial block)
    assert kv.num_cached_blocks == 4 and kv.evictions == 0
    kv.grow(taker, 6)  # then old's blocks, its tail first
    assert taker.block_table[1:] == [old_blocks[2], old_blocks[1]] and kv.evictions == 2
    survivor = fresh([1, 2, 3, 4, 5, 6, 7], name="survivor")
    assert kv.cached_prefix(survivor) == old_blocks[:1] and kv.cached_prefix(fresh([7, 8, 0])) == new_blocks


def test_a_hit_costs_the_cached_blocks_nobody_holds_and_no_block_someone_holds():
    kv = KVCacheManager(num_blocks=6, tokens_per_block=2)
    served(kv, [1, 2, 3, 4, 5])  # 2 cached, unreferenced
    assert kv.num_available_blocks == 6
    a = fresh([1, 2, 3, 4, 5, 6], max_tokens=2, name="a")  # 4 blocks, 2 of them from the cache
    assert kv.admit(a, a.max_total_tokens) and kv.num_available_blocks == 2
    b = fresh([1, 2, 3, 4, 7, 8], max_tokens=2, name="b")  # 4 blocks, 2 shared with a: 2 new
    assert not kv.can_reserve(b)  # without its hit b would not fit
    assert kv.admit(b, b.max_total_tokens) and kv.num_available_blocks == 0


def test_a_hit_on_cached_blocks_nobody_holds_is_refused_when_they_and_the_rest_do_not_fit():
    kv = KVCacheManager(num_blocks=6, tokens_per_block=2)
    served(kv, [1, 2, 3, 4, 5])  # 2 cached, unreferenced
    kv.grow(fresh([0] * 4, name="holder"), 4)  # 2 uncached blocks held
    big = fresh([1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=3)  # 6 blocks: 2 found, 4 new, only 4 free in all
    assert not kv.admit(big, big.max_total_tokens)
    assert big.block_table == [] and big.num_computed_tokens == 0 and kv.num_available_blocks == 4


def test_a_rolled_back_pass_keeps_the_hit_and_returns_only_the_tentative_blocks():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    served(kv, [1, 2, 3, 4, 5])
    r = fresh([1, 2, 3, 4, 5, 6, 7])
    assert kv.admit(r, r.max_total_tokens)
    hit = list(r.block_table)
    kv.grow(r, 7)  # the pass's tentative blocks
    kv.shrink(r, r.num_computed_tokens)  # vetoed
    assert r.block_table == hit and r.num_computed_tokens == 4 and kv.num_used_blocks == 2
    assert kv.num_available_blocks == 8 - kv.blocks_for(r.max_total_tokens)  # still admitted


def test_a_pool_full_of_cached_blocks_admits_reserves_and_pads_as_an_empty_pool():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)
    kv.padding_reserve_blocks = 1
    for i in range(4):
        served(kv, [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4])
    assert kv._free == [] and kv.num_cached_blocks == 8  # no uncached free block is left
    assert kv.num_free_blocks == kv.num_available_blocks + 1 == 8
    largest = fresh([7] * 10, max_tokens=4)  # everything but the reserve
    assert kv.admit(largest, largest.max_total_tokens)
    kv.grow(largest, 14)
    dummy = Request("adp-dummy", [0], SamplingParams(max_tokens=1), dummy_phase="post_schedule")
    assert kv.blocks_for(1) <= kv.available_for(dummy)
    kv.grow(dummy, 1)  # the reserve
    assert kv.num_free_blocks == 0 and kv.num_cached_blocks == 0 and kv.evictions == 8


def test_the_prefix_cache_off_never_shares():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2, prefix_cache=False)
    served(kv, [1, 2, 3, 4, 5])
    r = fresh([1, 2, 3, 4, 5])
    assert kv.num_cached_blocks == 0 and kv.admit(r, r.max_total_tokens) and r.num_computed_tokens == 0


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9, 9, 9], [5, 5]]
cache_ops = st.lists(st.tuples(st.sampled_from(["add", "compute", "finish", "rollback"]), st.integers(0, 5),
                               st.integers(0, 2), st.integers(0, 6), st.integers(1, 8)), max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(cache_ops)
def test_with_shared_prefixes_the_cache_never_admits_less_and_its_books_balance(sequence):
    """The same operations on a pool with and without the prefix cache: whatever the cacheless
    pool admits the cached one admits too, it never has fewer blocks available, no block is both
    free and held, reference counts are the holders, and a cached block holds its hash's tokens."""
    pools = {on: KVCacheManager(num_blocks=12, tokens_per_block=2, prefix_cache=on) for on in (True, False)}
    live: dict[bool, dict[int, Request]] = {True: {}, False: {}}
    for op, slot, prefix, extra, n in sequence:
        adding = op == "add" and slot not in live[True] and slot not in live[False]
        # both pools compute up to the same position (the cached one may start ahead: its hit)
        target = max((x[slot].num_computed_tokens for x in live.values() if slot in x), default=0) + n
        for on, kv in pools.items():
            r = live[on].get(slot)
            if adding:
                r = fresh(PREFIXES[prefix] + [20 + slot] * extra, max_tokens=n, name=f"r{slot}")
                if kv.admit(r, r.max_total_tokens):
                    live[on][slot] = r
            elif op == "compute" and r is not None and r.num_computed_tokens < min(target, r.num_prompt_tokens):
                computed(kv, r, min(target, r.num_prompt_tokens))
            elif op == "rollback" and r is not None:
                kv.grow(r, min(r.max_total_tokens, r.num_computed_tokens + n))
                kv.shrink(r, r.num_computed_tokens)
            elif op == "finish" and r is not None:
                kv.free(r)
                del live[on][slot]
        assert set(live[False]) <= set(live[True])  # the cache never cost an admission
        if adding and slot in live[True] and slot not in live[False]:
            # a hit let the cached pool admit what the cacheless one could not: undo it, so both go on
            # holding the same requests and the comparisons below stay like for like
            pools[True].free(live[True].pop(slot))
        assert pools[True].num_available_blocks >= pools[False].num_available_blocks
        for on, kv in pools.items():
            assert_books_balance(kv, list(live[on].values()))


def assert_books_balance(kv: KVCacheManager, holders: list[Request]) -> None:
    refs = collections.Counter(b for r in holders for b in r.block_table)
    free = set(kv._free) | set(kv._evictable)
    assert not free & set(refs) and len(free) + len(refs) == kv.num_blocks == len(kv._free) + len(kv._evictable) + len(refs)
    assert all(kv._refs[b] == refs[b] for b in range(1, kv.num_blocks + 1)) and 0 not in refs
    assert set(kv._evictable) <= set(kv._hash_of) and not set(kv._free) & set(kv._hash_of)
    for r in holders:
        hashes = block_hashes(r.prompt_token_ids[:r.num_computed_tokens], kv.tokens_per_block)
        for i, b in enumerate(r.block_table[:len(hashes)]):
            assert kv._hash_of.get(b, hashes[i]) == hashes[i]  # cached, then under its own tokens' hash
