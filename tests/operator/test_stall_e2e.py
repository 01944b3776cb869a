"""Stall detection and remediation end to end, all real and on loopback: the control plane, the node
agent running every pod as processes, the operator, a fleet of real servers (faults injected over
HTTP) behind the real router under a steady client load, and — for the alert path — real
Prometheus scraping the pods with the chart's rule file (its stall windows shortened:
tests/alert_windows.py) and real Alertmanager calling the operator's webhook.

One fleet serves the whole module (servers take a while to start on two cores); each test leaves
it healthy. Every client request must complete or end with an explicit error — none lost.
"""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from kubernetes import client

from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names

from adpfleet.operator.decisions.history import parse_rfc3339
from adpfleet.operator.decisions.leadership import Timing

from alert_windows import short_window_rules
from operator_harness import Fleets, OperatorProcess, PodTimeline, pod_ready
from stall_harness import Load, Monitoring, inject, inject_as_documented, remediations, stall_fleet

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.multiproc]

FLEET = "stalls"
WINDOW, INTERVAL = 4, 1
ALERT_WINDOW, ALERT_FOR = 10, 2  # the stall rules' 1m and 15s, shortened; Prometheus scrapes every second
TOKEN = secrets.token_hex(16)
ELECTION = Timing(lease_duration=6, renew_deadline=4, retry_period=1)  # the operators run elected, as the chart's do


@pytest.fixture(scope="module")
def env(k8s_cluster, fleet_crd, api_proxy, tmp_path_factory):
    """(fleets, operator holder, workdir): a namespace with the token Secret and the module's fleet."""
    workdir = tmp_path_factory.mktemp("stall-e2e")
    ns = f"stall-e2e-{secrets.token_hex(3)}"
    core = k8s_cluster.core
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    wait_for(lambda: core.read_namespaced_service_account("default", ns), timeout=30, what="default SA")
    core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="alerts-token"),
                                                      string_data={"token": TOKEN}))
    fleets = Fleets(k8s_cluster, ns)
    holder = {"op": None, "ns": ns, "proxy": api_proxy, "workdir": workdir, "started": []}
    start_op(holder)
    fleets.apply(stall_fleet(FLEET, window=WINDOW, interval=INTERVAL))
    fleets.wait_ready(FLEET, timeout=300)
    yield fleets, holder, workdir
    try:
        fleets.delete(FLEET)
        wait_for(lambda: not fleets.custom.list_namespaced_custom_object(
            names.GROUP, names.VERSION, ns, names.PLURAL)["items"], timeout=60, what="the fleet to be deleted")
    finally:
        for op in holder["started"]:
            op.stop()
        print(f"---- operator log ----\n{holder['op'].log()[-15000:]}")
        core.delete_namespace(ns)


def elected_op(holder, name: str, *extra: str) -> OperatorProcess:
    """An operator replica with leader election (started: the leader, or a standby when one leads)."""
    op = OperatorProcess(holder["proxy"], holder["workdir"], ["--namespace", holder["ns"]], name=name,
                         extra_args=("--alerts-token-secret", f"{holder['ns']}/alerts-token", "--log-format",
                                     "plain", "--leader-elect", "--leader-election-namespace", holder["ns"],
                                     "--lease-duration", str(ELECTION.lease_duration),
                                     "--renew-deadline", str(ELECTION.renew_deadline),
                                     "--retry-period", str(ELECTION.retry_period), *extra))
    holder["started"].append(op)
    return op.start()


def start_op(holder, *extra: str) -> OperatorProcess:
    """Replace the acting operator (a stopped leader hands the Lease over: the new one leads at once)."""
    if holder["op"] is not None and holder["op"].running():
        holder["op"].stop()
    op = elected_op(holder, "operator", *extra)
    wait_for(lambda: op.role() == "leader", timeout=3 * ELECTION.retry_period + 10, what="the new operator to lead")
    holder["op"] = op
    return op


def server(fleets: Fleets, role: str):
    pods = fleets.live_pods(FLEET, role)
    assert len(pods) == 1, [p.metadata.name for p in pods]
    return pods[0]


def wait_healthy_fleet(fleets: Fleets, timeout: float = 240) -> None:
    wait_for(lambda: all(len(fleets.live_pods(FLEET, r)) == 1 and pod_ready(server(fleets, r))
                         for r in ("context", "generation")), timeout=timeout, what="both servers Ready")
    fleets.wait_ready(FLEET, timeout=timeout)


def wait_flowing(load: Load, n: int = 3, timeout: float = 120) -> None:
    t = time.time()
    wait_for(lambda: load.completed_since(t) >= n, timeout=timeout, what=f"{n} completions through the router")


