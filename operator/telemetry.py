"""The operator's own health and metrics: a heartbeat of the reconcile loops behind /healthz, and
Prometheus counters for reconciles, errors, durations and every API request it makes.

Liveness is "the handlers are alive", not "the process is": each fleet's loop beats when a pass
starts and ends and at least once per resync period. The endpoint fails when a pass has been
running longer than `stuck_after` seconds (a hung API call, a deadlock) or when a loop has not
beaten for `resync + stuck_after` seconds (it died or never woke up). An operator watching no
fleets is alive while its event loop answers, which serving the probe itself proves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


@dataclass
class Heartbeats:
    resync_seconds: float
    stuck_after: float
    clock: callable = time.monotonic
    _last_beat: dict = field(default_factory=dict)
    _busy_since: dict = field(default_factory=dict)

    def started(self, key) -> None:
        now = self.clock()
        self._last_beat[key] = now
        self._busy_since[key] = now

    def finished(self, key) -> None:
        self._last_beat[key] = self.clock()
        self._busy_since.pop(key, None)

    def beat(self, key) -> None:
        self._last_beat[key] = self.clock()

    def forget(self, key) -> None:
        self._last_beat.pop(key, None)
        self._busy_since.pop(key, None)

    def problems(self) -> list[str]:
        """Why the operator should be restarted; empty when it is healthy."""
        now = self.clock()
        out = []
        for key, since in self._busy_since.items():
            if now - since > self.stuck_after:
                out.append(f"reconcile of {_show(key)} has been running for {now - since:.0f} s")
        silence = self.resync_seconds + self.stuck_after
        for key, last in self._last_beat.items():
            if key not in self._busy_since and now - last > silence:
                out.append(f"the loop of {_show(key)} has not run for {now - last:.0f} s")
        return out

    def snapshot(self) -> dict:
        now = self.clock()
        return {_show(k): {"seconds_since_beat": round(now - v, 1),
                           "busy_for": round(now - self._busy_since[k], 1) if k in self._busy_since else None}
                for k, v in self._last_beat.items()}


def _show(key) -> str:
    return "/".join(key) if isinstance(key, tuple) else str(key)


class OperatorMetrics:
    """Everything /metrics exports, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reconciles = Counter("adpfleet_operator_reconciles_total", "Reconcile passes, by result "
                                  "(ok, error).", ["result"], registry=r)
        self.reconcile_errors = Counter("adpfleet_operator_reconcile_errors_total",
                                        "Reconcile passes that raised or whose API calls failed.", registry=r)
        self.reconcile_seconds = Histogram("adpfleet_operator_reconcile_duration_seconds", "Duration of one "
                                           "reconcile pass.", buckets=(.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5,
                                                                        10, 30), registry=r)
        self.api_requests = Counter("adpfleet_operator_api_requests_total", "Kubernetes API requests made by the "
                                    "reconciler (kopf's own watches excluded), by verb, resource and HTTP code.",
                                    ["verb", "resource", "code"], registry=r)
        self.api_seconds = Histogram("adpfleet_operator_api_request_duration_seconds",
                                     "Latency of the reconciler's API requests.", ["verb"], registry=r)
        self.actions = Counter("adpfleet_operator_actions_total", "Changes made to fleets' children, by action.",
                               ["action"], registry=r)
        self.fleets = Gauge("adpfleet_operator_fleets", "Fleets the operator currently reconciles.", registry=r)
        self.healthy = Gauge("adpfleet_operator_healthy", "1 while /healthz passes.", registry=r)

    def write_count(self) -> float:
        """API requests that change something (create, patch, delete), summed over resources."""
        total = 0.0
        for metric in self.api_requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.labels.get("verb") in ("create", "patch", "delete",
                                                                                        "update"):
                    total += sample.value
        return total
