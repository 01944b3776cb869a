"""`adpfleet router`: the HTTP front of the router (FastAPI + uvicorn), thin over `pipeline.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from adpfleet.runtime.router.discovery import KubeDiscovery, static_endpoints
from adpfleet.runtime.router.metrics import CONTENT_TYPE, RouterMetrics
from adpfleet.runtime.router.pipeline import Answer, Relay, Router
from adpfleet.runtime.router.retry import error_body
from adpfleet.runtime.router.pool import ROLES, ServerPool
from adpfleet.runtime.router.queue import RequestQueue
from adpfleet.runtime.serving.auth import BearerAuth, Credentials
from adpfleet.runtime.serving.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, Refused,
                                             parse_json_object, read_body, uvicorn_config)

log = logging.getLogger("adpfleet.router")


@dataclass
class RouterConfig:
    context: list[str] = field(default_factory=list)
    generation: list[str] = field(default_factory=list)
    aggregated: list[str] = field(default_factory=list)
    kube_namespace: str | None = None
    kube_selector: str | None = None
    server_port: int = 8000
    request_timeout: float = 300.0
    max_attempts: int = 3
    first_token_timeout: float | None = None
    health_interval: float = 2.0
    cooldown: float = 5.0
    queue_size: int = 256
    queue_timeout: float = 60.0
    credentials: Credentials = field(default_factory=Credentials)
    enable_docs: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT_S

    @classmethod
    def from_args(cls, args) -> "RouterConfig":
        limits = {name: value for name in ("max_request_bytes", "read_timeout")
                  if (value := getattr(args, name)) is not None}
        config = cls(context=args.context, generation=args.generation, aggregated=args.aggregated,
                     kube_namespace=args.kube_namespace, kube_selector=args.kube_selector,
                     server_port=args.server_port, request_timeout=args.request_timeout,
                     max_attempts=args.max_attempts, first_token_timeout=args.first_token_timeout,
                     health_interval=args.health_interval, queue_size=args.queue_size,
                     queue_timeout=args.queue_timeout, credentials=Credentials.from_args(args),
                     enable_docs=args.enable_docs, **limits)
        config.validate()
        return config

    @property
    def uses_kubernetes(self) -> bool:
        return bool(self.kube_namespace or self.kube_selector)

    def validate(self) -> None:
        static = self.context or self.generation or self.aggregated
        if self.uses_kubernetes:
            if not (self.kube_namespace and self.kube_selector):
                raise ValueError("Kubernetes discovery needs both --kube-namespace and --kube-selector")
            if static:
                raise ValueError("give either server URLs (--context/--generation/--aggregated) or Kubernetes "
                                 "discovery (--kube-namespace/--kube-selector), not both")
        elif not static:
            raise ValueError("no servers: give --context URL and --generation URL, --aggregated URL, or "
                             "--kube-namespace NS --kube-selector SELECTOR")
        elif bool(self.context) != bool(self.generation):
            raise ValueError("disaggregated serving needs both --context and --generation servers")
        static_endpoints(self.context, self.generation, self.aggregated)  # URLs parse
        for name, value in (("--request-timeout", self.request_timeout), ("--health-interval", self.health_interval),
                            ("--queue-timeout", self.queue_timeout),
                            ("--max-request-bytes", self.max_request_bytes), ("--read-timeout", self.read_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.first_token_timeout is not None and not self.first_token_timeout > 0:
            raise ValueError(f"--first-token-timeout must be positive, got {self.first_token_timeout}")
        if self.queue_size < 0:
            raise ValueError(f"--queue-size must be 0 (no queue) or more, got {self.queue_size}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be at least 1, got {self.max_attempts}")
        if not 0 < self.server_port < 65536:
            raise ValueError(f"--server-port must be a TCP port, got {self.server_port}")


class RelayResponse(StreamingResponse):
    """A committed stream; whatever happens to the client, the server's stream is closed and the
    outcome counted."""

    def __init__(self, router: Router, relay: Relay, deadline: float):
        super().__init__(router.relay(relay, deadline), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **relay.headers})
        self.router, self.relay = router, relay

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.router.finish(self.relay)


class ClientGone(Exception):
    pass


async def until_disconnect(request: Request, work):
    """Run `work`; if the client disconnects first, cancel it (closing its upstream requests,
    which aborts them on the servers) and raise ClientGone."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()