def record_for(fleets: Fleets, pod_name: str, since: float, outcome: str | None = None) -> dict | None:
    for r in remediations(fleets.get(FLEET)):
        if r["server"] == pod_name and parse_rfc3339(r["time"]) >= since and (outcome is None or
                                                                              r["outcome"] == outcome):
            return r
    return None


def wait_restarts_settled(fleets: Fleets, timeout: float = 120) -> None:
    """Until no restart of the fleet is still underway or unresolved (Pending, Succeeded): the
    restarted servers made progress again. A stall of a server whose last restart is unresolved
    climbs the escalation ladder (its peers, then Halt) instead of restarting it again: a test that
    expects a plain RestartServer waits for this first."""
    wait_for(lambda: not [r for r in remediations(fleets.get(FLEET)) if r["action"].startswith("Restart")
                          and r["outcome"] in ("Pending", "Succeeded")],
             timeout=timeout, what="every restart resolved (its server made progress again)")


def assert_none_lost(load: Load) -> None:
    counts = load.counts()
    lost = [o for o in load.outcomes if o.kind == "lost"]
    assert not lost, f"requests without an answer by their deadline: {lost[:5]} ({counts})"
    assert counts["completed"] > 0, counts


# ---- no false positives ------------------------------------------------------------------------

def test_a_healthy_busy_fleet_and_an_idle_fleet_get_no_actions(env):
    fleets, holder, _ = env
    uids = {p.metadata.uid for p in fleets.live_pods(FLEET)}
    start = time.time()
    with Load(fleets.router_url(FLEET), clients=3) as load:
        wait_flowing(load)
        time.sleep(3 * WINDOW)  # busy for three windows
    assert_none_lost(load)
    time.sleep(3 * WINDOW)  # idle for three windows
    op = holder["op"]
    assert op.metric("adpfleet_operator_stalls_detected_total") == 0
    assert op.metric("adpfleet_operator_remediations_total") == 0
    assert remediations(fleets.get(FLEET)) == []
    assert {p.metadata.uid for p in fleets.live_pods(FLEET)} == uids
    assert fleets.condition(FLEET, "Stalled")["status"] == "False"
    assert not [e for e in fleets.events() if e.reason in ("StallDetected", "RestartingServer")
                and e.last_timestamp and e.last_timestamp.timestamp() >= start]
    assert op.metric("adpfleet_operator_servers", state="Idle") == 2


# ---- Auto: each fault, the right server, progress resumes ----------------------------------------

FAULTS = [  # (fault, rank, role of the server it is injected in, expected signature)
    ("starve", 1, "context", "vetoed"),
    ("freeze", 0, "generation", "hung"),
    ("stop-reaping", 0, "context", "transfer"),
]


@pytest.mark.parametrize("fault, rank, role, signature", FAULTS, ids=[f[0] for f in FAULTS])
def test_auto_detects_the_fault_and_restarts_the_right_server_under_load(env, fault, rank, role, signature):
    fleets, holder, _ = env
    wait_healthy_fleet(fleets)
    victim = server(fleets, role)
    other = server(fleets, "generation" if role == "context" else "context")
    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline, Load(fleets.router_url(FLEET), clients=4) as load:
        wait_flowing(load)
        wait_restarts_settled(fleets)
        t_fault = time.time()
        inject(fleets.core, victim, fault, rank)
        record = wait_for(lambda: record_for(fleets, victim.metadata.name, t_fault, "Succeeded"), timeout=120,
                          what=f"a Succeeded remediation of {victim.metadata.name}")
        assert record["action"] == "RestartServer" and record["signature"] == signature, record
        assert record["targets"] == [victim.metadata.name]
        assert "evidence:" in record["message"] and "real_tokens_delta=0" in record["message"]
        wait_healthy_fleet(fleets)
        t_back = time.time()
        wait_flowing(load, n=3, timeout=120)  # progress resumed
    assert_none_lost(load)
    # exactly the victim was replaced, once; its peer kept its pod
    replaced = [name for name, _ in timeline.created if name == victim.metadata.name]
    assert len(replaced) == 2, timeline.created
    assert other.metadata.uid in {p.metadata.uid for p in fleets.live_pods(FLEET)}
    events = {e.reason for e in fleets.events()}
    assert {"StallDetected", "RestartingServer", "Remediated"} <= events
    print(f"{fault}: remediated in {t_back - t_fault:.1f} s; load {load.counts()}")


# ---- DryRun, then the budget ----------------------------------------------------------------------

