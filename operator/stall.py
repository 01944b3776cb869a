"""The stall controller: one loop per fleet that scrapes, judges, decides, acts and reports.

    every scrape interval (or at once when an alert for the fleet arrives):
      scrape every Ready server's /metrics  ─► detection.judge ─► verdicts      (own detection)
      take the fleet's queued alerts        ─► fresh scrapes  ─► verdicts       (Alertmanager)
      remediation.decide(verdicts, history, spec, pods, now) ─► decisions       (one path, two inputs)
      decisions ─► records in status.recentRemediations, Events, metrics, and for each action a
                   task: record Pending ─► drain ─► delete the pod(s) ─► record the result

Status has one writer, the fleet's reconcile pass: this controller keeps what it owns (the Stalled
and Remediating conditions, recentRemediations, a Degraded reason of its own) in memory, wakes the
reconcile loop, and `RemediatingReconciler` lays it over the status the pass writes. An action
starts only once its Pending record is in the API server, so an operator restarted mid-action finds
it there and finishes it (deleting only pods older than the decision) instead of acting twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import httpx
from kubernetes import client
from prometheus_client import CollectorRegistry, Counter, Gauge

from adpfleet.operator.adapters.kube import KubeApi, Outcome, now_rfc3339
from adpfleet.operator.alerts import AlertInbox, StallAlert
from adpfleet.operator.decisions import conditions as fleet_conditions
from adpfleet.operator.decisions.desired import FleetRef
from adpfleet.operator.decisions.observed import FleetObservation, ServerPod
from adpfleet.operator.detection import (SampleWindows, Scrape, State, StallVerdict, evidence_text, judge,
                                         keep_seconds)
from adpfleet.operator.reconciler import Reconciler
from adpfleet.operator.remediation import (Action, Decision, Outcome as RecordOutcome, Plan, Remediation,
                                           ServerView, Verdict, budget_used, decide, degraded_problem,
                                           history_from_status, resolved, restarts_in_progress, rfc3339,
                                           stall_conditions,
                                           still_to_delete, with_records)
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.scrape import metrics_url, scrape

log = logging.getLogger("adpfleet.operator.stall")

Key = tuple[str, str]
CONFIRMATIONS = 2              # consecutive scrapes that must agree before a stall is acted on
PERSIST_TIMEOUT_SECONDS = 15.0  # how long an action waits for its Pending record to reach the API
STALLED_DRAIN_GRACE_SECONDS = 2.0  # a stalled server finishes nothing: drained this long, then restarted
STALLED_DELETE_GRACE_SECONDS = 5   # its pod's termination grace (a working peer keeps its own)
EVENT_REPEAT_SECONDS = 60.0    # the same skip of the same server is reported at most this often
ALERT_VERDICT_TTL_FACTOR = 1.0  # an alert's re-check stands for one stall window


class StallMetrics:
    """The remediation controller's part of the operator's /metrics."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.stalls = Counter("adpfleet_operator_stalls_detected_total", "Stalls confirmed (once per stalled "
                              "server incarnation), by signature.", ["fleet_namespace", "fleet", "signature"],
                              registry=r)
        self.remediations = Counter("adpfleet_operator_remediations_total", "Remediation decisions by action and "
                                    "result (Succeeded, Failed, Recovered, DryRun, Halted, or why it was skipped).",
                                    ["action", "result"], registry=r)
        self.scrapes = Counter("adpfleet_operator_scrapes_total", "Scrapes of servers' /metrics, by result.",
                               ["result"], registry=r)
        self.alerts = Counter("adpfleet_operator_alerts_received_total", "Alerts received on the webhook, by "
                              "result.", ["result"], registry=r)
        self.servers = Gauge("adpfleet_operator_servers", "Servers by their latest verdict.",
                             ["fleet_namespace", "fleet", "state"], registry=r)
        self.budget_exhausted = Gauge("adpfleet_operator_remediation_budget_exhausted", "1 while the fleet's "
                                      "remediation budget for the hour is used up.", ["fleet_namespace", "fleet"],
                                      registry=r)
        self.halted = Gauge("adpfleet_operator_remediation_halted", "1 while escalation has halted the fleet's "
                            "remediation.", ["fleet_namespace", "fleet"], registry=r)

    def forget(self, key: Key) -> None:
        for gauge in (self.budget_exhausted, self.halted):
            try:
                gauge.remove(*key)
            except KeyError:
                pass
        for state in State:
            try:
                self.servers.remove(*key, state.value)
            except KeyError:
                pass


