"""The cache-aware router in front of two real 2-rank aggregated servers, through the official openai
client: turn 2 of a conversation lands on the (server, rank) that holds turn 1, a hot shared prefix
spreads over ranks and servers, a prompt nobody holds goes by load; and a server whose snapshot
refuses, is not JSON or lies does not break routing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from threading import Barrier

import openai
import pytest

from adpfleet.runtime.engine import block_hash
from router_harness import FakeServer, RouterProcess, serve, wait_until
from servers import metric

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

TOKEN = "fleet-token"
B = 16  # the servers' tokens per block (the default)
RANKS = (0, 1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(servers, router): 2 aggregated servers x 2 ranks, a cache-aware router whose periodic poll
    never comes during a test: its view is fresh only by the polls that follow each request's end."""
    logs = tmp_path_factory.mktemp("prefix-routing")
    env = {"ADPFLEET_INTERNAL_TOKEN": TOKEN}
    servers = [serve("aggregated", logs, "--kv-blocks", "128", dp=2, env=env) for _ in range(2)]
    router = None
    try:
        for s in servers:
            s.wait_healthy(180)
        router = RouterProcess(logs, *[f for s in servers for f in ("--aggregated", s.url)], "--tokenizer", "tiny",
                               "--cache-poll-interval", "600", "--health-interval", "0.5", env=env)
        yield servers, router.wait_healthy().wait_usable(aggregated=2)
    finally:
        for p in [router, *servers]:
            if p is not None:
                p.stop()


def client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def finished(servers) -> dict[tuple[int, int], float]:
    """Requests finished so far, by (server index, rank)."""
    return {(i, r): metric(s, "adpfleet_requests_finished_total", rank=r) for i, s in enumerate(servers) for r in RANKS}


def hits(servers) -> dict[tuple[int, int], float]:
    return {(i, r): metric(s, "adpfleet_prefix_cache_hits_total", rank=r) for i, s in enumerate(servers) for r in RANKS}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def settled(servers, before: dict, n: int) -> dict:
    """Where the last `n` requests finished (the ranks' stats follow the outputs on the pipe)."""
    wait_until(lambda: sum(delta(finished(servers), before).values()) >= n, timeout=30, what=f"{n} requests counted")
    return delta(finished(servers), before)


def test_turn_two_lands_on_the_server_and_rank_that_holds_turn_one(fleet):
    servers, router = fleet
    for session in range(2):
        messages = [{"role": "system", "content": f"You are assistant number {session}, " + "terse and exact. " * 4},
                    {"role": "user", "content": f"Session {session}: name three rivers of Europe."}]
        before = finished(servers)
        answer = client(router).chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                         temperature=0, extra_body={"ignore_eos": True})
        (turn1,) = settled(servers, before, 1)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "And three of Asia?"}]
        before, hits_before = finished(servers), hits(servers)
        chosen = router.metric("adpfleet_router_prefix_decisions_total", decision="prefix")
        client(router).chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
        assert set(settled(servers, before, 1)) == {turn1}, f"session {session}: turn 1 ran on {turn1}"
        assert delta(hits(servers), hits_before).get(turn1, 0) >= 4 * B  # the system prompt and turn 1, at least
        assert router.metric("adpfleet_router_prefix_decisions_total", decision="prefix") == chosen + 1


def test_a_hot_shared_prefix_spreads_over_ranks_and_servers(fleet):
    servers, router = fleet
    prefix = [7 + i % 200 for i in range(6 * B)]
    client(router).completions.create(model="tiny", prompt=prefix + [1], max_tokens=2)  # one rank holds it
    before, chosen = finished(servers), router.metric("adpfleet_router_prefix_decisions_total", decision="prefix")

    clients, together = [client(router) for _ in range(8)], Barrier(8)

    def one(i: int) -> None:  # 8 at once, each long enough to overlap the others
        together.wait()
        clients[i].completions.create(model="tiny", prompt=prefix + [30 + i] * 5, max_tokens=64,
                                      extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))
    where = settled(servers, before, 8)
    assert len(where) >= 3 and max(where.values()) <= 4, f"8 requests sharing a prefix ran on {where}"
    assert router.metric("adpfleet_router_prefix_decisions_total", decision="prefix") > chosen


