"""The real vLLM behind the operator, end to end: one InferenceFleet with `engine: vllm` and two
aggregated `vllm serve` servers, shared by the module's tests (a vLLM start is minutes on two loaded
cores), in the order they run:

1. the official client is served through the fleet's router with the fleet's API key, streaming and
   not; without the key the router refuses, and so does vLLM itself (VLLM_API_KEY reached it); the
   servers keep vLLM's cache on the session's node directory (`vllm.cache.hostPath`), which their
   start filled, so the replacements below (and any later vLLM start of the session) skip that work;
2. (it replaces a server) under streaming and non-streaming load whose long requests keep
   both engines busy, one server's `VLLM::EngineCore` is frozen from the node's side (SIGSTOP, the
   way a wedged engine looks to the kernel: /health stays 200, the `vllm:` counters go flat). The
   operator, reading the servers in vLLM's dialect, decides `hung` on rank (engine) 0 of that server
   within the stall window and two scrapes, replaces only it, loses no request, and the fleet serves
   on its peer and then on both. Idle and just started, busy before the fault, and the new server's
   first window under load: nothing is flagged;
3. (last: it replaces a server and leaves its replacement starting) the same freeze, decided by the alert
   path alone: the operator restarted with its own stall detection off, real Prometheus scraping the servers
   with the chart's `adpfleet-vllm` rule (its window shortened: tests/alert_windows.py) and real Alertmanager
   calling the operator's webhook with its bearer token. The record and the Events name the alert, only the
   frozen server is replaced, no request is lost, and the rule never fires for the busy peer.

Each server runs one OpenMP thread that vLLM does not bind (`VLLM_CPU_OMP_THREADS_BIND=nobind`):
bound to one core, every server of the fleet and the replacement's start shared that core while the
other one idled, and a replacement starved past its start-up timeout."""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import doc_commands
import httpx
import openai
import pytest
from vllm_servers import ENGINE_CORE, START_TIMEOUT_S, build_model

from adpfleet.cluster import processes
from adpfleet.cluster.testing import fresh_namespace, wait_for
from adpfleet.operator.decisions.history import parse_rfc3339
from adpfleet.operator.resource import names

from alert_windows import short_window_rules
from operator_harness import Fleets, OperatorProcess, PodTimeline, operators, pod_ready
from stall_harness import (Load, Monitoring, ProgressWatch, assert_decided_in_time, remediations, verdict_time,
                           vllm_requests_running, vllm_stall_fleet)

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
# The alert path: the vLLM rule's 1m window and 15s `for`, shortened as the adpfleet rules' are for theirs
# (test_stall_e2e); the window is the operator's own here, longer than vLLM's longest step.
ALERT_WINDOW, ALERT_FOR = WINDOW, 2
ALERTS_TOKEN = secrets.token_hex(16)


def vllm_fleet(model_dir: str, cache_dir: Path) -> dict:
    return vllm_stall_fleet(FLEET, model_dir, window=WINDOW, interval=INTERVAL, servers=2, budget=20,
                            auth={"apiKeySecret": {"name": "vf-key", "key": "key"}}, cache_dir=cache_dir)


@dataclass
class ServedFleet:
    fleets: Fleets
    op: OperatorProcess                       # the acting operator
    start: Callable[..., OperatorProcess]     # another operator of the module (operator_harness.operators)
    workdir: Path
    cache_dir: Path   # the servers' vllm.cache.hostPath
    started_s: float  # applied -> Ready
    ready_at: float   # time.time() when it was Ready


@pytest.fixture(scope="module")
def served(k8s_cluster, api_proxy, fleet_crd, tmp_path_factory, vllm_cache_dir, request):
    """The module's fleet, Ready, with the operator that watches it (both gone after the module)."""
    def failed() -> bool:
        return any(getattr(item, "rep_call", None) is None or item.rep_call.failed
                   for item in request.session.items if item.module is request.module)

    with fresh_namespace(k8s_cluster, "vllm-fleet-e2e") as ns:
        fleets = Fleets(k8s_cluster, ns)
        workdir = tmp_path_factory.mktemp("vllm-operator")
        with operators(api_proxy, ns, fleets, workdir, failed) as start:
            for name, value in (("vf-key", KEY), ("alerts-token", ALERTS_TOKEN)):
                fleets.core.create_namespaced_secret(ns, {"metadata": {"name": name}, "data": {
                    "key": base64.b64encode(value.encode()).decode()}})
            op = start()
            t0 = time.monotonic()
            fleets.apply(vllm_fleet(str(build_model()), vllm_cache_dir))
            fleets.wait_ready(FLEET, timeout=START_TIMEOUT_S + 120)  # + the model check of the init container
            yield ServedFleet(fleets, op, start, workdir, vllm_cache_dir, time.monotonic() - t0, time.time())
        # the last test leaves a replacement starting: its pod goes once its processes have exited, before the next
        # module (test_vllm_dp_e2e: its DP=2 engine 0 never showed 2 requests running to a /metrics read for a
        # minute beside it, in a clean-clone run)
        wait_for(lambda: not fleets.pods(FLEET), timeout=120, what="the fleet's server pods to be gone", interval=0.5)


