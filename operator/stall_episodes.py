"""What the stall loop announces once per stretch, not once per scrape: a stall episode beginning
(a metric, a log line and an Event per stalled server incarnation; why the last one ended, for the
Stalled condition), and a server unreachable for a whole stall window (an Event; never acted on:
a scrape failure is not a stall)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from adpfleet.operator.decisions import stall_status
from adpfleet.operator.decisions.detection import StallVerdict, evidence_text
from adpfleet.operator.decisions.observed import ServerPod
from adpfleet.operator.resource.names import FleetKey
from adpfleet.operator.resource.vocabulary import ServerState
from adpfleet.operator.stall_events import Say
from adpfleet.operator.telemetry import StallMetrics


@dataclass
class StallEpisodes:
    ongoing: dict[str, stall_status.Episode] = field(default_factory=dict)  # server -> its ongoing stall
    ended: str | None = None  # why the last stall episode ended

    def verdicts(self) -> list[StallVerdict]:
        """The ongoing episodes' latest stalled verdicts (what the Stalled condition says)."""
        return [e.verdict for e in self.ongoing.values()]

    async def follow(self, key: FleetKey, verdicts: list[StallVerdict], pods: list[ServerPod], say: Say,
                     metrics: StallMetrics, logger: logging.Logger) -> None:
        self.ongoing, began, ended = stall_status.follow_stalls(self.ongoing, verdicts, pods)
        if ended:
            self.ended = "; ".join(ended)
        for verdict in began:
            metrics.stalls.labels(*key, verdict.signature.value).inc()
            # the scrapes the verdict spans (time.time() of the first and last, and how many), unrounded
            logger.warning("stall detected: %s", verdict.summary(), extra={
                "stalled_since": verdict.since, "decided_at": verdict.at, "scrapes": verdict.evidence.get("scrapes")})
            await say("Warning", "StallDetected", f"{verdict.summary()}; evidence: {evidence_text(verdict.evidence)}",
                      verdict.server, force=True)


@dataclass
class UnreachableServers:
    since: dict[str, float] = field(default_factory=dict)  # server -> when its scrapes began to fail
    reported: set[str] = field(default_factory=set)

    async def report(self, verdicts: dict[str, StallVerdict], window: float, now: float, say: Say) -> None:
        """An Event once a server has been unreachable for a whole stall window."""
        for server, v in verdicts.items():
            if v.state is not ServerState.UNREACHABLE:
                self._forget(server)
                continue
            since = self.since.setdefault(server, now)
            if now - since >= window and server not in self.reported:
                self.reported.add(server)
                await say("Warning", "ServerUnreachable", f"{v.summary()}; not acted on (a server that cannot be "
                          f"scraped is not a stall)", server, force=True)
        for server in [s for s in self.since if s not in verdicts]:
            self._forget(server)

    def _forget(self, server: str) -> None:
        self.since.pop(server, None)
        self.reported.discard(server)