def build_app(config: RouterConfig, *, kube_api_client=None) -> FastAPI:
    pool = ServerPool(cooldown_s=config.cooldown)
    metrics = RouterMetrics()
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        queue = RequestQueue(config.queue_size, config.queue_timeout, metrics)
        state["router"] = Router(pool, metrics, http, queue, request_timeout=config.request_timeout,
                                 max_attempts=config.max_attempts, first_token_timeout=config.first_token_timeout)

        def set_endpoints(endpoints) -> None:
            pool.set_endpoints(endpoints)
            queue.notify()
        discovery = None
        if config.uses_kubernetes:
            discovery = KubeDiscovery(config.kube_namespace, config.kube_selector, config.server_port,
                                      lambda eps: loop.call_soon_threadsafe(set_endpoints, eps),
                                      api_client=kube_api_client).start()
        else:
            set_endpoints(static_endpoints(config.context, config.generation, config.aggregated))
        prober = asyncio.create_task(probe_forever(pool, http, config.health_interval,
                                                   config.credentials.upstream_headers(None), queue.notify))
        try:
            yield
        finally:
            prober.cancel()
            if discovery is not None:
                discovery.stop()
            await http.aclose()

    pages = {} if config.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="adpfleet router", version="0.1.0", lifespan=lifespan, **pages)
    # clients hold the API key; the internal token is only what the router sends to its servers
    app.add_middleware(BearerAuth, credentials=Credentials(api_key=config.credentials.api_key))
    app.state.pool, app.state.metrics = pool, metrics

    def reject(message: str, param: str | None, status: int = 400) -> JSONResponse:
        metrics.requests.labels(str(status)).inc()
        return JSONResponse(error_body(message, "invalid_request_error", param=param), status_code=status)

    async def route(request: Request, path: str):
        router: Router = state["router"]
        try:
            raw = await read_body(request, config.max_request_bytes)
            # a large body takes a while to parse: off the event loop, so /health and streams go on
            body = await asyncio.to_thread(parse_json_object, raw) if len(raw) > 65536 else parse_json_object(raw)
        except Refused as r:
            metrics.requests.labels(str(r.status)).inc()
            return r.response()
        if "disaggregated_params" in body:
            return reject("unrecognized request argument supplied: 'disaggregated_params' (set by the router)",
                          "disaggregated_params")
        if not isinstance(body.get("stream", False), bool):
            return reject("'stream': Input should be a valid boolean", "stream")
        if not isinstance(body.get("stream_options") or {}, dict):  # the router reads it when it answers itself
            return reject("'stream_options': Input should be an object", "stream_options")
        deadline = asyncio.get_running_loop().time() + config.request_timeout
        try:
            upstream = config.credentials.upstream_headers(request.headers.get("authorization"))
            outcome = await until_disconnect(request, router.prepare(path, body, deadline, upstream))
        except ClientGone:
            metrics.requests.labels("client_closed").inc()
            return Response(status_code=499)
        if isinstance(outcome, Relay):
            return RelayResponse(router, outcome, deadline)
        answer: Answer = outcome
        metrics.requests.labels(str(answer.status)).inc()
        content = answer.body if isinstance(answer.body, bytes) else json.dumps(answer.body).encode()
        return Response(content, status_code=answer.status, media_type="application/json", headers=answer.headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        http: httpx.AsyncClient = state["router"].http
        upstream = config.credentials.upstream_headers(request.headers.get("authorization"))
        now = time.monotonic()
        servers = [ep for role in ROLES for ep in pool.usable(role, now)] or pool.endpoints()
        for ep in servers:
            try:
                resp = await http.get(ep.url + "/v1/models", timeout=5.0, headers=upstream)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
        return JSONResponse(error_body("no server answered /v1/models", code="no_server"), status_code=503)

    @app.get("/health")
    async def health():
        now = time.monotonic()
        mode = pool.mode(now)
        servers = {role: len(pool.usable(role, now)) for role in ROLES}
        if mode is None:
            return JSONResponse({"status": "unhealthy", "servers": servers,
                                 "reason": "no usable context+generation pair and no usable aggregated server"},
                                status_code=503)
        return {"status": "ok", "mode": mode, "servers": servers}

    @app.get("/metrics")
    async def prometheus():
        now = time.monotonic()
        for role in ROLES:
            usable = len(pool.usable(role, now))
            metrics.servers.labels(role, "true").set(usable)
            metrics.servers.labels(role, "false").set(len(pool.endpoints(role)) - usable)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def probe_forever(pool: ServerPool, http: httpx.AsyncClient, interval: float, headers: dict,
                        on_recovery) -> None:
    """GET /health on every known server each interval; a server answering non-200 (or not at
    all) gets no new work until it answers 200 again, and then `on_recovery()` runs."""
    async def probe(ep) -> bool:
        try:
            return (await http.get(ep.url + "/health", timeout=max(interval, 1.0), headers=headers)).status_code == 200
        except httpx.HTTPError:
            return False
    while True:
        servers = pool.endpoints()
        recovered = [pool.report_probe(ep, ok) for ep, ok in zip(servers, await asyncio.gather(*map(probe, servers)))]
        if any(recovered):
            on_recovery()
        await asyncio.sleep(interval)


def main(args) -> int:
    import uvicorn

    import prometheus_client

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request is noise
    prometheus_client.disable_created_metrics()
    config = RouterConfig.from_args(args)
    app = build_app(config)
    source = (f"pods '{config.kube_selector}' in namespace {config.kube_namespace}" if config.uses_kubernetes
              else "static server list")
    log.info("router on http://%s:%d (%s)%s", args.host, args.port, source,
             " (API key required)" if config.credentials.api_key else "")
    uvicorn.Server(uvicorn_config(app, args.host, args.port, config.read_timeout)).run()
    return 0