def test_dry_run_reports_the_stall_and_deletes_nothing(env):
    fleets, holder, _ = env
    wait_healthy_fleet(fleets)
    fleets.patch_spec(FLEET, {"remediation": {"mode": "DryRun"}})
    victim = server(fleets, "context")
    with Load(fleets.router_url(FLEET), clients=3) as load:
        wait_flowing(load)
        t_fault = time.time()
        inject_as_documented(fleets.cluster, victim, "starve", 1)  # docs/remediation.md's commands, as a user runs them
        record = wait_for(lambda: record_for(fleets, victim.metadata.name, t_fault, "DryRun"), timeout=90,
                          what="a DryRun record")
        assert record["action"] == "RestartServer" and record["message"].startswith("would RestartServer")
        stalled = wait_for(lambda: fleets.condition(FLEET, "Stalled") if fleets.condition(FLEET, "Stalled").get(
            "status") == "True" else None, timeout=30, what="Stalled=True")
        assert victim.metadata.name in stalled["message"] and "vetoed" in stalled["message"]
        assert any(e.reason == "RemediationDryRun" for e in fleets.events())
        time.sleep(2 * WINDOW)
        assert server(fleets, "context").metadata.uid == victim.metadata.uid  # nothing deleted
        assert not server(fleets, "context").metadata.annotations.get(names.ANNOTATION_DRAIN)
        # back to Auto: the same stall is remediated
        fleets.patch_spec(FLEET, {"remediation": {"mode": "Auto"}})
        wait_for(lambda: record_for(fleets, victim.metadata.name, t_fault, "Succeeded"), timeout=120,
                 what="the stall remediated once the mode is Auto")
        wait_healthy_fleet(fleets)
        wait_flowing(load)
    assert_none_lost(load)


def test_an_exhausted_budget_degrades_the_fleet_and_only_emits_events(env):
    fleets, holder, _ = env
    wait_healthy_fleet(fleets)
    with Load(fleets.router_url(FLEET), clients=3) as load:  # progress resolves the earlier tests' restarts
        wait_flowing(load)
        wait_restarts_settled(fleets)
    used = sum(1 for r in remediations(fleets.get(FLEET)) if r["action"].startswith("Restart")
               and r["outcome"] in ("Succeeded", "Resolved", "Failed", "Pending"))
    fleets.patch_spec(FLEET, {"remediation": {"budgetPerHour": used + 1}})  # room for one more action
    victim = server(fleets, "context")
    with Load(fleets.router_url(FLEET), clients=3) as load:
        wait_flowing(load)
        inject(fleets.core, victim, "starve", 1)
        wait_for(lambda: server(fleets, "context").metadata.uid != victim.metadata.uid, timeout=120,
                 what="the last action the budget allows")
        degraded = wait_for(lambda: fleets.condition(FLEET, "Degraded") if fleets.condition(FLEET, "Degraded").get(
            "reason") == "RemediationBudgetExhausted" else None, timeout=60,
            what="Degraded RemediationBudgetExhausted")
        assert degraded["status"] == "True"
        assert holder["op"].metric("adpfleet_operator_remediation_budget_exhausted", fleet=FLEET) == 1
        wait_healthy_fleet(fleets)
        wait_flowing(load)
        wait_restarts_settled(fleets)  # the next stall of this server is a new one, not an escalation
        # the next stall: Events only, nothing deleted
        victim = server(fleets, "context")
        inject(fleets.core, victim, "starve", 1)
        wait_for(lambda: any(e.reason == "RemediationBudgetExhausted" for e in fleets.events()), timeout=60,
                 what="a RemediationBudgetExhausted Event")
        time.sleep(WINDOW)
        assert server(fleets, "context").metadata.uid == victim.metadata.uid
        # more budget: the stall is remediated, Degraded clears
        fleets.patch_spec(FLEET, {"remediation": {"budgetPerHour": 20}})
        wait_for(lambda: server(fleets, "context").metadata.uid != victim.metadata.uid, timeout=120,
                 what="the stalled server restarted once budget is available")
        wait_healthy_fleet(fleets)
        wait_flowing(load)
    wait_for(lambda: fleets.condition(FLEET, "Degraded").get("status") == "False", timeout=30,
             what="Degraded cleared")
    assert_none_lost(load)


# ---- the leader killed in the middle of a remediation: the standby finishes it --------------------

