"""A server's OpenAI routes, `/v1/completions` and `/v1/chat/completions`: one request, top to
bottom, and what bounds each step (nothing one client sends may kill, wedge or pin the server;
docs/security.md):

1. the credential, when the server has one (`auth.BearerAuth`, in front of every route: 401);
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from adpfleet.runtime.engine.sampling import InvalidRequestError
from adpfleet.runtime.engine.validation import tokenize
from adpfleet.runtime.executor.kv_endpoint import FAILED as KV_TRANSFER_FAILED, parse_endpoint
from adpfleet.runtime.serving import protocol
from adpfleet.runtime.serving.auth import INTERNAL
from adpfleet.runtime.serving.engine_client import EngineUnavailable
from adpfleet.runtime.serving.limits import Refused, WaitingQueue, error_response, parse_json_object, read_body
from adpfleet.runtime.serving.rank_routing import rank_hint
from adpfleet.runtime.serving.options import ServerOptions

DISCONNECT_POLL_S = 0.5
PREP_THREADS = 2  # request preparation is mostly CPU under the GIL: more threads would not help


class ClientGone(Exception):
    pass


class DeadlineExceeded(Exception):
    pass


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


class CompletionRoutes:
    """What the two routes share: the engine, this server's role and options, the waiting queue and
    the preparation threads."""

    def __init__(self, engine, model_name: str, role: str, options: ServerOptions):
        self.engine, self.model_name, self.role, self.options = engine, model_name, role, options
        self.waiting = WaitingQueue(options.max_waiting_requests)
        self.prep_pool = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="request-prep")

    async def completions(self, request: Request):
        return await self.serve(request, protocol.CompletionRequest, protocol.CompletionFormat)

    async def chat_completions(self, request: Request):
        return await self.serve(request, protocol.ChatCompletionRequest, protocol.ChatFormat)

    async def serve(self, request: Request, model_cls, fmt_cls):
        """Steps 2 to 5 of the module's docstring (the middleware did step 1)."""
        deadline = asyncio.get_running_loop().time() + self.options.request_timeout
        try:
            ticket = self.waiting.enter()
        except Refused as r:
            return r.response()
        prepared = await self._admit(request, ticket, model_cls, fmt_cls)
        if not isinstance(prepared, Prepared):  # refused, and its waiting place left
            return prepared
        if prepared.req.stream and self.role != "context":  # a context server always answers in one piece
            return _Stream(self._stream(prepared, ticket, deadline), on_close=ticket.leave)
        return await self._answer(prepared, request, ticket, deadline)

    # -- admission: a healthy server, the body, its preparation ------------------------------------
    async def _admit(self, request: Request, ticket, model_cls, fmt_cls) -> Prepared | JSONResponse:
        """The request prepared, or the answer that refuses it (the waiting place then left)."""
        try:
            ok, reason = self.engine.health()
            if not ok:
                ticket.leave()
                return error_response(f"server unavailable: {reason}", 503, kind="server_error")
            hint = rank_hint(request, self.engine.group.dp, self.options.credentials)
            raw = await read_body(request, self.options.max_request_bytes)
            prepared = await asyncio.get_running_loop().run_in_executor(
                self.prep_pool, self.prepare, raw, model_cls, fmt_cls, request.state.principal)
            prepared.ereq.data_parallel_rank = hint  # the router's rank, or None: the dispatcher places it
            return prepared
        except Refused as r:
            ticket.leave()
            return r.response()
        except InvalidRequestError as e:
            ticket.leave()
            return error_response(str(e), 400, e.param)
        except BaseException:
            ticket.leave()
            raise

    def prepare(self, raw: bytes, model_cls, fmt_cls, principal: str) -> Prepared:
        """Off the event loop: parse, validate, render the chat template, tokenize."""
        engine, model_name, role = self.engine, self.model_name, self.role
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
            self._check_kv_peer(params, principal)
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

    def _check_kv_peer(self, params, principal: str) -> None:
        """Only the router (the internal token) vouches for any endpoint; anyone else may name
        only an allowed KV peer, and nobody else at all when the fleet has an internal token."""
        if principal == INTERNAL:
            return
        if self.options.credentials.internal_token is not None:
            raise Refused(403, "'disaggregated_params' are accepted only from the router (the fleet's internal "
                          "token)", "disaggregated_params", code="forbidden")
        host, _ = parse_endpoint(params.kv_endpoint)
        if not self.options.kv_peers.allows(host):
            raise Refused(403, f"'disaggregated_params.kv_endpoint': {host} is not an allowed KV peer of this "
                          "server (see --kv-peer)", "disaggregated_params", code="forbidden")

    # -- the answer in one piece -------------------------------------------------------------------
    async def _answer(self, p: Prepared, request: Request, ticket, deadline: float):
        """Run the request to its end, then answer it whole (a context server: the first token and
        where its KV is held)."""
        try:
            text, last = await self._collect(p.ereq, request, ticket, deadline)
        except EngineUnavailable as e:
            return self._failure(e)
        except ClientGone:
            return error_response("client disconnected", 499)
        except DeadlineExceeded:
            return error_response(self._deadline_message(), 504, kind="server_error", code="deadline_exceeded")
        finally:
            ticket.leave()
        if self.role == "context":
            return self._context_body(p.ereq, p.fmt, p.max_tokens, text, last)
        return p.fmt.full(text, last.finish_reason, protocol.usage(last.prompt_tokens, last.completion_tokens))

    async def _collect(self, ereq, request: Request, ticket, deadline: float):
        """Run a request to the end; abort it if the client disconnects or its deadline passes."""
        async def consume():
            texts, last = [], None
            async with contextlib.aclosing(self.engine.generate(ereq)) as outputs:
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

    def _failure(self, e: Exception) -> JSONResponse:
        if str(e).startswith(KV_TRANSFER_FAILED):
            return error_response(str(e), 502, kind="kv_transfer_failed")
        return error_response(f"server failed: {e}", 503, kind="server_error")

    def _context_body(self, ereq, fmt, max_tokens: int, text: str, last) -> dict:
        """The first token, and where the generation server pulls the prompt's KV from."""
        done = max_tokens == 1 or last.finish_reason == "stop"
        if done:  # finished at the first token: nothing to transfer
            self.engine.release_kv(last)
        body = fmt.full(text, ("length" if max_tokens == 1 else "stop") if done else None,
                        protocol.usage(last.prompt_tokens, last.completion_tokens))
        if not done:
            body["disaggregated_params"] = {
                "ctx_request_id": ereq.request_id, "first_token_id": last.new_token_ids[-1],
                "prompt_token_ids": ereq.prompt_token_ids, "kv_endpoint": self.engine.group.kv_endpoints[last.rank],
                "kv_handle": ereq.request_id}
        return body

    def _deadline_message(self) -> str:
        return ("the request did not complete within the server's request timeout of "
                f"{self.options.request_timeout:g} s")

    # -- the answer as a stream --------------------------------------------------------------------
    async def _stream(self, p: Prepared, ticket, deadline: float):
        last, first = None, True
        try:
            async with contextlib.aclosing(self.engine.generate(p.ereq)) as outputs:
                while True:
                    try:
                        async with asyncio.timeout_at(deadline):
                            out = await anext(outputs, None)
                    except TimeoutError:  # the request was aborted as its wait was cancelled
                        body = protocol.error_body(self._deadline_message(), kind="server_error",
                                                   code="deadline_exceeded")
                        yield f"data: {json.dumps(body)}\n\n"
                        return
                    if out is None:
                        break
                    ticket.start()
                    last = out
                    # a chunk per output with tokens, its text empty while the detokenizer holds them
                    # back (an unfinished UTF-8 sequence, a possible stop string), as vLLM streams: the
                    # client's time to first token is its first chunk
                    if out.new_token_ids or out.new_text or out.finished:
                        yield f"data: {json.dumps(p.fmt.chunk(out.new_text, out.finish_reason, first))}\n\n"
                        first = False
        except EngineUnavailable as e:  # the stream already started: end it with an explicit error
            kind = "kv_transfer_failed" if str(e).startswith(KV_TRANSFER_FAILED) else "server_error"
            yield f"data: {json.dumps(protocol.error_body(f'server failed: {e}', kind=kind))}\n\n"
            return
        if p.req.include_usage and last is not None:
            use = protocol.usage(last.prompt_tokens, last.completion_tokens)
            yield f"data: {json.dumps(p.fmt.usage_chunk(use))}\n\n"
        yield "data: [DONE]\n\n"