def test_a_prompt_no_rank_holds_goes_to_the_least_loaded_server(fleet):
    servers, router = fleet
    before = finished(servers)
    unmatched = router.metric("adpfleet_router_prefix_decisions_total", decision="no_match")
    for i in range(4):  # one at a time: every server is idle, ties go round
        client(router).completions.create(model="tiny", prompt=[211 + i] * (3 * B), max_tokens=2)
    where = settled(servers, before, 4)
    per_server = [sum(n for (s, _), n in where.items() if s == i) for i in range(2)]
    assert per_server == [2, 2], where
    assert router.metric("adpfleet_router_prefix_decisions_total", decision="no_match") == unmatched + 4


@pytest.fixture(scope="module")
def liar(tmp_path_factory):
    """(fake aggregated server, cache-aware router in front of it alone, polling every 0.1 s)."""
    logs = tmp_path_factory.mktemp("prefix-liar")
    fake = FakeServer("aggregated", logs).wait_healthy()
    router = RouterProcess(logs, "--aggregated", fake.url, "--tokenizer", "tiny", "--cache-poll-interval", "0.1",
                           "--health-interval", "0.5")
    try:
        yield fake, router.wait_healthy().wait_usable(aggregated=1)
    finally:
        router.stop()
        fake.stop()


PROMPT = "a prompt long enough to fill two blocks of sixteen tokens, and then some"


def claims_to_hold(prompt: str) -> dict:
    """A well-formed snapshot that says rank 0 holds `prompt`'s blocks (the fake holds nothing)."""
    ids = [256] + list(prompt.encode())  # the tiny models' byte tokenizer, BOS first
    blocks = [h.hex() for h in block_hash.prefix_hashes(ids, B)]
    return {"hash": block_hash.SCHEME, "tokens_per_block": B, "imbalance_bound": 1.25,
            "ranks": [{"rank": 0, "requests": 0, "pending_tokens": 0, "blocks": blocks}]}


@pytest.mark.parametrize("snapshot, outcome", [("refuse", "refused"), ("garbage", "bad_snapshot"),
                                               ({"hash": "md5", "ranks": []}, "bad_snapshot"),
                                               (claims_to_hold(PROMPT), "ok")])
def test_a_snapshot_that_refuses_or_lies_does_not_break_routing(liar, snapshot, outcome):
    fake, router = liar
    fake.configure(snapshot=snapshot)
    seen = router.metric("adpfleet_router_prefix_snapshots_total", outcome=outcome)
    wait_until(lambda: router.metric("adpfleet_router_prefix_snapshots_total", outcome=outcome) >= seen + 2,
               timeout=10, what=f"a snapshot counted {outcome}")
    chosen = router.metric("adpfleet_router_prefix_decisions_total", decision="prefix")
    answer = client(router).completions.create(model="fake", prompt=PROMPT, max_tokens=3)
    assert answer.choices[0].text and len(fake.received()) == 1
    # a refused or unreadable snapshot leaves the server without a view (routed by load); a
    # well-formed lie is believed: the request goes with its rank hint and costs only a miss
    assert router.metric("adpfleet_router_prefix_decisions_total", decision="prefix") == chosen + (outcome == "ok")


def test_in_a_disaggregated_fleet_the_context_rank_is_chosen_by_prefix(log_dir, server_trio):
    ctx, gen = server_trio["context"], server_trio["generation"]
    router = RouterProcess(log_dir, "--context", ctx.url, "--generation", gen.url, "--tokenizer", "tiny",
                           "--cache-poll-interval", "600", "--health-interval", "0.5")
    try:
        router.wait_healthy().wait_usable(context=1, generation=1)
        turn1 = [5 + i % 250 for i in range(4 * B + 3)]
        before = finished([ctx])
        client(router).completions.create(model="tiny", prompt=turn1, max_tokens=4)
        (rank,) = settled([ctx], before, 1)
        before, hits_before = finished([ctx]), hits([ctx])
        client(router).completions.create(model="tiny", prompt=turn1 + [9] * B, max_tokens=4)
        assert set(settled([ctx], before, 1)) == {rank}
        assert delta(hits([ctx]), hits_before).get(rank, 0) >= 4 * B
        assert router.metric("adpfleet_router_prefix_decisions_total", decision="prefix") == 1
    finally:
        router.stop()
