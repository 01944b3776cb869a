"""A frozen rank on the worker pod of a server over several pods (2 pods x 2 ranks, #17's larger
shape), under traffic, on the local cluster: the operator scrapes both pods, judges the group as
one server, calls it `hung` within the stall window and two scrape intervals of the freeze, names
the worker pod in the Stalled condition and its Events, and recreates the whole group; the fleet
serves again and every request through the router is answered. One fleet, short windows: each
server start costs a torch import per process."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from adpfleet.cluster.testing import wait_for
from adpfleet.operator.decisions.history import parse_rfc3339
from adpfleet.operator.resource import names

from operator_harness import pod_ready
from stall_harness import Load, assert_decided_in_time, inject, remediations, stall_fleet
from test_end_to_end import SERVER_START

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.multiproc]

FLEET = "mn"
WINDOW, INTERVAL = 6, 1
LEADER, WORKER = "mn-generation-0-0", "mn-generation-0-1"


def group(fleets) -> dict[str, object]:
    return {p.metadata.name: p for p in fleets.live_pods(FLEET, "generation")}


def test_a_frozen_rank_on_a_worker_pod_is_hung_named_by_its_pod_and_the_whole_group_is_recreated(
        start_operator, fleets):
    t0 = time.monotonic()
    op = start_operator()
    manifest = stall_fleet(FLEET, window=WINDOW, interval=INTERVAL, context_ranks=1)
    manifest["spec"]["generation"].update(adpRanks=4, podsPerServer=2)  # ranks 0-1 on the leader, 2-3 on the worker
    fleets.apply(manifest)
    fleets.wait_ready(FLEET, timeout=SERVER_START)
    t_ready = time.monotonic()
    before = group(fleets)
    assert sorted(before) == [LEADER, WORKER] and all(pod_ready(p) for p in before.values())

    # a worker answers /faults only to send the caller to its leader, which reaches every rank
    secret = fleets.core.read_namespaced_secret(f"{FLEET}-internal-token", fleets.ns)
    token = base64.b64decode(secret.data["token"]).decode()
    r = httpx.post(f"http://{before[WORKER].status.pod_ip}:{names.SERVER_HTTP_PORT}/faults",
                   json={"kind": "freeze", "rank": 3}, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 421 and "to its leader" in r.json()["error"]["message"], r.text

    with Load(fleets.router_url(FLEET), clients=3, deadline=180, streaming=True) as load:
        wait_for(lambda: load.completed_since(time.time() - 30) >= 3, timeout=120, what="traffic through the router")
        t_fault = time.time()
        assert inject(fleets.core, before[LEADER], "freeze", 3) == {"injected": "freeze", "rank": 3}

        def decided():  # the record and the Stalled condition come in the same status write
            fleet = fleets.get(FLEET)
            record = next((r for r in remediations(fleet) if r["server"] == LEADER
                           and parse_rfc3339(r["time"]) >= t_fault), None)
            stalled = next(c for c in fleet["status"]["conditions"] if c["type"] == "Stalled")
            return record and (record, stalled)
        record, stalled = wait_for(decided, timeout=120, what=f"a remediation of {LEADER}", interval=0.2)
        print(f"freeze -> remediation record: {parse_rfc3339(record['time']) - t_fault:.1f} s; Stalled: "
              f"{stalled['message']}", flush=True)
        # the group is judged as one server, from both pods' scrapes, and named with the worker's pod
        assert (record["action"], record["signature"], record["targets"]) == ("RestartServer", "hung", [LEADER])
        assert f"on pod {WORKER}" in record["message"], record["message"]
        detected = assert_decided_in_time(op.log(), LEADER, t_fault, WINDOW, INTERVAL)
        assert stalled["status"] == "True" and f"(hung, ranks " in stalled["message"] \
            and f"on pod {WORKER}" in stalled["message"], stalled
        # the whole group goes and comes back: two new pods, new uids, both Ready
        wait_for(lambda: sorted(now := group(fleets)) == [LEADER, WORKER]
                 and not {p.metadata.uid for p in now.values()} & {p.metadata.uid for p in before.values()}
                 and all(pod_ready(p) for p in now.values()),
                 timeout=SERVER_START, what="a whole new Ready group", interval=0.5)
        fleets.wait_ready(FLEET, timeout=120)
        events = {e.reason: e.message for e in fleets.events() if e.reason in ("StallDetected", "RestartingServer")}
        t_back = time.time()
        wait_for(lambda: load.completed_since(t_back) >= 3, timeout=120, what="the fleet serving again")
        t_serving = time.time()
    counts = load.counts()
    lost = [o for o in load.outcomes if o.kind == "lost"]
    assert not lost, f"requests without an answer by their deadline: {lost[:5]} ({counts})"
    assert counts["completed"] > 0, counts
    assert f"on pod {WORKER}" in events.get("StallDetected", ""), events
    assert f"on pod {WORKER}" in events.get("RestartingServer", ""), events
    retried = sum(1 for o in load.outcomes if o.attempts > 1)
    print(f"freeze -> hung verdict: {detected:.1f} s (bound window {WINDOW} + 2 x {INTERVAL} = "
          f"{WINDOW + 2 * INTERVAL} s); freeze -> serving again {t_serving - t_fault:.1f} s; fleet Ready "
          f"{t_ready - t0:.1f} s; load {counts}, {retried} retried by the router; wall {time.monotonic() - t0:.1f} s")
    for o in load.outcomes:
        if o.kind != "completed":
            print(f"  {o.kind} ({'streamed' if o.streamed else 'whole'}, {o.attempts} attempt(s)): {o.detail}")
