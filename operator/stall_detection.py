"""The stall loop's own detection: one scrape of every judged server per tick (`scrape_servers`,
read by the autoscaling policy too), each added to its server's window of scrapes, the window judged
(`OwnDetection`, over `decisions/detection.py`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from adpfleet.operator.adapters.dialects import Dialect
from adpfleet.operator.adapters.scrape import Scrape, Scraper, scrape_pods, timeout_for
from adpfleet.operator.decisions.detection import SampleWindows, StallVerdict, attribute, judge, keep_seconds
from adpfleet.operator.decisions.observed import ServerPod
from adpfleet.operator.stall_look import Look
from adpfleet.operator.telemetry import StallMetrics

CONFIRMATIONS = 2  # consecutive scrapes that must agree before a stall is acted on


async def scrape_server(scraper: Scraper, server: ServerPod, timeout: float, dialect: Dialect) -> Scrape:
    """One scrape of a server, read in its engine's dialect: of every pod of a server over several pods, as one."""
    return await scrape_pods(scraper, [(p.name, p.ip) for p in server.pods], timeout, dialect)


async def scrape_servers(scraper: Scraper, metrics: StallMetrics, servers: list[ServerPod],
                         interval: float, dialect: Dialect) -> dict[str, Scrape]:
    """One scrape of every server, all at once: pod name -> Scrape."""
    timeout = timeout_for(interval)

    async def timed(server: ServerPod) -> Scrape:
        start = time.monotonic()
        sample = await scrape_server(scraper, server, timeout, dialect)
        metrics.scrape_seconds.observe(time.monotonic() - start)
        metrics.scrapes.labels("ok" if sample.ok else "failed").inc()
        return sample
    samples = await asyncio.gather(*(timed(s) for s in servers))
    return {server.name: sample for server, sample in zip(servers, samples)}


@dataclass
class OwnDetection:
    """Each judged server's recent scrapes, and this tick's verdicts on them."""
    windows: SampleWindows = field(default_factory=SampleWindows)
    verdicts: dict[str, StallVerdict] = field(default_factory=dict)

    def judge(self, look: Look, scrapes: dict[str, Scrape]) -> dict[str, StallVerdict]:
        """Judge every judged server's window of scrapes, this tick's included; a server Blocked by
        its peers is told which ones (a transfer stall is the stall of the server not completing its
        pulls)."""
        self.windows.retain(p.name for p in look.judged)
        keep = keep_seconds(look.window, look.interval, CONFIRMATIONS)
        verdicts = {}
        for pod in look.judged:
            self.windows.add(pod.name, pod.uid, scrapes[pod.name], keep_seconds=keep)
            verdicts[pod.name] = judge(pod.name, pod.role, self.windows.samples(pod.name),
                                       window_seconds=look.window, interval_seconds=look.interval,
                                       confirmations=CONFIRMATIONS)
        self.verdicts = {v.server: v for v in attribute(verdicts.values(), [p.view for p in look.pods])}
        return self.verdicts

    def stand_down(self) -> None:
        """Nothing is judged (remediation.mode Disabled, or detection off): nothing is remembered."""
        self.windows.retain(())
        self.verdicts = {}

    def latest(self, server: str) -> Scrape | None:
        """The server's newest successful scrape (what a drain compares against)."""
        samples = [s for s in self.windows.samples(server) if s.ok]
        return samples[-1] if samples else None
