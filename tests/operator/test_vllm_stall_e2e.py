"""A stalled vLLM server is detected and replaced, end to end with the real vLLM: a fleet of two
aggregated `vllm serve` servers behind the router under streaming and non-streaming load; one
server's `VLLM::EngineCore` is frozen from the node's side (SIGSTOP, the way a wedged engine looks
to the kernel: /health stays 200, the `vllm:` counters go flat). The operator, reading the servers
in vLLM's dialect, decides `hung` on rank (engine) 0 of that server within the stall window and two
scrapes, replaces only it, loses no request, and the fleet serves on its peer and then on both. Before
the fault, idle and busy, and after it, the new server's first window under load, nothing is flagged.

One fleet, two vLLM starts and one restart: minutes on two loaded cores. The load stops while the
victim restarts: a vLLM start beside a busy peer on the same two cores took over five minutes.
"""

from __future__ import annotations

import signal
import time

import doc_commands
import httpx
import pytest
from vllm_servers import ENGINE_CORE, START_TIMEOUT_S, build_model

from adpfleet.cluster import processes
from adpfleet.cluster.testing import wait_for
from adpfleet.operator.adapters.dialects import dialect_for
from adpfleet.operator.decisions.history import parse_rfc3339

from operator_harness import PodTimeline, pod_ready
from stall_harness import Load, remediations
from test_vllm_fleet_e2e import vllm_fleet

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]

FLEET = "vf"
# Longer than vLLM's longest step here (a few dozen prompt tokens per chunk: well under a second,
# docs/remediation.md "Dialects"), short enough that the test sees the stall in seconds.
WINDOW, INTERVAL = 8, 1
RUNBOOK = doc_commands.ROOT / "docs" / "runbooks" / "AdpfleetServerStalled-vllm.md"


def stall_fleet() -> dict:
    manifest = vllm_fleet(str(build_model()))
    spec = manifest["spec"]
    del spec["auth"]  # the load sends no key (the key path is test_vllm_fleet_e2e's)
    spec["aggregated"].update(servers=2, terminationGracePeriodSeconds=5)
    spec.update(monitoring={"scrapeIntervalSeconds": INTERVAL},
                remediation={"mode": "Auto", "stallWindowSeconds": WINDOW, "cooldownSeconds": 5, "budgetPerHour": 20,
                             "drainTimeoutSeconds": 5, "maxConcurrentPerRole": 1})
    return manifest


def working(pod) -> bool:
    """The server's engine reports a request running (its /metrics, read as the operator reads them)."""
    text = httpx.get(f"http://{pod.status.pod_ip}:8000/metrics", timeout=5).text
    return any((r.requests_running or 0) > 0 for r in dialect_for("vllm").parse(text).values())


def decided(fleets, victim: str):
    """(the remediation record of `victim`, the Stalled condition, when seen): they come in one status write."""
    fleet = fleets.get(FLEET)
    record = next((r for r in remediations(fleet) if r["server"] == victim), None)
    stalled = next(c for c in fleet["status"]["conditions"] if c["type"] == "Stalled")
    return record and (record, stalled, time.time())


def replaced(fleets, victim: str, peer: str, before: dict) -> bool:
    now = {p.metadata.name: p for p in fleets.live_pods(FLEET, "aggregated")}
    return now.keys() == {victim, peer} and now[victim].metadata.uid != before[victim].metadata.uid \
        and all(pod_ready(p) for p in now.values())


def assert_nothing_flagged(fleets, op) -> None:
    assert op.metric("adpfleet_operator_stalls_detected_total") == 0
    assert remediations(fleets.get(FLEET)) == []
    assert fleets.condition(FLEET, "Stalled").get("status") == "False"
    assert not fleets.events("StallDetected")


