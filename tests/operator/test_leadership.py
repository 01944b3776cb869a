"""Leader election: the decisions as statements, and two electors sharing one Lease (a fake API
with the API server's optimistic concurrency) in real time with short periods. The real failover,
through the real API server, is in test_failover.py."""

import asyncio
import time

import pytest

from adpfleet.operator.adapters.kube import ApiResult
from adpfleet.operator.decisions.leadership import (LeaseRecord, Observation, Step, Timing, decide, lease_spec,
                                                    observe, released_spec)
from adpfleet.operator.election import LeaderElector
from adpfleet.operator.telemetry import OperatorMetrics

TIMING = Timing(lease_duration=15, renew_deadline=10, retry_period=2)


def record(holder="a", renew="t1", transitions=0, rv="1", duration=15) -> LeaseRecord:
    return LeaseRecord(holder, duration, "t0", renew, transitions, rv)


# ---- decisions ----

def test_no_lease_is_created_ours_is_renewed_a_released_one_is_taken():
    assert decide(Observation(None, 0.0), "a", 0.0, TIMING) is Step.CREATE
    assert decide(Observation(record("a"), 0.0), "a", 100.0, TIMING) is Step.RENEW
    assert decide(Observation(record(""), 0.0), "a", 0.0, TIMING) is Step.TAKE


def test_another_holders_lease_is_taken_only_after_a_whole_duration_without_change_on_our_clock():
    view = observe(None, record("b", renew="t1"), now=100.0)
    assert decide(view, "a", 114.9, TIMING) is Step.WAIT
    assert decide(view, "a", 115.0, TIMING) is Step.TAKE
    renewed = observe(view, record("b", renew="t2", rv="2"), now=110.0)  # a renewal seen: the clock restarts
    assert renewed.changed_at == 110.0 and decide(renewed, "a", 115.0, TIMING) is Step.WAIT
    same = observe(renewed, record("b", renew="t2", rv="2"), now=120.0)  # nothing new: the clock keeps running
    assert same.changed_at == 110.0 and decide(same, "a", 125.0, TIMING) is Step.TAKE


def test_the_holders_own_lease_duration_counts():
    view = observe(None, record("b", duration=60), now=0.0)
    assert decide(view, "a", 30.0, TIMING) is Step.WAIT


def test_a_takeover_counts_a_transition_and_a_renewal_keeps_the_acquire_time():
    taken = lease_spec(record("b", transitions=3), "a", Step.TAKE, "now", TIMING)
    assert taken["holderIdentity"] == "a" and taken["leaseTransitions"] == 4 and taken["acquireTime"] == "now"
    renewed = lease_spec(record("a", transitions=4), "a", Step.RENEW, "later", TIMING)
    assert renewed["leaseTransitions"] == 4 and renewed["acquireTime"] == "t0" and renewed["renewTime"] == "later"
    created = lease_spec(None, "a", Step.CREATE, "now", TIMING)
    assert created["leaseTransitions"] == 0 and created["leaseDurationSeconds"] == 15
    # a fractional duration is rounded up, never down below the renew deadline
    assert lease_spec(None, "a", Step.CREATE, "now", Timing(10.2, 10.1, 2))["leaseDurationSeconds"] == 11
    assert released_spec(record("a"), "now")["holderIdentity"] == ""


def test_the_renew_deadline_must_end_before_the_lease_does():
    assert TIMING.problem() is None and TIMING.takeover_bound == 19
    assert "renew deadline" in Timing(10, 10, 2).problem()
    assert Timing(10, 5, 5).problem() is not None


def test_a_lease_read_from_the_api_becomes_a_record():
    lease = {"metadata": {"resourceVersion": "7"}, "spec": {"holderIdentity": "pod-1_ab", "leaseDurationSeconds": 15,
                                                            "acquireTime": "2026-01-01T00:00:00.000000Z",
                                                            "renewTime": "2026-01-01T00:00:05.000000Z",
                                                            "leaseTransitions": 2}}
    r = LeaseRecord.from_lease(lease)
    assert (r.holder, r.transitions, r.resource_version) == ("pod-1_ab", 2, "7")
    assert LeaseRecord.from_lease(None) is None
    assert LeaseRecord.from_lease({"metadata": {}, "spec": {}}).holder == ""


# ---- two electors, one Lease ----

class LeaseStore:
    """One Lease with the API server's optimistic concurrency; `cut` makes one replica's requests hang."""

    def __init__(self):
        self.lease: dict | None = None
        self.version = 0
        self.cut: set[str] = set()
        self.writes: list[tuple[str, str]] = []  # (identity, holder written)

    def api(self, me: str) -> "FakeLeaseApi":
        return FakeLeaseApi(self, me)


