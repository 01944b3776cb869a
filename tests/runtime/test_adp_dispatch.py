"""The server's ADP dispatcher as specifications: the placement rule, its books, the cache events
it learns from, the rank hint at the HTTP edge. No processes (tests/runtime/test_prefix_dispatch_server.py
runs a real server)."""

import math
import random

import pytest
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.engine.cache_events import CLEARED, STORED
from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.request import Request as EngineRequest
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor.adp_dispatcher import ADPDispatcher
from adpfleet.runtime.executor.adp_router import IMBALANCE_BOUND, imbalance_after, place
from adpfleet.runtime.executor.rank_cache_view import RankCacheView
from adpfleet.runtime.serving.auth import BearerAuth, Credentials
from adpfleet.runtime.serving.limits import Refused
from adpfleet.runtime.serving.rank_routing import RANK_HEADER, rank_hint

B = 4  # tokens per block


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> EngineRequest:
    return EngineRequest(rid, tokens, SamplingParams(max_tokens=max_tokens))


def stored(tokens: list[int]) -> list[tuple[str, str]]:
    return [(STORED, h.hex()) for h in block_hash.block_hashes(tokens, B)]


# -- the rule ------------------------------------------------------------------------------------
def test_the_rank_with_the_longest_hit_wins_while_the_ranks_stay_within_the_bound():
    assert place([100, 110], [10, 30], hits=[0, 5]) == 1
    assert place([0, 0], [30, 10], hits=[0, 5]) == 1  # an idle server: nothing to balance against


def test_a_hit_that_would_pass_the_bound_goes_to_the_rank_that_keeps_it():
    # rank 0 holds the prefix but already has 3x rank 1's work: 150 / 105 > 1.25
    assert imbalance_after([140, 50], 10, 0) > IMBALANCE_BOUND
    assert place([140, 50], [10, 30], hits=[8, 0]) == 1
    assert place([140, 50], [10, 30], hits=[8, 0], bound=math.inf) == 0


def test_when_no_rank_keeps_the_bound_the_most_balanced_placement_is_taken():
    # one request on an idle 2-rank server is imbalance 2 wherever it goes; here rank 1 is 1.67
    assert place([24, 0], [24, 120], hits=[6, 0]) == 1


def test_without_hits_it_is_least_loaded_then_lowest_rank():
    assert place([5, 3, 3], [4, 4, 4], hits=[0, 0, 0]) == 1
    assert place([0, 0], [4, 4], hits=[0, 0]) == 0


def hot_prefix_placements(bound: float, sessions: int = 16) -> tuple[list[int], list[int]]:
    """Rank 0 holds a 24-token system prompt; `sessions` requests that start with it arrive at once."""
    d = ADPDispatcher(2, B, bound)
    system = list(range(100, 124))
    d.view.apply(0, stored(system))
    ranks = [d.assign(request(f"s{i}", system + [200 + i] * 4, max_tokens=4)) for i in range(sessions)]
    return ranks, d.pending


def test_a_hot_shared_prefix_spreads_over_the_ranks_within_the_bound():
    ranks, pending = hot_prefix_placements(IMBALANCE_BOUND)
    assert set(ranks) == {0, 1} and max(pending) / (sum(pending) / 2) <= IMBALANCE_BOUND
    ranks, pending = hot_prefix_placements(math.inf)  # affinity alone pins every session on rank 0
    assert set(ranks) == {0}


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(0, 8)), min_size=1, max_size=30))
def test_a_placement_never_makes_the_pending_work_more_unbalanced_than_the_bound_or_the_best_choice(load):
    pending = [0, 0, 0, 0]
    for _, cost, hit in load:
        costs = [cost + (hit if r else 0) for r in range(4)]  # rank 0 holds `hit` tokens more
        hits = [hit, 0, 0, 0]
        rank = place(pending, costs, hits)
        best = min(imbalance_after(pending, costs[r], r) for r in range(4))
        assert imbalance_after(pending, costs[rank], rank) <= max(IMBALANCE_BOUND, best) + 1e-9
        pending[rank] += costs[rank]


# -- the books -----------------------------------------------------------------------------------
def test_pending_tokens_are_the_prefill_left_after_the_hit_plus_the_tokens_not_yet_produced():
    d = ADPDispatcher(2, B)
    d.view.apply(1, stored([1] * 8))
    assert d.assign(request("a", [1] * 8 + [2, 3], max_tokens=5)) == 1
    assert d.pending == [0, (10 - 8) + 5] and d.requests == [0, 1] and d.hit_blocks == 2
    d.progress("a", 2)  # the prompt is done, 2 of 5 produced
    assert d.pending == [0, 3]
    assert d.release("a") == 1 and d.pending == [0, 0] and d.requests == [0, 0]
    assert d.release("a") is None


def test_a_pulled_request_costs_no_prefill_and_a_named_rank_is_taken_as_it_is():
    d = ADPDispatcher(2, B)
    pulled = request("g", [1] * 12, max_tokens=3)
    pulled.remote_kv = ("127.0.0.1:1", "h")
    assert d.assign(pulled, rank=1) == 1 and d.pending == [0, 3] and d.hinted == 1
    with pytest.raises(ValueError, match="rank 2 does not exist"):
        d.assign(request("x", [1, 2]), rank=2)


