"""`adpfleet router`: the HTTP front of the router (FastAPI + uvicorn), thin over `pipeline.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from adpfleet.runtime.router.discovery import KubeDiscovery, static_endpoints
from adpfleet.runtime.router.metrics import CONTENT_TYPE, RouterMetrics
from adpfleet.runtime.router.pipeline import Relay, Router
from adpfleet.contract.router_policy import CACHE_AWARE, DEFAULT_ROUTER_POLICY, ROUTER_POLICIES
from adpfleet.runtime.router.policy import Selector
from adpfleet.runtime.router.prefix_view import PrefixViews, snapshot_headers
from adpfleet.runtime.router.prompt_tokens import Prompt, PromptReader
from adpfleet.runtime.router.retry import error_body
from adpfleet.runtime.router.pool import ROLES, ServerPool
from adpfleet.runtime.router.queue import DEFAULT_MAX_BYTES as DEFAULT_QUEUE_MAX_BYTES
from adpfleet.runtime.router.queue import RequestQueue
from adpfleet.runtime.serving.auth import BearerAuth, Credentials
from adpfleet.runtime.serving.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT_S, JsonBody, Refused,
                                             parse_json_object, read_body, uvicorn_config)

log = logging.getLogger("adpfleet.router")
# Large bodies are parsed off the event loop, on this many threads: what parsing holds at once is
# bounded too (a body of MAX_JSON_VALUES values takes up to ~35 MiB), and under the GIL more would
# not parse faster.
PARSE_THREADS = 2


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
    queue_max_bytes: int = DEFAULT_QUEUE_MAX_BYTES
    credentials: Credentials = field(default_factory=Credentials)
    enable_docs: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    policy: str = DEFAULT_ROUTER_POLICY
    tokenizer: str | None = None  # cache-aware: the servers' model, to tokenize prompts as they do
    cache_poll_interval: float = 0.5

    @classmethod
    def from_args(cls, args) -> "RouterConfig":
        limits = {name: value for name in ("max_request_bytes", "read_timeout", "queue_max_bytes")
                  if (value := getattr(args, name)) is not None}
        config = cls(context=args.context, generation=args.generation, aggregated=args.aggregated,
                     kube_namespace=args.kube_namespace, kube_selector=args.kube_selector,
                     server_port=args.server_port, request_timeout=args.request_timeout,
                     max_attempts=args.max_attempts, first_token_timeout=args.first_token_timeout,
                     health_interval=args.health_interval, queue_size=args.queue_size,
                     queue_timeout=args.queue_timeout, credentials=Credentials.from_args(args),
                     enable_docs=args.enable_docs, policy=args.policy, tokenizer=args.tokenizer,
                     cache_poll_interval=args.cache_poll_interval, **limits)
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
                            ("--queue-timeout", self.queue_timeout), ("--queue-max-bytes", self.queue_max_bytes),
                            ("--max-request-bytes", self.max_request_bytes), ("--read-timeout", self.read_timeout)):
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}, got {self.policy!r}")
        if not self.cache_poll_interval > 0:
            raise ValueError(f"--cache-poll-interval must be positive, got {self.cache_poll_interval}")
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
    """The router's HTTP front: the client's credential, the OpenAI routes, /health and /metrics."""
    front = RouterFront(config, kube_api_client)
    pages = {} if config.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="adpfleet router", version="0.1.0", lifespan=front.lifespan, **pages)
    # clients hold the API key; the internal token is only what the router sends to its servers
    app.add_middleware(BearerAuth, credentials=Credentials(api_key=config.credentials.api_key))
    app.state.pool, app.state.metrics = front.pool, front.metrics
    app.add_api_route("/v1/completions", front.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", front.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.prometheus, methods=["GET"])
    return app


class RouterFront:
    """What the routes share: the pool, the metrics, and (while the app runs) the `Router` with
    its HTTP client, queue, discovery and health prober."""

    def __init__(self, config: RouterConfig, kube_api_client=None):
        self.config, self.kube_api_client = config, kube_api_client
        self.pool = ServerPool(cooldown_s=config.cooldown)
        self.metrics = RouterMetrics()
        self.router: Router | None = None
        self.parsing: ThreadPoolExecutor | None = None
        self.prompts = self._prompt_reader(config)
        self.views: PrefixViews | None = None

    # -- start and stop ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        config = self.config
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
        queue = RequestQueue(config.queue_size, config.queue_timeout, self.metrics, config.queue_max_bytes)
        views = self.views = None
        if self.prompts is not None:
            views = self.views = PrefixViews(self.pool, self.metrics, http, snapshot_headers(
                config.credentials.upstream_headers, config.credentials.api_key), config.cache_poll_interval)
        self.router = Router(self.pool, self.metrics, http, queue, request_timeout=config.request_timeout,
                             max_attempts=config.max_attempts, first_token_timeout=config.first_token_timeout,
                             selector=Selector(self.pool, config.policy, views, self.metrics))
        self.parsing = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="parse")
        discovery = self._discover(queue)
        tasks = [asyncio.create_task(probe_forever(self.pool, http, config.health_interval,
                                                   config.credentials.upstream_headers(None), queue.notify))]
        if views is not None:
            tasks.append(asyncio.create_task(views.poll_forever()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if discovery is not None:
                discovery.stop()
            await http.aclose()
            self.parsing.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _prompt_reader(config: RouterConfig) -> PromptReader | None:
        """The cache-aware policy's tokenizer; None (every request by load) for the other policies."""
        if config.policy != CACHE_AWARE:
            return None
        if config.tokenizer is None:
            log.warning("--policy cache-aware without --tokenizer: the router cannot compute the prompts' blocks, "
                        "so every request is routed by load (give --tokenizer, the servers' --model)")
            return None
        return PromptReader(config.tokenizer)

    async def _prompt(self, path: str, body: dict) -> Prompt | None:
        """The prompt's tokens for the cache-aware policy, read off the event loop (tokenizing takes
        a while), once the view of the caches covers every request that has ended (prefix_view.py)."""
        if self.prompts is None:
            return None
        prompt = await asyncio.get_running_loop().run_in_executor(self.parsing, self.prompts.read, path, body)
        if prompt is not None:
            await self.views.fresh()
        return prompt

    def _discover(self, queue: RequestQueue) -> KubeDiscovery | None:
        """Fill the pool — from Kubernetes (the discovery returned runs until stopped) or from the
        static URLs — and wake the queue whenever it changes."""
        config, loop = self.config, asyncio.get_running_loop()

        def set_endpoints(endpoints) -> None:
            self.pool.set_endpoints(endpoints)
            queue.notify()
        if not config.uses_kubernetes:
            set_endpoints(static_endpoints(config.context, config.generation, config.aggregated))
            return None
        return KubeDiscovery(config.kube_namespace, config.kube_selector, config.server_port,
                             lambda eps: loop.call_soon_threadsafe(set_endpoints, eps),
                             api_client=self.kube_api_client).start()

    # -- the OpenAI routes ---------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self.route(request, "/v1/completions")

    async def chat_completions(self, request: Request):
        return await self.route(request, "/v1/chat/completions")

    async def route(self, request: Request, path: str) -> Response:
        """One client request: its body within the limits, the router's own checks, the attempts
        (cancelled if the client leaves), the answer."""
        try:
            body = await self._read_json(request)
        except Refused as r:
            self.metrics.requests.labels(str(r.status)).inc()
            return r.response()
        refusal = self._refusal(body.fields)
        if refusal is not None:
            return refusal
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout
        upstream = self.config.credentials.upstream_headers(request.headers.get("authorization"))
        try:
            prompt = await self._prompt(path, body.fields)
            outcome = await until_disconnect(request, self.router.prepare(path, body.fields, deadline, upstream,
                                                                          body.footprint, prompt))
        except ClientGone:
            self.metrics.requests.labels("client_closed").inc()
            return Response(status_code=499)
        if isinstance(outcome, Relay):
            return RelayResponse(self.router, outcome, deadline)
        self.metrics.requests.labels(str(outcome.status)).inc()
        content = outcome.body if isinstance(outcome.body, bytes) else json.dumps(outcome.body).encode()
        return Response(content, status_code=outcome.status, media_type="application/json", headers=outcome.headers)

    async def _read_json(self, request: Request) -> JsonBody:
        """The body, parsed within the limits (limits.py); the raw bytes are not kept."""
        raw = await read_body(request, self.config.max_request_bytes)
        if len(raw) <= 65536:
            return parse_json_object(raw)
        # a large body takes a while to parse: off the event loop, so /health and streams go on
        return await asyncio.get_running_loop().run_in_executor(self.parsing, parse_json_object, raw)

    def _refusal(self, body: dict) -> JSONResponse | None:
        """The router's own 400 for what it reads of a body (the servers validate the rest)."""
        if "disaggregated_params" in body:
            message, param = ("unrecognized request argument supplied: 'disaggregated_params' (set by the router)",
                              "disaggregated_params")
        elif not isinstance(body.get("stream", False), bool):
            message, param = "'stream': Input should be a valid boolean", "stream"
        elif not isinstance(body.get("stream_options") or {}, dict):  # the router reads it when it answers itself
            message, param = "'stream_options': Input should be an object", "stream_options"
        else:
            return None
        self.metrics.requests.labels("400").inc()
        return JSONResponse(error_body(message, "invalid_request_error", param=param), status_code=400)

    # -- the other routes ----------------------------------------------------------------------
    async def models(self, request: Request):
        """/v1/models of the first server that answers (usable ones first)."""
        upstream = self.config.credentials.upstream_headers(request.headers.get("authorization"))
        now = time.monotonic()
        servers = [ep for role in ROLES for ep in self.pool.usable(role, now)] or self.pool.endpoints()
        for ep in servers:
            try:
                resp = await self.router.http.get(ep.url + "/v1/models", timeout=5.0, headers=upstream)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
        return JSONResponse(error_body("no server answered /v1/models", code="no_server"), status_code=503)

    async def health(self):
        now = time.monotonic()
        mode = self.pool.mode(now)
        servers = {role: len(self.pool.usable(role, now)) for role in ROLES}
        if mode is None:
            return JSONResponse({"status": "unhealthy", "servers": servers,
                                 "reason": "no usable context+generation pair and no usable aggregated server"},
                                status_code=503)
        return {"status": "ok", "mode": mode, "servers": servers}

    async def prometheus(self):
        now = time.monotonic()
        for role in ROLES:
            usable = len(self.pool.usable(role, now))
            self.metrics.servers.labels(role, "true").set(usable)
            self.metrics.servers.labels(role, "false").set(len(self.pool.endpoints(role)) - usable)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


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
