"""`adpfleet operator`: the operator process.

It runs kopf (watches, indexes, two daemons per fleet: the reconcile loop and the stall loop) and,
beside it on the same event loop, a small HTTP server: `/healthz` (liveness, from the reconcile
loops' heartbeats), `/readyz` (kopf has started), `/metrics`, and Alertmanager's webhook
`POST /alerts` (on its own TLS listener when given a certificate). Logs are JSON lines by default.
SIGTERM or SIGINT stop it gracefully: kopf stops the fleet loops (a pass in progress finishes), then
the HTTP server closes and the process exits 0.

With `--leader-elect` (the chart's default, two replicas) the process first stands by: it serves
the HTTP endpoints (`/alerts` answers 503 so Alertmanager retries, and lands on the leader) and
reads the Lease, and starts kopf only once it holds it (election.py). A leader that loses the
Lease exits at once with code 1; a leader stopped by SIGTERM hands the Lease back first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import secrets
import signal
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from adpfleet.operator.decisions.leadership import Timing
from adpfleet.contract.roles import SERVER_ROLES

if TYPE_CHECKING:  # the process imports them when it runs (the CLI's other commands need none of them)
    from adpfleet.operator.adapters.scrape import HttpScraper
    from adpfleet.operator.alerts import AlertReceiver
    from adpfleet.operator.drains import DrainWatch
    from adpfleet.operator.election import LeaderElector
    from adpfleet.operator.loops import FleetLoops
    from adpfleet.operator.stall import StallController
    from adpfleet.operator.telemetry import Heartbeats, OperatorMetrics

log = logging.getLogger("adpfleet.operator")


def add_arguments(p) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; default: $WATCH_NAMESPACE, comma-separated)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--http-host", default="0.0.0.0", help="address of /healthz, /readyz and /metrics")
    p.add_argument("--http-port", type=int, default=8080, help="port of /healthz, /readyz and /metrics (0: none)")
    p.add_argument("--resync-seconds", type=float, default=300.0,
                   help="reconcile every fleet at least this often, even without events (from the cache: "
                        "no API request unless something drifted)")
    p.add_argument("--stuck-seconds", type=float, default=120.0,
                   help="/healthz fails when a reconcile pass runs longer than this")
    p.add_argument("--stall-detection", choices=["on", "off"], default="on",
                   help="scrape every server's /metrics and remediate stalls (off: act on Alertmanager alerts only)")
    p.add_argument("--alerts-token-secret", metavar="NAMESPACE/NAME[:KEY]",
                   default=os.environ.get("ADPFLEET_ALERTS_TOKEN_SECRET", ""),
                   help="Secret (key default 'token') holding the bearer token of POST /alerts, Alertmanager's "
                        "webhook (default: $ADPFLEET_ALERTS_TOKEN_SECRET; without it /alerts answers 503)")
    p.add_argument("--alerts-tls-cert", metavar="FILE", default="",
                   help="PEM certificate (chain) of the webhook: with it, POST /alerts is served over TLS on "
                        "--alerts-port and no longer on the plain HTTP port; re-read when the file changes")
    p.add_argument("--alerts-tls-key", metavar="FILE", default="", help="the certificate's private key (PEM)")
    p.add_argument("--alerts-port", type=int, default=8443, help="port of the TLS webhook listener")
    p.add_argument("--network-policies", action="store_true",
                   help="give every fleet NetworkPolicies: server HTTP only from its router, this operator and "
                        "spec.networkPolicy.monitoringNamespaces; KV only from its generation servers")
    p.add_argument("--operator-pod-labels", metavar="K=V[,K=V]", default="",
                   help="labels of this operator's pods, which the NetworkPolicies let reach the servers' /metrics "
                        "(its namespace is $POD_NAMESPACE)")
    p.add_argument("--require-api-key", action="store_true",
                   help="refuse (status InvalidSpec, nothing created) fleets without spec.auth.apiKeySecret")
    election = p.add_argument_group("leader election (one acting replica among several; docs/operator.md)")
    election.add_argument("--leader-elect", action="store_true",
                          help="act only while holding the Lease; otherwise stand by (no watches, no writes)")
    election.add_argument("--leader-election-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                          metavar="NS", help="namespace of the Lease (default: $POD_NAMESPACE)")
    election.add_argument("--leader-election-id", default="adpfleet-operator", metavar="NAME",
                          help="name of the Lease; replicas that share it elect one leader")
    election.add_argument("--lease-duration", type=float, default=Timing.lease_duration, metavar="S",
                          help="a standby takes over a Lease not renewed for this long")
    election.add_argument("--renew-deadline", type=float, default=Timing.renew_deadline, metavar="S",
                          help="the leader exits when it could not renew for this long (< --lease-duration)")
    election.add_argument("--retry-period", type=float, default=Timing.retry_period, metavar="S",
                          help="how often the leader renews and a standby looks")
    p.add_argument("--log-format", choices=["json", "plain"], default="json")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logs")


def main(args) -> int:
    import kopf

    namespaces = [] if args.all_namespaces else \
        (args.namespace or [n for n in os.environ.get("WATCH_NAMESPACE", "").split(",") if n])
    if not namespaces and not args.all_namespaces:
        raise ValueError("say which namespaces to watch: --namespace NS (repeatable), $WATCH_NAMESPACE, "
                         "or --all-namespaces")
    webhook_tls(args)  # a certificate that cannot be used fails here, before anything starts
    security_config(args)  # so do NetworkPolicy settings that cannot be used
    election_timing(args)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.JSON if args.log_format == "json"
                   else kopf.LogFormat.FULL, log_refkey="object", log_prefix=args.log_format == "plain")
    logging.getLogger("adpfleet").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if not args.verbose:  # kopf logs every event handler call on its per-object loggers
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    asyncio.run(run(args, namespaces))
    return 0


def webhook_tls(args):
    """The webhook's certificate files (checked), or None: the webhook then stays on the HTTP port."""
    from adpfleet.operator.httpserver import TlsFiles

    if bool(args.alerts_tls_cert) != bool(args.alerts_tls_key):
        raise ValueError("give both --alerts-tls-cert and --alerts-tls-key, or neither")
    if not args.alerts_tls_cert:
        return None
    tls = TlsFiles(args.alerts_tls_cert, args.alerts_tls_key)
    tls.context()
    return tls


