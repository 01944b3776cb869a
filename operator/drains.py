"""The drains of scale-downs: which leaving servers have finished their requests.

A scale-down drains a Ready server before deleting it (`decisions/rollout.py`): the reconcile pass
marks it (the router stops sending it requests) and asks `finished` each pass which of the leaving
servers have nothing in flight any more. Each leaving server is watched by a small task that scrapes
it every `POLL_SECONDS` until its ranks report no request running or waiting and no KV held for a
transfer (a generation server has pulled it) — or until nothing answers on its port at all (no
server, nothing in flight) — and then wakes the fleet's reconcile loop, which deletes the pod. The
drain timeout (the role's `drainTimeoutSeconds`) is the reconcile's, read from the pod's own
annotation, so an operator restarted mid-drain neither forgets it nor starts it over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from adpfleet.operator.adapters.dialects import ADPFLEET, Dialect
from adpfleet.operator.adapters.scrape import Scrape, Scraper, metrics_url
from adpfleet.operator.decisions.observed import ServerPod
from adpfleet.operator.resource.names import FleetKey

log = logging.getLogger("adpfleet.operator.drains")

POLL_SECONDS = 0.5      # how often a leaving server is looked at
SCRAPE_TIMEOUT = 2.0


def drained(sample: Scrape) -> bool:
    """Nothing in flight: no request running or waiting, no KV held for a transfer; or nothing listening.
    A rank that does not know a gauge adds nothing: a vLLM engine publishes its queue gauges at its first
    step, so one without them has never had a request."""
    if sample.ok:
        return sample.total("requests_running") + sample.total("requests_waiting") + \
            sample.total("kv_transfers_in_flight") == 0
    return sample.refused


class DrainWatch:
    def __init__(self, scraper: Scraper, wake: Callable[[FleetKey], None]):
        self.scraper = scraper
        self.wake = wake
        self._done: dict[str, str] = {}               # uid whose drain finished -> its (key, role) group
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}  # uid -> (group, its watch)

    def finished(self, key: FleetKey, leaving: list[ServerPod], role: str = "",
                 dialect: Dialect = ADPFLEET) -> frozenset[str]:
        """See reconciler.DrainPart. Called per role with all of its leaving servers, whose /metrics
        read in `dialect` (their engine's): a server no longer among them (deleted, or wanted again)
        is forgotten."""
        group = f"{key[0]}/{key[1]}/{role}"
        now = {p.uid for p in leaving}
        for uid in [u for u, g in self._done.items() if g == group and u not in now]:
            del self._done[uid]
        for uid, (g, task) in list(self._tasks.items()):
            if g == group and uid not in now:
                task.cancel()
                del self._tasks[uid]
        for pod in leaving:
            if pod.uid not in self._done and pod.uid not in self._tasks and pod.ip:
                self._tasks[pod.uid] = (group, asyncio.ensure_future(self._watch(key, pod, group, dialect)))
        return frozenset(p.uid for p in leaving if p.uid in self._done)

    async def _watch(self, key: FleetKey, pod: ServerPod, group: str, dialect: Dialect) -> None:
        try:
            while True:
                sample = await self.scraper(metrics_url(pod.ip), SCRAPE_TIMEOUT, dialect)
                if drained(sample):
                    log.info("%s drained (%s)", pod.name, "idle" if sample.ok else "nothing listening")
                    self._done[pod.uid] = group
                    self.wake(key)
                    return
                await asyncio.sleep(POLL_SECONDS)
        finally:
            if self._tasks.get(pod.uid, (None, None))[1] is asyncio.current_task():
                del self._tasks[pod.uid]

    def close(self) -> None:
        for _, task in list(self._tasks.values()):
            task.cancel()