class FakeLeaseApi:
    def __init__(self, store: LeaseStore, me: str):
        self.store, self.me = store, me

    async def _reachable(self):
        if self.me in self.store.cut:
            await asyncio.sleep(3600)

    async def read_lease(self, namespace, name):
        await self._reachable()
        return (ApiResult(True, 404), None) if self.store.lease is None else (ApiResult(True), dict(self.store.lease))

    async def create_lease(self, namespace, name, spec):
        await self._reachable()
        if self.store.lease is not None:
            return ApiResult(False, 409, "exists"), None
        return ApiResult(True), self._write(spec)

    async def replace_lease(self, namespace, name, spec, resource_version):
        await self._reachable()
        if self.store.lease is None or self.store.lease["metadata"]["resourceVersion"] != resource_version:
            return ApiResult(False, 409, "the object has been modified"), None
        return ApiResult(True), self._write(spec)

    def _write(self, spec):
        self.store.version += 1
        self.store.lease = {"metadata": {"resourceVersion": str(self.store.version)}, "spec": dict(spec)}
        self.store.writes.append((self.me, spec["holderIdentity"]))
        return dict(self.store.lease)


FAST = Timing(lease_duration=1.6, renew_deadline=1.0, retry_period=0.2)
PATIENCE = 10.0  # seconds a scenario waits for what must happen (2 busy cores can stall a loop for a while)
SLACK = 0.5  # seconds a liveness bound may be late by on a busy machine (safety bounds get none)


def elector(store: LeaseStore, me: str) -> LeaderElector:
    return LeaderElector(store.api(me), OperatorMetrics(), namespace="ns", name="op", identity=me, timing=FAST)


def test_of_two_replicas_one_leads_and_a_standby_takes_over_when_it_stops_renewing():
    async def scenario():
        store = LeaseStore()
        a, b = elector(store, "a"), elector(store, "b")
        never = asyncio.Event()
        first = await asyncio.wait_for(a.acquire(never), PATIENCE)
        b_task = asyncio.ensure_future(b.acquire(never))
        lost_a = []
        keep_a = asyncio.ensure_future(a.keep(lost_a.append))
        await asyncio.sleep(3 * FAST.lease_duration)
        assert first and a.leading and not b_task.done(), "the standby took a Lease that was being renewed"
        assert {w for w, _ in store.writes} == {"a"}  # the standby only read
        keep_a.cancel()  # the leader dies: no more renewals
        died = time.monotonic()
        assert await asyncio.wait_for(b_task, PATIENCE)
        took = time.monotonic() - died
        assert FAST.lease_duration - FAST.retry_period <= took <= FAST.takeover_bound + SLACK, took
        assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
        assert not lost_a
    asyncio.run(scenario())


def test_a_cut_off_leader_gives_up_before_a_standby_can_take_over():
    async def scenario():
        store = LeaseStore()
        a, b = elector(store, "a"), elector(store, "b")
        never = asyncio.Event()
        await a.acquire(never)
        lost: list[tuple[str, float]] = []
        keep_a = asyncio.ensure_future(a.keep(lambda why: lost.append((why, time.monotonic()))))
        await asyncio.sleep(3 * FAST.retry_period)
        store.cut.add("a")  # partitioned: its requests hang
        cut = time.monotonic()
        await asyncio.wait_for(b.acquire(never), PATIENCE)
        took_over = time.monotonic()
        await asyncio.wait_for(keep_a, PATIENCE)
        (why, gave_up), = lost
        assert "not renewed" in why
        assert gave_up - cut <= FAST.renew_deadline + 2 * FAST.retry_period + SLACK
        assert gave_up < took_over, "the old leader still acted after the standby took over"
    asyncio.run(scenario())


def test_a_graceful_stop_hands_the_lease_over_within_a_retry_period():
    async def scenario():
        store = LeaseStore()
        a, b = elector(store, "a"), elector(store, "b")
        never = asyncio.Event()
        await a.acquire(never)
        b_task = asyncio.ensure_future(b.acquire(never))
        await asyncio.sleep(2 * FAST.retry_period)
        released = time.monotonic()
        await a.release()
        assert await asyncio.wait_for(b_task, PATIENCE)
        assert time.monotonic() - released <= 3 * FAST.retry_period + SLACK
        assert not a.leading
    asyncio.run(scenario())


def test_a_leader_whose_lease_was_taken_notices_at_its_next_renewal():
    async def scenario():
        store = LeaseStore()
        a = elector(store, "a")
        await a.acquire(asyncio.Event())
        store.lease = {"metadata": {"resourceVersion": "99"}, "spec": {**store.lease["spec"], "holderIdentity": "x"}}
        lost = []
        await asyncio.wait_for(a.keep(lost.append), PATIENCE)
        assert lost and "taken over by x" in lost[0] and not a.leading
    asyncio.run(scenario())


def test_a_standby_stops_waiting_when_told_to():
    async def scenario():
        store = LeaseStore()
        await elector(store, "a").acquire(asyncio.Event())
        stopping = asyncio.Event()
        waiting = asyncio.ensure_future(elector(store, "b").acquire(stopping))
        await asyncio.sleep(FAST.retry_period)
        stopping.set()
        assert await asyncio.wait_for(waiting, PATIENCE) is False
    asyncio.run(scenario())


@pytest.mark.parametrize("bad", [Timing(1, 1, 0.1), Timing(1, 0.5, 0.5), Timing(1, 2, 0.1)])
def test_an_elector_refuses_timing_that_could_let_two_replicas_act(bad):
    with pytest.raises(ValueError):
        LeaderElector(LeaseStore().api("a"), OperatorMetrics(), namespace="ns", name="op", identity="a", timing=bad)
