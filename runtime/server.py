"""`adpfleet serve`: the OpenAI-compatible HTTP server in front of the ADP ranks.

FastAPI + uvicorn, as vLLM, SGLang and trtllm-serve use: users and their tooling already know
its behaviour (SSE streaming, `Authorization: Bearer` API keys, graceful shutdown).

Roles: `aggregated` runs whole requests. `context` runs the prompt, answers with the first
token and `disaggregated_params` (where to pull the held KV), and holds the KV until pulled.
`generation` takes those params, pulls the KV, and continues the request from the first token.

The app is assembled here from its concerns: the credential (`serving/auth.py`), the OpenAI
routes (`serving/completions.py`, one request top to bottom), /health and /v1/models, /metrics,
and /faults when enabled; the drain on SIGTERM wraps it (`serving/drain.py`). A worker pod of a
server over several pods gets an app of its own (`build_worker_app`).
"""

from __future__ import annotations

import logging
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from adpfleet.runtime import metrics
from adpfleet.runtime.serving.auth import BearerAuth
from adpfleet.runtime.serving.completions import CompletionRoutes
from adpfleet.runtime.serving.limits import Refused, error_response, parse_json_object, read_body
from adpfleet.runtime.serving.options import ServerOptions
from adpfleet.runtime.serving.rank_routing import add_snapshot_route

log = logging.getLogger("adpfleet.server")
EXIT_GRACE_S = 1.0


def build_app(engine, model_name: str, role: str = "aggregated", options: ServerOptions | None = None) -> FastAPI:
    """The leader's HTTP front: the client's credential, /health and /v1/models, /metrics, /faults
    (when enabled) and the OpenAI routes."""
    options = options or ServerOptions()
    pages = {} if options.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="adpfleet", version="0.1.0", **pages)
    app.add_middleware(BearerAuth, credentials=options.credentials)
    _add_health(app, engine, model_name, role)
    _add_metrics(app, engine, role)
    add_snapshot_route(app, engine.group, options.credentials)
    if options.fault_injection:
        _add_faults(app, engine, role, options.max_request_bytes)
    routes = CompletionRoutes(engine, model_name, role, options)
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    return app


def _add_health(app: FastAPI, engine, model_name: str, role: str) -> None:
    """/health (503 while a rank is dead or hung) and /v1/models."""
    @app.get("/health")
    async def health():
        ok, reason = engine.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "role": role, "reason": reason},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "adpfleet",
            "max_model_len": engine.model_config.max_position_embeddings}]}


def _add_metrics(app: FastAPI, engine, role: str) -> None:
    """/metrics: this pod's ranks (each pod of a server exports its own, labelled with its node rank)."""
    topology = engine.group.topology
    node_rank = topology.node_rank if topology.nodes > 1 else None

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(role, engine.group.rank_stats(), node_rank),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_faults(app: FastAPI, engine, role: str, max_request_bytes: int) -> None:
    """POST /faults {"kind": ..., "rank": R}: a fault injected into one rank (executor/faults.py)."""
    from adpfleet.runtime.executor import faults

    @app.post("/faults")
    async def inject(request: Request):
        try:
            body = parse_json_object(await read_body(request, max_request_bytes)).fields
            kind, rank = body.get("kind"), body.get("rank", 0)
            if kind not in faults.KINDS:
                raise ValueError(f"'kind' must be one of {', '.join(faults.KINDS)}")
            if kind in faults.CONTEXT_ONLY and role != "context":
                raise ValueError(f"{kind} applies to context servers only")
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError("'rank' must be an integer")
            engine.group.inject_fault(kind, rank)
        except Refused as r:
            return r.response()
        except (ValueError, TypeError) as e:
            return error_response(f"bad fault: {e}", 400)
        log.warning("fault injected: %s on rank %d", kind, rank)
        return {"injected": kind, "rank": rank}


