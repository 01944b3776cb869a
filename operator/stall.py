"""The stall controller: one loop per fleet (a kopf daemon beside the reconcile loop) that judges,
decides, acts and reports.

    every scrape interval (or at once when an alert for the fleet arrives):
      scrape every Ready server's /metrics  ─► detection.judge ─► verdicts      (own detection)
      take the fleet's queued alerts        ─► fresh scrapes  ─► verdicts       (Alertmanager)
      remediation.decide(verdicts, history, spec, pods, now) ─► plan            (one path, two inputs)
      plan ─► Events, metrics, records in status.recentRemediations, and for each action a task of
              the `Remediator` (remediator.py): record Pending ─► drain ─► delete the pod(s) ─► result

This module is the loop: what it reads (`Look`), what it remembers between ticks (`FleetStall`) and
how a tick's verdicts become a plan; the verdicts and the policy are pure functions (`decisions/`),
the requests are the adapters' (`adapters/`), and carrying one action out is the remediator's.

Status has one writer, the fleet's reconcile pass: this controller keeps what it owns (the Stalled
and Remediating conditions, recentRemediations, a Degraded reason of its own) in memory, wakes the
reconcile loop, and is the pass's `StatusPart` (`overlay`, `stored`). An action starts only once
its Pending record is in the API server, so an operator restarted mid-action finds it there and
hands it to the remediator again (deleting only pods older than the decision) instead of acting twice.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from adpfleet.operator.adapters.kube import KubeApi, now_rfc3339
from adpfleet.operator.adapters.scrape import HttpScraper, Scrape, Scraper, scrape_pods, timeout_for
from adpfleet.operator.decisions import groups, stall_status
from adpfleet.operator.decisions.detection import (SampleWindows, StallVerdict, attribute, evidence_text, judge,
                                                   keep_seconds)
from adpfleet.operator.decisions.history import (Remediation, budget_used, history_from_status, left_drained,
                                                 pending, resolved, restarts_in_progress, rfc3339, with_records)
from adpfleet.operator.decisions.observed import FleetObservation, ServerPod
from adpfleet.operator.decisions.remediation import Decision, Plan, decide
from adpfleet.operator.inbox import AlertInbox, StallAlert
from adpfleet.operator.loops import sleep_until
from adpfleet.operator.remediator import Remediator
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetKey, FleetRef
from adpfleet.operator.resource.vocabulary import Action, Choice, Outcome, RemediationMode, ServerState
from adpfleet.operator.telemetry import StallMetrics

log = logging.getLogger("adpfleet.operator.stall")

CONFIRMATIONS = 2               # consecutive scrapes that must agree before a stall is acted on
INVALID_SPEC_RETRY_SECONDS = 5.0  # a spec that cannot be read (the reconciler reports it) is looked at again
EVENT_REPEAT_SECONDS = 60.0     # the same skip of the same server is reported at most this often
RECHECK_SCRAPES = 3             # fresh scrapes of a server an alert names ...
RECHECK_GAP = (0.5, 2.5)        # ... half a scrape interval apart, within these bounds (seconds)


class ScrapeListener(Protocol):
    """Another reader of each tick's scrapes (the autoscaling policy): the servers are scraped once."""

    def wanted(self, spec: FleetSpec) -> bool:
        """Whether this fleet needs scrapes for it (the servers are scraped when it or detection does)."""

    async def observe(self, key: FleetKey, ref: FleetRef, obs: FleetObservation, spec: FleetSpec,
                      scrapes: dict[str, Scrape]) -> None:
        """This tick's scrapes of the fleet's serving servers (pod name -> Scrape)."""

    def forget(self, key: FleetKey) -> None:
        """The fleet is gone (or no longer needs scrapes)."""


