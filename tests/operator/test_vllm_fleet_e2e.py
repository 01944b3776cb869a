"""The real vLLM behind the operator, end to end: one InferenceFleet with `engine: vllm` and two
aggregated `vllm serve` servers, shared by the module's tests (a vLLM start is minutes on two loaded
cores), in the order they run:

1. the official client is served through the fleet's router with the fleet's API key, streaming and
   not; without the key the router refuses, and so does vLLM itself (VLLM_API_KEY reached it);
2. (last: it replaces a server) under streaming and non-streaming load whose long requests keep
   both engines busy, one server's `VLLM::EngineCore` is frozen from the node's side (SIGSTOP, the
   way a wedged engine looks to the kernel: /health stays 200, the `vllm:` counters go flat). The
   operator, reading the servers in vLLM's dialect, decides `hung` on rank (engine) 0 of that server
   within the stall window and two scrapes, replaces only it, loses no request, and the fleet serves
   on its peer and then on both. Idle and just started, busy before the fault, and the new server's
   first window under load: nothing is flagged.

Each server runs one OpenMP thread that vLLM does not bind (`VLLM_CPU_OMP_THREADS_BIND=nobind`):
bound to one core, every server of the fleet and the replacement's start shared that core while the
other one idled, and a replacement starved past its start-up timeout."""

from __future__ import annotations

import base64
import json
import time
from datetime import datetime
from dataclasses import dataclass

import doc_commands
import httpx
import openai
import pytest
from vllm_servers import ENGINE_CORE, START_TIMEOUT_S, build_model

from adpfleet.cluster import processes
from adpfleet.cluster.testing import fresh_namespace, wait_for
from adpfleet.operator.decisions.history import parse_rfc3339

from operator_harness import Fleets, OperatorProcess, PodTimeline, operators, pod_ready
from stall_harness import Load, remediations, vllm_requests_running, vllm_stall_fleet

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]

FLEET, KEY = "vf", "vllm-fleet-key"
# Longer than vLLM's longest step here (a few dozen prompt tokens per chunk: well under a second,
# docs/remediation.md "Dialects"), short enough that the test sees the stall in seconds.
WINDOW, INTERVAL = 8, 1
# Tokens of the load's requests while the engine is frozen: seconds of decoding each, so an engine
# always has requests running (an engine frozen as its last request ended reports 0 running and
# cannot be told from an idle one: docs/remediation.md, "Dialects").
LONG_REQUEST_TOKENS = 384
RUNBOOK = doc_commands.ROOT / "docs" / "runbooks" / "AdpfleetServerStalled-vllm.md"


def vllm_fleet(model_dir: str) -> dict:
    return vllm_stall_fleet(FLEET, model_dir, window=WINDOW, interval=INTERVAL, servers=2, budget=20,
                            auth={"apiKeySecret": {"name": "vf-key", "key": "key"}})


@dataclass
class ServedFleet:
    fleets: Fleets
    op: OperatorProcess
    started_s: float  # applied -> Ready
    ready_at: float   # time.time() when it was Ready


@pytest.fixture(scope="module")
def served(k8s_cluster, api_proxy, fleet_crd, tmp_path_factory, request):
    """The module's fleet, Ready, with the operator that watches it (both gone after the module)."""
    def failed() -> bool:
        return any(getattr(item, "rep_call", None) is None or item.rep_call.failed
                   for item in request.session.items if item.module is request.module)

    with fresh_namespace(k8s_cluster, "vllm-fleet-e2e") as ns:
        fleets = Fleets(k8s_cluster, ns)
        with operators(api_proxy, ns, fleets, tmp_path_factory.mktemp("vllm-operator"), failed) as start:
            fleets.core.create_namespaced_secret(ns, {"metadata": {"name": "vf-key"},
                                                      "data": {"key": base64.b64encode(KEY.encode()).decode()}})
            op = start()
            t0 = time.monotonic()
            fleets.apply(vllm_fleet(str(build_model())))
            fleets.wait_ready(FLEET, timeout=START_TIMEOUT_S + 120)  # + the model check of the init container
            yield ServedFleet(fleets, op, time.monotonic() - t0, time.time())