def security_config(args):
    """The operator's own security settings from its flags (docs/security.md)."""
    from adpfleet.operator.decisions.security import OperatorIdentity, SecurityConfig

    identity = None
    if args.network_policies:
        namespace = os.environ.get("POD_NAMESPACE", "")
        if not namespace or not args.operator_pod_labels:
            raise ValueError("--network-policies needs $POD_NAMESPACE and --operator-pod-labels: the policies must "
                             "let this operator's pods reach the servers' /metrics")
        labels = dict(pair.split("=", 1) for pair in args.operator_pod_labels.split(",") if "=" in pair)
        if len(labels) != len([p for p in args.operator_pod_labels.split(",") if p]):
            raise ValueError(f"--operator-pod-labels must be K=V[,K=V], got {args.operator_pod_labels!r}")
        identity = OperatorIdentity(namespace, labels)
    return SecurityConfig(network_policies=identity, require_api_key=args.require_api_key)
def election_timing(args) -> Timing | None:
    """The leader election's timing (checked), or None without --leader-elect."""
    if not args.leader_elect:
        return None
    if not args.leader_election_namespace:
        raise ValueError("--leader-elect needs the Lease's namespace: --leader-election-namespace or $POD_NAMESPACE")
    timing = Timing(args.lease_duration, args.renew_deadline, args.retry_period)
    problem = timing.problem()
    if problem:
        raise ValueError(problem)
    return timing


def identity() -> str:
    """This replica's name in the Lease: the pod (or host) and a random suffix, so that a restarted
    container is a new candidate rather than a holder that forgot it holds the Lease."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(4)}"


def _exit_now(why: str) -> None:
    """Leadership lost: stop writing at once (no graceful shutdown: a pass in progress must not finish)."""
    log.error("leader election lost: %s; exiting so that only the new leader acts", why)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(1)


async def stand_by(elector) -> bool:
    """Wait to become the leader; False when SIGTERM/SIGINT came first (kopf handles them once it runs)."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        return await elector.acquire(stopping)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def operator_settings(settings) -> None:
    import kopf

    from adpfleet.operator.resource.names import FINALIZER

    settings.posting.enabled = False  # Events are written by the reconciler, only when something happened
    settings.persistence.finalizer = FINALIZER
    settings.peering.standalone = True  # no kopf peering: one replica acts, chosen by the Lease (election.py)
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.batching.worker_limit = 200
    settings.scanning.disabled = True  # the resources exist at start-up; no cluster-wide CRD watch needed
    # nothing in kopf's own progress bookkeeping is used (no change handlers); keep it out of the objects
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="adpfleet.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="adpfleet.io", key="last-handled-configuration")


def fleet_pods(stall, namespace: str, name: str) -> set[str] | None:
    """The server pods of a fleet the stall loop watches, as the pods an alert may name (None: it
    watches no such fleet). The stall loop keys its Events by the pod an alert names: only real
    pods, so a sender cannot grow that memory with names of its own."""
    fleet = stall.fleets.get((namespace, name))
    if fleet is None:
        return None
    observed = fleet.observe()
    return {pod.name for role in SERVER_ROLES for pod in observed.role_pods(role)}


async def run(args, namespaces: list[str]) -> None:
    """The operator: its parts wired, its HTTP endpoints served, and kopf run once this replica leads."""
    from adpfleet.operator.adapters.kube import CONNECTION_POOL

    # The API client is synchronous and runs in worker threads: enough of them that fifty fleets
    # converging at once are not queued behind six (the default on a two-core machine).
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=CONNECTION_POOL,
                                                                       thread_name_prefix="kube-api"))
    parts = _wire(args)
    ready = asyncio.Event()
    listeners = await _listen(args, parts, ready)
    try:
        await _operate(args, namespaces, parts, ready)
    finally:
        for server in listeners:
            await server.cleanup()
        await parts.close()
        log.info("stopped")


