"""Stall verdicts (docs/remediation.md) as pure functions of scrapes: what is stalled, what is not, which
signature and which ranks, and how fast."""

from __future__ import annotations

import math

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.contract.metrics import RankSample
from adpfleet.operator.adapters.dialects import ADPFLEET
from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.decisions.detection import SampleWindows, StallVerdict, attribute, judge, keep_seconds
from adpfleet.operator.decisions.observed import ServerView
from adpfleet.operator.resource.vocabulary import ServerState, Signature
from adpfleet.runtime.metrics import RankStats, render
from budgets import examples

W, I = 10.0, 1.0  # stall window, scrape interval


def rank(**kw) -> RankSample:
    return RankSample(**kw)


def series(step, n: int, *, start: float = 0.0, interval: float = I) -> list[Scrape]:
    """n scrapes; step(k) -> {rank: RankSample} for the k-th one."""
    return [Scrape(at=start + k * interval, ranks=step(k)) for k in range(n)]


def verdict(samples, window=W, interval=I, confirmations=2):
    return judge("f-context-0", "context", samples, window_seconds=window, interval_seconds=interval,
                 confirmations=confirmations)


# ---- not stalled ------------------------------------------------------------------------------

def test_idle_server_spinning_iterations_is_idle_never_stalled():
    samples = series(lambda k: {0: rank(iterations=50 * k), 1: rank(iterations=50 * k)}, 40)
    v = verdict(samples)
    assert v.state is ServerState.IDLE and not v.stalled


def test_busy_server_producing_tokens_is_progressing():
    samples = series(lambda k: {0: rank(iterations=50 * k, forward_steps=50 * k, generation_tokens=10 * k,
                                        requests_running=4)}, 40)
    assert verdict(samples).state is ServerState.PROGRESSING


def test_a_rank_idling_while_its_peers_work_is_normal():
    # rank 1 has nothing schedulable and spins empty batches (padded), rank 0 keeps producing
    samples = series(lambda k: {0: rank(iterations=50 * k, forward_steps=50 * k, generation_tokens=5 * k,
                                        requests_running=2),
                                1: rank(iterations=50 * k, forward_steps=50 * k, empty_batch_iterations=50 * k)}, 40)
    assert verdict(samples).state is ServerState.PROGRESSING