def test_a_vllm_fleet_is_served_through_the_router_with_the_fleets_api_key(served):
    fleets = served.fleets
    pods = fleets.pods(FLEET, "aggregated")
    assert len(pods) == 2 and all(pod_ready(p) and p.metadata.labels["adpfleet.io/engine"] == "vllm" for p in pods)
    assert all(p.spec.containers[0].command == ["vllm"] for p in pods)
    # vLLM's cache root is the fleet's vllm.cache, and their start wrote it: its model inspection, which a
    # restarted server reads instead of redoing it (~15 CPU-seconds here: docs/operator.md, "vLLM fleets")
    assert list((served.cache_dir / "modelinfos").glob("*.json")), "vLLM wrote no model info into the cache"
    for p in pods:
        assert {e.name: e.value for e in p.spec.containers[0].env}["VLLM_CACHE_ROOT"] == names.VLLM_CACHE_DIR
        assert next(v for v in p.spec.volumes if v.name == names.VLLM_CACHE_VOLUME).host_path.path == \
            str(served.cache_dir)
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

def decided(fleets, victim: str, since: float):
    """(the remediation record of `victim` made after `since`, the Stalled condition, when seen): they come in
    one status write. (A record of an earlier test may name the same server: names are stable.)"""
    fleet = fleets.get(FLEET)
    record = next((r for r in remediations(fleet) if r["server"] == victim and parse_rfc3339(r["time"]) >= since),
                  None)
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


def busy_for_a_window(served: ServedFleet, load: Load) -> None:
    """Traffic through the router, a stall window of it: nothing flagged."""
    wait_for(lambda: load.completed_since(time.time() - 60) >= 4, timeout=180, what="traffic")
    time.sleep(WINDOW + 2 * INTERVAL)
    assert_nothing_flagged(served.fleets, served.op)


def freeze_and_see_it_healed(served: ServedFleet, before: dict, load: Load, origin: str = "scrape") -> dict:
    """Freeze a busy engine under `load`; the decision, made from `origin` (the operator's own scrapes, or the
    alert the record names), and the fleet serving on the peer. Returns the times."""
    fleets = served.fleets
    # a server whose engine runs 2 requests or more, its gauges still showing work once frozen
    watches = {name: ProgressWatch(p, engine=0) for name, p in before.items()}  # the victim's is kept
    victim, t_fault = processes.freeze_busy_pod({name: p.metadata.uid for name, p in before.items()}, ENGINE_CORE,
                                                lambda name: vllm_requests_running(before[name]))
    for name in before.keys() - {victim}:
        watches[name].stop()
    record, stalled, t_seen = wait_for(lambda: decided(fleets, victim, t_fault), timeout=120,
                                       what=f"a remediation of {victim}", interval=0.2)
    moved_until = watches[victim].last_moved()
    detected = verdict_time(served.op.log(), victim) - t_fault
    print(f"vLLM freeze -> hung verdict ({origin}): {detected:.1f} s, -> remediation record "
          f"{parse_rfc3339(record['time']) - t_fault:.1f} s; {stalled['message']}", flush=True)
    assert (record["action"], record["signature"], record["targets"]) == ("RestartServer", "hung", [victim])
    # the record says which path decided: an alert's name and fingerprint, or nothing for the operator's own
    assert (f"from {origin} (fingerprint " in record["message"]) if origin != "scrape" else \
        "from alert" not in record["message"], record["message"]
    assert stalled["status"] == "True" and victim in stalled["message"] and "hung, ranks 0" in stalled["message"]
    wait_for(lambda: load.completed_since(t_seen) >= 4, timeout=180, what="the fleet serving on its peer")
    return {"victim": victim, "fault": t_fault, "moved_until": moved_until, "detected": detected,
            "seen": t_seen - t_fault,
            "recorded": parse_rfc3339(record["time"]) - t_fault, "message": record["message"],
            "serving": time.time() - t_fault}


def assert_none_lost(outcomes: list) -> None:
    lost = [o for o in outcomes if o.kind == "lost"]
    assert not lost, f"requests without an answer by their deadline: {lost[:5]}"
    cut = [o for o in outcomes if o.kind == "error" and o.after_tokens and o.streamed]
    silent = [(round(o.start, 1), round(o.end, 1), o.detail) for o in cut
              if not o.detail.startswith("stream_error_event")]
    assert not silent, silent  # an explicit error, never a silent cut