@dataclass
class FleetStall:
    """One fleet's memory between ticks. Lost on restart by design: what must survive is in status."""
    ref: FleetRef
    observe: Callable[[], FleetObservation]
    logger: logging.Logger
    windows: SampleWindows = field(default_factory=SampleWindows)
    verdicts: dict[str, StallVerdict] = field(default_factory=dict)  # own detection, this tick
    alert_verdicts: dict[str, tuple[StallVerdict, float]] = field(default_factory=dict)  # server -> (v, until)
    local: dict[tuple, Remediation] = field(default_factory=dict)  # records not yet seen in the cached status
    plan: Plan = field(default_factory=Plan)
    episodes: dict[str, stall_status.Episode] = field(default_factory=dict)  # server -> its ongoing stall
    stall_ended: str | None = None  # why the last stall episode ended
    started: float = field(default_factory=time.time)  # when this operator began judging the fleet
    last_event: dict[tuple[str, str], float] = field(default_factory=dict)
    tasks: set[asyncio.Task] = field(default_factory=set)
    persisted: set[tuple] = field(default_factory=set)  # (record key, outcome) known to be in the API
    persisted_changed: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    resumed: bool = False
    published: object = None
    unreachable_since: dict[str, float] = field(default_factory=dict)
    unreachable_reported: set[str] = field(default_factory=set)
    spec: tuple[dict, FleetSpec] | None = None  # the spec as last read, and its model: validated once per change

    def all_verdicts(self) -> list[StallVerdict]:
        """Own detection's and the standing alert re-checks'."""
        return list(self.verdicts.values()) + [v for v, _ in self.alert_verdicts.values()]


@dataclass(frozen=True)
class Look:
    """What one tick reads of the fleet."""
    obs: FleetObservation
    spec: FleetSpec
    pods: list[ServerPod]    # every server pod of the fleet
    judged: list[ServerPod]  # the Running, Ready ones with an address, not being scaled down: the ones scraped

    @property
    def interval(self) -> float:
        return float(self.spec.monitoring.scrape_interval_seconds)

    @property
    def window(self) -> float:
        return float(self.spec.remediation.stall_window_seconds)


