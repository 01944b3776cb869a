"""`adpfleet serve`: the OpenAI-compatible HTTP server in front of the ADP ranks.

FastAPI + uvicorn, as vLLM, SGLang and trtllm-serve use: users and their tooling already know
its behaviour (SSE streaming, `Authorization: Bearer` API keys, graceful shutdown).

Roles: `aggregated` runs whole requests. `context` runs the prompt, answers with the first
token and `disaggregated_params` (where to pull the held KV), and holds the KV until pulled.
`generation` takes those params, pulls the KV, and continues the request from the first token.

One request, top to bottom, and what bounds each step (nothing one client sends may kill, wedge
or pin the server; docs/security.md):
1. the credential, when the server has one (`auth.BearerAuth`: 401 otherwise);
2. a place among the waiting requests (`limits.WaitingQueue`: 429 with Retry-After when full);
3. the body, within `--max-request-bytes` and the read timeout (413; the connection is closed);
4. preparation off the event loop — parse, validate, render the chat template, tokenize — so
   /health answers while a large prompt is prepared (4xx naming the parameter);
5. the ranks, until the answer is complete or the request's deadline (`--request-timeout`: 504,
   or an error event in a stream) passes; a client that leaves aborts its request and frees its KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from adpfleet.runtime import metrics
from adpfleet.runtime.engine.sampling import InvalidRequestError
from adpfleet.runtime.engine.validation import tokenize
from adpfleet.runtime.executor import kv_transfer
from adpfleet.runtime.executor.kv_endpoint import parse_endpoint
from adpfleet.runtime.serving import protocol
from adpfleet.runtime.serving.auth import INTERNAL, BearerAuth, Credentials, KVPeers
from adpfleet.runtime.serving.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_WAITING_REQUESTS,
                                             DEFAULT_READ_TIMEOUT_S, Refused, WaitingQueue, error_response,
                                             parse_json_object, read_body)
from adpfleet.runtime.serving.rank_routing import add_snapshot_route, rank_hint

log = logging.getLogger("adpfleet.server")
EXIT_GRACE_S = 1.0
DISCONNECT_POLL_S = 0.5
PREP_THREADS = 2  # request preparation is mostly CPU under the GIL: more threads would not help
DEFAULT_REQUEST_TIMEOUT_S = 300.0
FAULT_INJECTION_ENV = "ADPFLEET_FAULT_INJECTION"


class ClientGone(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


@dataclass
class ServerOptions:
    """What the server allows, and whom: the security and resource flags of `adpfleet serve`."""
    credentials: Credentials = field(default_factory=Credentials)
    kv_peers: KVPeers = field(default_factory=KVPeers)
    fault_injection: bool = False
    enable_docs: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S

    read_timeout: float = DEFAULT_READ_TIMEOUT_S

    @classmethod
    def from_args(cls, args) -> "ServerOptions":
        """From `adpfleet serve`'s flags; an unset limit keeps its default here."""
        limits = {name: value for name in ("max_request_bytes", "max_waiting_requests", "request_timeout",
                                           "read_timeout") if (value := getattr(args, name)) is not None}
        options = cls(Credentials.from_args(args), KVPeers(args.kv_peer) if args.kv_peer else KVPeers(),
                      args.fault_injection or os.environ.get(FAULT_INJECTION_ENV) == "1", args.enable_docs, **limits)
        for flag, value in (("--max-request-bytes", options.max_request_bytes),
                            ("--max-waiting-requests", options.max_waiting_requests),
                            ("--request-timeout", options.request_timeout), ("--read-timeout", options.read_timeout),
                            ("--kv-transfer-timeout", args.kv_transfer_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        return options


@dataclass
class Prepared:
    req: object  # the parsed OpenAI request (protocol.CompletionRequest or ChatCompletionRequest)
    ereq: object  # the engine's Request
    fmt: protocol.CompletionFormat
    max_tokens: int


class _Stream(StreamingResponse):
    """A streamed answer whose generator is closed (aborting the request, leaving its waiting
    place) however the response ends — also when the client left before the first byte."""

    def __init__(self, body, on_close):
        super().__init__(body, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


def build_app(engine, model_name: str, role: str = "aggregated", options: ServerOptions | None = None) -> FastAPI:
    from adpfleet.runtime.serving.engine_client import EngineUnavailable

    options = options or ServerOptions()
    pages = {} if options.enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="adpfleet", version="0.1.0", **pages)
    app.add_middleware(BearerAuth, credentials=options.credentials)
    waiting = WaitingQueue(options.max_waiting_requests)
    prep_pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="request-prep")
    error = error_response

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

    _add_metrics(app, engine, role)
    add_snapshot_route(app, engine.group, options.credentials)

    def check_kv_peer(params, principal: str) -> None:
        """Only the router (the internal token) vouches for any endpoint; anyone else may name
        only an allowed KV peer, and nobody else at all when the fleet has an internal token."""
        if principal == INTERNAL:
            return
        if options.credentials.internal_token is not None:
            raise Refused(403, "'disaggregated_params' are accepted only from the router (the fleet's internal "
                          "token)", "disaggregated_params", code="forbidden")
        host, _ = parse_endpoint(params.kv_endpoint)
        if not options.kv_peers.allows(host):
            raise Refused(403, f"'disaggregated_params.kv_endpoint': {host} is not an allowed KV peer of this "
                          "server (see --kv-peer)", "disaggregated_params", code="forbidden")

    def prepare(raw: bytes, model_cls, fmt_cls, principal: str) -> Prepared:
        """Off the event loop: parse, validate, render the chat template, tokenize."""
        req = protocol.parse(model_cls, parse_json_object(raw).fields)
        if req.model is not None and req.model != model_name:
            raise Refused(404, f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                          "model", code="model_not_found")
        req.unsupported()
        fmt = fmt_cls(model_name)
        limit = engine.model_config.max_position_embeddings
        if role == "generation":
            params = req.disaggregated_params
            if params is None:
                raise InvalidRequestError("a generation server continues requests a context server started: "
                                          "send 'disaggregated_params' (or go through the router)",
                                          "disaggregated_params")
            check_kv_peer(params, principal)
            max_tokens = req.requested_max_tokens(len(params.prompt_token_ids), limit)
            ereq = engine.make_generation_request(req.sampling_params(max_tokens), params, fmt.id)
        else:
            if req.disaggregated_params is not None:
                raise InvalidRequestError(f"'disaggregated_params' is only for generation servers; this is a "
                                          f"{role} server", "disaggregated_params")
            prompt = tokenize(req.prompt_input(engine.tokenizer), engine.tokenizer)
            max_tokens = req.requested_max_tokens(len(prompt), limit)
            ereq = engine.make_request(prompt, req.sampling_params(max_tokens), fmt.id)
            if role == "context":  # the context role runs the prompt and samples only the first token
                ereq.params.max_tokens = 1
        return Prepared(req, ereq, fmt, max_tokens)

    async def serve(request: Request, model_cls, fmt_cls):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + options.request_timeout
        try:
            ticket = waiting.enter()
        except Refused as r:
            return r.response()
        try:
            ok, reason = engine.health()
            if not ok:
                ticket.leave()
                return error(f"server unavailable: {reason}", 503, kind="server_error")
            hint = rank_hint(request, engine.group.dp, options.credentials)
            raw = await read_body(request, options.max_request_bytes)
            p = await loop.run_in_executor(prep_pool, prepare, raw, model_cls, fmt_cls, request.state.principal)
            p.ereq.data_parallel_rank = hint
        except Refused as r:
            ticket.leave()
            return r.response()
        except InvalidRequestError as e:
            ticket.leave()
            return error(str(e), 400, e.param)
        except BaseException:
            ticket.leave()
            raise

        if p.req.stream and role != "context":  # a context server always answers in one piece
            return _Stream(stream(p, ticket, deadline), on_close=ticket.leave)
        try:
            text, last = await collect(p.ereq, request, ticket, deadline)
        except EngineUnavailable as e:
            return failure(e)
        except ClientGone:
            return error("client disconnected", 499)
        except DeadlineExceeded:
            return error(deadline_message(), 504, kind="server_error", code="deadline_exceeded")
        finally:
            ticket.leave()
        if role == "context":
            return context_body(p.ereq, p.fmt, p.max_tokens, text, last)
        return p.fmt.full(text, last.finish_reason, protocol.usage(last.prompt_tokens, last.completion_tokens))

    def deadline_message() -> str:
        return f"the request did not complete within the server's request timeout of {options.request_timeout:g} s"

    async def collect(ereq, request: Request, ticket, deadline: float):
        """Run a request to the end; abort it if the client disconnects or its deadline passes."""
        async def consume():
            texts, last = [], None
            async with contextlib.aclosing(engine.generate(ereq)) as outputs:
                async for out in outputs:
                    ticket.start()
                    texts.append(out.new_text)
                    last = out
            return "".join(texts), last

        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(consume())
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    raise DeadlineExceeded()
                done, _ = await asyncio.wait({task}, timeout=min(DISCONNECT_POLL_S, left))
                if done:
                    return task.result()
                if await request.is_disconnected():
                    raise ClientGone()
        finally:
            task.cancel()  # if still running: the generator's cleanup aborts the request and frees its KV

    def failure(e: Exception) -> JSONResponse:
        if str(e).startswith(kv_transfer.FAILED):
            return error(str(e), 502, kind="kv_transfer_failed")
        return error(f"server failed: {e}", 503, kind="server_error")

    def context_body(ereq, fmt, max_tokens: int, text: str, last) -> dict:
        """The first token, and where the generation server pulls the prompt's KV from."""
        done = max_tokens == 1 or last.finish_reason == "stop"
        if done:  # finished at the first token: nothing to transfer
            engine.release_kv(last)
        body = fmt.full(text, ("length" if max_tokens == 1 else "stop") if done else None,
                        protocol.usage(last.prompt_tokens, last.completion_tokens))
        if not done:
            body["disaggregated_params"] = {
                "ctx_request_id": ereq.request_id, "first_token_id": last.new_token_ids[-1],
                "prompt_token_ids": ereq.prompt_token_ids, "kv_endpoint": engine.group.kv_endpoints[last.rank],
                "kv_handle": ereq.request_id}
        return body

    async def stream(p: Prepared, ticket, deadline: float):
        last, first = None, True
        try:
            async with contextlib.aclosing(engine.generate(p.ereq)) as outputs:
                while True:
                    try:
                        async with asyncio.timeout_at(deadline):
                            out = await anext(outputs, None)
                    except TimeoutError:  # the request was aborted as its wait was cancelled
                        body = protocol.error_body(deadline_message(), kind="server_error", code="deadline_exceeded")
                        yield f"data: {json.dumps(body)}\n\n"
                        return
                    if out is None:
                        break
                    ticket.start()
                    last = out
                    if out.new_text or out.finished:
                        yield f"data: {json.dumps(p.fmt.chunk(out.new_text, out.finish_reason, first))}\n\n"
                        first = False
        except EngineUnavailable as e:  # the stream already started: end it with an explicit error
            kind = "kv_transfer_failed" if str(e).startswith(kv_transfer.FAILED) else "server_error"
            yield f"data: {json.dumps(protocol.error_body(f'server failed: {e}', kind=kind))}\n\n"
            return
        if p.req.include_usage and last is not None:
            use = protocol.usage(last.prompt_tokens, last.completion_tokens)
            yield f"data: {json.dumps(p.fmt.usage_chunk(use))}\n\n"
        yield "data: [DONE]\n\n"

    if options.fault_injection:
        from adpfleet.runtime.executor import faults

        @app.post("/faults")
        async def inject(request: Request):
            try:
                body = parse_json_object(await read_body(request, options.max_request_bytes)).fields
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
                return error(f"bad fault: {e}", 400)
            log.warning("fault injected: %s on rank %d", kind, rank)
            return {"injected": kind, "rank": rank}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, protocol.CompletionRequest, protocol.CompletionFormat)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, protocol.ChatCompletionRequest, protocol.ChatFormat)

    return app


def _add_metrics(app: FastAPI, engine, role: str) -> None:
    """/metrics: this pod's ranks (each pod of a server exports its own, labelled with its node rank)."""
    topology = engine.group.topology
    node_rank = topology.node_rank if topology.nodes > 1 else None

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(role, engine.group.rank_stats(), node_rank),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")


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