def test_a_frozen_vllm_engine_is_hung_and_only_its_server_is_replaced_with_no_request_lost(served):
    t0, fleets, op = time.monotonic(), served.fleets, served.op
    before = {p.metadata.name: p for p in fleets.live_pods(FLEET, "aggregated")}
    assert len(before) == 2 and all(pod_ready(p) for p in before.values())
    time.sleep(max(0.0, served.ready_at + WINDOW + 2 * INTERVAL - time.time()))  # idle, just started: a window
    assert_nothing_flagged(fleets, op)

    url = fleets.router_url(FLEET)
    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline:
        with Load(url, clients=4, max_tokens=LONG_REQUEST_TOKENS, deadline=240, streaming=True, api_key=KEY) as load:
            busy_for_a_window(served, load)
            times = freeze_and_see_it_healed(served, before, load)
        assert_decided_in_time(op.log(), times["victim"], times["fault"], WINDOW, INTERVAL, times["moved_until"])
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
            # its progress resolved the restart: a later stall of this server starts the ladder again (the
            # alert-path test's operator, its own detection off, would not see the progress that resolves it)
            wait_for(lambda: [r["outcome"] for r in remediations(fleets.get(FLEET))] == ["Resolved"], timeout=30,
                     what="the restart Resolved by the replacement's progress")
    outcomes = load.outcomes + after.outcomes
    assert_none_lost(outcomes)
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
    print_failures(outcomes)


def print_failures(outcomes: list) -> None:
    for o in outcomes:
        if o.kind != "completed":
            print(f"  {o.kind} ({'streamed' if o.streamed else 'whole'}, {o.attempts} attempt(s)): {o.detail}")


# ---- the same freeze, decided by the alert path -------------------------------------------------------

def alert_path_operator(served: ServedFleet) -> OperatorProcess:
    """The acting operator replaced by one whose own stall detection is off, with the webhook's token: only
    Alertmanager's alerts can make it act (test_stall_e2e's start_op; one operator here, not elected)."""
    served.op.stop()
    served.op = served.start(name="alert-path-operator", extra_args=(
        "--stall-detection", "off", "--alerts-token-secret", f"{served.fleets.ns}/alerts-token:key"))
    return served.op


def stall_alerts(monitoring: Monitoring) -> list[dict]:
    """Every AdpfleetServerStalled Prometheus held, pending or firing, since it started: labels, and when it
    became active (ALERTS_FOR_STATE's value)."""
    held = monitoring.query('max_over_time(ALERTS_FOR_STATE{alertname="AdpfleetServerStalled"}[1h])')
    return [{**s["metric"], "active_at": float(s["value"][1])} for s in held]


def test_a_frozen_vllm_engine_is_remediated_from_the_alert_path_with_the_operators_own_detection_off(served):
    t0, fleets = time.monotonic(), served.fleets
    before = {p.metadata.name: p for p in fleets.live_pods(FLEET, "aggregated")}
    assert len(before) == 2 and all(pod_ready(p) for p in before.values())
    op = alert_path_operator(served)
    monitoring = Monitoring(served.workdir, fleets.core, fleets.ns, f"http://127.0.0.1:{op.port}/alerts",
                            ALERTS_TOKEN, rules=short_window_rules(ALERT_WINDOW, ALERT_FOR)).start()
    try:
        wait_for(lambda: monitoring.targets_up() == 2, timeout=60, what="Prometheus scraping both servers")
        with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline:
            with Load(fleets.router_url(FLEET), clients=4, max_tokens=LONG_REQUEST_TOKENS, deadline=240,
                      streaming=True, api_key=KEY) as load:
                times = freeze_and_see_it_healed(served, before, load, origin="alert AdpfleetServerStalled")
            victim = times["victim"]
            first = {p.metadata.uid for p in before.values()}
            # the load ended (the victim's requests with its pod): its replacement is created; not waited Ready
            wait_for(lambda: [n for n, uid in timeline.created if uid not in first], timeout=60,
                     what=f"a new {victim}")
        alerts = stall_alerts(monitoring)
    finally:
        monitoring.stop()
    assert_none_lost(load.outcomes)
    assert [name for name, uid in timeline.created if uid not in first] == [victim], timeline.created  # only it
    (peer,) = set(before) - {victim}
    assert before[peer].metadata.uid in {p.metadata.uid for p in fleets.live_pods(FLEET)}
    # the adpfleet-vllm rule, on the frozen engine alone: never on the peer, busy throughout
    assert [(a["pod"], a["engine"], a["fleet_engine"]) for a in alerts] == [(victim, "0", "vllm")], alerts
    assert op.metric("adpfleet_operator_alerts_received_total", result="accepted") >= 1
    assert op.metric("adpfleet_operator_scrapes_total") == 0  # its own detection stayed off
    restarting = [e for e in fleets.events("RestartingServer") if "from alert AdpfleetServerStalled" in e.message]
    assert len(restarting) == 1 and victim in restarting[0].message, restarting
    active = alerts[0]["active_at"] - times["fault"]
    counts = {kind: sum(1 for o in load.outcomes if o.kind == kind) for kind in ("completed", "error", "lost")}
    print(f"vLLM freeze (alert path) -> alert pending {active:.1f} s, firing {active + ALERT_FOR:.1f} s "
          f"(rule window {ALERT_WINDOW} s, for {ALERT_FOR} s) -> the operator's re-checked verdict "
          f"{times['detected']:.1f} s -> remediation record {times['recorded']:.1f} s; freeze -> serving on the peer "
          f"{times['serving']:.1f} s; load {counts}, {sum(1 for o in load.outcomes if o.attempts > 1)} retried by "
          f"the router; test wall {time.monotonic() - t0:.1f} s", flush=True)
    print_failures(load.outcomes)
