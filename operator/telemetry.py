"""The operator's own health and metrics: a heartbeat of the reconcile loops behind /healthz, and
Prometheus metrics for reconciles, errors, durations, every API request it makes (`OperatorMetrics`)
and stall detection and remediation (`StallMetrics`).

Liveness is "the handlers are alive", not "the process is": each fleet's loop beats when a pass
starts and ends and at least once per resync period. The endpoint fails when a pass has been
running longer than `stuck_after` seconds (a hung API call, a deadlock) or when a loop has not
beaten for `resync + stuck_after` seconds (it died or never woke up). An operator watching no
fleets is alive while its event loop answers, which serving the probe itself proves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from adpfleet.operator.resource.names import FleetKey
from adpfleet.operator.resource.vocabulary import ServerState


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
        self.scale_changes = Counter("adpfleet_operator_scale_changes_total", "Changes of a role's desired server "
                                     "count, by role and reason (the policy's, the spec's, kubectl's or an "
                                     "autoscaler's).", ["role", "reason"], registry=r)
        self.fleets = Gauge("adpfleet_operator_fleets", "Fleets the operator currently reconciles.", registry=r)
        self.healthy = Gauge("adpfleet_operator_healthy", "1 while /healthz passes.", registry=r)
        self.leader = Gauge("adpfleet_operator_leader", "1 while this replica holds the leader Lease (and acts); "
                            "1 always without leader election.", registry=r)
        self.leader_transitions = Counter("adpfleet_operator_leader_acquisitions_total",
                                          "Times this replica became the leader.", registry=r)


class StallMetrics:
    """The stall controller's part of the operator's /metrics (docs/remediation.md lists them)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.stalls = Counter("adpfleet_operator_stalls_detected_total", "Stalls confirmed (once per stalled "
                              "server incarnation), by signature.", ["fleet_namespace", "fleet", "signature"],
                              registry=r)
        self.remediations = Counter("adpfleet_operator_remediations_total", "Remediation decisions by action and "
                                    "result (Succeeded, Failed, Recovered, DryRun, Halted, or why it was skipped).",
                                    ["action", "result"], registry=r)
        self.scrapes = Counter("adpfleet_operator_scrapes_total", "Scrapes of servers' /metrics, by result.",
                               ["result"], registry=r)
        self.scrape_seconds = Histogram("adpfleet_operator_scrape_duration_seconds", "Latency of one scrape of a "
                                        "server's /metrics (connect, request, read, parse).",
                                        buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5),
                                        registry=r)
        self.alerts = Counter("adpfleet_operator_alerts_received_total", "Alerts received on the webhook, by "
                              "result.", ["result"], registry=r)
        self.servers = Gauge("adpfleet_operator_servers", "Servers by their latest verdict.",
                             ["fleet_namespace", "fleet", "state"], registry=r)
        self.budget_exhausted = Gauge("adpfleet_operator_remediation_budget_exhausted", "1 while the fleet's "
                                      "remediation budget for the hour is used up.", ["fleet_namespace", "fleet"],
                                      registry=r)
        self.halted = Gauge("adpfleet_operator_remediation_halted", "1 while escalation has halted the fleet's "
                            "remediation.", ["fleet_namespace", "fleet"], registry=r)

    def set_fleet(self, key: FleetKey, states: Iterable[ServerState], budget_exhausted: bool,
                  halted: bool) -> None:
        """The fleet's gauges: servers per state (every state, zeros included), budget, halt."""
        counts = {state: 0 for state in ServerState}
        for state in states:
            counts[state] += 1
        for state, n in counts.items():
            self.servers.labels(*key, state.value).set(n)
        self.budget_exhausted.labels(*key).set(1 if budget_exhausted else 0)
        self.halted.labels(*key).set(1 if halted else 0)

    def forget(self, key: FleetKey) -> None:
        """Drop a fleet's gauges (it is gone, or no longer ours)."""
        for gauge in (self.budget_exhausted, self.halted):
            try:
                gauge.remove(*key)
            except KeyError:
                pass
        for state in ServerState:
            try:
                self.servers.remove(*key, state.value)
            except KeyError:
                pass


class ScalingMetrics:
    """The autoscaling policy's part of the operator's /metrics (docs/autoscaling.md)."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        labels = ["fleet_namespace", "fleet", "role"]
        self.signal = Gauge("adpfleet_operator_role_signal", "A role's signal as the autoscaling policy last read it "
                            "(mean per ADP rank over its serving servers).", labels + ["signal"], registry=r)
        self.desired = Gauge("adpfleet_operator_role_desired_servers", "Servers the autoscaling policy wants for "
                             "a role.", labels, registry=r)
        self.decisions = Counter("adpfleet_operator_scaling_decisions_total", "Changes the autoscaling policy "
                                 "decided, by role and reason.", ["role", "reason"], registry=r)

    def forget(self, key: FleetKey, roles: Iterable[str], signals: Iterable[str]) -> None:
        for role in roles:
            for gauge, extra in ((self.desired, ()),) + tuple((self.signal, (s,)) for s in signals):
                try:
                    gauge.remove(*key, role, *extra)
                except KeyError:
                    pass