def test_a_frozen_vllm_engine_is_hung_and_only_its_server_is_replaced_with_no_request_lost(start_operator, fleets):
    t0 = time.monotonic()
    op = start_operator()
    fleets.apply(stall_fleet())
    fleets.wait_ready(FLEET, timeout=START_TIMEOUT_S + 120)
    t_ready = time.monotonic()
    before = {p.metadata.name: p for p in fleets.live_pods(FLEET, "aggregated")}
    assert len(before) == 2 and all(pod_ready(p) for p in before.values())
    time.sleep(WINDOW + 2 * INTERVAL)  # idle, just started: a window of scrapes
    assert_nothing_flagged(fleets, op)

    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline:
        with Load(fleets.router_url(FLEET), clients=4, deadline=180, streaming=True) as load:
            wait_for(lambda: load.completed_since(time.time() - 30) >= 4, timeout=180, what="traffic")
            time.sleep(WINDOW + 2 * INTERVAL)  # busy for a window
            assert_nothing_flagged(fleets, op)
            victim, peer = sorted(before)
            # frozen while it has work: an engine frozen between requests leaves its gauges at 0, and vLLM's
            # metrics cannot tell it from an idle one (docs/remediation.md, "Dialects")
            wait_for(lambda: working(before[victim]), timeout=60, what=f"{victim} running a request", interval=0.05)
            t_fault = time.time()
            frozen = processes.signal_pod_processes(before[victim].metadata.uid, ENGINE_CORE, signal.SIGSTOP)
            assert len(frozen) == 1, frozen
            record, stalled, t_seen = wait_for(lambda: decided(fleets, victim), timeout=120,
                                               what=f"a remediation of {victim}", interval=0.2)
            detected = parse_rfc3339(record["time"]) - t_fault
            print(f"vLLM freeze -> hung decision: {detected:.1f} s; {stalled['message']}", flush=True)
            assert (record["action"], record["signature"], record["targets"]) == ("RestartServer", "hung", [victim])
            assert detected <= WINDOW + 2 * INTERVAL, f"hung decided {detected:.1f} s after the freeze"
            assert stalled["status"] == "True" and victim in stalled["message"] \
                and "hung, ranks 0" in stalled["message"]
            wait_for(lambda: load.completed_since(t_seen) >= 4, timeout=120, what="the fleet serving on its peer")
            t_serving = time.time()
        # the load stopped (every request it sent has ended): vLLM restarts on two busy cores, minutes
        wait_for(lambda: replaced(fleets, victim, peer, before), timeout=START_TIMEOUT_S + 300,
                 what=f"a new Ready {victim}", interval=0.5)
        fleets.wait_ready(FLEET, timeout=120)
        t_replaced = time.time()
        with Load(fleets.router_url(FLEET), clients=4, deadline=180, streaming=True) as after:
            wait_for(lambda: after.completed_since(t_replaced) >= 4, timeout=180, what="both servers serving")
            time.sleep(WINDOW + 2 * INTERVAL)  # the new server's first window, under load
    load.outcomes.extend(after.outcomes)
    counts = load.counts()
    lost = [o for o in load.outcomes if o.kind == "lost"]
    assert not lost, f"requests without an answer by their deadline: {lost[:5]} ({counts})"
    cut = [o for o in load.outcomes if o.kind == "error" and o.after_tokens and o.streamed]
    assert all(o.detail.startswith("stream_error_event") for o in cut), cut  # an explicit error, never a silent cut
    first = {p.metadata.uid for p in before.values()}
    assert [name for name, uid in timeline.created if uid not in first] == [victim], timeline.created  # only it
    assert before[peer].metadata.uid in {p.metadata.uid for p in fleets.live_pods(FLEET)}
    detected_events = fleets.events("StallDetected")
    assert len(detected_events) == 1 and victim in detected_events[0].message, detected_events
    assert "hung, ranks 0" in detected_events[0].message
    assert op.metric("adpfleet_operator_stalls_detected_total") == 1  # the new server is not flagged
    # the runbook's diagnosis, as written, against this fleet and the peer that served throughout
    runbook = [c for b in doc_commands.blocks(RUNBOOK) for c in b.commands]
    doc_commands.run(runbook, doc_commands.Place(fleets.ns, FLEET, pod=peer), fleets.cluster, timeout=120)
    print(f"vLLM freeze -> hung decision: {detected:.1f} s (seen by the test at {t_seen - t_fault:.1f} s; bound "
          f"window {WINDOW} + 2 x {INTERVAL} = {WINDOW + 2 * INTERVAL} s); freeze -> serving again "
          f"{t_serving - t_fault:.1f} s, -> replaced and Ready {t_replaced - t_fault:.1f} s; "
          f"fleet Ready {t_ready - t0:.1f} s; load {counts}, "
          f"{sum(1 for o in load.outcomes if o.attempts > 1)} retried by the router; "
          f"wall {time.monotonic() - t0:.1f} s", flush=True)
    for o in load.outcomes:
        if o.kind != "completed":
            print(f"  {o.kind} ({'streamed' if o.streamed else 'whole'}, {o.attempts} attempt(s)): {o.detail}")
