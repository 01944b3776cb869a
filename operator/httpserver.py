"""The operator's HTTP endpoints: /healthz (liveness), /readyz (readiness), /metrics (Prometheus),
and POST /alerts (Alertmanager's webhook, alerts.py).

The webhook is served on the same listener, or — given a certificate — on a listener of its own
over TLS (and then not over plain HTTP: its bearer token never crosses the network in clear). A
renewed certificate (cert-manager rewrites the mounted Secret) is picked up without a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adpfleet.operator.telemetry import Heartbeats, OperatorMetrics

log = logging.getLogger("adpfleet.operator.http")

TLS_RELOAD_SECONDS = 30.0  # how often the certificate files are checked for a renewal
STANDBY_SILENCE_FACTOR = 10  # a standby whose Lease loop is silent this many retry periods is unhealthy
RETRY_AFTER_STANDBY = "2"    # seconds Alertmanager is told to wait before it tries (another replica) again


def leader_only(routes, elector) -> list[web.RouteDef]:
    """`routes` answering 503 (Retry-After) while this replica stands by: only the leader acts on
    an alert, and behind the operator's Service a retry soon reaches it."""
    def guard(handler):
        async def guarded(request: web.Request) -> web.StreamResponse:
            if not elector.leading:
                return web.json_response({"error": "this operator replica is a standby; retry (the Service "
                                                   "routes to the leader)"}, status=503,
                                         headers={"Retry-After": RETRY_AFTER_STANDBY})
            return await handler(request)
        return guarded
    return [web.route(r.method, r.path, guard(r.handler), **r.kwargs) for r in routes]


async def start_http_server(host: str, port: int, metrics: OperatorMetrics, heartbeats: Heartbeats,
                            ready: asyncio.Event, routes=(), elector=None) -> web.AppRunner:
    """`routes`: more endpoints on the same listener (the webhook, when it has no TLS listener).
    `elector`: this replica's leader election (its role shows on /readyz and /healthz)."""
    async def healthz(_request):
        problems = heartbeats.problems()
        if elector is not None and not elector.leading and \
                elector.clock() - elector.last_attempt > STANDBY_SILENCE_FACTOR * elector.timing.retry_period:
            problems = problems + [f"the standby has not looked at the Lease for "
                                   f"{elector.clock() - elector.last_attempt:.0f} s"]
        metrics.healthy.set(0 if problems else 1)
        body = {"status": "unhealthy" if problems else "ok", "problems": problems, "fleets": heartbeats.snapshot()}
        if elector is not None:
            body["role"] = elector.role
        return web.json_response(body, status=503 if problems else 200)

    async def readyz(_request):
        body = {"ready": ready.is_set(), **({"role": elector.role} if elector is not None else {})}
        return web.json_response(body, status=200 if ready.is_set() else 503)

    async def prometheus(_request):
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    runner = await _serve([web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", prometheus),
                           *routes], host, port)
    log.info("health and metrics on http://%s:%d (/healthz, /readyz, /metrics)", host, port)
    return runner


@dataclass(frozen=True)
class TlsFiles:
    """A PEM certificate (chain) and its key, as a Secret of type kubernetes.io/tls mounts them."""
    cert: str
    key: str

    def context(self) -> ssl.SSLContext:
        """A server context for them; ValueError that names the file when they cannot be used."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        self.load(ctx)
        return ctx

    def load(self, ctx: ssl.SSLContext) -> None:
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot use the webhook certificate {self.cert} with key {self.key}: {e}") from None

    def stamp(self) -> tuple[int, int]:
        return os.stat(self.cert).st_mtime_ns, os.stat(self.key).st_mtime_ns


async def start_webhook_server(host: str, port: int, routes, tls: TlsFiles, *,
                               reload_seconds: float = TLS_RELOAD_SECONDS) -> web.AppRunner:
    """The webhook alone on an HTTPS listener, its certificate re-read when the files change."""
    ctx = tls.context()
    reloader: asyncio.Future | None = None

    async def stop_reloading(_app) -> None:
        if reloader is not None:
            reloader.cancel()
    runner = await _serve(routes, host, port, ssl_context=ctx, on_cleanup=stop_reloading)
    reloader = asyncio.ensure_future(_reload_on_change(tls, ctx, reload_seconds))
    log.info("Alertmanager webhook on https://%s:%d/alerts", host, port)
    return runner


async def _reload_on_change(tls: TlsFiles, ctx: ssl.SSLContext, every: float) -> None:
    """New connections get the renewed certificate; open ones keep theirs."""
    stamp = tls.stamp()
    while True:
        await asyncio.sleep(every)
        try:
            now = tls.stamp()
            if now != stamp:
                tls.load(ctx)
                stamp = now
                log.info("reloaded the webhook certificate %s", tls.cert)
        except (OSError, ValueError) as e:  # half-written files: the old certificate serves meanwhile
            log.warning("webhook certificate not reloaded (the current one stays in use): %s", e)


async def _serve(routes, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                 on_cleanup=None) -> web.AppRunner:
    app = web.Application()
    app.add_routes(routes)
    if on_cleanup is not None:
        app.on_cleanup.append(on_cleanup)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    return runner
