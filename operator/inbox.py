"""Alerts between the webhook and the stall controller: `alerts.py` parses Alertmanager's
notifications into `StallAlert`s and puts them here; each fleet's stall loop (`stall.py`) takes its
own, re-checks the named server and decides as it does for its own verdicts."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from adpfleet.operator.resource.names import FleetKey

INBOX_LIMIT = 1_000  # queued alerts over all fleets


@dataclass(frozen=True)
class StallAlert:
    """A firing stall alert naming one server pod."""
    alertname: str
    namespace: str
    fleet: str
    pod: str
    fingerprint: str
    starts_at: str
    received_at: float
    summary: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.fingerprint, self.starts_at)

    @property
    def source(self) -> str:
        return f"alert {self.alertname} (fingerprint {self.fingerprint}, since {self.starts_at})"


class AlertInbox:
    """Queued alerts per fleet, taken by that fleet's stall loop. Bounded: a full inbox refuses (the
    webhook answers 503, and Alertmanager retries)."""

    def __init__(self, limit: int = INBOX_LIMIT):
        self.limit = limit
        self._queues: dict[FleetKey, deque[StallAlert]] = {}
        self._size = 0
        self.on_put: Callable[[FleetKey], None] | None = None  # wakes the fleet's stall loop

    def room(self) -> int:
        return self.limit - self._size

    def put(self, alert: StallAlert) -> None:
        key = (alert.namespace, alert.fleet)
        self._queues.setdefault(key, deque()).append(alert)
        self._size += 1
        if self.on_put:
            self.on_put(key)

    def take(self, namespace: str, fleet: str) -> list[StallAlert]:
        queue = self._queues.pop((namespace, fleet), None)
        if not queue:
            return []
        self._size -= len(queue)
        return list(queue)

    def __len__(self) -> int:
        return self._size
