"""The router's own Prometheus series, in a registry of its own (no process collectors)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from adpfleet.runtime.router.retry import REASONS
from adpfleet.runtime.router.pool import Endpoint

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "adpfleet_router_requests", "Client requests finished, by outcome: the HTTP status sent, "
            "'stream_error' for a stream ended by an error event, 'client_closed' when the client left.",
            ["status"], registry=self.registry)
        self.retries = Counter("adpfleet_router_retries", "Attempts beyond the first, over all requests.",
                               registry=self.registry)
        self.errors = Counter("adpfleet_router_errors", "Failures seen by the router, retried or not.",
                              ["reason"], registry=self.registry)
        self.in_flight = Gauge("adpfleet_router_in_flight", "Requests the router has open on a server.",
                               ["server", "role"], registry=self.registry)
        self.servers = Gauge("adpfleet_router_servers", "Servers known to the router, by role and usability.",
                             ["role", "usable"], registry=self.registry)
        self.queue_waiting = Gauge("adpfleet_router_queue_waiting", "Requests waiting for a usable server now.",
                                   registry=self.registry)
        self.queue_bytes = Gauge("adpfleet_router_queue_bytes", "Bytes the bodies of the waiting requests take now "
                                 "(at most --queue-max-bytes).", registry=self.registry)
        self.queued = Counter("adpfleet_router_queued", "Requests that found no usable server, by how their wait "
                              "ended: placed, full (refused: the queue was full), over_bytes (refused: the bodies "
                              "waiting would take more than --queue-max-bytes), timeout, left (client gone).",
                              ["outcome"], registry=self.registry)
        self.queue_wait = Histogram("adpfleet_router_queue_wait_seconds", "Time requests waited for a usable server.",
                                    buckets=(0.01, 0.1, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300),
                                    registry=self.registry)
        self.prefix_snapshots = Counter(
            "adpfleet_router_prefix_snapshots", "Polls of the servers' GET /internal/prefix_cache, by outcome: ok, "
            "refused (not 200), unreachable, bad_snapshot (not the expected JSON); a server without a good one is "
            "routed by load.", ["outcome"], registry=self.registry)
        self.prefix_decisions = Counter(
            "adpfleet_router_prefix_decisions", "Cache-aware choices of a context or aggregated server: prefix (a "
            "(server, rank) holding part of the prompt, named by X-Data-Parallel-Rank), no_match (no view holds a "
            "block of it: least-loaded), unread (no tokenizer, or a body the server will refuse: least-loaded).",
            ["decision"], registry=self.registry)
        self.prefix_predicted_tokens = Counter(
            "adpfleet_router_prefix_predicted_hit_tokens", "Prompt tokens the router expected the ranks it chose to "
            "hold (compare with the servers' adpfleet_prefix_cache_hits_total).", registry=self.registry)
        self.prefix_predictions = Counter(
            "adpfleet_router_prefix_predictions", "Requests sent to a rank for its prefix, by whether the rank's "
            "next snapshot still held the last block expected: held, missing (the view was wrong or stale).",
            ["outcome"], registry=self.registry)
        for label in ("ok", "refused", "unreachable", "bad_snapshot"):
            self.prefix_snapshots.labels(label)
        for label in ("prefix", "no_match", "unread"):
            self.prefix_decisions.labels(label)
        for label in ("held", "missing"):
            self.prefix_predictions.labels(label)
        for reason in REASONS:
            self.errors.labels(reason)
        for outcome in ("placed", "full", "over_bytes", "timeout", "left"):  # queue.OUTCOMES (queue.py imports this)
            self.queued.labels(outcome)
        self._shown: set[Endpoint] = set()

    def set_in_flight(self, counts: dict[Endpoint, int]) -> None:
        for ep in self._shown - counts.keys():  # a server that left the pool leaves the metrics
            self.in_flight.remove(ep.url, ep.role)
        for ep, n in counts.items():
            self.in_flight.labels(ep.url, ep.role).set(n)
        self._shown = set(counts)

    def render(self) -> bytes:
        return generate_latest(self.registry)