def test_a_leader_killed_mid_remediation_is_replaced_by_the_standby_without_a_duplicate_action(env):
    fleets, holder, _ = env
    wait_healthy_fleet(fleets)
    standby = elected_op(holder, "standby")
    assert standby.role() == "standby"
    victim = server(fleets, "context")
    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline, Load(fleets.router_url(FLEET), clients=3) as load:
        wait_flowing(load)
        wait_restarts_settled(fleets)
        t_fault = time.time()
        inject(fleets.core, victim, "starve", 1)
        wait_for(lambda: record_for(fleets, victim.metadata.name, t_fault), timeout=90, what="the remediation record")
        holder["op"].kill()  # no goodbye, no Lease handed back: SIGKILL right after the decision was recorded
        killed = time.monotonic()
        wait_for(lambda: standby.role() == "leader", timeout=ELECTION.takeover_bound + 5, interval=0.2,
                 what="the standby to take over")
        took = time.monotonic() - killed
        assert took <= ELECTION.takeover_bound, f"takeover took {took:.1f} s (bound {ELECTION.takeover_bound:g} s)"
        holder["op"] = standby
        record = wait_for(lambda: record_for(fleets, victim.metadata.name, t_fault, "Succeeded"), timeout=120,
                          what="the remediation finished by the new leader")
        wait_healthy_fleet(fleets)
        time.sleep(2 * WINDOW)  # the new operator must not act again on the same stall
        wait_flowing(load)
    assert_none_lost(load)
    assert [name for name, _ in timeline.created].count(victim.metadata.name) == 2, timeline.created
    mine = [r for r in remediations(fleets.get(FLEET)) if r["server"] == victim.metadata.name
            and r["time"] >= record["time"]]
    assert len(mine) == 1, mine
    print(f"leader SIGKILLed mid-remediation: the standby led after {took:.1f} s and finished it, once")


# ---- the alert path: Prometheus → Alertmanager → webhook → the same policy --------------------------

