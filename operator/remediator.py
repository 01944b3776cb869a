"""Carrying out one remediation: the stall controller (`stall.py`) decides and records an action;
the `Remediator` carries it out, each step idempotent:

    record Pending ─► (until the reconcile pass has written it to the API server)
    drain the pod(s) ─► a stalled server: progress resumed meanwhile? undrain, Recovered
                        a working one (a rolling peer restart): until its requests are done
    delete the pod(s) ─► rolling: until the batch's replacements are Ready, then the next batch
    record the result (Succeeded, Failed or Recovered), an Event and the metric

An action starts only once its Pending record is in the API server, so an operator restarted
mid-action finds it there and finishes it (`persisted=True`: deleting only pods older than the
decision) instead of acting twice. The remediator owns no state: it reads and writes the rooms of
the fleet's in-memory state it is handed, and reaches the reconcile loop through the hooks it is given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from adpfleet.operator.adapters.kube import KubeApi
from adpfleet.operator.adapters.dialects import Dialect, dialect_for
from adpfleet.operator.adapters.scrape import Scrape, Scraper
from adpfleet.operator.decisions import groups
from adpfleet.operator.decisions.history import Remediation, still_to_delete
from adpfleet.operator.decisions.observed import FleetObservation, ServerPod
from adpfleet.operator.drains import drained
from adpfleet.contract.roles import SERVER_ROLES
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetKey, FleetRef
from adpfleet.operator.resource.vocabulary import Outcome
from adpfleet.operator.stall_detection import OwnDetection, scrape_server
from adpfleet.operator.stall_events import FleetEvents
from adpfleet.operator.stall_share import StatusShare
from adpfleet.operator.telemetry import StallMetrics

PERSIST_TIMEOUT_SECONDS = 15.0  # how long an action waits for its Pending record to reach the API
STALLED_DRAIN_GRACE_SECONDS = 2.0  # a stalled server finishes nothing: drained this long, then restarted
STALLED_DELETE_GRACE_SECONDS = 5   # its pod's termination grace (a working peer keeps its own)
WATCH_SCRAPE_TIMEOUT = 2.0      # a scrape while draining (progress made? requests finished?)
WATCH_POLL_SECONDS = 0.5        # how often a drain or a rolling restart looks again


class ActingFleet(Protocol):
    """What an action reads and writes of its fleet's in-memory state (the stall controller's `FleetStall`)."""
    ref: FleetRef
    observe: Callable[[], FleetObservation]
    logger: logging.Logger
    detection: OwnDetection  # a deleted server's scrapes are forgotten
    share: StatusShare       # the records, and which of them the API server holds
    events: FleetEvents


Publish = Callable[[FleetKey, ActingFleet, FleetObservation], None]  # wake the reconcile pass if the status changed


@dataclass(frozen=True)
class Remediator:
    """Carries out the actions of every fleet of one stall controller, one `execute` task an action."""
    api: KubeApi
    scraper: Scraper
    metrics: StallMetrics
    wake_reconcile: Callable[[FleetKey], None]
    publish: Publish

    async def execute(self, key: FleetKey, fleet: ActingFleet, record: Remediation, spec: FleetSpec, batch: int, *,
                      persisted: bool, stalled_sample: Scrape | None) -> None:
        """Carry `record` out, each step idempotent; rolling actions a batch at a time."""
        try:
            if not persisted and not await self._persist(key, fleet, record):
                fleet.share.drop(record)
                self.publish(key, fleet, fleet.observe())
                fleet.logger.warning("not acting on %s: its record did not reach the API server within %.0f s",
                                     record.server, PERSIST_TIMEOUT_SECONDS)
                self.metrics.remediations.labels(record.action.value, "NotPersisted").inc()
                return
            rolling = record.action.rolling
            targets = list(record.targets)
            batches = [targets[i:i + batch] for i in range(0, len(targets), batch)] if rolling else [targets]
            problems: list[str] = []
            for number, group in enumerate(batches):
                outcome = await self._restart(fleet, record, group, spec, stalled=not rolling,
                                              stalled_sample=stalled_sample)
                if outcome is Outcome.RECOVERED:
                    await self._finish(key, fleet, record, Outcome.RECOVERED,
                                       f"progress resumed while draining; nothing restarted. {record.message}")
                    return
                if isinstance(outcome, str):
                    problems.append(outcome)
                if rolling and number + 1 < len(batches):
                    await self._wait_replaced(fleet, record, group, spec)
            if problems:
                await self._finish(key, fleet, record, Outcome.FAILED, "; ".join(problems) + f". {record.message}")
            else:
                await self._finish(key, fleet, record, Outcome.SUCCEEDED, record.message)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            fleet.logger.exception("remediation of %s failed", record.server)
            await self._finish(key, fleet, record, Outcome.FAILED, f"{type(e).__name__}: {e}. {record.message}")

    async def _restart(self, fleet: ActingFleet, record: Remediation, group: list[str], spec: FleetSpec, *,
                       stalled: bool, stalled_sample: Scrape | None) -> Outcome | str | None:
        """Drain and delete the pods of `group` that the record means. RECOVERED, an error text, or None."""
        ns = fleet.ref.namespace
        obs = fleet.observe()
        current = {p.name: p for p in obs.pods if p.owner_uid == fleet.ref.uid}
        victims = [current[n] for n in group if n in current and not current[n].terminating
                   and still_to_delete(record, current[n].created)]
        # a server over several pods is watched on all its pods (its leader is the one drained and deleted)
        servers = {s.name: s for role in SERVER_ROLES for s in groups.servers(obs.role_pods(role))}
        watched = [servers.get(v.name, v) for v in victims]
        for pod in victims:
            if not pod.draining:
                out = await self.api.set_drain(ns, pod.name, pod.uid, True)
                if not out.ok:
                    return f"could not drain {pod.name}: {out.message}"
        drain_timeout = float(spec.remediation.drain_timeout_seconds)
        dialect = dialect_for(spec.engine)
        if stalled:
            wait = min(drain_timeout, STALLED_DRAIN_GRACE_SECONDS)
            if victims and stalled_sample is not None and \
                    await self._progressed(watched[0], stalled_sample, wait, dialect):
                for pod in victims:
                    await self.api.set_drain(ns, pod.name, pod.uid, False)
                return Outcome.RECOVERED
        else:
            await self._drained(watched, drain_timeout, dialect)
        errors = []
        for pod in victims:
            grace = STALLED_DELETE_GRACE_SECONDS if stalled else None
            out = await self.api.delete_pod(ns, pod.name, pod.uid, grace)
            if not out.ok:
                errors.append(f"could not delete {pod.name}: {out.message}")
            else:
                fleet.detection.windows.reset(pod.name)
                fleet.logger.info("deleted %s (%s)", pod.name, record.action.value)
        self.wake_reconcile((ns, fleet.ref.name))
        return "; ".join(errors) or None

    async def _progressed(self, pod: ServerPod, before: Scrape, wait: float, dialect: Dialect) -> bool:
        """Whether the stalled server made progress since `before`, watched for `wait` s: detection's
        own rule (real tokens or an engine step: a long prefill while it drains is progress too)."""
        deadline = time.monotonic() + wait
        while True:
            now = await self._scrape(pod, dialect)
            if now.ok and set(now.ranks) == set(before.ranks) and now.progressed_since(before):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(WATCH_POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    async def _scrape(self, server: ServerPod, dialect: Dialect) -> Scrape:
        return await scrape_server(self.scraper, server, WATCH_SCRAPE_TIMEOUT, dialect)

    async def _drained(self, pods: list[ServerPod], timeout: float, dialect: Dialect) -> None:
        """Until the (working) servers have finished their requests, or `timeout` (a scale-down's rule)."""
        deadline = time.monotonic() + timeout
        while pods and time.monotonic() < deadline:
            samples = await asyncio.gather(*(self._scrape(p, dialect) for p in pods))
            if all(drained(s) for s in samples):
                return
            await asyncio.sleep(WATCH_POLL_SECONDS)

    async def _wait_replaced(self, fleet: ActingFleet, record: Remediation, group: list[str],
                             spec: FleetSpec) -> None:
        """Until the batch's replacements are Ready (or their startup and drain timeouts pass)."""
        timeout = max(spec.role(role).probes.startup_timeout_seconds for role in spec.roles())
        deadline = time.monotonic() + timeout + spec.remediation.drain_timeout_seconds
        while time.monotonic() < deadline:
            current = {p.name: p for p in fleet.observe().pods if p.owner_uid == fleet.ref.uid}
            if all(n in current and current[n].ready and not current[n].terminating and
                   not still_to_delete(record, current[n].created) for n in group):
                return
            await asyncio.sleep(WATCH_POLL_SECONDS)

    async def _persist(self, key: FleetKey, fleet: ActingFleet, record: Remediation) -> bool:
        """Until the record is in the API server (the reconcile pass writes it), or the timeout."""
        self.publish(key, fleet, fleet.observe())
        return await fleet.share.until_stored(record, PERSIST_TIMEOUT_SECONDS, lambda: self.wake_reconcile(key))

    async def _finish(self, key: FleetKey, fleet: ActingFleet, record: Remediation, outcome: Outcome,
                      message: str) -> None:
        done = record.ended(outcome, message)
        fleet.share.note(done)
        self.metrics.remediations.labels(record.action.value, outcome.value).inc()
        kind, reason = outcome.event
        await fleet.events.say(self.api, kind, reason, f"{record.action.value} {', '.join(record.targets)}: "
                               f"{outcome.value}. {message}", record.server, force=True)
        self.publish(key, fleet, fleet.observe())
