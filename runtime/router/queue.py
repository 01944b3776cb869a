"""Requests the router cannot place yet, held until a server can take them.

A request that finds no usable server for its mode (no Ready server of a role: starting, drained,
restarting, or every one failed and cooling down) waits here instead of getting a 503 at once:
at most `max_size` requests wait at a time, each request for at most `timeout_s` in all (however
many of its attempts had to wait). Every waiter looks at the pool again whenever it changed
(discovery, a health probe) or a failed server's cool-down ends; all waiters that find a server
go on together and the pool's least-loaded selection spreads them. The bodies of the waiters take
at most `max_bytes` in all (each counted as what its parsed JSON takes, `limits.JsonBody.footprint`):
a bound in requests alone would let 256 bodies of small JSON values take gigabytes. What the client
gets when waiting fails — a 503 or 429 with Retry-After — is `retry.final_error`'s business.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from adpfleet.runtime.router.metrics import RouterMetrics

# The `outcome` label of adpfleet_router_queued_total.
OUTCOMES = (
    "placed",   # a server became usable while the request waited
    "full",     # the queue already held max_size requests: refused without waiting
    "over_bytes",  # the bodies waiting and this one would take more than max_bytes: refused without waiting
    "timeout",  # the queue timeout (or the request's own deadline) passed first
    "left",     # the client went away while waiting
)


DEFAULT_MAX_BYTES = 256 << 20


class RequestQueue:
    def __init__(self, max_size: int, timeout_s: float, metrics: RouterMetrics, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_size, self.timeout_s, self.metrics, self.max_bytes = max_size, timeout_s, metrics, max_bytes
        self.waiting = 0
        self.held_bytes = 0  # what the waiters' bodies take
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """The pool changed: every waiter checks again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, placeable: Callable[[], bool], until: float,
                   recovery_in: Callable[[], float | None] = lambda: None, body_bytes: int = 0) -> str:
        """Hold the caller, whose body takes `body_bytes`, until `placeable()` or the loop time
        `until`; one of OUTCOMES (never 'left': a client leaving cancels the caller).
        `recovery_in()`: seconds until the pool may change without telling (a cool-down ends), or None."""
        loop = asyncio.get_running_loop()
        refused = "full" if self.waiting >= self.max_size else \
            "over_bytes" if self.held_bytes + body_bytes > self.max_bytes else None
        if refused:
            self.metrics.queued.labels(refused).inc()
            return refused
        self._hold(1, body_bytes)
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
            self._hold(-1, -body_bytes)
            self.metrics.queued.labels(outcome).inc()
            self.metrics.queue_wait.observe(loop.time() - started)

    def _hold(self, requests: int, body_bytes: int) -> None:
        self.waiting += requests
        self.held_bytes += body_bytes
        self.metrics.queue_waiting.set(self.waiting)
        self.metrics.queue_bytes.set(self.held_bytes)
