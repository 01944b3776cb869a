"""The operator's HTTP endpoints: /healthz (liveness), /readyz (readiness), /metrics (Prometheus),
and POST /alerts (Alertmanager's webhook) when given."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from adpfleet.operator.telemetry import Heartbeats, OperatorMetrics

log = logging.getLogger("adpfleet.operator.http")


async def start_http_server(host: str, port: int, metrics: OperatorMetrics, heartbeats: Heartbeats,
                            ready: asyncio.Event, routes=()) -> web.AppRunner:
    """`routes`: more endpoints on the same listener (the Alertmanager webhook, alerts.py)."""
    async def healthz(_request):
        problems = heartbeats.problems()
        metrics.healthy.set(0 if problems else 1)
        body = {"status": "unhealthy" if problems else "ok", "problems": problems, "fleets": heartbeats.snapshot()}
        return web.json_response(body, status=503 if problems else 200)

    async def readyz(_request):
        return web.json_response({"ready": ready.is_set()}, status=200 if ready.is_set() else 503)

    async def prometheus(_request):
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz), web.get("/metrics", prometheus),
                    *routes])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("health and metrics on http://%s:%d (/healthz, /readyz, /metrics)", host, port)
    return runner
