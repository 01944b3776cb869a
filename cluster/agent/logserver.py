"""The node agent's kubelet-style HTTPS endpoint: `/healthz` and `/containerLogs/...`, which is
what the apiserver calls for `kubectl logs` (with its kubelet client certificate). Exec, attach and
port-forward are not offered: pods are plain processes, reach them directly."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Callable

from aiohttp import web

from adpfleet.cluster.agent.sandbox import LogSource

FOLLOW_POLL = 0.25
# (namespace, pod, container, previous) -> the log; LookupError saying what is missing
FindLog = Callable[[str, str, str, bool], LogSource]


def tls_context(cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
    ctx.load_cert_chain(str(cert), str(key))
    ctx.verify_mode = ssl.CERT_REQUIRED  # only the apiserver (and `cluster status`) may read logs
    return ctx


def build_app(healthy: Callable[[], bool], find_log: FindLog) -> web.Application:
    async def healthz(_request: web.Request) -> web.Response:
        if healthy():
            return web.Response(text="ok")
        return web.Response(status=503, text="the node agent has not finished starting")

    async def container_logs(request: web.Request) -> web.StreamResponse:
        ns, pod, container = (request.match_info[k] for k in ("namespace", "pod", "container"))
        query = request.query
        try:
            source = find_log(ns, pod, container, query.get("previous") == "true")
        except LookupError as exc:
            raise web.HTTPNotFound(text=str(exc)) from None
        data = source.path.read_bytes()
        size = len(data)
        if "tailLines" in query:
            lines = data.splitlines(keepends=True)
            data = b"".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) else b""
        if "limitBytes" in query:
            data = data[:int(query["limitBytes"])]
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(data)
        if query.get("follow") == "true":
            await _follow(response, source, size)
        await response.write_eof()
        return response

    async def unsupported(request: web.Request) -> web.Response:
        return web.Response(status=404, text=f"{request.path}: the adpfleet node agent serves only "
                                             "/containerLogs and /healthz (no exec, attach or port-forward)")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", container_logs)
    app.router.add_route("*", "/{tail:.*}", unsupported)
    return app


async def _follow(response: web.StreamResponse, source: LogSource, offset: int) -> None:
    """Stream what the container writes until this run of it ends."""
    with open(source.path, "rb") as f:
        f.seek(offset)
        while True:
            chunk = f.read(65536)
            if chunk:
                await response.write(chunk)
                continue
            if not source.writing():
                return
            await asyncio.sleep(FOLLOW_POLL)


async def serve(healthy: Callable[[], bool], find_log: FindLog, host: str, port: int,
                ctx: ssl.SSLContext) -> web.AppRunner:
    runner = web.AppRunner(build_app(healthy, find_log), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=ctx).start()
    return runner