def test_a_vllm_fleet_is_served_through_the_router_with_the_fleets_api_key(served):
    fleets = served.fleets
    pods = fleets.pods(FLEET, "aggregated")
    assert len(pods) == 2 and all(pod_ready(p) and p.metadata.labels["adpfleet.io/engine"] == "vllm" for p in pods)
    assert all(p.spec.containers[0].command == ["vllm"] for p in pods)
    base = wait_for(lambda: fleets.router_url(FLEET), timeout=120, what="a Ready router", interval=1) + "/v1"

    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
    answer = wait_for(lambda: client.completions.create(model="tiny-llama", prompt="The fleet", max_tokens=6),
                      timeout=120, what="a completion through the router (it discovers the servers)", interval=1)
    assert answer.model == "tiny-llama" and answer.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny-llama", prompt="A stream", max_tokens=5, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert [m.id for m in client.models.list()] == ["tiny-llama"]

    with pytest.raises(openai.AuthenticationError):  # the router checks the key
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).completions.create(
            model="tiny-llama", prompt="x", max_tokens=1)
    # and vLLM checks the same key itself: it got VLLM_API_KEY from the fleet's Secret
    server = f"http://{pods[0].status.pod_ip}:8000"
    assert httpx.post(server + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1},
                      timeout=60).status_code == 401
    assert httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200


# ---- a frozen engine ------------------------------------------------------------------------------

def decided(fleets, victim: str):
    """(the remediation record of `victim`, the Stalled condition, when seen): they come in one status write."""
    fleet = fleets.get(FLEET)
    record = next((r for r in remediations(fleet) if r["server"] == victim), None)
    stalled = next(c for c in fleet["status"]["conditions"] if c["type"] == "Stalled")
    return record and (record, stalled, time.time())


def detected_at(op: OperatorProcess, victim: str) -> float:
    """When the operator judged `victim` stalled: its log line of the verdict (the remediation record's time is
    later, when the action starts, after the Events went out: seconds under load)."""
    entries = (json.loads(line) for line in op.log().splitlines() if line.startswith("{"))
    verdict = next(e for e in entries if e["message"].startswith(f"stall detected: {victim} "))
    return datetime.fromisoformat(verdict["timestamp"]).timestamp()


def replaced(fleets, victim: str, peer: str, before: dict) -> bool:
    now = {p.metadata.name: p for p in fleets.live_pods(FLEET, "aggregated")}
    return now.keys() == {victim, peer} and now[victim].metadata.uid != before[victim].metadata.uid \
        and all(pod_ready(p) for p in now.values())


def assert_nothing_flagged(fleets, op) -> None:
    assert op.metric("adpfleet_operator_stalls_detected_total") == 0
    assert remediations(fleets.get(FLEET)) == []
    assert fleets.condition(FLEET, "Stalled").get("status") == "False"
    assert not fleets.events("StallDetected")


