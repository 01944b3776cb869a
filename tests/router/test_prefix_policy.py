"""The cache-aware policy's pure parts: reading a snapshot, scoring (server, rank), the fallback,
round robin, and counting the view's wrong predictions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.router.metrics import RouterMetrics
from adpfleet.runtime.router.policy import Selector, best_by_prefix
from adpfleet.runtime.router.pool import Endpoint, ServerPool
from adpfleet.runtime.router.prefix_view import BadSnapshot, PrefixViews, parse_snapshot
from adpfleet.runtime.router.prompt_tokens import Prompt

B = 4
A, Z = Endpoint("aggregated", "http://a:8000"), Endpoint("aggregated", "http://z:8000")


def snapshot(blocks_by_rank: list[list[int]], pending: list[int], prompt: list[int]) -> dict:
    """A server's snapshot whose rank r holds the first blocks_by_rank[r] blocks of `prompt`."""
    hashes = [h.hex() for h in block_hash.block_hashes(prompt, B)]
    return {"hash": block_hash.SCHEME, "tokens_per_block": B, "imbalance_bound": 1.25,
            "ranks": [{"rank": r, "requests": 1, "pending_tokens": p, "blocks": hashes[:n]}
                      for r, (n, p) in enumerate(zip(blocks_by_rank, pending))]}


PROMPT = list(range(1, 33))  # 8 blocks; 7 matchable (the last token always runs)


def views(**by_server: tuple[list[int], list[int]]):
    return {ep: parse_snapshot(snapshot(*by_server[name], PROMPT)) for name, ep in (("a", A), ("z", Z))
            if name in by_server}


def test_the_rank_holding_the_longest_prefix_wins_when_loads_are_even():
    pick = best_by_prefix(views(a=([0, 2], [50, 50]), z=([5, 0], [50, 50])), [A, Z], Prompt(PROMPT, 8))
    assert (pick.server, pick.rank, pick.hit_blocks, pick.prefill) == (Z, 0, 5, 32 - 5 * B)


def test_a_loaded_server_loses_its_hit_to_an_idle_one_once_its_load_outweighs_the_prefill_saved():
    # z's rank 0 holds 5 blocks (20 tokens saved), but z's busiest rank has 400 tokens pending
    pick = best_by_prefix(views(a=([1, 0], [0, 0]), z=([5, 0], [400, 400])), [A, Z], Prompt(PROMPT, 8))
    assert pick.server == A


def test_a_hit_rank_past_the_lockstep_bound_yields_to_its_peer():
    pick = best_by_prefix(views(z=([7, 0], [200, 0])), [Z], Prompt(PROMPT, 8))
    assert (pick.rank, pick.hit_blocks) == (1, 0)  # rank 0 would hold 200 + 12 vs 0: over 1.25 x the mean


def test_nothing_held_anywhere_is_no_choice_and_servers_without_a_view_are_not_scored():
    assert best_by_prefix(views(a=([0, 0], [0, 0]), z=([0, 0], [0, 0])), [A, Z], Prompt(PROMPT, 8)) is None
    assert best_by_prefix(views(z=([5, 0], [0, 0])), [A], Prompt(PROMPT, 8)) is None


@pytest.mark.parametrize("body, what", [
    ([], "not a JSON object"),
    ({**snapshot([1], [0], PROMPT), "hash": "md5"}, "hash scheme"),
    ({**snapshot([1], [0], PROMPT), "tokens_per_block": 0}, "tokens_per_block"),
    ({**snapshot([1], [0], PROMPT), "imbalance_bound": "x"}, "imbalance_bound"),
    ({**snapshot([1], [0], PROMPT), "ranks": {}}, "'ranks'"),
    ({**snapshot([1], [0], PROMPT), "ranks": [{"rank": 1, "pending_tokens": 0, "blocks": []}]}, "ranks[0]"),
    ({**snapshot([1], [0], PROMPT), "ranks": [{"rank": 0, "pending_tokens": -1, "blocks": []}]}, "pending_tokens"),
    ({**snapshot([1], [0], PROMPT), "ranks": [{"rank": 0, "pending_tokens": 0, "blocks": ["zz"]}]}, "blocks"),
])
def test_a_snapshot_of_the_wrong_shape_is_refused_saying_what_is_wrong(body, what):
    with pytest.raises(BadSnapshot, match=what.replace("[", r"\[").replace("]", r"\]")):
        parse_snapshot(body)