def test_the_alert_path_remediates_with_the_operators_own_detection_off(env):
    fleets, holder, workdir = env
    wait_healthy_fleet(fleets)
    op = start_op(holder, "--stall-detection", "off")
    webhook = f"http://127.0.0.1:{op.port}/alerts"
    # bad input first: the operator answers and keeps running
    assert httpx.post(webhook, json={"version": "4", "alerts": []}).status_code == 401
    assert httpx.post(webhook, content=b"{", headers={"Authorization": f"Bearer {TOKEN}",
                                                      "Content-Type": "application/json"}).status_code == 400
    assert httpx.post(webhook, content=b"{}", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 415

    monitoring = Monitoring(workdir, fleets.core, fleets.ns, webhook, TOKEN,
                            rules=short_window_rules(ALERT_WINDOW, ALERT_FOR)).start()
    try:
        wait_for(lambda: monitoring.targets_up() == 2, timeout=60, what="Prometheus scraping both servers")
        victim = server(fleets, "context")
        # A request caught on the starved server is answered by its replacement: after the rule's
        # window without tokens and its `for`, Alertmanager, the operator's re-check, the drain and
        # the restart. Still every one answered.
        with Load(fleets.router_url(FLEET), clients=3, deadline=240) as load:
            wait_flowing(load)
            # the rule judges the victim (its series a window old) and has seen it make progress
            pod = f'{{pod="{victim.metadata.name}"}}'
            progress = (f"sum(increase(adpfleet_prompt_tokens_total{pod}[{ALERT_WINDOW}s])) > 0"
                        f" and sum(adpfleet_requests_running{pod} offset {ALERT_WINDOW}s)")
            wait_for(lambda: monitoring.query(progress), timeout=60, what="Prometheus judging the victim's progress")
            t_fault = time.time()
            inject(fleets.core, victim, "starve", 1)
            firing = wait_for(lambda: [a for a in monitoring.alerts() if a["state"] == "firing"
                                       and a["labels"]["alertname"] == "AdpfleetServerStalled"], timeout=150,
                              what="AdpfleetServerStalled firing in Prometheus")
            assert firing[0]["labels"]["pod"] == victim.metadata.name
            record = wait_for(lambda: record_for(fleets, victim.metadata.name, t_fault, "Succeeded"), timeout=90,
                              what="the alert-driven remediation")
            assert "from alert Adpfleet" in record["message"], record
            wait_healthy_fleet(fleets)
            wait_flowing(load)
        assert_none_lost(load)
        assert op.metric("adpfleet_operator_alerts_received_total", result="accepted") >= 1
        assert op.metric("adpfleet_operator_scrapes_total") == 0  # its own detection stayed off
        # a flood of duplicates of the same firing alert: acted on once
        dup = {"version": "4", "status": "firing", "alerts": [{
            "status": "firing", "labels": {"alertname": "AdpfleetServerStalled", "namespace": fleets.ns,
                                           "fleet": FLEET, "pod": victim.metadata.name},
            "annotations": {}, "startsAt": "2024-01-01T00:00:00Z", "fingerprint": "e2e-dup"}]}
        codes = {httpx.post(webhook, json=dup, headers={"Authorization": f"Bearer {TOKEN}"}).status_code
                 for _ in range(30)}
        assert codes == {202}
        assert op.running()
    finally:
        monitoring.stop()
        start_op(holder)  # own detection back on for whatever runs next


# ---- transfer stalls are the puller's or the server's own: two generation servers ----------------

def test_two_sided_transfer_faults_restart_only_the_server_at_fault(env):
    """A frozen generation rank leaves KV held for it on the context server: that is the generation
    server's symptom, so only it restarts (its sibling and the context server keep their pods). A
    context server that takes pulls and never answers them is the one at fault: only it restarts.
    Runs last: it leaves the module's fleet with two generation servers."""
    fleets, holder, _ = env
    wait_healthy_fleet(fleets)
    fleets.patch_spec(FLEET, {"generation": {"servers": 2}})
    wait_for(lambda: len([p for p in fleets.live_pods(FLEET, "generation") if pod_ready(p)]) == 2,
             timeout=240, what="two generation servers Ready")
    fleets.wait_ready(FLEET, timeout=120)
    frozen = min(fleets.live_pods(FLEET, "generation"), key=lambda p: p.metadata.name)
    ctx = server(fleets, "context")
    uids = lambda: {p.metadata.name: p.metadata.uid for p in fleets.live_pods(FLEET)}  # noqa: E731

    decided: dict[str, float] = {}  # fault -> seconds from its injection to the remediation's record

    def fault(pod, kind: str, signature: str, ranks: tuple[int, ...] = (0,)) -> float:
        """Injects `kind` into `pod`'s `ranks` under flowing load, waits (up to 120 s) for the one
        remediation it calls for and every server Ready again; asserts no other server was replaced.
        Returns the time of the injection."""
        wait_flowing(load)
        wait_restarts_settled(fleets)
        others = lambda: {n: u for n, u in uids().items() if n != pod.metadata.name}  # noqa: E731
        before, since = others(), time.time()
        for rank in ranks:
            inject(fleets.core, pod, kind, rank)
        print(f"{kind} injected into {pod.metadata.name} at {since:.1f}; load {load.counts()}")
        record = wait_for(lambda: record_for(fleets, pod.metadata.name, since, "Succeeded"), timeout=120,
                          what=f"a Succeeded remediation of {pod.metadata.name}")
        assert (record["action"], record["signature"], record["targets"]) == (
            "RestartServer", signature, [pod.metadata.name]), record
        wait_for(lambda: len([p for p in fleets.live_pods(FLEET) if pod_ready(p)]) == 3, timeout=240,
                 what="all three servers Ready")
        fleets.wait_ready(FLEET, timeout=120)
        assert others() == before, f"{kind} on {pod.metadata.name}: another server was restarted"
        decided[kind] = parse_rfc3339(record["time"]) - since
        return since

    # The client waits as long as these faults can make the fleet take to answer: a request may wait on the
    # context server for KV that the frozen server's pulls hold until their lease ends (60 s), and one
    # caught by the wedge waits out a pull's timeout (30 s) in each of the router's three attempts, all
    # on the one context server there is. With the default 90 s, a CI run lost 3 of 1,889 requests.
    with Load(fleets.router_url(FLEET), clients=4, deadline=240) as load:
        t_freeze = fault(frozen, "freeze", "hung")  # the context server keeps the KV held for it
        # Both ranks' transfer servers wedge, so every request the context server prefills then waits on a
        # pull it never answers: within one request's time it has transfers in flight and none complete,
        # while the generation servers wait on it. (Rank 0 alone left rank 1 serving, and the server made
        # progress until every client happened to wait on rank 0: up to 105 s after the injection on loaded
        # lanes, and the test took 40-200 s.)
        t_wedge = fault(ctx, "stop-serving-kv", "transfer", ranks=(0, 1))
        wait_flowing(load)
    assert_none_lost(load)
    at_fault = lambda r: r["server"] == frozen.metadata.name or (  # noqa: E731
        r["server"] == ctx.metadata.name and parse_rfc3339(r["time"]) >= t_wedge)
    collateral = [r for r in remediations(fleets.get(FLEET)) if parse_rfc3339(r["time"]) >= t_freeze
                  and not at_fault(r)]
    assert collateral == [], collateral
    print(f"two-sided transfer faults: {load.counts()}, 0 collateral restarts; decided after (s): "
          + ", ".join(f"{kind} {took:.1f}" for kind, took in decided.items()))
