"""The autoscaling policy as a specification: desired = decide(history of role loads, policy, now)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.operator.adapters.scrape import RankSample, Scrape
from adpfleet.operator.decisions.autoscaling import RoleLoad, decide, recommend, role_load, with_context_peer
from adpfleet.operator.resource.server_role import AutoscalingSpec
from adpfleet.operator.resource.vocabulary import ScaleReason
from budgets import examples

NOW = 1_700_000_000.0
INTERVAL = 5.0
BATCH = 64


def policy(**overrides) -> AutoscalingSpec:
    base = {"enabled": True, "minServers": 1, "maxServers": 8,
            "targets": {"waitingPerRank": 2, "kvCacheUtilization": 0.8},
            "scaleUp": {"stabilizationWindowSeconds": 10, "maxServersPerStep": 2},
            "scaleDown": {"stabilizationWindowSeconds": 60, "maxServersPerStep": 1}}
    base.update(overrides)
    return AutoscalingSpec.model_validate(base)


def load(at=NOW, servers=2, **signals) -> RoleLoad:
    return RoleLoad(at=at, servers=servers, ranks=2 * servers, **signals)


def steady(seconds, servers=2, **signals) -> list[RoleLoad]:
    """A load repeated every scrape interval for `seconds`, ending now."""
    n = int(seconds // INTERVAL)
    return [load(NOW - (n - k) * INTERVAL, servers, **signals) for k in range(n + 1)]


def run(history, current=2, p=None, settled_for=600.0, role="context"):
    return decide(role, history, p or policy(), current, NOW, settled_since=NOW - settled_for, batch_capacity=BATCH)


# ---- one load's recommendation ------------------------------------------------------------------

def test_a_queue_above_target_asks_for_the_servers_that_would_absorb_it():
    # 13 requests per rank on 2 servers, 8 of them running (what the KV allows): on 3 servers 8.7
    # per rank, 0.7 of them waiting, under the target of 2
    rec = recommend(load(waiting_per_rank=5.0, running_per_rank=8), "context", policy(), BATCH)
    assert rec.servers == 3 and rec.reason is ScaleReason.WAITING
    assert "waiting/rank 5 > target 2" in rec.detail
    deep = recommend(load(waiting_per_rank=40.0, running_per_rank=8), "context", policy(), BATCH)
    assert deep.servers == math.ceil(2 * 48 / (8 + 2))


def test_requests_a_rank_admitted_beyond_one_batch_count_as_waiting():
    # The engine admits up to maxNumActiveRequests and runs maxBatchSize of them per pass: 8
    # admitted on a rank whose batch holds 1 is 7 waiting, though adpfleet_requests_waiting says 0
    # (bench/autoscale.py: a generation role at 4x load never grew, its queue all "running").
    rec = recommend(load(servers=1, waiting_per_rank=0.0, running_per_rank=8.0), "generation",
                    policy(targets={"waitingPerRank": 1}), 1)
    assert rec.reason is ScaleReason.WAITING and "waiting/rank 7 > target 1" in rec.detail
    assert rec.servers == 4  # 8 per rank on 1 server is 2 on 4: one in the batch, one waiting
    within = recommend(load(servers=1, waiting_per_rank=0.0, running_per_rank=8.0), "generation",
                       policy(targets={"waitingPerRank": 1}), 8)
    assert within.reason is None


def test_a_proportional_signal_follows_the_hpa_rule():
    p = policy(targets={"timeToFirstTokenSeconds": 0.5})
    rec = recommend(load(servers=3, time_to_first_token_seconds=1.7), "context", p, BATCH)
    assert rec.servers == math.ceil(3 * 1.7 / 0.5)


def test_kv_cache_use_above_target_asks_for_more_servers_too_and_the_worst_signal_decides():
    rec = recommend(load(kv_cache_utilization=0.96, waiting_per_rank=2.3), "generation", policy(), BATCH)
    assert rec.reason is ScaleReason.KV_CACHE and rec.servers == 3


def test_a_signal_within_the_tolerance_band_changes_nothing():
    rec = recommend(load(waiting_per_rank=2.15, kv_cache_utilization=0.7, running_per_rank=20), "context",
                    policy(), BATCH)
    assert rec.servers == 2 and rec.reason is None


def test_scale_down_goes_to_the_fewest_servers_at_which_every_target_still_holds():
    # KV at 0.2 on 4 servers would be 0.4 on 2 and 0.8 on 1 (above 0.72 = target less the tolerance)
    rec = recommend(load(servers=4, kv_cache_utilization=0.2, running_per_rank=3), "generation", policy(), BATCH)
    assert rec.servers == 2 and rec.reason is ScaleReason.BELOW_TARGETS


def test_an_empty_queue_does_not_scale_down_servers_whose_batches_are_full():
    # waiting is the only target and it is 0, but each rank runs 40 of at most 64 requests: on one
    # server it would need 80
    p = policy(targets={"waitingPerRank": 2})
    rec = recommend(load(waiting_per_rank=0.0, running_per_rank=40.0), "context", p, BATCH)
    assert rec.servers == 2 and rec.reason is None


def test_latency_targets_count_when_the_servers_export_them():
    p = policy(targets={"timeToFirstTokenSeconds": 0.5})
    assert recommend(load(time_to_first_token_seconds=1.6), "context", p, BATCH).reason is ScaleReason.TTFT
    p = policy(targets={"interTokenLatencySeconds": 0.05})
    assert recommend(load(inter_token_latency_seconds=0.2), "generation", p, BATCH).reason is ScaleReason.ITL
    assert recommend(load(inter_token_latency_seconds=None), "generation", p, BATCH).reason is \
        ScaleReason.BELOW_TARGETS  # no tokens in the interval: nothing to hold it up


def test_a_context_queue_caused_by_slow_generation_scales_generation_not_context():
    # the context servers' KV cache is mostly held for transfers the generation servers have not pulled
    context = load(waiting_per_rank=9.0, kv_cache_utilization=0.9, transfer_share=0.8)
    rec = recommend(context, "context", policy(targets={"waitingPerRank": 2}), BATCH)
    assert rec.reason is None and "waits for generation" in rec.detail
    generation = with_context_peer(load(kv_cache_utilization=0.3), context)
    rec = recommend(generation, "generation", policy(), BATCH)
    assert rec.reason is ScaleReason.GENERATION_BACKLOG and rec.servers == 3


def test_a_context_queue_with_its_kv_cache_mostly_free_adds_context_servers_though_its_blocks_wait_for_pulls():
    # A context server prefills in moments and holds each finished prompt until its pull, so nearly
    # every block it uses is held for a transfer even when generation keeps up; with 90 % of its
    # cache free, its queue is its own (bench/autoscale.py: the context role never grew at 4x load,
    # and neither role ever shrank, as generation was told to grow whenever blocks were held).
    now = {"c": scrape(5, requests_waiting=[6, 6], requests_running=[2, 2], kv_cache_blocks_used=[10, 10],
                       kv_cache_capacity_blocks=[100, 100], kv_transfers_in_flight=[9, 9])}
    context = role_load(5.0, now, {})
    assert context.transfer_share == 0.9 and context.held_for_transfers == pytest.approx(0.09)
    rec = recommend(context, "context", policy(targets={"waitingPerRank": 2}), BATCH)
    assert rec.reason is ScaleReason.WAITING and rec.servers > 1
    generation = with_context_peer(load(servers=2, running_per_rank=1, kv_cache_utilization=0.05), context)
    rec = recommend(generation, "generation", policy(), BATCH)
    assert (rec.servers, rec.reason) == (1, ScaleReason.BELOW_TARGETS)


# ---- decisions over time ------------------------------------------------------------------------

def test_bounds_apply_at_once_whatever_the_signals():
    assert run([], current=0, p=policy(minServers=2)).desired == 2
    d = run([], current=12)
    assert (d.desired, d.reason) == (8, ScaleReason.ABOVE_MAXIMUM)
    d = run([], current=1, p=policy(minServers=3), settled_for=0)
    assert (d.desired, d.reason) == (3, ScaleReason.BELOW_MINIMUM)


def test_nothing_moves_while_the_role_has_not_settled():
    d = decide("context", steady(60, waiting_per_rank=10), policy(), 2, NOW, settled_since=None,
               batch_capacity=BATCH)
    assert not d.changes and "settle" in d.detail


def test_scale_up_waits_for_its_stabilisation_window_and_takes_the_lowest_recommendation():
    p = policy(scaleUp={"stabilizationWindowSeconds": 10, "maxServersPerStep": 8})
    history = steady(60, waiting_per_rank=0.5)[:-3] + [load(NOW - 10, waiting_per_rank=6),
                                                       load(NOW - 5, waiting_per_rank=10),
                                                       load(NOW, waiting_per_rank=20)]
    d = run(history, p=p)
    assert d.desired == 6 and d.reason is ScaleReason.WAITING  # ceil(2 * 6 / 2): the lowest of the window
    spike = steady(60, waiting_per_rank=0.5)[:-1] + [load(NOW, waiting_per_rank=20)]
    assert not run(spike, p=p).changes  # one scrape is not a window
    assert not run(steady(5, waiting_per_rank=20), p=p).changes  # a restarted operator has not seen a window


def test_scale_up_is_limited_per_step_and_by_max_servers():
    d = run(steady(30, waiting_per_rank=20))
    assert d.desired == 4 and "step limit" in d.detail  # asks for 20, 2 per step
    d = run(steady(30, servers=7, waiting_per_rank=20), current=7)
    assert d.desired == 8 and "maxServers" in d.detail


def test_scale_down_needs_a_whole_window_allowing_it_and_takes_the_highest_recommendation():
    quiet = steady(120, servers=4, kv_cache_utilization=0.1, running_per_rank=1)
    d = run(quiet, current=4)
    assert (d.desired, d.reason) == (3, ScaleReason.BELOW_TARGETS)  # one per step
    busy_moment = quiet[:-5] + [load(NOW - 20, servers=4, kv_cache_utilization=0.7)] + quiet[-4:]
    assert not run(busy_moment, current=4).changes  # a scrape within the window wanted all four
    assert not run(quiet[-6:], current=4).changes  # the window is not covered yet


def test_loads_taken_at_another_size_count_as_the_server_count_they_ask_for():
    # on one server the queue asked for 15; on two it asks for nothing more: neither up nor down
    old = [load(NOW - 30 + k * INTERVAL, servers=1, waiting_per_rank=30) for k in range(3)]
    now = [load(NOW - 10 + k * INTERVAL, servers=2, waiting_per_rank=1, running_per_rank=60) for k in range(3)]
    p = policy(scaleDown={"stabilizationWindowSeconds": 30})
    assert not decide("context", old + now, p, 2, NOW, settled_since=NOW - 12, batch_capacity=BATCH).changes
    # a decision needs a scrape taken at the new size
    assert not decide("context", old, p, 2, NOW, settled_since=NOW - 1, batch_capacity=BATCH).changes


# ---- properties ----------------------------------------------------------------------------------

policies = st.builds(
    lambda low, span, up_w, down_w, up_step, down_step, tol: policy(
        minServers=low, maxServers=low + span, tolerance=tol,
        scaleUp={"stabilizationWindowSeconds": up_w, "maxServersPerStep": up_step},
        scaleDown={"stabilizationWindowSeconds": down_w, "maxServersPerStep": down_step}),
    st.integers(1, 4), st.integers(0, 8), st.sampled_from([0, 5, 15, 30]), st.sampled_from([0, 30, 120]),
    st.integers(1, 4), st.integers(1, 3), st.sampled_from([0.0, 0.1, 0.2]))
signals = st.fixed_dictionaries({
    "waiting_per_rank": st.floats(0, 50), "running_per_rank": st.floats(0, 80),
    "kv_cache_utilization": st.floats(0, 1), "transfer_share": st.floats(0, 1),
    "peer_held_for_transfers": st.floats(0, 1)})


@settings(max_examples=examples(300), deadline=None)
@given(policies, st.lists(signals, max_size=30), st.integers(0, 20), st.sampled_from(["context", "generation"]),
       st.one_of(st.none(), st.floats(0, 600)))
def test_the_count_is_never_below_min_or_above_max(p, history, current, role, settled_for):
    loads = [load(NOW - (len(history) - k) * INTERVAL, servers=max(1, current), **s) for k, s in enumerate(history)]
    d = decide(role, loads, p, current, NOW, settled_since=None if settled_for is None else NOW - settled_for,
               batch_capacity=BATCH)
    assert p.min_servers <= d.desired <= p.max_servers
    assert d.changes == (d.desired != current)


@settings(max_examples=examples(200), deadline=None)
@given(signals, st.floats(0, 1), st.floats(0, 1))
def test_context_servers_holding_at_most_half_their_kv_cache_for_transfers_never_grow_generation(gen, used, held):
    """Blocks waiting for pulls are normal in a disaggregated fleet: only a context KV cache mostly
    filled by them says generation does not keep up. Below that the generation role scales on its
    own signals alone, up or down."""
    context = load(kv_cache_utilization=used, transfer_share=held)
    generation = load(**{k: v for k, v in gen.items() if k != "peer_held_for_transfers"})
    seen = recommend(with_context_peer(generation, context), "generation", policy(), BATCH)
    if used * held <= 0.5:
        assert seen == recommend(generation, "generation", policy(), BATCH)
    else:
        assert seen.servers >= generation.servers


def engine(per_rank: float) -> dict:
    """What a rank's metrics show with `per_rank` requests: running up to the batch capacity, the rest
    waiting, KV in proportion to the running ones (full at 50)."""
    running = min(per_rank, BATCH)
    return {"waiting_per_rank": per_rank - running, "running_per_rank": running,
            "kv_cache_utilization": min(1.0, running * 0.02)}


def linear(per_rank: float) -> dict:
    """A signal in exact proportion to the load (a time to first token of 20 ms per queued request)."""
    return {"running_per_rank": min(per_rank, BATCH), "time_to_first_token_seconds": 0.02 * per_rank}


def play(p, demand, current, steps, *, model=engine, ranks_per_server=2, role="generation", start=NOW,
         ready_after=1):
    """A closed loop: `demand(t)` requests spread over the role's ranks, per-rank signals from them
    (`model`), a scrape every interval, each decision taking effect (servers Ready) `ready_after`
    intervals later. The counts the policy asked for, one per scrape."""
    history, counts, settled_since, pending = [], [], start, None
    for k in range(steps):
        t = start + k * INTERVAL
        if pending is not None and k >= pending[1]:
            current, settled_since, pending = pending[0], t, None
        per_rank = demand(t) / (current * ranks_per_server)
        history.append(RoleLoad(at=t, servers=current, ranks=current * ranks_per_server, **model(per_rank)))
        d = decide(role, history, p, current, t, settled_since=settled_since if pending is None else None,
                   batch_capacity=BATCH)
        if d.changes and pending is None:
            pending = (d.desired, k + ready_after)
        counts.append(pending[0] if pending else current)
    return counts


def reversals(counts) -> int:
    moves = [b - a for a, b in zip(counts, counts[1:]) if b != a]
    return sum(1 for a, b in zip(moves, moves[1:]) if (a > 0) != (b > 0))


@settings(max_examples=examples(200), deadline=None)
@given(policies, st.floats(0, 2000), st.integers(1, 12))
def test_a_steady_load_finds_one_size_without_flapping(p, demand, start):
    start = min(max(start, p.min_servers), p.max_servers)
    counts = play(p, lambda t: demand, start, steps=120)
    assert reversals(counts) == 0, counts
    assert len(set(counts[-10:])) == 1, counts  # and stays there


@settings(max_examples=examples(200), deadline=None)
@given(policies, st.lists(st.floats(0, 50), min_size=1, max_size=20), st.integers(1, 12))
def test_a_steady_signal_moves_the_count_one_way_only(p, repeated, start):
    """Open loop: the same signals scrape after scrape (whatever the servers do), so the policy may
    keep moving, but never back."""
    start = min(max(start, p.min_servers), p.max_servers)
    values = {"waiting_per_rank": repeated[0], "running_per_rank": repeated[-1],
              "kv_cache_utilization": min(1.0, repeated[0] / 50)}
    history, counts, current, settled_since = [], [], start, NOW
    for k in range(80):
        t = NOW + k * INTERVAL
        history.append(RoleLoad(at=t, servers=current, ranks=2 * current, **values))
        d = decide("context", history, p, current, t, settled_since=settled_since, batch_capacity=BATCH)
        if d.changes:
            current, settled_since = d.desired, t
        counts.append(current)
    assert reversals(counts) == 0, counts


def fewest(demand: float, model, p, start: int, slack: float) -> int:
    """The fewest servers from `start` up at which `demand` holds every target times `slack`."""
    n = start
    while any(v is not None and v > t * slack for name, t in p.targets.given().items()
              for v in [model(demand / (n * 2)).get(name)]):
        n += 1
    return n


def jump(p, base, model):
    """Load steps from `base` to 4x after 600 s: (counts, servers before, the range of counts it may
    settle at: from the fewest within the tolerance of every target to the fewest under them)."""
    counts = play(p, lambda t: base * (4 if t >= NOW + 600 else 1), 1, steps=500, model=model)
    before = counts[int(600 / INTERVAL) - 1]
    return counts, before, (fewest(4 * base, model, p, before, 1 + p.tolerance),
                            fewest(4 * base, model, p, before, 1.0))


def seconds_to_reach(counts, needed) -> float:
    start = int(600 / INTERVAL)
    return (next(k for k, c in enumerate(counts) if k >= start and c >= needed) - start) * INTERVAL


@settings(max_examples=examples(150), deadline=None)
@given(st.floats(20, 400), st.sampled_from([0, 10, 30]), st.integers(1, 4))
def test_a_four_fold_step_of_a_proportional_signal_is_met_after_one_window_and_a_step_per_limit(base, up_window, step):
    """A signal in proportion to the load (the HPA's case): the first decision comes one up window
    after the step, and then one decision per maxServersPerStep, each Ready one interval after it
    is made and measured one interval later."""
    p = policy(maxServers=256, targets={"timeToFirstTokenSeconds": 0.5},
               scaleUp={"stabilizationWindowSeconds": up_window, "maxServersPerStep": step})
    counts, before, (needed, enough) = jump(p, base, linear)
    bound = up_window + INTERVAL + 2 * INTERVAL * math.ceil((needed - before) / step)
    assert seconds_to_reach(counts, needed) <= bound, (counts[118:160], before, needed, bound)
    assert needed <= counts[-1] <= enough  # and no further


@settings(max_examples=examples(150), deadline=None)
@given(st.floats(20, 400), st.sampled_from([0, 10, 30]), st.integers(1, 4))
def test_a_four_fold_step_of_saturating_signals_is_met_within_a_window_per_server(base, up_window, step):
    """Queue and KV signals saturate (a full batch queues, the KV cache tops out at 1), so a
    decision may ask for too little and wait a window for the next: still at least one server per
    window and two intervals."""
    p = policy(maxServers=256, scaleUp={"stabilizationWindowSeconds": up_window, "maxServersPerStep": step})
    counts, before, (needed, enough) = jump(p, base, engine)
    bound = up_window + INTERVAL + (needed - before) * (up_window + 2 * INTERVAL)
    assert seconds_to_reach(counts, needed) <= bound, (counts[118:160], before, needed, bound)
    assert needed <= counts[-1] <= enough and max(counts) <= enough  # no overshoot


# ---- reading a role's load from scrapes ------------------------------------------------------------

def scrape(at, **per_rank) -> Scrape:
    return Scrape(at=at, ranks={r: RankSample(**{k: v[r] for k, v in per_rank.items()}) for r in (0, 1)})


def test_role_load_is_the_mean_per_rank_over_its_servers_and_latency_means_over_the_interval():
    before = {"a": scrape(0, ttft_sum=[1.0, 1.0], ttft_count=[2, 2], itl_sum=[0, 0], itl_count=[0, 0])}
    now = {"a": scrape(5, requests_waiting=[4, 0], requests_running=[2, 2], kv_cache_blocks_used=[30, 10],
                       kv_cache_capacity_blocks=[40, 40], kv_transfers_in_flight=[15, 5],
                       ttft_sum=[2.0, 1.6], ttft_count=[4, 3], itl_sum=[0.5, 0.3], itl_count=[10, 6]),
           "b": Scrape(at=5, error="refused")}
    got = role_load(5.0, now, before)
    assert got.servers == 1 and got.ranks == 2
    assert got.waiting_per_rank == 2.0 and got.running_per_rank == 2.0
    assert got.kv_cache_utilization == 0.5 and got.transfer_share == 0.5
    assert got.time_to_first_token_seconds == pytest.approx(1.6 / 3)  # (1.0 + 0.6) / (2 + 1)
    assert got.inter_token_latency_seconds == pytest.approx(0.8 / 16)
    assert role_load(5.0, {"b": Scrape(at=5, error="refused")}, {}) is None


def test_a_restarted_server_s_histograms_are_not_compared_with_its_old_ones():
    before = {"a": scrape(0, ttft_sum=[9.0, 9.0], ttft_count=[9, 9])}
    now = {"a": scrape(5, ttft_sum=[0.5, 0.5], ttft_count=[1, 1])}
    assert role_load(5.0, now, before).time_to_first_token_seconds is None
