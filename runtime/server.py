"""`adpfleet serve`: the OpenAI-compatible HTTP server in front of the engine.

FastAPI + uvicorn, as vLLM, SGLang and trtllm-serve use: users and their tooling already know
its behaviour (SSE streaming, OpenAPI document at /openapi.json, graceful shutdown).
"""

from __future__ import annotations

import json
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from adpfleet.runtime import metrics
from adpfleet.runtime.engine.sampling import InvalidRequestError
from adpfleet.runtime.serving import protocol

log = logging.getLogger("adpfleet.server")
EXIT_GRACE_S = 1.0


def build_app(engine_client, model_name: str, role: str = "aggregated"):
    from adpfleet.runtime.serving.engine_client import EngineUnavailable

    app = FastAPI(title="adpfleet", version="0.1.0")
    engine = engine_client

    def bad(e: InvalidRequestError, status: int = 400) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(e), e.param), status_code=status)

    @app.get("/health")
    async def health():
        ok, reason = engine_client.health()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "reason": reason},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "adpfleet",
            "max_model_len": engine.model_config.max_position_embeddings}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(role, engine.group.rank_stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise InvalidRequestError(f"the request body is not valid JSON: {e}", None) from None
            req = protocol.parse(protocol.CompletionRequest, body)
            if req.model is not None and req.model != model_name:
                return JSONResponse(protocol.error_body(
                    f"the model '{req.model}' does not exist; this server serves '{model_name}'", "model",
                    code="model_not_found"), status_code=404)
            req.unsupported()
            rid = protocol.completion_id()
            ereq = engine.make_request(req.the_prompt(), req.sampling_params(), rid)
        except InvalidRequestError as e:
            return bad(e)
        ok, reason = engine_client.health()
        if not ok:
            return JSONResponse(protocol.error_body(f"server unavailable: {reason}", kind="server_error"),
                                status_code=503)
        created = int(time.time())
        if not req.stream:
            text, last = [], None
            try:
                async for out in engine_client.generate(ereq):
                    text.append(out.new_text)
                    last = out
            except EngineUnavailable as e:
                return JSONResponse(protocol.error_body(f"server failed: {e}", kind="server_error"), status_code=503)
            return protocol.completion_body(rid, model_name, "".join(text), last.finish_reason,
                                            protocol.usage(last.prompt_tokens, last.completion_tokens), created)

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            last = None
            try:
                async for out in engine_client.generate(ereq):
                    last = out
                    if out.new_text or out.finished:
                        chunk = protocol.completion_body(rid, model_name, out.new_text, out.finish_reason, None,
                                                         created)
                        yield f"data: {json.dumps(chunk)}\n\n"
            except EngineUnavailable as e:  # the stream already started: end it with an explicit error
                yield f"data: {json.dumps(protocol.error_body(f'server failed: {e}', kind='server_error'))}\n\n"
                return
            if include_usage and last is not None:
                chunk = protocol.completion_body(rid, model_name, "", None,
                                                 protocol.usage(last.prompt_tokens, last.completion_tokens), created)
                chunk["choices"] = []
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main(args) -> int:
    import uvicorn

    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.serving.engine_client import EngineClient

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.dp < 1:
        raise ValueError(f"--dp must be a positive integer, got {args.dp}")
    config = EngineConfig.from_args(args)
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
                          collective_timeout_s=args.collective_timeout)
    name = args.served_model_name or (args.model if args.model in ("tiny", "tiny-dense")
                                      else args.model.rstrip("/").rsplit("/", 1)[-1])
    app = build_app(client, name, args.role)
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