def test_the_snapshot_says_what_each_rank_holds_and_has_pending():
    d = ADPDispatcher(2, B)
    d.view.apply(0, stored([1] * 8))
    snap = d.snapshot()
    assert snap["hash"] == block_hash.SCHEME and snap["tokens_per_block"] == B
    assert snap["ranks"][0]["blocks"] == sorted(h.hex() for h in block_hash.block_hashes([1] * 8, B))
    assert snap["ranks"][1] == {"rank": 1, "requests": 0, "pending_tokens": 0, "events": 0, "blocks": []}


# -- what the dispatcher learns from ---------------------------------------------------------------
def test_a_request_may_find_every_full_block_but_the_one_holding_its_last_token():
    assert block_hash.matchable_blocks(8, 4) == 1 and block_hash.matchable_blocks(9, 4) == 2
    assert block_hash.prefix_hashes(list(range(9)), 4) == block_hash.block_hashes(list(range(8)), 4)
    assert block_hash.prefix_hashes([], 4) == []


def test_a_hit_stops_at_the_first_block_a_rank_does_not_hold():
    view = RankCacheView(2)
    first, second, third = block_hash.block_hashes(list(range(12)), B)
    view.apply(0, [(STORED, first.hex()), (STORED, third.hex())])
    view.apply(1, [(STORED, first.hex()), (STORED, second.hex()), ("removed", second.hex())])
    assert view.hits([first, second, third]) == [1, 1]
    view.apply(0, [(CLEARED, "")])
    assert view.hits([first]) == [0, 1]
    with pytest.raises(ValueError, match="kind 'bogus'"):
        view.apply(0, [("bogus", "")])


def churn(kv: KVCacheManager, rng: random.Random, steps: int, on_step) -> None:
    """Requests from a few shared prefixes, admitted, computed, cached and freed, evicting as they go."""
    live = []
    for i in range(steps):
        if live and (rng.random() < 0.5 or kv.num_available_blocks < 6):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            stem = [rng.randrange(3)] * rng.choice([4, 8, 12])
            req = request(f"r{i}", stem + [rng.randrange(50) for _ in range(rng.randrange(1, 9))])
            if kv.admit(req, req.num_prompt_tokens):
                kv.grow(req, req.num_prompt_tokens)
                req.num_computed_tokens = req.num_prompt_tokens
                kv.cache_computed_blocks(req)
                live.append(req)
        on_step()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.floats(0, 1))
def test_replaying_the_events_a_rank_sends_yields_exactly_what_its_cache_holds(seed, drain_rate):
    rng = random.Random(seed)
    kv, view = KVCacheManager(12, B), RankCacheView(1)

    def drain():
        if rng.random() < drain_rate:
            view.apply(0, kv.events.take())
    churn(kv, rng, 60, drain)
    view.apply(0, kv.events.take())
    assert set(view.blocks(0)) == {h.hex() for h in kv.cached_hashes()}


def test_a_log_nobody_drains_stays_bounded_and_still_replays_to_the_cache():
    rng = random.Random(7)
    kv = KVCacheManager(12, B)
    longest = []
    churn(kv, rng, 2000, lambda: longest.append(len(kv.events)))
    assert max(longest) <= kv.events.capacity and kv.evictions > 50
    view = RankCacheView(1)
    view.apply(0, kv.events.take())
    assert set(view.blocks(0)) == {h.hex() for h in kv.cached_hashes()}


# -- the rank hint at the HTTP edge --------------------------------------------------------------
def hint_app(credentials: Credentials) -> TestClient:
    app = FastAPI()
    app.add_middleware(BearerAuth, credentials=credentials)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            return {"rank": rank_hint(request, 2, credentials)}
        except Refused as r:
            return r.response()
    return TestClient(app)


@pytest.mark.parametrize("headers, rank", [({}, None), ({RANK_HEADER: "1"}, 1), ({"x-data-parallel-rank": "0"}, 0),
                                           ({RANK_HEADER: " 1 "}, 1)])
def test_a_rank_hint_names_a_rank_of_this_server(headers, rank):
    answer = hint_app(Credentials()).post("/v1/completions", headers=headers)
    assert answer.status_code == 200 and answer.json() == {"rank": rank}


@pytest.mark.parametrize("value", ["2", "-1", "abc", "1.0", "", "\u0661".encode(), "9" * 5000])
def test_a_rank_hint_that_is_no_rank_of_this_server_is_refused_naming_the_header(value):
    answer = hint_app(Credentials()).post("/v1/completions", headers={RANK_HEADER: value})
    assert answer.status_code == 400, value
    assert answer.json()["error"]["param"] == RANK_HEADER and "0..1" in answer.json()["error"]["message"]


def test_two_rank_hints_are_refused():
    answer = hint_app(Credentials()).post("/v1/completions", headers=[(RANK_HEADER, "0"), (RANK_HEADER, "1")])
    assert answer.status_code == 400


def test_with_an_internal_token_only_the_router_may_name_a_rank():
    client = hint_app(Credentials(api_key="user-key", internal_token="fleet-token"))
    user = client.post("/v1/completions", headers={RANK_HEADER: "1", "Authorization": "Bearer user-key"})
    assert user.status_code == 403 and RANK_HEADER in user.json()["error"]["message"]
    assert client.post("/v1/completions", headers={"Authorization": "Bearer user-key"}).json() == {"rank": None}
    router = client.post("/v1/completions", headers={RANK_HEADER: "1", "Authorization": "Bearer fleet-token"})
    assert router.json() == {"rank": 1}
