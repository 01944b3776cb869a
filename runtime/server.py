"""`adpfleet serve`: the OpenAI-compatible HTTP server in front of the ADP ranks.

FastAPI + uvicorn, as vLLM, SGLang and trtllm-serve use: users and their tooling already know
its behaviour (SSE streaming, OpenAPI document at /openapi.json, graceful shutdown).

Roles: `aggregated` runs whole requests. `context` runs the prompt, answers with the first
token and `disaggregated_params` (where to pull the held KV), and holds the KV until pulled.
`generation` takes those params, pulls the KV, and continues the request from the first token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from adpfleet.runtime import metrics
from adpfleet.runtime.engine.sampling import InvalidRequestError
from adpfleet.runtime.engine.validation import tokenize
from adpfleet.runtime.serving import kv_transfer, protocol

log = logging.getLogger("adpfleet.server")
EXIT_GRACE_S = 1.0
DISCONNECT_POLL_S = 0.5


class ClientGone(Exception):
    pass


def build_app(engine, model_name: str, role: str = "aggregated", fault_injection: bool = False):
    from adpfleet.runtime.serving.engine_client import EngineUnavailable

    app = FastAPI(title="adpfleet", version="0.1.0")

    def error(message: str, status: int, param=None, kind="invalid_request_error", code=None) -> JSONResponse:
        return JSONResponse(protocol.error_body(message, param, kind, code), status_code=status)

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

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(role, engine.group.rank_stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def collect(ereq, request: Request):
        """Run a request to the end; abort it if the client disconnects meanwhile."""
        async def consume():
            texts, last = [], None
            async for out in engine.generate(ereq):
                texts.append(out.new_text)
                last = out
            return "".join(texts), last

        task = asyncio.ensure_future(consume())
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()  # the generator's cleanup aborts the request and frees its KV
                raise ClientGone()

    async def serve(request: Request, model_cls, fmt_cls):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidRequestError(f"the request body is not valid JSON: {e}", None) from None
            req = protocol.parse(model_cls, body)
            if req.model is not None and req.model != model_name:
                return error(f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                             404, "model", code="model_not_found")
            req.unsupported()
            fmt = fmt_cls(model_name)
            limit = engine.model_config.max_position_embeddings
            if role == "generation":
                if req.disaggregated_params is None:
                    raise InvalidRequestError("a generation server continues requests a context server started: "
                                              "send 'disaggregated_params' (or go through the router)",
                                              "disaggregated_params")
                n = len(req.disaggregated_params.prompt_token_ids)
                ereq = engine.make_generation_request(req.sampling_params(req.requested_max_tokens(n, limit)),
                                                      req.disaggregated_params, fmt.id)
            else:
                if req.disaggregated_params is not None:
                    raise InvalidRequestError(f"'disaggregated_params' is only for generation servers; this is a "
                                              f"{role} server", "disaggregated_params")
                prompt = tokenize(req.prompt_input(engine.tokenizer), engine.tokenizer)
                max_tokens = req.requested_max_tokens(len(prompt), limit)
                # the context role runs the prompt and samples only the first token
                ereq = engine.make_request(prompt, req.sampling_params(max_tokens), fmt.id)
                if role == "context":
                    ereq.params.max_tokens = 1
        except InvalidRequestError as e:
            return error(str(e), 400, e.param)
        ok, reason = engine.health()
        if not ok:
            return error(f"server unavailable: {reason}", 503, kind="server_error")

        if req.stream and role != "context":  # a context server always answers in one piece
            return StreamingResponse(stream(req, ereq, fmt), media_type="text/event-stream")
        try:
            text, last = await collect(ereq, request)
        except EngineUnavailable as e:
            return failure(e)
        except ClientGone:
            return error("client disconnected", 499)
        if role == "context":
            return context_body(ereq, fmt, max_tokens, text, last)
        return fmt.full(text, last.finish_reason, protocol.usage(last.prompt_tokens, last.completion_tokens))

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

    async def stream(req, ereq, fmt):
        last, first = None, True
        try:
            async for out in engine.generate(ereq):
                last = out
                if out.new_text or out.finished:
                    yield f"data: {json.dumps(fmt.chunk(out.new_text, out.finish_reason, first))}\n\n"
                    first = False
        except EngineUnavailable as e:  # the stream already started: end it with an explicit error
            kind = "kv_transfer_failed" if str(e).startswith(kv_transfer.FAILED) else "server_error"
            yield f"data: {json.dumps(protocol.error_body(f'server failed: {e}', kind=kind))}\n\n"
            return
        if req.include_usage and last is not None:
            yield f"data: {json.dumps(fmt.usage_chunk(protocol.usage(last.prompt_tokens, last.completion_tokens)))}\n\n"
        yield "data: [DONE]\n\n"

    if fault_injection:
        from adpfleet.runtime.executor import faults

        @app.post("/faults")
        async def inject(request: Request):
            try:
                body = json.loads(await request.body())
                kind, rank = body["kind"], body.get("rank", 0)
                if kind not in faults.KINDS:
                    raise ValueError(f"'kind' must be one of {', '.join(faults.KINDS)}")
                if kind == "stop-reaping" and role != "context":
                    raise ValueError("stop-reaping applies to context servers only")
                if not isinstance(rank, int):
                    raise ValueError("'rank' must be an integer")
                engine.group.inject_fault(kind, rank)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
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


def main(args) -> int:
    import uvicorn

    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.model.sources.fetch import resolve_model
    from adpfleet.runtime.serving.engine_client import EngineClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dp < 1:
        raise ValueError(f"--dp must be a positive integer, got {args.dp}")
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
                          kv_lease_s=args.kv_lease, kv_transfer_timeout_s=args.kv_transfer_timeout)
    name = args.served_model_name or model.served_name
    # the environment variable lets an InferenceFleet's `env` enable it without a new flag
    fault_injection = args.fault_injection or os.environ.get("ADPFLEET_FAULT_INJECTION") == "1"
    app = build_app(client, name, args.role, fault_injection=fault_injection)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    log.info("serving %s (%s, %d ADP ranks) on http://%s:%d", name, args.role, args.dp, args.host, args.port)
    try:
        server.run()
    finally:
        client.close()
    if failure:
        log.error("exiting: %s", failure[0])
        return 1
    return 0