def test_slow_progress_is_progress():
    # one token every 9 s: less than the window apart, so never a whole window without tokens
    samples = series(lambda k: {0: rank(iterations=50 * k, generation_tokens=k // 9, requests_running=1)}, 60)
    assert all(verdict(samples[:n]).state is not ServerState.STALLED for n in range(1, 61))


def test_work_that_arrived_less_than_a_window_ago_is_not_a_stall():
    # idle for 20 scrapes, then work with no tokens yet for 6 s
    samples = series(lambda k: {0: rank(iterations=50 * k, requests_waiting=1 if k >= 20 else 0)}, 27)
    v = verdict(samples)
    assert v.state is ServerState.SUSPECT and not v.stalled


def test_work_that_starts_after_the_baseline_is_stalled_only_after_a_whole_window_of_work():
    # idle until scrape 20, then work that never produces a token: the scrape before the work is
    # no baseline for the stall, so it is called a whole window (less the jitter allowance) after
    # the work began, never earlier
    samples = series(lambda k: {0: rank(iterations=50 * k, forward_vetoed=50 * k,
                                        requests_waiting=1 if k >= 20 else 0)}, 40)
    detected = next(samples[n - 1].at for n in range(1, 41) if verdict(samples[:n]).stalled)
    assert W - 0.5 * I <= detected - samples[20].at <= W + 2 * I


def test_a_server_just_started_is_warming_up_not_stalled():
    samples = series(lambda k: {0: rank(iterations=50 * k, forward_vetoed=50 * k, requests_waiting=3)}, 5)
    assert verdict(samples[:1]).state is ServerState.WARMING_UP
    assert verdict(samples).state is ServerState.SUSPECT


def test_no_scrapes_is_warming_up():
    assert verdict([]).state is ServerState.WARMING_UP


# ---- stalled, with signatures -----------------------------------------------------------------

def vetoed_stall(k):
    # §1.1: every pass vetoed, rank 1 schedules an empty batch every pass, nothing completes
    return {0: rank(iterations=100 + 50 * k, forward_steps=100, forward_vetoed=50 * k, prompt_tokens=300,
                    requests_running=1, requests_waiting=5, kv_transfers_in_flight=12),
            1: rank(iterations=100 + 50 * k, forward_steps=100, forward_vetoed=50 * k, prompt_tokens=280,
                    empty_batch_iterations=50 * k, requests_waiting=4, kv_cache_blocks_used=48)}


def test_vetoed_stall_names_the_starving_rank():
    v = verdict(series(vetoed_stall, 30))
    assert v.stalled and v.signature is Signature.VETOED and v.ranks == (1,)
    assert v.evidence["real_tokens_delta"] == 0
    assert v.evidence["empty_batch_iterations_delta"]["1"] > 0 and v.evidence["forward_steps_delta"]["0"] == 0
    assert "rank(s) 1 scheduling empty batches" in v.reason
    assert "[vetoed, ranks 1]" in v.summary()


GROUP = {0: "mn-generation-0-0", 1: "mn-generation-0-1"}  # a server over two pods: the pod of each rank


def test_a_starving_rank_on_a_worker_pod_is_named_with_its_pod():
    # the merged scrape of a two-pod server says which pod each rank came from (stall.py)
    samples = [Scrape(at=s.at, ranks=s.ranks, rank_pods=GROUP) for s in series(vetoed_stall, 30)]
    v = verdict(samples)
    assert v.stalled and v.ranks == (1,) and v.pods == {1: "mn-generation-0-1"}
    assert "[vetoed, ranks 1 on pod mn-generation-0-1]" in v.summary()


def test_ranks_on_several_pods_are_named_with_each_pod_and_a_one_pod_server_with_none():
    both = StallVerdict("mn-generation-0-0", "generation", ServerState.STALLED, 0.0, "r", Signature.HUNG,
                        ranks=(0, 1, 2), pods={0: "mn-generation-0-0", 1: "mn-generation-0-0", 2: "mn-generation-0-1"})
    assert both.ranks_text() == "ranks 0,1 on pod mn-generation-0-0 and 2 on pod mn-generation-0-1"
    one = verdict(series(vetoed_stall, 30))  # no rank_pods: one pod, read exactly as before
    assert one.pods == {} and "[vetoed, ranks 1]: " in one.summary()


def test_hung_server_iterations_stop():
    def hung(k):
        it = 100 + 50 * min(k, 3)  # the loop stopped after the 4th scrape
        return {0: rank(iterations=it, forward_steps=it, generation_tokens=min(k, 3) * 10, requests_running=3),
                1: rank(iterations=it, forward_steps=it, generation_tokens=min(k, 3) * 10, requests_running=2)}
    v = verdict(series(hung, 20))
    assert v.stalled and v.signature is Signature.HUNG and v.ranks == (0, 1)
    assert v.evidence["iterations_delta"] == {"0": 0, "1": 0}


def test_a_hung_loop_is_stalled_even_when_its_frozen_counters_show_no_work():
    # the rank froze between requests: its last stats say idle, but an idle loop would spin
    samples = series(lambda k: {0: rank(iterations=100 + 50 * min(k, 3), generation_tokens=40)}, 20)
    v = verdict(samples)
    assert v.stalled and v.signature is Signature.HUNG and "loop advanced" in v.reason
    assert verdict(samples[:8]).state is ServerState.IDLE  # not before a whole window without a pass


def test_transfer_stall_names_the_ranks_holding_kv():
    def transfer(k):
        # forwards run (dummies), nothing vetoed, KV held for transfers never freed, requests wait
        return {0: rank(iterations=50 * k, forward_steps=50 * k, prompt_tokens=900, kv_transfers_in_flight=40,
                        requests_waiting=6),
                1: rank(iterations=50 * k, forward_steps=50 * k, prompt_tokens=800, requests_waiting=1)}
    v = verdict(series(transfer, 20))
    assert v.stalled and v.signature is Signature.TRANSFER and v.ranks == (0,)


def test_a_rank_starved_by_kv_held_for_transfers_is_a_transfer_stall():
    # padding off: rank 0's KV is full of blocks held for transfers nobody completes, so it schedules
    # empty batches and every forward is vetoed — the transfers are the cause
    def held(k):
        return {0: rank(iterations=50 * k, forward_vetoed=50 * k, empty_batch_iterations=50 * k, prompt_tokens=900,
                        kv_transfers_in_flight=96, kv_cache_blocks_used=96, kv_cache_capacity_blocks=96,
                        requests_waiting=2),
                1: rank(iterations=50 * k, forward_vetoed=50 * k, prompt_tokens=700, requests_running=1)}
    v = verdict(series(held, 20))
    assert v.stalled and v.signature is Signature.TRANSFER and v.ranks == (0,) and "96 blocks" in v.reason


def test_a_starved_rank_with_room_in_its_kv_is_vetoed_even_if_it_holds_some_transfers():
    # the rank admits nothing though its KV has room: the held blocks are not why it starves
    def starved(k):
        return {0: rank(iterations=50 * k, forward_vetoed=50 * k, prompt_tokens=900, requests_running=2,
                        kv_cache_blocks_used=16, kv_cache_capacity_blocks=96),
                1: rank(iterations=50 * k, forward_vetoed=50 * k, empty_batch_iterations=50 * k, prompt_tokens=700,
                        kv_transfers_in_flight=8, kv_cache_blocks_used=8, kv_cache_capacity_blocks=96,
                        requests_waiting=1)}
    v = verdict(series(starved, 20))
    assert v.stalled and v.signature is Signature.VETOED and v.ranks == (1,)


def test_transfers_that_start_mid_window_are_not_the_transfer_signature():
    # the loop spins without vetoes and without tokens; KV transfers appear only late in the
    # window: they cannot be why it made no progress since the baseline
    samples = series(lambda k: {0: rank(iterations=50 * k, requests_waiting=1,
                                        kv_transfers_in_flight=8 if k >= 25 else 0)}, 30)
    v = verdict(samples)
    assert v.stalled and v.signature is Signature.VETOED


def test_a_few_vetoes_among_running_forwards_do_not_hide_a_transfer_stall():
    # forwards run (dummies) far more often than they are vetoed; KV stays held for transfers
    # from the start of the window: the transfers are the stall, not the vote
    def held(k):
        return {0: rank(iterations=60 * k, forward_steps=50 * k, forward_vetoed=10 * k, prompt_tokens=900,
                        kv_transfers_in_flight=40, requests_waiting=3)}
    v = verdict(series(held, 20))
    assert v.stalled and v.signature is Signature.TRANSFER and v.ranks == (0,)


# ---- a transfer stall is the server's that does not complete the pulls ----------------------------

def held_kv(own: int, awaiting: int):
    """A context server's ranks: idle loops, no tokens, KV held; `own` blocks whose pull began (hung
    or done and never freed), `awaiting` blocks no generation server has begun to pull."""
    def step(k):
        return {0: rank(iterations=50 * k, prompt_tokens=900, kv_transfers_in_flight=own + awaiting,
                        kv_transfers_awaiting_pull=awaiting),
                1: rank(iterations=50 * k, prompt_tokens=700)}
    return step


def test_kv_that_no_generation_server_pulls_is_the_generation_sides_stall_not_the_holders():
    # a generation rank froze: the KV held for its pulls piles up on a healthy context server
    v = verdict(series(held_kv(own=0, awaiting=42), 20))
    assert v.state is ServerState.BLOCKED and not v.stalled
    assert v.signature is Signature.TRANSFER and v.ranks == (0,) and "42 KV blocks held for pulls" in v.reason


def test_kv_whose_pull_began_and_never_ended_is_the_holders_own_transfer_stall():
    # the context server stopped serving KV (pulls hang) or never frees what was pulled
    for own, awaiting in ((3, 0), (3, 40)):
        v = verdict(series(held_kv(own=own, awaiting=awaiting), 20))
        assert v.stalled and v.signature is Signature.TRANSFER and v.ranks == (0,), (own, awaiting)


def test_a_pull_seen_under_way_at_some_scrapes_does_not_make_the_holder_stalled():
    # another generation server pulls now and then; the blocks that stay are awaiting the frozen one
    def step(k):
        busy = 1 if k % 4 == 0 else 0
        return {0: rank(iterations=50 * k, prompt_tokens=900, kv_transfers_in_flight=20 + busy,
                        kv_transfers_awaiting_pull=20)}
    assert verdict(series(step, 20)).state is ServerState.BLOCKED


def test_an_exposition_without_the_awaiting_gauge_keeps_the_transfer_stall_the_holders():
    v = verdict(series(lambda k: {0: rank(iterations=50 * k, kv_transfers_in_flight=8)}, 20))
    assert v.stalled and v.signature is Signature.TRANSFER


def blocked_context(since=5.0) -> StallVerdict:
    return StallVerdict("f-context-0", "context", ServerState.BLOCKED, 20.0, "no real tokens; 42 KV blocks held "
                        "for pulls no generation server has begun", signature=Signature.TRANSFER, ranks=(0,),
                        since=since)


def test_a_blocked_context_server_names_the_generation_server_that_does_not_pull():
    hung = StallVerdict("f-generation-1", "generation", ServerState.STALLED, 20.0, "hung",
                        signature=Signature.HUNG, ranks=(0,))
    fine = StallVerdict("f-generation-0", "generation", ServerState.PROGRESSING, 20.0, "tokens")
    servers = [ServerView("f-context-0", "context", True, created=0.0),
               ServerView("f-generation-0", "generation", True, created=0.0),
               ServerView("f-generation-1", "generation", True, created=0.0)]
    out = {v.server: v for v in attribute([blocked_context(), hung, fine], servers)}
    assert "waiting on f-generation-1 (stalled)" in out["f-context-0"].reason
    assert "f-generation-0" not in out["f-context-0"].reason and not out["f-context-0"].stalled
    assert out["f-generation-1"] == hung and out["f-generation-0"] == fine  # the others unchanged


def test_a_blocked_context_server_names_a_generation_server_replaced_since_the_kv_was_held():
    servers = [ServerView("f-generation-0", "generation", True, created=12.0)]  # restarted after `since`
    (v,) = attribute([blocked_context(since=5.0)], servers)
    assert "waiting on f-generation-0 (restarted or not Ready)" in v.reason
    (v,) = attribute([blocked_context(since=5.0)], [ServerView("f-generation-0", "generation", True, created=1.0)])
    assert "no generation server is stalled now" in v.reason


def test_kv_transfers_alone_count_as_work():
    samples = series(lambda k: {0: rank(iterations=50 * k, forward_steps=0, kv_transfers_in_flight=8)}, 20)
    v = verdict(samples)
    assert v.stalled and v.signature is Signature.TRANSFER


def test_stall_needs_confirmation_on_consecutive_scrapes():
    samples = series(vetoed_stall, 30)
    # the first scrape at which the window is covered is only suspect, the next confirms
    first = next(n for n in range(1, 31) if verdict(samples[:n]).state in (ServerState.SUSPECT, ServerState.STALLED)
                 and "confirmed" in verdict(samples[:n]).reason)
    assert verdict(samples[:first]).state is ServerState.SUSPECT
    assert verdict(samples[:first + 1]).stalled
    assert verdict(samples, confirmations=3).stalled
    assert not verdict(samples[:first], confirmations=3).stalled


def test_a_confirmed_stall_reports_the_whole_window_without_tokens():
    # a 20 s window scraped every 5 s: each test's baseline is 15 s old, the stall spans 20 s
    v = verdict(series(vetoed_stall, 12, interval=5.0), window=20.0, interval=5.0)
    assert v.stalled and v.reason.startswith("no real tokens for 20 s while having work")
    assert v.evidence["window_seconds"] == 20.0


def test_progress_resuming_clears_the_stall():
    samples = series(vetoed_stall, 30)
    resumed = Scrape(at=30 * I, ranks={r: RankSample(**{**s.__dict__, "prompt_tokens": s.prompt_tokens + 64})
                                       for r, s in samples[-1].ranks.items()})
    assert verdict(samples + [resumed]).state is ServerState.PROGRESSING


# ---- engines that export less (a dialect's None is unknown, never 0) -------------------------------

def engine_rank(**kw) -> RankSample:
    """A rank of an engine without loop, veto or transfer counters (vLLM's dialect)."""
    return RankSample(**{"iterations": None, "forward_steps": None, "forward_vetoed": None,
                         "empty_batch_iterations": None, "kv_transfers_in_flight": None,
                         "kv_transfers_awaiting_pull": None, **kw})


def test_a_rank_whose_work_is_unknown_is_never_judged():
    v = verdict(series(lambda k: {0: engine_rank(requests_running=None, requests_waiting=None)}, 40))
    assert v.state is ServerState.WARMING_UP and "unknown" in v.reason


def test_unknown_work_inside_the_window_is_not_work_pending():
    unknown = engine_rank(requests_running=None, requests_waiting=None)
    v = verdict(series(lambda k: {0: unknown if k < 35 else engine_rank(requests_running=2)}, 40))
    assert v.state is ServerState.SUSPECT  # the work is known pending for 5 s only


def test_an_engine_without_a_loop_counter_that_moves_nothing_and_has_no_work_is_idle():
    assert verdict(series(lambda k: {0: engine_rank(generation_tokens=9)}, 40)).state is ServerState.IDLE


def test_an_engine_without_a_loop_counter_with_work_and_no_step_is_hung():
    v = verdict(series(lambda k: {0: engine_rank(requests_running=2, generation_tokens=9, step_marks=(4, 0.5))}, 40))
    assert v.stalled and (v.signature, v.ranks) == (Signature.HUNG, (0,))
    assert "iterations_delta" not in v.evidence  # what the engine does not export is not shown as 0


def test_a_step_without_new_tokens_is_progress():
    v = verdict(series(lambda k: {0: engine_rank(requests_running=1, step_marks=(1, k // 8))}, 40))
    assert v.state is ServerState.PROGRESSING and "engine steps" in v.reason


def test_ranks_that_step_alone_are_judged_alone_and_the_server_is_its_worst():
    def step(k):
        return {0: engine_rank(requests_running=2, generation_tokens=100), 1: engine_rank(requests_running=2,
                                                                                    generation_tokens=100 + k)}
    scrapes = [Scrape(at=k * I, ranks=step(k), lockstep=False) for k in range(40)]
    v = verdict(scrapes)
    assert v.stalled and (v.signature, v.ranks) == (Signature.HUNG, (0,))
    assert verdict([Scrape(at=s.at, ranks=s.ranks) for s in scrapes]).state is ServerState.PROGRESSING  # summed


def test_an_unknown_counter_is_not_a_restart():
    scrapes = series(lambda k: {0: rank(iterations=None if k % 2 else 100.0, requests_running=1)}, 40)
    assert verdict(scrapes).stalled  # one incarnation: no token over the whole window


# ---- unreachable ------------------------------------------------------------------------------

def test_failed_scrape_is_unreachable_never_stalled():
    samples = series(vetoed_stall, 30) + [Scrape(at=30.0, error="timed out after 2 s")]
    v = verdict(samples)
    assert v.state is ServerState.UNREACHABLE and not v.stalled and "timed out" in v.reason
    assert v.evidence["consecutive_failures"] == 1


def test_a_failed_scrape_breaks_the_confirmation():
    samples = series(vetoed_stall, 30)
    samples[-2] = Scrape(at=samples[-2].at, error="connection refused")
    assert verdict(samples).state is ServerState.SUSPECT
    assert verdict(samples + [Scrape(at=30.0, ranks=vetoed_stall(30))]).stalled


def test_a_restarted_server_starts_a_new_window():
    before = series(vetoed_stall, 30)
    after = series(lambda k: {0: rank(iterations=50 * k, requests_waiting=2),
                              1: rank(iterations=50 * k, requests_waiting=1)}, 5, start=31.0)
    v = verdict(before + after)
    assert v.state is ServerState.SUSPECT  # counters went back to 0: only 5 s of this incarnation


def test_rank_set_change_starts_a_new_window():
    before = series(vetoed_stall, 30)
    one_rank = [Scrape(at=30.0 + k, ranks={0: vetoed_stall(30 + k)[0]}) for k in range(3)]
    assert verdict(before + one_rank).state is not ServerState.STALLED


# ---- timing -----------------------------------------------------------------------------------

@settings(max_examples=examples(200), deadline=None)
@given(window_scrapes=st.integers(2, 30), interval=st.sampled_from([0.5, 1.0, 2.0, 5.0]),
       phase=st.floats(0.01, 0.99), jitter=st.lists(st.floats(-0.1, 0.1), min_size=80, max_size=80))
def test_detection_is_within_window_plus_two_intervals(window_scrapes, interval, phase, jitter):
    """The issue's target: fault → Stalled within window + 2 scrape intervals, and not before the
    window has passed without tokens (less a scrape-jitter allowance)."""
    window = window_scrapes * interval
    fault = 10 * interval + phase * interval  # tokens stop at `fault`; the loop keeps spinning
    times = [k * interval + jitter[k] * interval for k in range(80)]

    def at(t):
        produced = min(t, fault)
        return {0: rank(iterations=50 * t, forward_steps=50 * produced, forward_vetoed=50 * max(0.0, t - fault),
                        prompt_tokens=math.floor(produced * 20), requests_running=2)}
    samples = [Scrape(at=t, ranks=at(t)) for t in times]
    detected = next((s.at for n, s in enumerate(samples, 1)
                     if judge("s", "context", samples[:n], window_seconds=window, interval_seconds=interval).stalled),
                    None)
    assert detected is not None
    assert fault + window - 0.5 * interval <= detected <= fault + window + 2 * interval


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(1, 4)), min_size=2, max_size=40))
def test_never_stalled_without_work_or_with_tokens_in_every_window(steps):
    """Generated histories: a server whose loop spins and that is idle now, or that produced tokens
    in every scrape interval, is never stalled — whatever else its counters do."""
    tokens, its, samples = 0, 0, []
    for k, (work, produce, spin) in enumerate(steps):
        tokens += produce
        its += spin
        samples.append(Scrape(at=float(k), ranks={0: rank(iterations=its, forward_vetoed=its, prompt_tokens=tokens,
                                                          requests_waiting=work)}))
        v = judge("s", "context", samples, window_seconds=3.0, interval_seconds=1.0)
        if work == 0 or all(steps[j][1] for j in range(max(0, k - 3), k + 1)):
            assert not v.stalled


# ---- the window of samples --------------------------------------------------------------------

def test_windows_keep_one_baseline_older_than_needed_and_reset_on_a_new_pod():
    w = SampleWindows()
    keep = keep_seconds(W, I)
    for k in range(100):
        w.add("s", "uid-1", Scrape(at=float(k), ranks={0: rank()}), keep_seconds=keep)
    got = w.samples("s")
    assert got[-1].at == 99 and 99 - got[0].at >= keep and 99 - got[1].at < keep
    w.add("s", "uid-2", Scrape(at=100.0, ranks={0: rank()}), keep_seconds=keep)
    assert len(w.samples("s")) == 1
    w.retain(["other"])
    assert w.samples("s") == ()


# ---- a real server ----------------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.slow
def test_a_real_idle_two_rank_server_is_parsed_per_rank_and_judged_idle():
    from servers import Server
    import time

    server = Server("--model", "tiny", "--dp", "2").wait_healthy()
    try:
        samples = []
        for _ in range(4):
            samples.append(Scrape(at=time.time(), ranks=ADPFLEET.parse(httpx.get(server.url + "/metrics").text)))
            time.sleep(0.5)
        assert set(samples[-1].ranks) == {0, 1}
        assert samples[-1].total("iterations") > samples[0].total("iterations")  # idle ADP ranks keep spinning
        assert judge("s", "context", samples, window_seconds=1.0, interval_seconds=0.5).state is ServerState.IDLE
    finally:
        server.stop()


# ---- scraping over HTTP: every failure is a failed Scrape with its reason ------------------------

def _scrapes_from(handler, timeout=0.5, times=1):
    """`times` scrapes, by one HttpScraper, of a local aiohttp server answering /metrics with `handler`."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from adpfleet.operator.adapters.scrape import HttpScraper

    async def main():
        app = web.Application()
        app.router.add_get("/metrics", handler)
        async with TestServer(app) as server:
            scraper = HttpScraper()
            try:
                return [await scraper(str(server.make_url("/metrics")), timeout) for _ in range(times)]
            finally:
                await scraper.close()
    return asyncio.run(main())


def _scrape_from(handler, timeout=0.5):
    return _scrapes_from(handler, timeout)[0]


def test_scrape_of_a_real_exposition():
    from aiohttp import web

    async def ok(_):
        return web.Response(text=render("context", [(0, RankStats()), (1, RankStats())]))
    s = _scrape_from(ok)
    assert s.ok and set(s.ranks) == {0, 1}


@pytest.mark.parametrize("behaviour, words", [
    ("slow", "timed out"), ("garbage", "not Prometheus text"), ("404", "HTTP 404"), ("huge", "more than"),
])
def test_a_scrape_that_times_out_or_returns_garbage_is_a_failed_scrape(behaviour, words):
    import asyncio

    from aiohttp import web

    async def handler(_):
        if behaviour == "slow":
            await asyncio.sleep(5)
        if behaviour == "404":
            return web.Response(status=404)
        if behaviour == "huge":
            return web.Response(body=b"#" * (5 * 1024 * 1024))
        return web.Response(text="<html>oops</html>")
    s = _scrape_from(handler)
    assert not s.ok and words in s.error


def test_a_refused_connection_is_a_failed_scrape():
    import asyncio

    from adpfleet.operator.adapters.scrape import HttpScraper

    async def main():
        scraper = HttpScraper()
        try:
            return await scraper("http://127.0.0.1:9/metrics", 1.0)
        finally:
            await scraper.close()
    s = asyncio.run(main())
    assert not s.ok and s.refused and "127.0.0.1:9" in s.error


def test_a_server_is_scraped_over_one_kept_alive_connection():
    from aiohttp import web

    peers = []

    async def ok(request):
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(text=render("context", [(0, RankStats()), (1, RankStats())]))

    scrapes = _scrapes_from(ok, timeout=1.0, times=3)
    assert all(s.ok for s in scrapes) and len(peers) == 3
    assert len(set(peers)) == 1, peers  # one connection, reused


def test_a_kept_alive_connection_the_server_closed_is_retried_not_a_failed_scrape():
    """uvicorn closes an idle connection after 5 s, about one scrape interval: a close that crosses
    the next request must not make the server Unreachable (that would break a stall's confirmations)."""
    import asyncio

    from adpfleet.operator.adapters.scrape import HttpScraper

    body = render("context", [(0, RankStats()), (1, RankStats())]).encode()
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        answered = 0
        while True:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if answered:  # a second request on this connection: it is closed instead (the idle timeout's race)
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
            answered += 1

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        scraper = HttpScraper()
        try:
            return [await scraper(f"http://127.0.0.1:{port}/metrics", 1.0) for _ in range(3)]
        finally:
            await scraper.close()
            server.close()
    scrapes = asyncio.run(main())
    assert [s.error for s in scrapes] == [None, None, None]
    assert len(connections) == 3  # each reuse was refused by the server, and retried on a new connection