def build_worker_app(engine, role: str, options: ServerOptions | None = None) -> FastAPI:
    """A worker pod of a server over several pods: it runs its ranks for the leader, which alone
    serves the API and the KV endpoints. It answers /health (200 only while joined to its group and
    its ranks are ready) and /metrics for its own ranks."""
    options = options or ServerOptions()
    app = FastAPI(title="adpfleet worker", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BearerAuth, credentials=options.credentials)
    node_rank = engine.group.topology.node_rank

    @app.get("/health")
    async def health():
        ok, reason = engine.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "role": role, "node_rank": node_rank,
                             "reason": reason}, status_code=200 if ok else 503)

    _add_metrics(app, engine, role)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"])
    async def not_here(path: str):
        return error_response(f"this pod is worker {node_rank} of a server over several pods: send requests "
                              "to its leader (node rank 0)", 421, kind="invalid_request_error",
                              code="misdirected_request")

    if options.fault_injection:
        @app.post("/faults")
        async def faults_at_the_leader():  # the leader reaches every rank of the server over the group link
            return error_response(f"this pod is worker {node_rank} of a server over several pods: POST /faults "
                                  "to its leader (node rank 0), naming the rank (the server's global rank); the "
                                  "leader sends it to the pod that runs it", 421, kind="invalid_request_error",
                                  code="misdirected_request")

    return app


def main(args) -> int:
    import uvicorn

    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.executor.node_link import NodeTopology
    from adpfleet.runtime.serving.drain import GracefulServer
    from adpfleet.runtime.model.sources.fetch import resolve_model
    from adpfleet.runtime.serving.engine_client import EngineClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dp < 1:
        raise ValueError(f"--dp must be a positive integer, got {args.dp}")
    options = ServerOptions.from_args(args)  # first: a bad flag costs no model fetch and no model load
    topology = NodeTopology(args.nodes, args.node_rank, args.leader_address, args.group_port,
                            options.credentials.internal_token, args.join_timeout)
    topology.validate(args.dp)
    model = resolve_model(args.model, args.cache_dir)  # hf://, s3://, pvc://: fetched or found first
    config = EngineConfig.from_args(args).with_model(model.path)
    server: uvicorn.Server | None = None
    failure: list[str] = []

    def on_dead(reason: str) -> None:  # a rank died or hung: unhealthy now, exit non-zero shortly
        failure.append(reason)

        def stop():
            if server is not None:
                server.should_exit = True
        # the grace lets in-flight requests get their explicit error and probes see the 503
        threading.Timer(EXIT_GRACE_S, stop).start()

    client = EngineClient(config, args.dp, args.role, on_dead=on_dead,
                          pad_empty_batch=not args.no_pad_empty_batch,
                          collective_timeout_s=args.collective_timeout,
                          kv_host=args.host, kv_port=args.kv_port if args.kv_port is not None else args.port + 1,
                          kv_lease_s=args.kv_lease, kv_transfer_timeout_s=args.kv_transfer_timeout,
                          kv_token=options.credentials.internal_token, topology=topology, link_host=args.host)
    name = args.served_model_name or model.served_name
    app = build_app(client, name, args.role, options) if topology.leader else build_worker_app(client, args.role,
                                                                                                options)
    server = GracefulServer(app, client, host=args.host, port=args.port,
                            read_timeout=options.read_timeout, drain_timeout_s=args.drain_timeout)
    if options.fault_injection and not options.credentials.required:
        log.warning("POST /faults is enabled and this server has no API key: anyone who reaches it can stall it")
    share = "" if topology.nodes == 1 else (f"; pod {topology.node_rank} of {topology.nodes}, ranks "
                                             f"{client.group.local_ranks[0]}..{client.group.local_ranks[-1]}")
    log.info("serving %s (%s, %d ADP ranks%s) on http://%s:%d%s", name, args.role, args.dp, share, args.host,
             args.port, " (API key required)" if options.credentials.required else "")
    try:
        server.run()
    finally:
        client.close()
    if failure:
        log.error("exiting: %s", failure[0])
        return 1
    return 0
