"""Leader election: which of the operator's replicas acts (decisions/leadership.py says how).

A replica starts as a standby: it reads the Lease every retry period and does nothing else (no
watches, no caches, no writes). When the Lease is free or has expired it takes it, and the process
starts kopf: the fleets' loops, the stall loops, the webhook's actions. From then on it renews the
Lease every retry period; when it has not managed to for the renew deadline (partitioned, or the
API server down) `keep` calls `on_lost`, which exits the process at once — it must not write after
another replica may have taken over. A graceful stop hands the Lease back so a standby takes over
within a retry period.

Why a Lease and not kopf's peering: a Lease is what client-go and controller-runtime operators use
(`kubectl get lease` shows the holder), it needs no CRD of its own, and it gives a stated bound on
a takeover; kopf's peering pauses operators of lower priority but has no notion of a single holder
among equals, and runs the watches on every replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from adpfleet.operator.adapters.kube import KubeApi, now_micro
from adpfleet.operator.decisions.leadership import (LeaseRecord, Observation, Step, Timing, decide, lease_spec,
                                                    observe, released_spec)
from adpfleet.operator.telemetry import OperatorMetrics

log = logging.getLogger("adpfleet.operator.election")


class LeaderElector:
    def __init__(self, api: KubeApi, metrics: OperatorMetrics, *, namespace: str, name: str, identity: str,
                 timing: Timing, clock: Callable[[], float] = time.monotonic):
        problem = timing.problem()
        if problem:
            raise ValueError(problem)
        self.api = api
        self.metrics = metrics
        self.namespace, self.name, self.identity = namespace, name, identity
        self.timing = timing
        self.clock = clock
        self.view: Observation | None = None
        self.record: LeaseRecord | None = None  # ours, as last written (renewals need no read first)
        self.leading = False
        self.last_attempt = clock()

    @property
    def role(self) -> str:
        return "leader" if self.leading else "standby"

    async def acquire(self, stopping: asyncio.Event) -> bool:
        """Until this replica holds the Lease (True) or `stopping` is set (False)."""
        log.info("leader election: %s is a standby for Lease %s/%s", self.identity, self.namespace, self.name)
        while not stopping.is_set():
            if await self._bounded(self._try_acquire()):
                self._became_leader()
                return True
            try:
                await asyncio.wait_for(stopping.wait(), timeout=self.timing.retry_period)
            except asyncio.TimeoutError:
                pass
        return False

    async def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew every retry period; `on_lost(why)` once the renew deadline passes without a renewal
        (a request that hangs counts as failed when its retry period is over)."""
        renewed = self.clock()
        while True:
            started = self.clock()
            if await self._bounded(self._renew()):
                renewed = self.clock()
            elif not self.leading:
                holder = self.view.record.holder if self.view and self.view.record else "another replica"
                return on_lost(f"Lease {self.namespace}/{self.name} was taken over by {holder}")
            if self.clock() - renewed >= self.timing.renew_deadline:
                return on_lost(f"Lease {self.namespace}/{self.name} not renewed for {self.clock() - renewed:.1f} s "
                               f"(renew deadline {self.timing.renew_deadline:g} s)")
            await asyncio.sleep(max(0.0, self.timing.retry_period - (self.clock() - started)))

    async def release(self) -> None:
        """Hand the Lease back (a graceful stop): a standby takes it on its next look."""
        if not self.leading or self.record is None:
            return
        self.leading = False
        self.metrics.leader.set(0)
        done = await self._bounded(self.api.replace_lease(self.namespace, self.name,
                                                          released_spec(self.record, now_micro()),
                                                          self.record.resource_version), want_result=True)
        out = done[0] if done else None
        log.info("leader election: released Lease %s/%s%s", self.namespace, self.name,
                 "" if out and out.ok else f" failed ({out.message if out else 'timed out'}); it expires instead")

    # ---- one attempt ----

    async def _try_acquire(self) -> bool:
        self.last_attempt = self.clock()
        out, lease = await self.api.read_lease(self.namespace, self.name)
        record = LeaseRecord.from_lease(lease)
        if not out.ok:
            log.warning("leader election: cannot read Lease %s/%s: %s", self.namespace, self.name, out.message)
            return False
        self.view = observe(self.view, record, self.clock())
        step = decide(self.view, self.identity, self.clock(), self.timing)
        if step is Step.WAIT:
            return False
        spec = lease_spec(record, self.identity, step, now_micro(), self.timing)
        if step is Step.CREATE:
            out, written = await self.api.create_lease(self.namespace, self.name, spec)
        else:
            out, written = await self.api.replace_lease(self.namespace, self.name, spec, record.resource_version)
        if not out.ok:  # 409: another replica was faster
            log.info("leader election: could not %s Lease %s/%s: %s", step.value, self.namespace, self.name,
                     out.message)
            return False
        self.record = LeaseRecord.from_lease(written)
        if step is Step.TAKE and record and record.holder:
            log.warning("leader election: took over Lease %s/%s from %s (not renewed for %.1f s)", self.namespace,
                        self.name, record.holder, self.clock() - self.view.changed_at)
        return True

    async def _renew(self) -> bool:
        self.last_attempt = self.clock()
        spec = lease_spec(self.record, self.identity, Step.RENEW, now_micro(), self.timing)
        out, written = await self.api.replace_lease(self.namespace, self.name, spec, self.record.resource_version)
        if out.ok:
            self.record = LeaseRecord.from_lease(written)
            return True
        if out.code == 409:  # changed under us: read it; someone else holding it means we lost
            read, lease = await self.api.read_lease(self.namespace, self.name)
            record = LeaseRecord.from_lease(lease)
            if read.ok and record is not None and record.holder == self.identity:
                self.record = record
                return await self._renew()
            if read.ok:
                self.leading = False
                self.metrics.leader.set(0)
                self.view = observe(self.view, record, self.clock())
        log.warning("leader election: could not renew Lease %s/%s: %s", self.namespace, self.name, out.message)
        return False

    async def _bounded(self, coro, want_result: bool = False):
        """`coro`'s result, or False (None) when it takes longer than a retry period."""
        try:
            return await asyncio.wait_for(coro, timeout=self.timing.retry_period)
        except asyncio.TimeoutError:
            log.warning("leader election: a Lease request took longer than %.1f s", self.timing.retry_period)
            return None if want_result else False

    def _became_leader(self) -> None:
        self.leading = True
        self.metrics.leader.set(1)
        self.metrics.leader_transitions.inc()
        log.info("leader election: %s leads (Lease %s/%s)", self.identity, self.namespace, self.name)