def pool_of(*eps: Endpoint) -> ServerPool:
    pool = ServerPool()
    pool.set_endpoints(eps)
    return pool


def test_the_selector_falls_back_to_least_loaded_without_a_hint_when_nothing_matches():
    pool = pool_of(A, Z)
    pool.acquire(A)
    prefix_views = PrefixViews(pool, RouterMetrics(), None, {}, 1.0)
    prefix_views.views = views(a=([0, 0], [0, 0]), z=([0, 0], [0, 0]))
    pick = Selector(pool, "cache-aware", prefix_views, prefix_views.metrics).pick("aggregated", 0.0, set(),
                                                                                  Prompt(PROMPT, 8))
    assert (pick.server, pick.rank) == (Z, None)


def test_round_robin_ignores_load():
    pool = pool_of(A, Z)
    pool.acquire(A)
    selector = Selector(pool, "round-robin")
    assert [selector.pick("aggregated", 0.0, set(), None).server for _ in range(4)] == [A, Z, A, Z]
    assert Selector(pool, "least-loaded").pick("aggregated", 0.0, set(), None).server == Z


def test_a_prediction_the_next_snapshot_does_not_bear_out_is_counted_missing():
    pool = pool_of(Z)
    metrics = RouterMetrics()
    prefix_views = PrefixViews(pool, metrics, None, {}, 1.0)
    prefix_views.views = views(z=([5, 3], [0, 0]))
    pick = Selector(pool, "cache-aware", prefix_views, metrics).pick("aggregated", 0.0, set(), Prompt(PROMPT, 8))
    assert (pick.rank, pick.hit_blocks) == (0, 5) and prefix_views.routed[Z] == [12 + 8]
    prefix_views._replace(Z, parse_snapshot(snapshot([4, 3], [0, 0], PROMPT)))  # block 5 evicted meanwhile
    count = {s.labels["outcome"]: s.value for s in metrics.prefix_predictions.collect()[0].samples
             if s.name.endswith("_total")}
    assert count == {"held": 0, "missing": 1}


def test_a_rank_counts_the_larger_of_its_snapshot_and_the_requests_this_router_has_on_it():
    view = parse_snapshot(snapshot([0, 0], [30, 100], PROMPT))
    assert view.load([50, 40]) == [50, 100] and view.load() == [30, 100]
    pick = best_by_prefix({Z: parse_snapshot(snapshot([5, 0], [0, 0], PROMPT))}, [Z], Prompt(PROMPT, 8),
                          routed={Z: [200, 0]})
    assert (pick.rank, pick.hit_blocks) == (1, 0)  # the rank with the hit is busy with this router's requests


def test_reading_prompts_for_prefix_routing_does_not_import_torch(tmp_path):
    """A cache-aware router is the small process a least-loaded one is: the tokenizer, the request
    models and the block hashes it reads prompts with are torch-free (torch put ~0.5 GB in it)."""
    code = ("import sys\n"
            "from adpfleet.runtime.router.app import build_app\n"
            "from adpfleet.runtime.router.prompt_tokens import PromptReader\n"
            "reader = PromptReader('tiny')\n"
            "assert reader.read('/v1/completions', {'model': 'tiny', 'prompt': 'hi', 'max_tokens': 2}).max_tokens == 2\n"
            "assert reader.read('/v1/chat/completions', {'model': 'tiny', 'messages': [{'role': 'user', "
            "'content': 'hi'}], 'seed': 3, 'temperature': 1.0}).token_ids\n"
            "assert 'torch' not in sys.modules, 'prefix routing imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=tmp_path)