class StallController:
    def __init__(self, api: KubeApi, metrics: StallMetrics, inbox: AlertInbox,
                 wake_reconcile: Callable[[FleetKey], None], *, detection: bool = True,
                 clock: Callable[[], float] = time.time, scraper: Scraper | None = None,
                 listener: ScrapeListener | None = None):
        self.api = api
        self.metrics = metrics
        self.inbox = inbox
        self.wake_reconcile = wake_reconcile
        self.detection = detection
        self.clock = clock
        self.fleets: dict[FleetKey, FleetStall] = {}
        inbox.on_put = self._alert_arrived
        self._owned_scraper = None if scraper is not None else HttpScraper(clock)
        self._scraper: Scraper = scraper or self._owned_scraper  # tests script the servers' /metrics
        self.listener = listener
        self.remediator = Remediator(api, self._scraper, metrics, wake_reconcile, publish=self._publish,
                                     event=self._event)

    def fleet_known(self, namespace: str, name: str) -> bool:
        return (namespace, name) in self.fleets

    def _alert_arrived(self, key: FleetKey) -> None:
        fleet = self.fleets.get(key)
        if fleet is not None:
            fleet.wake.set()

    # ---- the loop (a kopf daemon per fleet) ------------------------------------------------------

    async def run(self, key: FleetKey, ref: FleetRef, observe: Callable[[], FleetObservation], stopped,
                  logger: logging.Logger) -> None:
        fleet = self.fleets[key] = FleetStall(ref, observe, logger, started=self.clock())
        try:
            while not stopped:
                fleet.wake.clear()
                started = time.monotonic()
                interval = INVALID_SPEC_RETRY_SECONDS
                try:
                    interval = await self.tick(key, fleet)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - a bug or an API surprise: logged, never fatal
                    logger.exception("stall check failed; retrying")
                await sleep_until(fleet.wake, stopped, max(0.0, interval - (time.monotonic() - started)))
        finally:
            for task in list(fleet.tasks):  # an action in flight is finished by the next operator
                task.cancel()
            self.fleets.pop(key, None)
            self.metrics.forget(key)
            if self.listener is not None:
                self.listener.forget(key)

    async def tick(self, key: FleetKey, fleet: FleetStall) -> float:
        """One pass of the diagram above; the seconds until the next."""
        look = _look(fleet.observe(), fleet)
        if look is None:
            return INVALID_SPEC_RETRY_SECONDS
        alerts = self.inbox.take(*key)
        disabled = look.spec.remediation.mode is RemediationMode.DISABLED
        listening = self.listener is not None and self.listener.wanted(look.spec)
        scrapes = await self._scrape_judged(look) if (self.detection and not disabled) or listening else {}
        if listening:
            await self.listener.observe(key, fleet.ref, look.obs, look.spec, scrapes)
        elif self.listener is not None:
            self.listener.forget(key)
        if disabled:
            await self._stand_down(key, fleet, look, alerts)
            return look.interval
        await self._finish_left_over(key, fleet, look)

        fleet.verdicts = await self._judge(fleet, look, scrapes) if self.detection else {}
        sources = await self._recheck_alerts(fleet, look, alerts)
        await self._count_stalls(key, fleet, look)
        plan = self._decide(fleet, look, sources)
        await self._carry_out(key, fleet, look, plan)
        self._report(key, fleet, look, sources)
        return look.interval

    # ---- verdicts --------------------------------------------------------------------------------

    async def _scrape_judged(self, look: Look) -> dict[str, Scrape]:
        """One scrape of every judged server, all at once: pod name -> Scrape."""
        timeout = timeout_for(look.interval)

        async def timed(pod: ServerPod) -> Scrape:
            start = time.monotonic()
            sample = await self._scrape(pod, timeout)
            self.metrics.scrape_seconds.observe(time.monotonic() - start)
            self.metrics.scrapes.labels("ok" if sample.ok else "failed").inc()
            return sample
        samples = await asyncio.gather(*(timed(p) for p in look.judged))
        return {pod.name: sample for pod, sample in zip(look.judged, samples)}

    async def _judge(self, fleet: FleetStall, look: Look, scrapes: dict[str, Scrape]) -> dict[str, StallVerdict]:
        """Judge every judged server's window of scrapes, this tick's included; a server Blocked by
        its peers is told which ones (a transfer stall is the stall of the server not completing its
        pulls)."""
        fleet.windows.retain(p.name for p in look.judged)
        keep = keep_seconds(look.window, look.interval, CONFIRMATIONS)
        verdicts = {}
        for pod in look.judged:
            sample = scrapes[pod.name]
            fleet.windows.add(pod.name, pod.uid, sample, keep_seconds=keep)
            verdicts[pod.name] = judge(pod.name, pod.role, fleet.windows.samples(pod.name),
                                       window_seconds=look.window, interval_seconds=look.interval,
                                       confirmations=CONFIRMATIONS)
        verdicts = {v.server: v for v in attribute(verdicts.values(), [p.view for p in look.pods])}
        await self._report_unreachable(fleet, verdicts, look.window)
        return verdicts

    async def _recheck_alerts(self, fleet: FleetStall, look: Look, alerts: list[StallAlert]) -> dict[str, str]:
        """Verdicts for the servers this tick's alerts name, from fresh scrapes; each stands for
        one stall window. Server -> the alert, for the servers whose stall an alert confirmed."""
        sources = {}
        for alert in alerts:
            verdict = await self._recheck(fleet, alert, look)
            if verdict is not None:  # keyed by the server: an alert may name a worker pod of it
                fleet.alert_verdicts[verdict.server] = (verdict, self.clock() + look.window)
                sources[verdict.server] = alert.source if alert.pod == verdict.server else \
                    f"{alert.source} on pod {alert.pod}"
        now = self.clock()
        judged = {p.name for p in look.judged}
        fleet.alert_verdicts = {s: (v, until) for s, (v, until) in fleet.alert_verdicts.items()
                                if until > now and s in judged}
        return sources

    async def _recheck(self, fleet: FleetStall, alert: StallAlert, look: Look) -> StallVerdict | None:
        """The alert's server, scraped afresh: still no tokens with work pending? (the alert stands for
        the window; these scrapes confirm it still holds now). Prometheus scrapes every pod, so the
        alert may name a worker pod of a server over several pods: its whole group is re-checked."""
        pod = next((p for p in look.judged if any(m.name == alert.pod for m in p.pods)), None)
        if pod is None:
            await self._event(fleet, "Normal", "AlertIgnored", f"{alert.source}: pod {alert.pod} is not a Ready "
                              f"server of this fleet (starting, being replaced, or gone)", alert.pod)
            self.metrics.alerts.labels("stale").inc()
            return None
        gap = min(max(look.interval / 2, RECHECK_GAP[0]), RECHECK_GAP[1])
        fresh: list[Scrape] = []
        for i in range(RECHECK_SCRAPES):
            if i:
                await asyncio.sleep(gap)
            fresh.append(await self._scrape(pod, timeout_for(look.interval)))
        verdict = judge(pod.name, pod.role, fresh, window_seconds=fresh[-1].at - fresh[0].at, interval_seconds=0.0,
                        confirmations=1)
        if not verdict.stalled:
            self.metrics.alerts.labels("not_confirmed").inc()
            of = "" if alert.pod == pod.name else f" (the server of pod {alert.pod})"
            await self._event(fleet, "Normal", "AlertNotConfirmed", f"{alert.source}: a fresh check of {pod.name}{of} "
                              f"does not confirm a stall: {verdict.summary()}", pod.name)
            return None
        self.metrics.alerts.labels("confirmed").inc()
        return verdict

    async def _report_unreachable(self, fleet: FleetStall, verdicts: dict[str, StallVerdict], window: float) -> None:
        """An Event once a server has been unreachable for a whole stall window (it is never restarted
        for it: a scrape failure is not a stall)."""
        now = self.clock()
        for server, v in verdicts.items():
            if v.state is not ServerState.UNREACHABLE:
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

    async def _count_stalls(self, key: FleetKey, fleet: FleetStall, look: Look) -> None:
        """Stall episodes: a metric, a log line and an Event when one begins (once per stalled server
        incarnation); why the last one ended, for the Stalled condition."""
        fleet.episodes, began, ended = stall_status.follow_stalls(fleet.episodes, fleet.all_verdicts(), look.pods)
        if ended:
            fleet.stall_ended = "; ".join(ended)
        for verdict in began:
            self.metrics.stalls.labels(*key, verdict.signature.value).inc()
            fleet.logger.warning("stall detected: %s", verdict.summary())
            await self._event(fleet, "Warning", "StallDetected", f"{verdict.summary()}; evidence: "
                              f"{evidence_text(verdict.evidence)}", verdict.server, force=True)

    # ---- decisions into actions ------------------------------------------------------------------

    def _decide(self, fleet: FleetStall, look: Look, sources: dict[str, str]) -> Plan:
        """The policy over own verdicts and this tick's confirmed alerts (a re-check stands for one
        decision), after marking the restarts the servers have since recovered from as Resolved."""
        servers = [p.view for p in look.pods]
        for record in resolved(self._history(fleet, look.obs), list(fleet.verdicts.values()), servers):
            fleet.local[record.key()] = record
        verdicts = dict(fleet.verdicts)
        for server in sources:
            if server not in verdicts or not verdicts[server].stalled:
                verdicts[server] = fleet.alert_verdicts[server][0]
        fleet.plan = decide(list(verdicts.values()), self._history(fleet, look.obs), look.spec, servers,
                            self.clock(), source=sources)
        return fleet.plan

    async def _carry_out(self, key: FleetKey, fleet: FleetStall, look: Look, plan: Plan) -> None:
        now = self.clock()
        for d in plan.decisions:
            await self._carry_out_one(key, fleet, d, look.spec, now)
        if plan.actions:  # what was just started is now in progress (the Remediating condition)
            after = self._history(fleet, look.obs)
            fleet.plan = replace(plan, in_progress=restarts_in_progress(after, [p.view for p in look.pods],
                                                                        look.spec, now),
                                 budget_used=budget_used(after, now))

    async def _carry_out_one(self, key: FleetKey, fleet: FleetStall, d: Decision, spec: FleetSpec, now: float) -> None:
        if d.choice is Choice.SKIP:
            if not d.quiet:
                self.metrics.remediations.labels(d.action.value, d.reason).inc()
                await self._event(fleet, "Warning", d.event_reason, f"not remediated ({d.reason}): {d.message}",
                                  d.verdict.server)
            return
        record = d.record(now)
        fleet.local[record.key()] = record
        await self._event(fleet, "Warning", d.event_reason, d.message, d.verdict.server, force=True)
        if d.choice is Choice.DRY_RUN or d.action is Action.HALT:
            self.metrics.remediations.labels(d.action.value, record.outcome.value).inc()
            return
        self._spawn(fleet, self.remediator.execute(key, fleet, record, spec, d.batch, persisted=False,
                                                   stalled_sample=self._latest(fleet, d.verdict.server)))

    async def _stand_down(self, key: FleetKey, fleet: FleetStall, look: Look, alerts: list[StallAlert]) -> None:
        """mode Disabled: nothing is judged, alerts are acknowledged with an Event."""
        fleet.windows.retain(())
        fleet.verdicts, fleet.alert_verdicts = {}, {}
        for alert in alerts:
            await self._event(fleet, "Normal", "AlertIgnored", f"{alert.source} for {alert.pod}: "
                              f"remediation.mode is Disabled", alert.pod)
        fleet.plan = Plan(mode=RemediationMode.DISABLED)
        self._publish(key, fleet, look.obs)

    async def _finish_left_over(self, key: FleetKey, fleet: FleetStall, look: Look) -> None:
        """What an operator that died midway left: once per operator, finish the actions recorded as
        Pending (only pods older than the decision are deleted, so nothing is done twice) and fail
        the ones too old to finish; every tick, undrain servers an action left drained although it
        ended Recovered."""
        history = self._history(fleet, look.obs)
        now = self.clock()
        if not fleet.resumed:
            fleet.resumed = True
            to_finish, too_old = pending(history, look.spec, now)
            for record in too_old:
                fleet.local[record.key()] = record.ended(
                    Outcome.FAILED, "abandoned: the operator restarted and the action is too old to finish")
            for record in to_finish:
                fleet.logger.info("resuming %s of %s recorded at %s", record.action.value, ", ".join(record.targets),
                                  rfc3339(record.time))
                batch = max(1, look.spec.remediation.max_concurrent_per_role)
                self._spawn(fleet, self.remediator.execute(key, fleet, record, look.spec, batch, persisted=True,
                                                           stalled_sample=None))
        by_name = {p.name: p for p in look.pods}
        for name in left_drained(history, [p.view for p in look.pods], now):
            await self.api.set_drain(fleet.ref.namespace, name, by_name[name].uid, False)

    def _spawn(self, fleet: FleetStall, coro) -> None:
        task = asyncio.ensure_future(coro)
        fleet.tasks.add(task)
        task.add_done_callback(fleet.tasks.discard)

    def _latest(self, fleet: FleetStall, server: str) -> Scrape | None:
        samples = [s for s in fleet.windows.samples(server) if s.ok]
        return samples[-1] if samples else None

    # ---- reporting -------------------------------------------------------------------------------

    def _report(self, key: FleetKey, fleet: FleetStall, look: Look, sources: dict[str, str]) -> None:
        """The fleet's gauges, and a wake-up of the reconcile loop when the status should change."""
        states = {s: v.state for s, v in fleet.verdicts.items()}
        states.update({s: v.state for s, (v, _) in fleet.alert_verdicts.items()})
        self.metrics.set_fleet(key, states.values(), fleet.plan.budget_exhausted, fleet.plan.halted)
        self._publish(key, fleet, look.obs)

    def _history(self, fleet: FleetStall, obs: FleetObservation) -> list[Remediation]:
        """The stored history with this operator's records the cache has not shown yet."""
        stored = history_from_status(obs.status)
        stored_keys = {(r.key(), r.outcome) for r in stored}
        for k, r in list(fleet.local.items()):  # the cache has caught up: no need to remember it
            if (k, r.outcome) in stored_keys:
                fleet.persisted.add((k, r.outcome))
                del fleet.local[k]
        return with_records(stored, fleet.local.values())

    def _publish(self, key: FleetKey, fleet: FleetStall, obs: FleetObservation) -> None:
        """Wake the reconcile pass when what this controller owns in the status changed."""
        out = self.overlay(key, obs, {"conditions": []})
        view = (tuple((c["type"], c["status"], c["reason"], c["message"]) for c in out["conditions"]),
                repr(out.get("recentRemediations")), stall_status.degraded_problem(fleet.plan))
        if view != fleet.published:
            fleet.published = view
            self.wake_reconcile(key)

    async def _event(self, fleet: FleetStall, type_: str, reason: str, message: str, server: str,
                     force: bool = False) -> None:
        now = time.monotonic()
        last = fleet.last_event.get((server, reason))
        if not force and last is not None and now - last < EVENT_REPEAT_SECONDS:
            return
        fleet.last_event[(server, reason)] = now
        fleet.logger.info("%s: %s", reason, message)
        await self.api.record_event(fleet.ref, type_, reason, message)

    async def _scrape(self, pod: ServerPod, timeout: float) -> Scrape:
        """One scrape of a server: of every pod of a server over several pods, as one."""
        return await scrape_pods(self._scraper, [(p.name, p.ip) for p in pod.pods], timeout)

    # ---- the reconcile pass's StatusPart -----------------------------------------------------------

    def overlay(self, key: FleetKey, obs: FleetObservation, status: dict) -> dict:
        """`status` (computed by the reconcile pass) with what this controller owns laid over it."""
        fleet = self.fleets.get(key)
        if fleet is None:
            return status
        look = _look(obs, fleet)
        settling = look is None or self.clock() - fleet.started < look.window + look.interval
        return stall_status.overlay(status, obs.status, [e.verdict for e in fleet.episodes.values()], fleet.plan,
                                    self._history(fleet, obs), now_rfc3339(), generation=obs.generation,
                                    ended=fleet.stall_ended, settling=settling)

    def stored(self, key: FleetKey, status: dict) -> None:
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
        if self._owned_scraper is not None:
            await self._owned_scraper.close()


def _look(obs: FleetObservation, fleet: FleetStall) -> Look | None:
    """The tick's view of the fleet; None while the spec cannot be read (the reconciler reports it).
    The spec's model is made again only when the spec changed (comparing is far cheaper than
    validating, which every tick and every status overlay would otherwise do)."""
    source = obs.spec or {}
    if fleet.spec is not None and fleet.spec[0] == source:
        spec = fleet.spec[1]
    else:
        try:
            spec = FleetSpec.model_validate(source)
        except Exception:  # noqa: BLE001 - the reconciler reports an invalid spec
            return None
        fleet.spec = (copy.deepcopy(source), spec)
    # A server a scale-down is draining is on its way out: never judged (its queue empties on purpose),
    # never a remediation's concern.
    # a server over several pods is one server, judged on the scrapes of all its pods (groups.py)
    pods = [p for role in names.ROLES for p in groups.servers(obs.role_pods(role)) if not p.leaving]
    judged = [p for p in pods if p.phase == "Running" and p.ready and not p.terminating and p.ip]
    return Look(obs, spec, pods, judged)
