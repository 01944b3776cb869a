"""Requests the router cannot place yet, held until a server can take them.

A request that finds no usable server for its mode (no Ready server of a role: starting, drained,
restarting, or every one failed and cooling down) waits here instead of getting a 503 at once:
at most `max_size` requests wait at a time, each request for at most `timeout_s` in all (however
many of its attempts had to wait). Every waiter looks at the pool again whenever it changed
(discovery, a health probe) or a failed server's cool-down ends; all waiters that find a server
go on together and the pool's least-loaded selection spreads them. What the client gets when
waiting fails — a 503 with Retry-After — is `retry.final_error`'s business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from adpfleet.runtime.router.metrics import RouterMetrics

# The `outcome` label of adpfleet_router_queued_total.
OUTCOMES = (
    "placed",   # a server became usable while the request waited
    "full",     # the queue already held max_size requests: refused without waiting
    "timeout",  # the queue timeout (or the request's own deadline) passed first
    "left",     # the client went away while waiting
)


class RequestQueue:
    def __init__(self, max_size: int, timeout_s: float, metrics: RouterMetrics):
        self.max_size, self.timeout_s, self.metrics = max_size, timeout_s, metrics
        self.waiting = 0
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """The pool changed: every waiter checks again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, placeable: Callable[[], bool], until: float,
                   recovery_in: Callable[[], float | None] = lambda: None) -> str:
        """Hold the caller until `placeable()` or the loop time `until`; one of OUTCOMES (never
        'left': a client leaving cancels the caller). `recovery_in()`: seconds until the pool
        may change without telling (a cool-down ends), or None."""
        loop = asyncio.get_running_loop()
        if self.waiting >= self.max_size:
            self.metrics.queued.labels("full").inc()
            return "full"
        self.waiting += 1
        self.metrics.queue_waiting.set(self.waiting)
        started, outcome = loop.time(), "left"
        try:
            while True:
                if placeable():
                    outcome = "placed"
                    return outcome
                left = until - loop.time()
                if left <= 0:
                    outcome = "timeout"
                    return outcome
                changed = self._changed
                soon = recovery_in()
                try:
                    await asyncio.wait_for(changed.wait(), left if soon is None else min(left, max(soon, 0.01)))
                except TimeoutError:
                    pass
        finally:
            self.waiting -= 1
            self.metrics.queue_waiting.set(self.waiting)
            self.metrics.queued.labels(outcome).inc()
            self.metrics.queue_wait.observe(loop.time() - started)