def freeze_and_see_it_healed(served: ServedFleet, before: dict, load: Load) -> dict:
    """Freeze a busy engine under `load`; the decision, the fleet serving on the peer. Returns the times."""
    fleets = served.fleets
    wait_for(lambda: load.completed_since(time.time() - 60) >= 4, timeout=180, what="traffic")
    time.sleep(WINDOW + 2 * INTERVAL)  # busy for a window
    assert_nothing_flagged(fleets, served.op)
    # a server whose engine runs 2 requests or more, its gauges still showing work once frozen
    victim, t_fault = processes.freeze_busy_pod({name: p.metadata.uid for name, p in before.items()}, ENGINE_CORE,
                                                lambda name: vllm_requests_running(before[name]))
    record, stalled, t_seen = wait_for(lambda: decided(fleets, victim), timeout=120,
                                       what=f"a remediation of {victim}", interval=0.2)
    detected = detected_at(served.op, victim) - t_fault
    print(f"vLLM freeze -> hung verdict: {detected:.1f} s, -> remediation record "
          f"{parse_rfc3339(record['time']) - t_fault:.1f} s; {stalled['message']}", flush=True)
    assert (record["action"], record["signature"], record["targets"]) == ("RestartServer", "hung", [victim])
    assert detected <= WINDOW + 2 * INTERVAL, f"hung decided {detected:.1f} s after the freeze"
    assert stalled["status"] == "True" and victim in stalled["message"] and "hung, ranks 0" in stalled["message"]
    wait_for(lambda: load.completed_since(t_seen) >= 4, timeout=180, what="the fleet serving on its peer")
    return {"victim": victim, "fault": t_fault, "detected": detected, "seen": t_seen - t_fault,
            "recorded": parse_rfc3339(record["time"]) - t_fault,
            "serving": time.time() - t_fault}


def test_a_frozen_vllm_engine_is_hung_and_only_its_server_is_replaced_with_no_request_lost(served):
    t0, fleets, op = time.monotonic(), served.fleets, served.op
    before = {p.metadata.name: p for p in fleets.live_pods(FLEET, "aggregated")}
    assert len(before) == 2 and all(pod_ready(p) for p in before.values())
    time.sleep(max(0.0, served.ready_at + WINDOW + 2 * INTERVAL - time.time()))  # idle, just started: a window
    assert_nothing_flagged(fleets, op)

    url = fleets.router_url(FLEET)
    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline:
        with Load(url, clients=4, max_tokens=LONG_REQUEST_TOKENS, deadline=240, streaming=True, api_key=KEY) as load:
            times = freeze_and_see_it_healed(served, before, load)
        victim = times["victim"]
        (peer,) = set(before) - {victim}
        # the load stopped (every request it sent has ended): the replacement starts on quiet cores
        wait_for(lambda: replaced(fleets, victim, peer, before), timeout=START_TIMEOUT_S + 300,
                 what=f"a new Ready {victim}", interval=0.5)
        fleets.wait_ready(FLEET, timeout=120)
        t_replaced = time.time()
        with Load(url, clients=4, deadline=180, streaming=True, api_key=KEY) as after:
            wait_for(lambda: after.completed_since(t_replaced) >= 4, timeout=180, what="both servers serving")
            time.sleep(WINDOW + 2 * INTERVAL)  # the new server's first window, under load
    outcomes = load.outcomes + after.outcomes
    lost = [o for o in outcomes if o.kind == "lost"]
    assert not lost, f"requests without an answer by their deadline: {lost[:5]}"
    cut = [o for o in outcomes if o.kind == "error" and o.after_tokens and o.streamed]
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
    report(times, t_replaced, served, outcomes, time.monotonic() - t0)


def report(times: dict, t_replaced: float, served: ServedFleet, outcomes: list, wall: float) -> None:
    counts = {kind: sum(1 for o in outcomes if o.kind == kind) for kind in ("completed", "error", "lost")}
    print(f"vLLM freeze -> hung verdict: {times['detected']:.1f} s (remediation record {times['recorded']:.1f} s, "
          f"seen by the test at {times['seen']:.1f} s; "
          f"bound window {WINDOW} + 2 x {INTERVAL} = {WINDOW + 2 * INTERVAL} s); freeze -> serving on the peer "
          f"{times['serving']:.1f} s, -> replaced and Ready {t_replaced - times['fault']:.1f} s; "
          f"fleet Ready {served.started_s:.1f} s after it was applied; load {counts}, "
          f"{sum(1 for o in outcomes if o.attempts > 1)} retried by the router; test wall {wall:.1f} s", flush=True)
    for o in outcomes:
        if o.kind != "completed":
            print(f"  {o.kind} ({'streamed' if o.streamed else 'whole'}, {o.attempts} attempt(s)): {o.detail}")