class RemediationApi(KubeApi):
    """The few requests remediation makes beyond the reconciler's."""

    async def set_drain(self, namespace: str, name: str, uid: str, drain: bool) -> Outcome:
        # metadata.uid in a patch is a precondition: a replacement with the same name is left alone
        body = {"metadata": {"uid": uid, "annotations": {names.ANNOTATION_DRAIN: "true" if drain else None}}}
        return await self._call("patch", "pods", self.core.patch_namespaced_pod, name, namespace, body,
                                ok_codes=(404,))

    async def delete_pod_within(self, namespace: str, name: str, uid: str, grace_seconds: int | None) -> Outcome:
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid),
                                      grace_period_seconds=grace_seconds)
        return await self._call("delete", "pods", self.core.delete_namespaced_pod, name, namespace, body=body,
                                ok_codes=(404, 409))

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        import base64
        out = await self._call("get", "secrets", self.core.read_namespaced_secret, name, namespace, ok_codes=(404,))
        if not out.ok or out.body is None:
            return None
        data = out.body.data or {}
        if key in data:
            return base64.b64decode(data[key]).decode().strip()
        return ((out.body.string_data or {}).get(key) or "").strip() or None


@dataclass
class SecretToken:
    """The webhook's bearer token from a Secret, re-read every `ttl` seconds (rotation)."""
    api: RemediationApi
    namespace: str
    name: str
    key: str = "token"
    ttl: float = 10.0
    _value: str | None = None
    _read_at: float = -1e9

    async def get(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at > self.ttl or self._value is None:
            self._value = await self.api.secret_value(self.namespace, self.name, self.key)
            self._read_at = now
        return self._value


@dataclass
class FleetStall:
    """One fleet's memory between ticks. Lost on restart by design: what must survive is in status."""
    ref: FleetRef
    observe: Callable[[], FleetObservation]
    logger: logging.Logger
    windows: SampleWindows = field(default_factory=SampleWindows)
    verdicts: dict[str, StallVerdict] = field(default_factory=dict)
    alert_verdicts: dict[str, tuple[StallVerdict, float]] = field(default_factory=dict)  # server -> (v, until)
    local: dict[tuple, Remediation] = field(default_factory=dict)  # records not yet seen in the cached status
    plan: Plan = field(default_factory=Plan)
    mode: str = "Auto"
    counted: set[tuple[str, str]] = field(default_factory=set)  # (server, pod uid) stalls already counted
    last_event: dict[tuple[str, str], float] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    persisted: set[tuple] = field(default_factory=set)  # (record key, outcome) known to be in the API
    persisted_changed: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    resumed: bool = False
    published: object = None
    unreachable_since: dict[str, float] = field(default_factory=dict)
    unreachable_reported: set[str] = field(default_factory=set)


class StallController:
    def __init__(self, api: RemediationApi, metrics: StallMetrics, inbox: AlertInbox,
                 wake_reconcile: Callable[[Key], None], *, detection: bool = True, clock: Callable[[], float] = time.time,
                 scraper=None):
        self.api = api
        self.metrics = metrics
        self.inbox = inbox
        self.wake_reconcile = wake_reconcile
        self.detection = detection
        self.clock = clock
        self.fleets: dict[Key, FleetStall] = {}
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), follow_redirects=False)
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per scrape otherwise
        inbox.on_put = self._alert_arrived
        self._scraper = scraper  # (url, timeout) -> Scrape; tests script it

    async def _scrape(self, pod: ServerPod, timeout: float) -> Scrape:
        if self._scraper is not None:
            return await self._scraper(metrics_url(pod.ip), timeout)
        return await scrape(self.http, metrics_url(pod.ip), timeout, self.clock)

    def fleet_known(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self.fleets

    def _alert_arrived(self, key: Key) -> None:
        fleet = self.fleets.get(key)
        if fleet is not None:
            fleet.wake.set()

    # ---- the loop (a kopf daemon per fleet) ------------------------------------------------------

    async def run(self, key: Key, ref: FleetRef, observe: Callable[[], FleetObservation], stopped,
                  logger: logging.Logger) -> None:
        fleet = self.fleets[key] = FleetStall(ref, observe, logger)
        try:
            while not stopped:
                fleet.wake.clear()
                started = time.monotonic()
                interval = 5.0
                try:
                    interval = await self.tick(key, fleet)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - a bug or an API surprise: logged, never fatal
                    logger.exception("stall check failed; retrying")
                delay = max(0.0, interval - (time.monotonic() - started))
                waiters = [asyncio.ensure_future(fleet.wake.wait()), asyncio.ensure_future(stopped.wait(delay))]
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
        finally:
            for task in list(fleet.tasks):  # an action in flight is finished by the next operator
                task.cancel()
            self.fleets.pop(key, None)
            self.metrics.forget(key)

    async def tick(self, key: Key, fleet: FleetStall) -> float:
        """One pass; the seconds until the next."""
        obs = fleet.observe()
        try:
            spec = FleetSpec.model_validate(obs.spec or {})
        except Exception:  # noqa: BLE001 - the reconciler reports an invalid spec
            return 5.0
        interval = float(spec.monitoring.scrape_interval_seconds)
        window = float(spec.remediation.stall_window_seconds)
        fleet.mode = spec.remediation.mode
        now = self.clock()
        pods = [p for role in names.ROLES for p in obs.role_pods(role)]
        servers = [ServerView(p.name, p.role, p.ready, p.terminating, p.created) for p in pods]
        history = self._history(fleet, obs)
        alerts = self.inbox.take(*key)

        if spec.remediation.mode == "Disabled":
            fleet.windows.retain(())
            fleet.verdicts, fleet.alert_verdicts = {}, {}
            for alert in alerts:
                await self._event(fleet, "Normal", "AlertIgnored", f"{alert.source} for {alert.pod}: "
                                  f"remediation.mode is Disabled", alert.pod)
            fleet.plan = Plan(mode="Disabled")
            self._publish(key, fleet, obs)
            return interval

        if not fleet.resumed:
            fleet.resumed = True
            self._resume(key, fleet, history, pods, spec)
        await self._finish_recoveries(fleet, history, pods)

        judged = [p for p in pods if p.phase == "Running" and p.ready and not p.terminating and p.ip]
        fleet.windows.retain(p.name for p in judged)
        if self.detection:
            scrapes = await asyncio.gather(*(self._scrape(p, min(max(1.0, interval * 0.8), 5.0)) for p in judged))
            keep = keep_seconds(window, interval, CONFIRMATIONS)
            verdicts = {}
            for pod, sample in zip(judged, scrapes):
                self.metrics.scrapes.labels("ok" if sample.ok else "failed").inc()
                fleet.windows.add(pod.name, pod.uid, sample, keep_seconds=keep)
                verdicts[pod.name] = judge(pod.name, pod.role, fleet.windows.samples(pod.name),
                                           window_seconds=window, interval_seconds=interval,
                                           confirmations=CONFIRMATIONS)
            fleet.verdicts = verdicts
            await self._report_unreachable(fleet, verdicts, window)
        else:
            fleet.verdicts = {}

        sources = {}
        for alert in alerts:
            verdict = await self._recheck(fleet, alert, judged, interval)
            if verdict is not None:
                fleet.alert_verdicts[alert.pod] = (verdict, self.clock() + window * ALERT_VERDICT_TTL_FACTOR)
                sources[alert.pod] = alert.source
        now = self.clock()
        fleet.alert_verdicts = {s: (v, until) for s, (v, until) in fleet.alert_verdicts.items()
                                if until > now and any(p.name == s for p in judged)}
        pods_by_name = {p.name: p for p in pods}
        fleet.counted &= {(p.name, p.uid) for p in pods}  # stall episodes of pods that still exist
        for verdict in list(fleet.verdicts.values()) + [v for v, _ in fleet.alert_verdicts.values()]:
            await self._count_stall(key, fleet, verdict, pods_by_name)

        done = resolved(history, list(fleet.verdicts.values()), servers)
        for record in done:
            fleet.local[record.key()] = record
        if done:
            history = self._history(fleet, obs)

        # own verdicts, and the verdicts of this tick's alerts (a re-check stands for one decision)
        for_decision = dict(fleet.verdicts)
        for server in sources:
            if server not in for_decision or not for_decision[server].stalled:
                for_decision[server] = fleet.alert_verdicts[server][0]
        plan = decide(list(for_decision.values()), history, spec, servers, now, source=sources)
        fleet.plan = plan
        for decision in plan.decisions:
            await self._carry_out(key, fleet, decision, spec, pods, now)
        if plan.actions:  # what was just started is now in progress (the Remediating condition)
            after = self._history(fleet, obs)
            fleet.plan = replace(plan, in_progress=restarts_in_progress(after, servers, spec, now),
                                 budget_used=budget_used(after, now))
        self._set_gauges(key, fleet, {**for_decision, **{s: v for s, (v, _) in fleet.alert_verdicts.items()}},
                         fleet.plan)
        self._publish(key, fleet, obs)
        return interval

    # ---- verdicts --------------------------------------------------------------------------------

    async def _recheck(self, fleet: FleetStall, alert: StallAlert, judged: list[ServerPod],
                       interval: float) -> StallVerdict | None:
        """The alert's pod, scraped afresh: still no tokens with work pending? (the alert stands for
        the window; these scrapes confirm it still holds now)."""
        pod = next((p for p in judged if p.name == alert.pod), None)
        if pod is None:
            await self._event(fleet, "Normal", "AlertIgnored", f"{alert.source}: pod {alert.pod} is not a Ready "
                              f"server of this fleet (starting, being replaced, or gone)", alert.pod)
            self.metrics.alerts.labels("stale").inc()
            return None
        gap = min(max(interval / 2, 0.5), 2.5)
        fresh: list[Scrape] = []
        for i in range(3):
            if i:
                await asyncio.sleep(gap)
            fresh.append(await self._scrape(pod, min(max(1.0, interval * 0.8), 5.0)))
        verdict = judge(pod.name, pod.role, fresh, window_seconds=fresh[-1].at - fresh[0].at, interval_seconds=0.0,
                        confirmations=1)
        if not verdict.stalled:
            self.metrics.alerts.labels("not_confirmed").inc()
            await self._event(fleet, "Normal", "AlertNotConfirmed", f"{alert.source}: a fresh check of {pod.name} "
                              f"does not confirm a stall: {verdict.summary()}", pod.name)
            return None
        self.metrics.alerts.labels("confirmed").inc()
        return verdict

    async def _report_unreachable(self, fleet: FleetStall, verdicts: dict[str, StallVerdict], window: float) -> None:
        """An Event once a server has been unreachable for a whole stall window (it is never restarted
        for it: a scrape failure is not a stall)."""
        now = self.clock()
        for server, v in verdicts.items():
            if v.state is not State.UNREACHABLE:
                fleet.unreachable_since.pop(server, None)
                fleet.unreachable_reported.discard(server)
                continue
            since = fleet.unreachable_since.setdefault(server, now)
            if now - since >= window and server not in fleet.unreachable_reported:
                fleet.unreachable_reported.add(server)
                await self._event(fleet, "Warning", "ServerUnreachable", f"{v.summary()}; not acted on (a server "
                                  f"that cannot be scraped is not a stall)", server, force=True)
        for server in list(fleet.unreachable_since):
            if server not in verdicts:
                fleet.unreachable_since.pop(server, None)
                fleet.unreachable_reported.discard(server)

    async def _count_stall(self, key: Key, fleet: FleetStall, verdict: StallVerdict,
                           pods: dict[str, ServerPod]) -> None:
        pod = pods.get(verdict.server)
        episode = (verdict.server, pod.uid if pod else "")
        if not verdict.stalled:
            if verdict.state in (State.PROGRESSING, State.IDLE):
                fleet.counted.discard(episode)
            return
        if episode in fleet.counted:
            return
        fleet.counted.add(episode)
        signature = verdict.signature.value if verdict.signature else "unknown"
        self.metrics.stalls.labels(*key, signature).inc()
        fleet.logger.warning("stall detected: %s", verdict.summary())
        await self._event(fleet, "Warning", "StallDetected", f"{verdict.summary()}; evidence: "
                          f"{evidence_text(verdict.evidence)}", verdict.server, force=True)

    # ---- decisions into actions ------------------------------------------------------------------

    async def _carry_out(self, key: Key, fleet: FleetStall, d: Decision, spec: FleetSpec, pods: list[ServerPod],
                         now: float) -> None:
        if d.outcome is Verdict.SKIP:
            if not d.quiet:
                self.metrics.remediations.labels(d.action.value, d.reason).inc()
                await self._event(fleet, "Warning", d.event_reason, f"not remediated ({d.reason}): {d.message}",
                                  d.verdict.server)
            return
        record = d.record(now)
        fleet.local[record.key()] = record
        if d.outcome is Verdict.DRY_RUN or d.action is Action.HALT:
            result = record.outcome
            self.metrics.remediations.labels(d.action.value, result).inc()
            await self._event(fleet, "Warning", d.event_reason, d.message, d.verdict.server, force=True)
            return
        await self._event(fleet, "Warning", d.event_reason, d.message, d.verdict.server, force=True)
        self._spawn(key, fleet, self._execute(key, fleet, record, spec, d.batch, persisted=False,
                                              stalled_sample=self._latest(fleet, d.verdict.server)))

    def _spawn(self, key: Key, fleet: FleetStall, coro) -> None:
        task = asyncio.ensure_future(coro)
        fleet.tasks.add(task)
        task.add_done_callback(fleet.tasks.discard)

    def _latest(self, fleet: FleetStall, server: str) -> Scrape | None:
        samples = [s for s in fleet.windows.samples(server) if s.ok]
        return samples[-1] if samples else None

    def _resume(self, key: Key, fleet: FleetStall, history: list[Remediation], pods: list[ServerPod],
                spec: FleetSpec) -> None:
        """Finish actions a previous operator recorded as Pending (only pods older than the decision
        are deleted, so nothing is done twice)."""
        now = self.clock()
        for record in history:
            if record.outcome != RecordOutcome.PENDING.value:
                continue
            startup = max(spec.context.probes.startup_timeout_seconds, spec.generation.probes.startup_timeout_seconds)
            if now - record.time > spec.remediation.drain_timeout_seconds + startup + 60:
                fleet.local[record.key()] = _replaced(record, RecordOutcome.FAILED, "abandoned: the operator "
                                                      "restarted and the action is too old to finish")
                continue
            fleet.logger.info("resuming %s of %s recorded at %s", record.action, ", ".join(record.targets),
                              rfc3339(record.time))
            batch = max(1, spec.remediation.max_concurrent_per_role)
            self._spawn(key, fleet, self._execute(key, fleet, record, spec, batch, persisted=True, stalled_sample=None))

    async def _finish_recoveries(self, fleet: FleetStall, history: list[Remediation], pods: list[ServerPod]) -> None:
        """A server left drained by an action that ended Recovered (the operator died in between)."""
        recent = [r for r in history if r.outcome == RecordOutcome.RECOVERED.value and self.clock() - r.time < 3600]
        for pod in pods:
            if pod.draining and not pod.terminating and any(
                    pod.name in r.targets and still_to_delete(r, pod.created) for r in recent):
                await self.api.set_drain(fleet.ref.namespace, pod.name, pod.uid, False)

    async def _execute(self, key: Key, fleet: FleetStall, record: Remediation, spec: FleetSpec, batch: int, *,
                       persisted: bool, stalled_sample: Scrape | None) -> None:
        """Pending → drain → delete → Succeeded/Failed/Recovered, each step idempotent."""
        try:
            if not persisted and not await self._persist(key, fleet, record):
                fleet.local.pop(record.key(), None)
                self._publish(key, fleet, fleet.observe())
                fleet.logger.warning("not acting on %s: its record did not reach the API server within %.0f s",
                                     record.server, PERSIST_TIMEOUT_SECONDS)
                self.metrics.remediations.labels(record.action, "NotPersisted").inc()
                return
            rolling = record.action in (Action.RESTART_PEERS.value, Action.RESTART_ROLE.value)
            targets = list(record.targets)
            batches = [targets[i:i + batch] for i in range(0, len(targets), batch)] if rolling else [targets]
            problems: list[str] = []
            for number, group in enumerate(batches):
                outcome = await self._restart(fleet, record, group, spec, stalled=not rolling,
                                              stalled_sample=stalled_sample)
                if outcome is RecordOutcome.RECOVERED:
                    await self._finish(key, fleet, record, RecordOutcome.RECOVERED,
                                       f"progress resumed while draining; nothing restarted. {record.message}")
                    return
                if isinstance(outcome, str):
                    problems.append(outcome)
                if rolling and number + 1 < len(batches):
                    await self._wait_replaced(fleet, record, group, spec)
            if problems:
                await self._finish(key, fleet, record, RecordOutcome.FAILED, "; ".join(problems) + f". {record.message}")
            else:
                await self._finish(key, fleet, record, RecordOutcome.SUCCEEDED, record.message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            fleet.logger.exception("remediation of %s failed", record.server)
            await self._finish(key, fleet, record, RecordOutcome.FAILED, f"{type(e).__name__}: {e}. {record.message}")

    async def _restart(self, fleet: FleetStall, record: Remediation, group: list[str], spec: FleetSpec, *,
                       stalled: bool, stalled_sample: Scrape | None):
        """Drain and delete the pods of `group` that the record means. RECOVERED, an error text, or None."""
        ns = fleet.ref.namespace
        current = {p.name: p for p in fleet.observe().pods if p.owner_uid == fleet.ref.uid}
        victims = [current[n] for n in group if n in current and not current[n].terminating
                   and still_to_delete(record, current[n].created)]
        for pod in victims:
            if not pod.draining:
                out = await self.api.set_drain(ns, pod.name, pod.uid, True)
                if not out.ok:
                    return f"could not drain {pod.name}: {out.message}"
        drain_timeout = float(spec.remediation.drain_timeout_seconds)
        if stalled:
            wait = min(drain_timeout, STALLED_DRAIN_GRACE_SECONDS)
            if victims and stalled_sample is not None and await self._progressed(victims[0], stalled_sample, wait):
                for pod in victims:
                    await self.api.set_drain(ns, pod.name, pod.uid, False)
                return RecordOutcome.RECOVERED
        else:
            await self._drained(victims, drain_timeout)
        errors = []
        for pod in victims:
            grace = STALLED_DELETE_GRACE_SECONDS if stalled else None
            out = await self.api.delete_pod_within(ns, pod.name, pod.uid, grace)
            if not out.ok:
                errors.append(f"could not delete {pod.name}: {out.message}")
            else:
                fleet.windows.reset(pod.name)
                fleet.logger.info("deleted %s (%s)", pod.name, record.action)
        self.wake_reconcile((ns, fleet.ref.name))
        return "; ".join(errors) or None

    async def _progressed(self, pod: ServerPod, before: Scrape, wait: float) -> bool:
        """Whether the stalled server produced real tokens since `before`, watched for `wait` s."""
        deadline = time.monotonic() + wait
        while True:
            now = await self._scrape(pod, 2.0)
            if now.ok and set(now.ranks) == set(before.ranks) and now.tokens > before.tokens:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    async def _drained(self, pods: list[ServerPod], timeout: float) -> None:
        """Until the (working) servers have finished their requests, or `timeout`."""
        deadline = time.monotonic() + timeout
        while pods and time.monotonic() < deadline:
            samples = await asyncio.gather(*(self._scrape(p, 2.0) for p in pods))
            if all(s.ok and s.total("requests_running") + s.total("requests_waiting") == 0 for s in samples):
                return
            await asyncio.sleep(0.5)

    async def _wait_replaced(self, fleet: FleetStall, record: Remediation, group: list[str], spec: FleetSpec) -> None:
        timeout = max(spec.context.probes.startup_timeout_seconds, spec.generation.probes.startup_timeout_seconds)
        deadline = time.monotonic() + timeout + spec.remediation.drain_timeout_seconds
        while time.monotonic() < deadline:
            current = {p.name: p for p in fleet.observe().pods if p.owner_uid == fleet.ref.uid}
            if all(n in current and current[n].ready and not current[n].terminating and
                   not still_to_delete(record, current[n].created) for n in group):
                return
            await asyncio.sleep(0.5)

    async def _persist(self, key: Key, fleet: FleetStall, record: Remediation) -> bool:
        want = (record.key(), record.outcome)
        deadline = time.monotonic() + PERSIST_TIMEOUT_SECONDS
        self._publish(key, fleet, fleet.observe())
        while want not in fleet.persisted:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            fleet.persisted_changed.clear()
            self.wake_reconcile(key)
            try:
                await asyncio.wait_for(fleet.persisted_changed.wait(), timeout=min(left, 2.0))
            except asyncio.TimeoutError:
                pass
        return True

    async def _finish(self, key: Key, fleet: FleetStall, record: Remediation, outcome: RecordOutcome,
                      message: str) -> None:
        done = _replaced(record, outcome, message)
        fleet.local[done.key()] = done
        self.metrics.remediations.labels(record.action, outcome.value).inc()
        kind = "Normal" if outcome in (RecordOutcome.SUCCEEDED, RecordOutcome.RECOVERED) else "Warning"
        reason = {RecordOutcome.SUCCEEDED: "Remediated", RecordOutcome.RECOVERED: "RemediationCancelled",
                  RecordOutcome.FAILED: "RemediationFailed"}.get(outcome, "Remediation")
        await self._event(fleet, kind, reason, f"{record.action} {', '.join(record.targets)}: {outcome.value}. "
                          f"{message}", record.server, force=True)
        self._publish(key, fleet, fleet.observe())

    # ---- reporting -------------------------------------------------------------------------------

    def _history(self, fleet: FleetStall, obs: FleetObservation) -> list[Remediation]:
        stored = history_from_status(obs.status)
        stored_keys = {(r.key(), r.outcome) for r in stored}
        for k, r in list(fleet.local.items()):  # the cache has caught up: no need to remember it
            if (k, r.outcome) in stored_keys:
                fleet.persisted.add((k, r.outcome))
                del fleet.local[k]
        return with_records(stored, fleet.local.values())

    def _set_gauges(self, key: Key, fleet: FleetStall, verdicts: dict[str, StallVerdict], plan: Plan) -> None:
        counts = {state: 0 for state in State}
        for v in verdicts.values():
            counts[v.state] += 1
        for state, n in counts.items():
            self.metrics.servers.labels(*key, state.value).set(n)
        self.metrics.budget_exhausted.labels(*key).set(1 if plan.budget_exhausted else 0)
        self.metrics.halted.labels(*key).set(1 if plan.halted else 0)

    def _publish(self, key: Key, fleet: FleetStall, obs: FleetObservation) -> None:
        """Wake the reconcile pass when what this controller owns in the status changed."""
        view = self._owned_view(fleet, obs)
        if view != fleet.published:
            fleet.published = view
            self.wake_reconcile(key)

    def _owned_view(self, fleet: FleetStall, obs: FleetObservation):
        out = self.overlay((fleet.ref.namespace, fleet.ref.name), obs, {"conditions": []})
        return (tuple((c["type"], c["status"], c["reason"], c["message"]) for c in out["conditions"]),
                repr(out.get("recentRemediations")), degraded_problem(fleet.plan))

    async def _event(self, fleet: FleetStall, type_: str, reason: str, message: str, server: str,
                     force: bool = False) -> None:
        now = time.monotonic()
        last = fleet.last_event.get((server, reason))
        if not force and last is not None and now - last < EVENT_REPEAT_SECONDS:
            return
        fleet.last_event[(server, reason)] = now
        fleet.logger.info("%s: %s", reason, message)
        await self.api.record_event(fleet.ref, type_, reason, message)

    def overlay(self, key: Key, obs: FleetObservation, status: dict) -> dict:
        """`status` (computed by the reconcile pass) with what this controller owns laid over it."""
        fleet = self.fleets.get(key)
        if fleet is None:
            return status
        previous = {c.get("type"): c for c in (obs.status or {}).get("conditions") or []}
        verdicts = list(fleet.verdicts.values()) + [v for v, _ in fleet.alert_verdicts.values()]
        generation = status.get("observedGeneration", obs.generation) or 0
        now = now_rfc3339()
        mine = stall_conditions(verdicts, fleet.plan, previous, generation, now)
        conditions = [c for c in status.get("conditions") or [] if c.get("type") not in ("Stalled", "Remediating")]
        problem = degraded_problem(fleet.plan)
        if problem:
            for i, c in enumerate(conditions):
                if c.get("type") == "Degraded" and c.get("status") != "True":
                    conditions[i] = fleet_conditions.condition("Degraded", True, problem[0], problem[1], generation,
                                                               previous, now)
        out = {**status, "conditions": conditions + mine}
        history = [r.to_status() for r in self._history(fleet, obs)]
        if history:
            out["recentRemediations"] = history
        else:
            out.pop("recentRemediations", None)
        return out

    def persisted(self, key: Key, status: dict) -> None:
        """The reconcile pass wrote `status` (or found it already stored)."""
        fleet = self.fleets.get(key)
        if fleet is None:
            return
        for entry in status.get("recentRemediations") or []:
            record = Remediation.from_status(entry)
            if record is not None:
                fleet.persisted.add((record.key(), record.outcome))
        fleet.persisted_changed.set()

    async def close(self) -> None:
        await self.http.aclose()


def _replaced(record: Remediation, outcome: RecordOutcome, message: str) -> Remediation:
    return replace(record, outcome=outcome.value, message=message[:1024])


class RemediatingReconciler(Reconciler):
    """The reconciler, writing the stall controller's part of the status with its own (one writer)."""

    def __init__(self, *args, stall: StallController, **kwargs):
        super().__init__(*args, **kwargs)
        self.stall = stall

    async def _write_status(self, fleet: FleetRef, obs: FleetObservation, status: dict, memory, logger) -> None:
        key = (fleet.namespace, fleet.name)
        status = self.stall.overlay(key, obs, status)
        before = obs.status or {}
        unchanged = all(before.get(k) == v for k, v in status.items()) and all(k in status for k in before)
        written = memory.written_status
        await super()._write_status(fleet, obs, status, memory, logger)
        if unchanged or (memory.written_status is not written and memory.written_status is not None
                         and memory.written_status[1] is status):
            self.stall.persisted(key, status)


def alerts_token(api: RemediationApi, reference: str):
    """The webhook's token source from `NAMESPACE/NAME[:KEY]` ('' = not configured: every request 503)."""
    from adpfleet.operator.alerts import StaticToken

    if not reference:
        return StaticToken(None)
    where, _, key = reference.partition(":")
    namespace, _, name = where.partition("/")
    if not namespace or not name:
        raise ValueError(f"--alerts-token-secret must be NAMESPACE/NAME[:KEY], got {reference!r}")
    return SecretToken(api, namespace, name, key or "token")
