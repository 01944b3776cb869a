"""Two operator replicas with leader election against the real API server: one acts, the standby
reads the Lease and nothing else, and takes over within the stated bound when the leader is
SIGKILLed or cut off from the API server; a SIGTERMed leader hands over at once.

Each replica reaches the API server through a relay of its own (partition.py: cut it and the
replica is partitioned) and a counting proxy of its own (its requests, counted from outside).
Fleets are status-only: the pods run nothing. The remediation that must survive a failover is in
test_stall_e2e.py (it needs real servers to stall).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
from kubernetes import client

from adpfleet.cluster.apiproxy import CountingProxy
from adpfleet.cluster.testing import wait_for
from adpfleet.operator.decisions.leadership import Timing
from adpfleet.operator.resource import names

from operator_harness import OperatorProcess
from partition import Relay
from specs import fleet_manifest

pytestmark = pytest.mark.k8s

TIMING = Timing(lease_duration=6, renew_deadline=4, retry_period=1)
STARTUP = 5.0  # a new leader's kopf start (listing what it watches) on two busy cores, beyond the bound
LEASE = "adpfleet-operator"


@dataclass
class Replica:
    op: OperatorProcess
    proxy: CountingProxy
    relay: Relay


@pytest.fixture
def replicas(k8s_cluster, k8s_namespace, fleets, tmp_path, request):
    """start(name) -> a Replica: an elected operator behind its own proxy and relay."""
    started: list[Replica] = []
    closers = []

    def start(name: str) -> Replica:
        proxy = CountingProxy(k8s_cluster.kubeconfig).start()
        relay = Relay(proxy.port).__enter__()
        closers.extend([relay.__exit__, lambda *_: proxy.stop()])
        op = OperatorProcess(relay, tmp_path, ["--namespace", k8s_namespace], resync_seconds=2, name=name,
                             extra_args=("--leader-elect", "--leader-election-namespace", k8s_namespace,
                                         "--lease-duration", str(TIMING.lease_duration),
                                         "--renew-deadline", str(TIMING.renew_deadline),
                                         "--retry-period", str(TIMING.retry_period), "--stall-detection", "off",
                                         "--log-format", "plain")).start()
        started.append(Replica(op, proxy, relay))
        return started[-1]

    yield start
    try:
        for fleet in fleets.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, fleets.ns,
                                                                 names.PLURAL)["items"]:
            fleets.delete(fleet["metadata"]["name"])
        if any(r.op.running() and r.op.role() == "leader" for r in started):
            wait_for(lambda: not fleets.custom.list_namespaced_custom_object(
                names.GROUP, names.VERSION, fleets.ns, names.PLURAL)["items"], timeout=60,
                what="the test's fleets to be deleted")
    finally:
        for r in started:
            r.op.stop()
        fleets.drop_finalizers()
        for close in reversed(closers):
            close(None, None, None)
        failed = getattr(request.node, "rep_call", None)
        if failed is None or failed.failed:
            for r in started:
                print(f"---- {r.op.name} ----\n{r.op.log()[-8000:]}")


def holder(cluster, namespace: str) -> str:
    lease = client.CoordinationV1Api(cluster.api_client).read_namespaced_lease(LEASE, namespace)
    return lease.spec.holder_identity or ""


def leads(replica: Replica) -> bool:
    return replica.op.role() == "leader"


def rss_kib(pid: int) -> int:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return int(status["VmRSS"].split()[0])


def lease_requests(requests) -> list:
    return [r for r in requests if r.resource == "leases"]


def test_one_replica_acts_the_standby_only_reads_the_lease_and_at_rest_nothing_but_the_lease_is_written(
        replicas, fleets):
    a = replicas("a")
    wait_for(lambda: leads(a), timeout=10, what="the first replica to lead")
    b = replicas("b")
    fleets.apply(fleet_manifest("demo", status_only=True))
    fleets.wait_ready("demo")
    assert b.op.role() == "standby" and holder(fleets.cluster, fleets.ns).startswith("a_")
    # everything the fleet needed was written by the leader; the standby asked for the API groups once
    # when it started (is the CRD served?) and then read the Lease, nothing else
    discovery = [r for r in b.proxy.snapshot() if r.path.rstrip("/") == "/apis"]
    assert len(discovery) == 1
    assert {(r.verb, r.resource) for r in b.proxy.snapshot() if r not in discovery} == {("get", "leases")}
    assert {("create", "pods"), ("patch", "poddisruptionbudgets")} <= {(r.verb, r.resource)
                                                                       for r in a.proxy.snapshot()}

    # at rest: once the leader's last request of the fleet's start is a resync period (2 s) old (kopf posts
    # Events from a queue of its own: on a loaded machine one of them was written after Ready)
    wait_for(lambda: time.monotonic() - max(r.time for r in a.proxy.snapshot() if r.resource != "leases") >= 2,
             timeout=30, what="the leader's start-up requests to end")
    start = time.monotonic()
    # at rest for three resync periods of the leader (2 s), counted by its Lease renewals (1 s apart)
    wait_for(lambda: len(lease_requests(a.proxy.since(start))) >= 3 * 2 / TIMING.retry_period + 1, timeout=30,
             what="three resync periods of the leader at rest")
    seconds = time.monotonic() - start
    leader, standby = a.proxy.since(start), b.proxy.since(start)
    assert CountingProxy.writes([r for r in leader if r.resource != "leases"]) == []
    assert [r for r in leader if r.resource != "leases"] == []  # not even a read: the caches answer
    renewals = [r for r in lease_requests(leader) if r.verb == "update"]
    assert {r.verb for r in leader} == {"update"} and seconds / TIMING.retry_period - 2 <= len(renewals) \
        <= seconds / TIMING.retry_period + 1
    assert {(r.verb, r.resource) for r in standby} == {("get", "leases")}
    assert len(standby) <= seconds / TIMING.retry_period + 1
    rss = {name: rss_kib(r.op.proc.pid) for name, r in (("leader", a), ("standby", b))}
    assert rss["standby"] <= rss["leader"], rss  # no caches, no fleet loops
    print(f"at rest over {seconds:.1f} s: leader {len(renewals)} Lease renewals and nothing else; "
          f"standby {len(standby)} Lease reads and nothing else; RSS leader {rss['leader'] / 1024:.1f} MiB, "
          f"standby {rss['standby'] / 1024:.1f} MiB ({rss['standby'] / rss['leader']:.2f}x)")


def test_a_sigkilled_leader_is_replaced_within_the_bound_and_the_new_leader_acts(replicas, fleets):
    a = replicas("a")
    wait_for(lambda: leads(a), timeout=10, what="the first replica to lead")
    b = replicas("b")
    fleets.apply(fleet_manifest("demo", status_only=True))
    fleets.wait_ready("demo")
    before = {p.metadata.uid for p in fleets.pods("demo")}

    a.op.kill()
    killed = time.monotonic()
    wait_for(lambda: leads(b), timeout=TIMING.takeover_bound + 5, what="the standby to take over", interval=0.1)
    took = time.monotonic() - killed
    assert took <= TIMING.takeover_bound, f"takeover took {took:.1f} s (bound {TIMING.takeover_bound} s)"
    lease = client.CoordinationV1Api(fleets.cluster.api_client).read_namespaced_lease(LEASE, fleets.ns).spec
    assert lease.holder_identity.startswith("b_") and lease.lease_transitions == 1

    # it acts: a scale-up is carried out, and nothing that existed was replaced by the takeover
    fleets.patch_spec("demo", {"context": {"servers": 2}})
    fleets.wait_ready("demo", timeout=STARTUP + 30)
    acted = time.monotonic() - killed
    pods = {p.metadata.name: p.metadata.uid for p in fleets.pods("demo")}
    assert "demo-context-1" in pods and set(pods.values()) - before == {pods["demo-context-1"]}
    print(f"SIGKILL: standby leads after {took:.1f} s (bound {TIMING.takeover_bound:g} s); "
          f"scale-up done {acted:.1f} s after the kill")


def test_a_partitioned_leader_stops_before_the_standby_takes_over(replicas, fleets):
    a = replicas("a")
    wait_for(lambda: leads(a), timeout=10, what="the first replica to lead")
    b = replicas("b")
    fleets.apply(fleet_manifest("demo", status_only=True))
    fleets.wait_ready("demo")

    a.relay.cut()
    cut = time.monotonic()
    exited = took_over = None
    while time.monotonic() - cut < TIMING.takeover_bound + 10 and (exited is None or took_over is None):
        if exited is None and not a.op.running():
            exited = time.monotonic() - cut
        if took_over is None and leads(b):
            took_over = time.monotonic() - cut
        time.sleep(0.05)
    assert exited is not None and a.op.proc.returncode == 1, "the cut-off leader did not exit"
    assert "leader election lost" in a.op.log()
    assert took_over is not None and took_over <= TIMING.takeover_bound + TIMING.retry_period, took_over
    assert exited < took_over, f"the old leader ran until {exited:.1f} s, the new one led from {took_over:.1f} s"
    # nothing it sent after the cut reached the API server (a request already on its way when the cut came
    # may still be answered in the next moment)
    assert a.proxy.since(cut + 0.5) == []
    a.relay.heal()

    fleets.patch_spec("demo", {"generation": {"servers": 2}})
    fleets.wait_ready("demo", timeout=STARTUP + 30)
    print(f"partition: old leader exited after {exited:.1f} s (renew deadline {TIMING.renew_deadline:g} s), "
          f"standby led after {took_over:.1f} s")


def test_a_leader_stopped_with_sigterm_hands_the_lease_over_at_once(replicas, fleets):
    a = replicas("a")
    wait_for(lambda: leads(a), timeout=10, what="the first replica to lead")
    b = replicas("b")
    assert a.op.stop() == 0
    stopped = time.monotonic()
    wait_for(lambda: leads(b), timeout=TIMING.takeover_bound, what="the standby to take over", interval=0.1)
    assert time.monotonic() - stopped <= 2 * TIMING.retry_period + 1
    # a standby stopped with SIGTERM exits 0 too
    c = replicas("c")
    assert c.op.role() == "standby" and c.op.stop() == 0