@dataclass
class _Parts:
    """The operator's parts, wired together: what its HTTP endpoints, kopf and its shutdown use."""
    api_client: Any
    metrics: OperatorMetrics
    heartbeats: Heartbeats
    scraper: HttpScraper
    stall: StallController
    drains: DrainWatch
    loops: FleetLoops
    receiver: AlertReceiver
    elector: LeaderElector | None

    async def close(self) -> None:
        await self.stall.close()
        self.drains.close()
        await self.scraper.close()
        self.api_client.close()


def _wire(args) -> _Parts:
    from adpfleet.operator.adapters.kube import KubeApi, load_api_client, require_crd
    from adpfleet.operator.adapters.scrape import HttpScraper
    from adpfleet.operator.alerts import AlertReceiver, token_source
    from adpfleet.operator.drains import DrainWatch
    from adpfleet.operator.election import LeaderElector
    from adpfleet.operator.inbox import AlertInbox
    from adpfleet.operator.loops import FleetLoops
    from adpfleet.operator.reconciler import Reconciler
    from adpfleet.operator.scaling import ScalingController
    from adpfleet.operator.stall import StallController
    from adpfleet.operator.telemetry import Heartbeats, OperatorMetrics, ScalingMetrics, StallMetrics

    metrics = OperatorMetrics()
    heartbeats = Heartbeats(resync_seconds=args.resync_seconds, stuck_after=args.stuck_seconds)
    api_client = load_api_client()
    require_crd(api_client)
    api = KubeApi(api_client, metrics)
    inbox = AlertInbox()
    scraper = HttpScraper()  # one connection pool for every scrape: detection, autoscaling, drains
    scaling = ScalingController(api, ScalingMetrics(metrics.registry), lambda key: loops.wake(key))
    stall = StallController(api, StallMetrics(metrics.registry), inbox, lambda key: loops.wake(key),
                            detection=args.stall_detection == "on", scraper=scraper, listener=scaling)
    drains = DrainWatch(scraper, lambda key: loops.wake(key))
    loops = FleetLoops(Reconciler(api, metrics, status_part=stall, drains=drains,
                                  security_config=security_config(args)), metrics, heartbeats,
                       resync_seconds=args.resync_seconds)
    receiver = AlertReceiver(token_source(api, args.alerts_token_secret), inbox, functools.partial(fleet_pods, stall),
                             count=lambda result, n: stall.metrics.alerts.labels(result).inc(n))
    timing = election_timing(args)
    elector = LeaderElector(api, metrics, namespace=args.leader_election_namespace, name=args.leader_election_id,
                            identity=identity(), timing=timing) if timing else None
    return _Parts(api_client, metrics, heartbeats, scraper, stall, drains, loops, receiver, elector)


async def _listen(args, parts: _Parts, ready: asyncio.Event) -> list:
    """The HTTP endpoints (and the webhook's own TLS listener, when given a certificate); a standby
    answers 503 on /alerts."""
    from adpfleet.operator.httpserver import leader_only, start_http_server, start_webhook_server

    routes = leader_only(parts.receiver.routes(), parts.elector) if parts.elector else parts.receiver.routes()
    tls = webhook_tls(args)
    http = await start_http_server(args.http_host, args.http_port, parts.metrics, parts.heartbeats, ready,
                                   routes=() if tls else routes, elector=parts.elector) if args.http_port else None
    webhook = await start_webhook_server(args.http_host, args.alerts_port, routes, tls) if tls else None
    return [server for server in (http, webhook) if server is not None]


async def _operate(args, namespaces: list[str], parts: _Parts, ready: asyncio.Event) -> None:
    """kopf, once this replica leads (at once without leader election); the Lease handed back after."""
    import kopf

    from adpfleet.operator.handlers import build_registry

    settings = kopf.OperatorSettings()
    operator_settings(settings)
    keeping = None
    try:
        if parts.elector is not None:
            ready.set()  # a standby is ready to take over: it serves /metrics, and 503 on /alerts
            if not await stand_by(parts.elector):
                return
            keeping = asyncio.ensure_future(parts.elector.keep(_exit_now))
        else:
            parts.metrics.leader.set(1)
        log.info("starting: watching %s", "all namespaces" if args.all_namespaces else ", ".join(namespaces))
        await kopf.operator(registry=build_registry(), settings=settings,
                            memo=kopf.Memo(loops=parts.loops, stall=parts.stall),
                            clusterwide=bool(args.all_namespaces), namespaces=namespaces,
                            standalone=True, ready_flag=ready)
    finally:
        if keeping is not None:
            keeping.cancel()
            await parts.elector.release()
