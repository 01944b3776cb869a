"""A counting proxy in front of the local API server: what exactly does a client ask for?

`CountingProxy` listens on plain HTTP on 127.0.0.1, forwards every request to the API server with
the cluster's admin credentials (streaming, so watches work), and records each one: verb (as the
API server names them: get, list, watch, create, update, patch, delete, deletecollection), path,
HTTP status. A client pointed at `proxy.kubeconfig` (no credentials of its own) is thereby counted
from the outside, independently of anything it reports about itself. The operator tests and the
scale benchmark use it to show that a fleet at rest costs zero writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

import aiohttp
import yaml
from aiohttp import web

from adpfleet.cluster import kubeconfig

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade",
               "proxy-connection", "te", "trailer"}


@dataclass(frozen=True)
class Request:
    time: float      # time.monotonic() when the response began
    verb: str
    method: str
    path: str
    query: str
    status: int

    @property
    def resource(self) -> str:
        """The resource part of the path: 'pods', 'inferencefleets/status', ..."""
        parts = [p for p in self.path.split("/") if p]
        if parts[:1] == ["api"]:
            parts = parts[2:]
        elif parts[:1] == ["apis"]:
            parts = parts[3:]
        if parts[:1] == ["namespaces"] and len(parts) > 2:
            parts = parts[2:]
        return "/".join([parts[0]] + parts[2:3]) if parts else ""


def verb_of(method: str, path: str, query: str) -> str:
    params = parse_qs(query)
    parts = [p for p in path.split("/") if p]
    # a collection path ends in a resource name: /api/v1/pods, /api/v1/namespaces/ns/pods
    base = parts[2:] if parts[:1] == ["api"] else parts[3:] if parts[:1] == ["apis"] else parts
    if base[:1] == ["namespaces"] and len(base) >= 3:
        base = base[2:]
    collection = len(base) == 1
    if method == "GET":
        if params.get("watch", ["false"])[0] in ("true", "1"):
            return "watch"
        return "list" if collection else "get"
    return {"POST": "create", "PUT": "update", "PATCH": "patch",
            "DELETE": "deletecollection" if collection else "delete"}.get(method, method.lower())


class CountingProxy:
    def __init__(self, upstream_kubeconfig: Path):
        self._creds = kubeconfig.load(Path(upstream_kubeconfig))
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._writes_open: asyncio.Event | None = None
        self.port = 0

    # ---- lifecycle ----

    def start(self) -> "CountingProxy":
        self._thread = threading.Thread(target=self._serve, name="counting-api-proxy", daemon=True)
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the counting API proxy did not start within 10 s")
        return self

    def stop(self) -> None:
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread:
            self._thread.join(10)

    def __enter__(self) -> "CountingProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that sends a client through the proxy (the proxy holds the credentials)."""
        config = {"apiVersion": "v1", "kind": "Config",
                  "clusters": [{"name": "counted", "cluster": {"server": self.url}}],
                  "users": [{"name": "counted", "user": {}}],
                  "contexts": [{"name": "counted", "context": {"cluster": "counted", "user": "counted"}}],
                  "current-context": "counted"}
        path.write_text(yaml.safe_dump(config))
        return path

    @contextlib.contextmanager
    def writes_held(self):
        """Within the block, write requests wait at the proxy (as if the API server hung on them);
        they go through when the block ends. Reads and watches pass."""
        self._loop.call_soon_threadsafe(self._writes_open.clear)
        try:
            yield
        finally:
            self._loop.call_soon_threadsafe(self._writes_open.set)

    # ---- what was seen ----

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def since(self, start: float) -> list[Request]:
        return [r for r in self.snapshot() if r.time >= start]

    @staticmethod
    def writes(requests: list[Request]) -> list[Request]:
        return [r for r in requests if r.verb in WRITE_VERBS]

    # ---- the server ----

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._main())
        pending = asyncio.all_tasks(self._loop)  # handlers the 1 s shutdown left (watches): end them here
        for task in pending:
            task.cancel()
        if pending:  # gather() of nothing asks for this thread's current loop, which it has not got
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self._writes_open = asyncio.Event()
        self._writes_open.set()
        connector = aiohttp.TCPConnector(ssl=self._creds.ssl_context, limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            async def forward(request: web.Request) -> web.StreamResponse:
                return await self._forward(session, request)
            app.router.add_route("*", "/{tail:.*}", forward)
            # on stop, what is still open (a client's watch, held until the API server ends it) gets 1 s,
            # then is cancelled: aiohttp's default would wait 60 s for it, past stop()'s join
            runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]
            self._started.set()
            await self._stop.wait()
            await runner.cleanup()

    async def _forward(self, session: aiohttp.ClientSession, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP | {"authorization"}}
        url = self._creds.server.rstrip("/") + str(request.rel_url)
        verb = verb_of(request.method, request.path, request.query_string)
        if verb in WRITE_VERBS:
            await self._writes_open.wait()
        try:
            # forward the headers as they came: aiohttp would otherwise add a Content-Type of its own
            # (application/octet-stream) where a client sent none, which the API server refuses
            upstream = await session.request(request.method, url, data=body or None, headers=headers,
                                             allow_redirects=False,
                                             skip_auto_headers=("Content-Type", "User-Agent", "Accept",
                                                                "Accept-Encoding"))
        except aiohttp.ClientError as exc:
            self._record(verb, request, 502)
            return web.Response(status=502, text=f"counting proxy: upstream failed: {exc}")
        self._record(verb, request, upstream.status)
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for k, v in upstream.headers.items():
            if k.lower() not in _HOP_BY_HOP:
                response.headers[k] = v
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():  # watches: pass each event on as it comes
                await response.write(chunk)
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientError, asyncio.CancelledError):
            pass  # the client hung up (a watch being closed); nothing to forward anymore
        finally:
            upstream.release()
        return response

    def _record(self, verb: str, request: web.Request, status: int) -> None:
        with self._lock:
            self.requests.append(Request(time.monotonic(), verb, request.method, request.path,
                                         request.query_string, status))
