"""One loop per fleet: run a reconcile pass, then sleep until something about the fleet changes.

kopf runs `FleetLoops.run` as the fleet's daemon, so passes of one fleet never overlap and passes
of different fleets run concurrently. Watch events (the fleet itself, its pods, its router objects)
call `wake`; a pass also runs when its requested requeue time or the resync period is up. A burst of
events is absorbed by a short settle delay, so one pass sees all of them.

The stall controller runs beside this as a second kopf daemon per fleet (`stall.py`): it reads the
same indexes, decides from its own scrapes, and calls `wake` when its part of the status changed
(this loop's pass is the status's one writer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from adpfleet.operator.decisions.observed import FleetObservation
from adpfleet.operator.reconciler import FleetMemory, MAX_BACKOFF_SECONDS, Reconciler
from adpfleet.operator.resource.names import FleetKey
from adpfleet.operator.telemetry import Heartbeats, OperatorMetrics

log = logging.getLogger("adpfleet.operator.loops")


class FleetLoops:
    def __init__(self, reconciler: Reconciler, metrics: OperatorMetrics, heartbeats: Heartbeats, *,
                 resync_seconds: float, settle_seconds: float = 0.2):
        self.reconciler = reconciler
        self.metrics = metrics
        self.heartbeats = heartbeats
        self.resync_seconds = resync_seconds
        self.settle_seconds = settle_seconds
        self._wakeups: dict[FleetKey, asyncio.Event] = {}

    def wake(self, key: FleetKey) -> None:
        event = self._wakeups.get(key)
        if event is not None:
            event.set()

    async def run(self, key: FleetKey, observe: Callable[[], FleetObservation], stopped: Any,
                  logger: logging.Logger) -> None:
        """The fleet's loop until kopf stops it (fleet deleted, operator exiting)."""
        wake = self._wakeups[key] = asyncio.Event()
        memory = FleetMemory()
        self.metrics.fleets.inc()
        try:
            while not stopped:
                wake.clear()
                requeue = await self._one_pass(key, observe, memory, logger)
                await sleep_until(wake, stopped, requeue if requeue is not None else self.resync_seconds)
                if wake.is_set() and not stopped:
                    await sleep_until(asyncio.Event(), stopped, self.settle_seconds)
        finally:
            self._wakeups.pop(key, None)
            self.heartbeats.forget(key)
            self.metrics.fleets.dec()

    async def _one_pass(self, key: FleetKey, observe, memory: FleetMemory, logger: logging.Logger) -> float | None:
        self.heartbeats.started(key)
        start = time.monotonic()
        try:
            result = await self.reconciler.reconcile(observe(), memory, logger)
            self.metrics.reconciles.labels("error" if result.failed else "ok").inc()
            if result.failed:
                self.metrics.reconcile_errors.inc()
            return result.requeue_after
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug or an unexpected reply: logged, retried, never fatal
            logger.exception("reconcile failed; retrying")
            self.metrics.reconciles.labels("error").inc()
            self.metrics.reconcile_errors.inc()
            memory.failures += 1
            return min(MAX_BACKOFF_SECONDS, 2.0 ** memory.failures)
        finally:
            self.metrics.reconcile_seconds.observe(time.monotonic() - start)
            self.heartbeats.finished(key)


async def sleep_until(wake: asyncio.Event, stopped: Any, timeout: float) -> None:
    """Until `wake` is set, kopf stops the daemon, or `timeout` passes.

    The time limit is this wait's, not kopf's `stopped.wait(timeout)`: that one runs a task of its own that
    ends in TimeoutError when the limit passes, and a task that ends so while kopf stops the operator is
    re-raised by kopf as the operator's failure (a clean-clone run: SIGTERM mid-roll, exit status 1)."""
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
