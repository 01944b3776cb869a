"""A stand-in for `adpfleet serve` that follows the disaggregation contract, with fault knobs.

Text is deterministic: token i of a prompt is a word chosen from the prompt's bytes and i, so
aggregated, context+generation and retried answers are identical. Runs as its own process
(`python fake_server.py --role R --port P`) so tests can kill it; POST /fake/config changes its
behaviour at run time, GET /fake/state returns the bodies it received and how many streams are open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
         "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
MODEL = "fake"


def error(message, param=None, kind="invalid_request_error", status=400, code=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


def prompt_of(body, chat):
    if chat:
        return " ".join(str(m.get("content", "")) for m in body.get("messages") or [])
    p = body.get("prompt")
    return p[0] if isinstance(p, list) and p and isinstance(p[0], str) else str(p)


def tokens_for(prompt: str, max_tokens: int, stop: list[str]) -> tuple[list[str], str]:
    """The output pieces and finish reason, with OpenAI stop-string semantics (the stop string
    and what follows are not returned)."""
    seed = sum(prompt.encode())
    text, pieces = "", []
    for i in range(max_tokens):
        piece = " " + WORDS[(seed + 7 * i + i * i) % len(WORDS)]
        for s in stop:
            if s in text + piece:
                cut = (text + piece).index(s)
                if cut > len(text):
                    pieces.append((text + piece)[len(text):cut])
                return pieces, "stop"
        pieces.append(piece)
        text += piece
    return pieces, "length"


def build(role: str, host: str, port: int) -> FastAPI:
    app = FastAPI()
    cfg = {"token_delay": 0.0, "fail_status": None, "hang": False, "kv_hang": False, "kv_timeout": 5.0,
           "kv_fail": False, "kv_fail_in_stream": False, "healthy": True, "kv_host": None, "refuse_params": False,
           "snapshot": None, "line_breaks_in_text": False}
    received: list[dict] = []
    active = [0]  # streams being sent
    held: dict[str, float] = {}

    @app.post("/fake/config")
    async def configure(request: Request):
        cfg.update(await request.json())
        received.clear()
        return cfg

    @app.get("/fake/state")
    async def state():
        return {"received": received, "active": active[0]}

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok"}, status_code=200 if cfg["healthy"] else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fake"}]}

    @app.get("/internal/prefix_cache")
    async def prefix_cache():
        """The snapshot a cache-aware router polls: 404 by default (a server that has none), 403
        ("refuse"), a body that is not JSON ("garbage"), or the JSON given (a lie of any shape)."""
        snapshot = cfg["snapshot"]
        if snapshot is None:
            return error("not found", status=404)
        if snapshot == "refuse":
            return error("accepted only from the router", kind="forbidden", status=403)
        if snapshot == "garbage":
            return StreamingResponse(iter([b"{not json"]), media_type="application/json")
        return snapshot

    @app.get("/kv/{handle}")
    async def kv(handle: str):
        if cfg["kv_hang"]:
            await asyncio.sleep(3600)
        if held.pop(handle, None) is None:
            return error(f"unknown KV handle {handle}", status=404)
        return {"ok": True}

    async def complete(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error("the request body is not valid JSON")
        received.append(json.loads(json.dumps(body)))
        if cfg["fail_status"]:
            return error(f"fake failure at {host}:{port}", kind="server_error", status=cfg["fail_status"])
        if cfg["hang"]:
            await asyncio.sleep(3600)
        if body.get("model") not in (None, MODEL):
            return error(f"the model '{body['model']}' does not exist", "model", status=404, code="model_not_found")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            return error("'max_tokens': must be a positive integer", "max_tokens")
        if chat and not isinstance(body.get("messages"), list):
            return error("'messages': Field required", "messages")
        if not chat and "prompt" not in body:
            return error("'prompt': Field required", "prompt")
        params = body.pop("disaggregated_params", None)
        if role == "generation":
            if params is None:
                return error("a generation server needs disaggregated_params", "disaggregated_params")
            if cfg["refuse_params"]:  # as `adpfleet serve` refuses a KV peer it does not allow
                host_of = str(params.get("kv_endpoint")).rpartition(":")[0]
                return error(f"'disaggregated_params.kv_endpoint': {host_of} is not an allowed KV peer of this "
                             "server (see --kv-peer)", "disaggregated_params", status=403, code="forbidden")
            try:  # "pull the KV" from the context server
                async with httpx.AsyncClient(trust_env=False) as http:
                    r = await http.get(f"http://{params['kv_endpoint']}/kv/{params['kv_handle']}",
                                       timeout=cfg["kv_timeout"])
                ok = r.status_code == 200
                why = r.text
            except httpx.HTTPError as e:
                ok, why = False, repr(e)
            if cfg["kv_fail"]:
                ok, why = False, "kv_fail is set"
            if not ok:  # naming the endpoint, as `adpfleet serve` does
                return error(f"KV transfer failed (from {params['kv_endpoint']}): {why}", kind="kv_transfer_failed",
                             status=502)
            if cfg["kv_fail_in_stream"] and body.get("stream"):  # as `adpfleet serve` does: 200, then an error event
                err = {"error": {"message": f"KV transfer failed (from {params['kv_endpoint']}) in stream",
                                 "type": "kv_transfer_failed", "param": None, "code": None}}
                return StreamingResponse(iter([f"data: {json.dumps(err)}\n\n"]), media_type="text/event-stream")
        elif params is not None:
            return error("unrecognized request argument supplied: 'disaggregated_params'", "disaggregated_params")
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        prompt = prompt_of(body, chat)
        n_prompt = max(1, len(prompt.split()))
        pieces, finish = tokens_for(prompt, max_tokens, stop)
        if cfg["line_breaks_in_text"]:  # what str.splitlines breaks at and JSON leaves as is, sent as is (as vLLM does)
            pieces = [p + "\u2028\x85\u2029" for p in pieces]
        rid, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())
        extra = {}
        if role == "context":  # the first token only; finished if that already ends the request
            pieces, finish = tokens_for(prompt, 1, stop)
            if finish != "stop" and max_tokens > 1:
                finish = None
                handle = uuid.uuid4().hex
                held[handle] = time.time()
                extra["disaggregated_params"] = {"ctx_request_id": rid, "first_token_id": 3,
                                                 "prompt_token_ids": list(range(n_prompt)),
                                                 "kv_endpoint": f"{cfg['kv_host'] or host}:{port}",
                                                 "kv_handle": handle}
        usage = {"prompt_tokens": n_prompt, "completion_tokens": len(pieces), "total_tokens": n_prompt + len(pieces)}
        kind = "chat.completion" if chat else "text_completion"

        def choice(text, fin, streaming):
            if chat:
                key = "delta" if streaming else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": fin,
                        "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": fin, "logprobs": None}

        if not body.get("stream"):
            await asyncio.sleep(cfg["token_delay"] * len(pieces))
            return {"id": rid, "object": kind, "created": created, "model": MODEL,
                    "choices": [choice("".join(pieces), finish, False)], "usage": usage, **extra}

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        async def events():
            active[0] += 1
            try:
                async for event in chunks():
                    yield event
            finally:
                active[0] -= 1

        def dumps(event: dict) -> str:
            return json.dumps(event, ensure_ascii=not cfg["line_breaks_in_text"])

        async def chunks():
            if chat:
                yield "data: " + dumps({"id": rid, "object": chunk_kind, "created": created, "model": MODEL,
                                        "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                     "finish_reason": None}]}) + "\n\n"
            for i, piece in enumerate(pieces):
                await asyncio.sleep(cfg["token_delay"])
                fin = finish if i == len(pieces) - 1 else None
                yield "data: " + dumps({"id": rid, "object": chunk_kind, "created": created, "model": MODEL,
                                        "choices": [choice(piece, fin, True)]}) + "\n\n"
            if not pieces:
                yield "data: " + dumps({"id": rid, "object": chunk_kind, "created": created, "model": MODEL,
                                        "choices": [choice("", finish, True)]}) + "\n\n"
            if include_usage:
                yield "data: " + dumps({"id": rid, "object": chunk_kind, "created": created, "model": MODEL,
                                        "choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["context", "generation", "aggregated"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(build(args.role, args.host, args.port), host=args.host, port=args.port, log_level="warning")
