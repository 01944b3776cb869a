"""Alerts re-checked: a server an Alertmanager alert names is scraped afresh a few times, half a
scrape interval apart, and judged on those scrapes alone; a confirmed stall then stands for one
stall window beside the loop's own verdicts (its own schedule: the alert's, not the loop's)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from adpfleet.operator.adapters.scrape import Scrape, Scraper, timeout_for
from adpfleet.operator.decisions.detection import StallVerdict, judge
from adpfleet.operator.inbox import StallAlert
from adpfleet.operator.stall_detection import scrape_server
from adpfleet.operator.stall_events import Say
from adpfleet.operator.stall_look import Look
from adpfleet.operator.telemetry import StallMetrics

RECHECK_SCRAPES = 3             # fresh scrapes of a server an alert names ...
RECHECK_GAP = (0.5, 2.5)        # ... half a scrape interval apart, within these bounds (seconds)


@dataclass
class AlertRechecks:
    """The stalls alerts confirmed, each standing for a stall window: server -> (verdict, until)."""
    standing: dict[str, tuple[StallVerdict, float]] = field(default_factory=dict)

    def verdicts(self) -> list[StallVerdict]:
        return [v for v, _ in self.standing.values()]

    async def confirm(self, alerts: list[StallAlert], look: Look, scraper: Scraper, say: Say,
                      metrics: StallMetrics, clock: Callable[[], float]) -> dict[str, str]:
        """Verdicts for the servers this tick's alerts name, from fresh scrapes; the ones no longer
        standing are dropped. Server -> the alert, for the servers whose stall an alert confirmed."""
        sources = {}
        for alert in alerts:
            verdict = await _recheck(alert, look, scraper, say, metrics)
            if verdict is not None:  # keyed by the server: an alert may name a worker pod of it
                self.standing[verdict.server] = (verdict, clock() + look.window)
                sources[verdict.server] = alert.source if alert.pod == verdict.server else \
                    f"{alert.source} on pod {alert.pod}"
        now = clock()
        judged = {p.name for p in look.judged}
        self.standing = {s: (v, until) for s, (v, until) in self.standing.items() if until > now and s in judged}
        return sources


async def _recheck(alert: StallAlert, look: Look, scraper: Scraper, say: Say,
                   metrics: StallMetrics) -> StallVerdict | None:
    """The alert's server, scraped afresh: still no tokens with work pending? (the alert stands for
    the window; these scrapes confirm it still holds now). Prometheus scrapes every pod, so the
    alert may name a worker pod of a server over several pods: its whole group is re-checked."""
    pod = next((p for p in look.judged if any(m.name == alert.pod for m in p.pods)), None)
    if pod is None:
        await say("Normal", "AlertIgnored", f"{alert.source}: pod {alert.pod} is not a Ready server of this "
                  f"fleet (starting, being replaced, or gone)", alert.pod)
        metrics.alerts.labels("stale").inc()
        return None
    gap = min(max(look.interval / 2, RECHECK_GAP[0]), RECHECK_GAP[1])
    fresh: list[Scrape] = []
    for i in range(RECHECK_SCRAPES):
        if i:
            await asyncio.sleep(gap)
        fresh.append(await scrape_server(scraper, pod, timeout_for(look.interval), look.dialect))
    verdict = judge(pod.name, pod.role, fresh, window_seconds=fresh[-1].at - fresh[0].at, interval_seconds=0.0,
                    confirmations=1)
    if not verdict.stalled:
        metrics.alerts.labels("not_confirmed").inc()
        of = "" if alert.pod == pod.name else f" (the server of pod {alert.pod})"
        await say("Normal", "AlertNotConfirmed", f"{alert.source}: a fresh check of {pod.name}{of} does not "
                  f"confirm a stall: {verdict.summary()}", pod.name)
        return None
    metrics.alerts.labels("confirmed").inc()
    return verdict
