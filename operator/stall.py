"""The stall controller: one loop per fleet (a kopf daemon beside the reconcile loop) that judges,
decides, acts and reports.

    every scrape interval (or at once when an alert for the fleet arrives):
      scrape every Ready server's /metrics  ─► detection.judge ─► verdicts      (own detection)
      take the fleet's queued alerts        ─► fresh scrapes  ─► verdicts       (Alertmanager)
      remediation.decide(verdicts, history, spec, pods, now) ─► plan            (one path, two inputs)
      plan ─► Events, metrics, records in status.recentRemediations, and for each action a task of
              the `Remediator` (remediator.py): record Pending ─► drain ─► delete the pod(s) ─► result

This module is the loop (`StallController.tick`). Every other job is a room that holds the state
it owns; `FleetStall` is one fleet's rooms:

    stall_look.py       what a tick reads (`Look`), the spec made into its model once per change
    stall_detection.py  one scrape of every judged server, their windows of scrapes, the verdicts
    stall_rechecks.py   alerts re-checked by fresh scrapes, each confirmed stall standing a window
    stall_episodes.py   stall episodes begun and ended; servers unreachable for a window
    stall_leftover.py   the actions a previous operator left Pending, or left drained
    stall_events.py     the fleet's Events, rate limited
    stall_share.py      what this controller owns in the status: the plan, its records, publishing
    remediator.py       one action carried out

The verdicts and the policy are pure functions (`decisions/`), the requests the adapters'
(`adapters/`).

Status has one writer, the fleet's reconcile pass: this controller keeps what it owns (the Stalled
and Remediating conditions, recentRemediations, a Degraded reason of its own) in memory, wakes the
reconcile loop, and is the pass's `StatusPart` (`overlay`, `stored`). An action starts only once
its Pending record is in the API server, so an operator restarted mid-action finds it there and
hands it to the remediator again (deleting only pods older than the decision) instead of acting twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Coroutine, Protocol

from adpfleet.operator.adapters.kube import KubeApi
from adpfleet.operator.adapters.scrape import HttpScraper, Scrape, Scraper
from adpfleet.operator.decisions.detection import StallVerdict
from adpfleet.operator.decisions.history import budget_used, resolved, restarts_in_progress
from adpfleet.operator.decisions.observed import FleetObservation
from adpfleet.operator.decisions.remediation import Decision, Plan, decide
from adpfleet.operator.inbox import AlertInbox, StallAlert
from adpfleet.operator.loops import sleep_until
from adpfleet.operator.remediator import Remediator
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetKey, FleetRef
from adpfleet.operator.resource.vocabulary import Action, Choice, RemediationMode
from adpfleet.operator.stall_detection import OwnDetection, scrape_servers
from adpfleet.operator.stall_episodes import StallEpisodes, UnreachableServers
from adpfleet.operator.stall_events import FleetEvents
from adpfleet.operator.stall_leftover import LeftOver
from adpfleet.operator.stall_look import Look, SpecCache
from adpfleet.operator.stall_rechecks import AlertRechecks
from adpfleet.operator.stall_share import StatusShare
from adpfleet.operator.telemetry import StallMetrics

log = logging.getLogger("adpfleet.operator.stall")

INVALID_SPEC_RETRY_SECONDS = 5.0  # a spec that cannot be read (the reconciler reports it) is looked at again


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
    """One fleet's memory between ticks, a room per job. Lost on restart by design: what must survive is in status."""
    ref: FleetRef
    observe: Callable[[], FleetObservation]
    logger: logging.Logger
    started: float = field(default_factory=time.time)  # when this operator began judging the fleet
    spec: SpecCache = field(default_factory=SpecCache)
    detection: OwnDetection = field(default_factory=OwnDetection)
    rechecks: AlertRechecks = field(default_factory=AlertRechecks)
    episodes: StallEpisodes = field(default_factory=StallEpisodes)
    unreachable: UnreachableServers = field(default_factory=UnreachableServers)
    leftover: LeftOver = field(default_factory=LeftOver)
    share: StatusShare = field(default_factory=StatusShare)
    events: FleetEvents = field(init=False)
    tasks: set[asyncio.Task] = field(default_factory=set)      # the actions being carried out
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # an alert for the fleet arrived

    def __post_init__(self) -> None:
        self.events = FleetEvents(self.ref, self.logger)

    def all_verdicts(self) -> list[StallVerdict]:
        """Own detection's and the standing alert re-checks'."""
        return list(self.detection.verdicts.values()) + self.rechecks.verdicts()

    def spawn(self, action: Coroutine) -> None:
        task = asyncio.ensure_future(action)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


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
        self.remediator = Remediator(api, self._scraper, metrics, wake_reconcile, publish=self._publish)

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
        look = fleet.spec.look(fleet.observe())
        if look is None:
            return INVALID_SPEC_RETRY_SECONDS
        alerts = self.inbox.take(*key)
        disabled = look.spec.remediation.mode is RemediationMode.DISABLED
        scrapes = await self._scrape(key, fleet, look, judging=self.detection and not disabled)
        if disabled:
            await self._stand_down(key, fleet, look, alerts)
            return look.interval
        say = partial(fleet.events.say, self.api)
        await fleet.leftover.finish(key, fleet, look, self.clock(), self.remediator, fleet.spawn)

        fleet.detection.verdicts = fleet.detection.judge(look, scrapes) if self.detection else {}
        await fleet.unreachable.report(fleet.detection.verdicts, look.window, self.clock(), say)
        sources = await fleet.rechecks.confirm(alerts, look, self._scraper, say, self.metrics, self.clock)
        await fleet.episodes.follow(key, fleet.all_verdicts(), look.pods, say, self.metrics, fleet.logger)
        plan = self._decide(fleet, look, sources)
        await self._carry_out(key, fleet, look, plan)
        self._report(key, fleet, look)
        return look.interval

    async def _scrape(self, key: FleetKey, fleet: FleetStall, look: Look, *, judging: bool) -> dict[str, Scrape]:
        """This tick's one scrape of the judged servers, for detection and for the listener."""
        listening = self.listener is not None and self.listener.wanted(look.spec)
        scrapes = await scrape_servers(self._scraper, self.metrics, look.judged, look.interval, look.dialect) \
            if judging or listening else {}
        if listening:
            await self.listener.observe(key, fleet.ref, look.obs, look.spec, scrapes)
        elif self.listener is not None:
            self.listener.forget(key)
        return scrapes

    async def _stand_down(self, key: FleetKey, fleet: FleetStall, look: Look, alerts: list[StallAlert]) -> None:
        """mode Disabled: nothing is judged, alerts are acknowledged with an Event."""
        fleet.detection.stand_down()
        fleet.rechecks.standing = {}
        for alert in alerts:
            await fleet.events.say(self.api, "Normal", "AlertIgnored", f"{alert.source} for {alert.pod}: "
                                   f"remediation.mode is Disabled", alert.pod)
        fleet.share.plan = Plan(mode=RemediationMode.DISABLED)
        self._publish(key, fleet, look.obs)

    # ---- decisions into actions ------------------------------------------------------------------

    def _decide(self, fleet: FleetStall, look: Look, sources: dict[str, str]) -> Plan:
        """The policy over own verdicts and this tick's confirmed alerts (a re-check stands for one
        decision), after marking the restarts the servers have since recovered from as Resolved."""
        servers = [p.view for p in look.pods]
        for record in resolved(fleet.share.history(look.obs), list(fleet.detection.verdicts.values()), servers):
            fleet.share.note(record)
        verdicts = dict(fleet.detection.verdicts)
        for server in sources:
            if server not in verdicts or not verdicts[server].stalled:
                verdicts[server] = fleet.rechecks.standing[server][0]
        fleet.share.plan = decide(list(verdicts.values()), fleet.share.history(look.obs), look.spec, servers,
                                  self.clock(), source=sources)
        return fleet.share.plan

    async def _carry_out(self, key: FleetKey, fleet: FleetStall, look: Look, plan: Plan) -> None:
        now = self.clock()
        for d in plan.decisions:
            await self._carry_out_one(key, fleet, d, look.spec, now)
        if plan.actions:  # what was just started is now in progress (the Remediating condition)
            after = fleet.share.history(look.obs)
            fleet.share.plan = replace(plan, in_progress=restarts_in_progress(after, [p.view for p in look.pods],
                                                                              look.spec, now),
                                       budget_used=budget_used(after, now))

    async def _carry_out_one(self, key: FleetKey, fleet: FleetStall, d: Decision, spec: FleetSpec,
                             now: float) -> None:
        if d.choice is Choice.SKIP:
            if not d.quiet:
                self.metrics.remediations.labels(d.action.value, d.reason).inc()
                await fleet.events.say(self.api, "Warning", d.event_reason, f"not remediated ({d.reason}): "
                                       f"{d.message}", d.verdict.server)
            return
        record = d.record(now)
        fleet.share.note(record)
        await fleet.events.say(self.api, "Warning", d.event_reason, d.message, d.verdict.server, force=True)
        if d.choice is Choice.DRY_RUN or d.action is Action.HALT:
            self.metrics.remediations.labels(d.action.value, record.outcome.value).inc()
            return
        fleet.spawn(self.remediator.execute(key, fleet, record, spec, d.batch, persisted=False,
                                            stalled_sample=fleet.detection.latest(d.verdict.server)))

    # ---- reporting, and the reconcile pass's StatusPart -------------------------------------------

    def _report(self, key: FleetKey, fleet: FleetStall, look: Look) -> None:
        """The fleet's gauges, and a wake-up of the reconcile loop when the status should change."""
        states = {s: v.state for s, v in fleet.detection.verdicts.items()}
        states.update({s: v.state for s, (v, _) in fleet.rechecks.standing.items()})
        self.metrics.set_fleet(key, states.values(), fleet.share.plan.budget_exhausted, fleet.share.plan.halted)
        self._publish(key, fleet, look.obs)

    def _publish(self, key: FleetKey, fleet: FleetStall, obs: FleetObservation) -> None:
        """Wake the reconcile pass when what this controller owns in the status changed."""
        if fleet.share.changed(self.overlay(key, obs, {"conditions": []})):
            self.wake_reconcile(key)

    def overlay(self, key: FleetKey, obs: FleetObservation, status: dict) -> dict:
        """`status` (computed by the reconcile pass) with what this controller owns laid over it."""
        fleet = self.fleets.get(key)
        if fleet is None:
            return status
        look = fleet.spec.look(obs)
        settling = look is None or self.clock() - fleet.started < look.window + look.interval
        return fleet.share.overlay(obs, status, fleet.episodes.verdicts(), ended=fleet.episodes.ended,
                                   settling=settling)

    def stored(self, key: FleetKey, status: dict) -> None:
        """The reconcile pass wrote `status` (or found it already stored)."""
        fleet = self.fleets.get(key)
        if fleet is not None:
            fleet.share.stored(status)

    async def close(self) -> None:
        if self._owned_scraper is not None:
            await self._owned_scraper.close()
