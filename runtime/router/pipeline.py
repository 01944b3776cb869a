"""One client request through the fleet: pick servers, run context then generation (or one
aggregated server), retry what failed before any token reached the client, relay the answer.

`Router.prepare` runs every attempt up to the point of no return — the first event that carries
output — and returns either a complete `Answer` or a committed `Relay`; `Router.relay` streams a
committed answer to the end, or ends it with an explicit error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit
from dataclasses import dataclass, field

import httpx

from adpfleet.runtime.executor.kv_endpoint import parse_endpoint
from adpfleet.runtime.router import sse
from adpfleet.runtime.router.metrics import RouterMetrics
from adpfleet.runtime.router.retry import (Failure, error_body, failure_from_status, final_error, is_client_error,
                                            retry_after, servers_to_avoid, should_retry)
from adpfleet.runtime.router.policy import Pick, Selector
from adpfleet.runtime.router.pool import ROLES, Endpoint, ServerPool
from adpfleet.runtime.router.prompt_tokens import Prompt
from adpfleet.runtime.router.queue import RequestQueue
from adpfleet.runtime.serving.limits import RETRY_AFTER_S
from adpfleet.runtime.serving.rank_routing import RANK_HEADER

log = logging.getLogger("adpfleet.router")

# On every answer `prepare` makes: how many attempts it took (more than 1: the router retried it on
# another server, invisibly to the client) and how long it waited in the queue for a usable server.
ATTEMPTS_HEADER = "X-Adpfleet-Attempts"
QUEUED_HEADER = "X-Adpfleet-Queued-Seconds"


@dataclass
class Answer:
    """A complete answer: a JSON body (dict, or the server's bytes passed through unchanged)."""
    status: int
    body: dict | bytes
    headers: dict = field(default_factory=dict)


@dataclass
class Relay:
    """A stream the client will receive: `first` events are already in hand (nothing was sent
    yet), `rest` continues from the server (None when the stream is complete)."""
    first: list[bytes]
    rest: AsyncIterator[sse.Event] | None = None
    server: Endpoint | None = None
    on_close: list = field(default_factory=list)
    outcome: str = "client_closed"  # the requests_total label, set by Router.relay as it ends
    headers: dict = field(default_factory=dict)  # sent with the stream (see ATTEMPTS_HEADER)

    async def close(self) -> None:
        """Idempotent: closes the server's stream and releases its in-flight slot."""
        while self.on_close:
            await self.on_close.pop()()


class AttemptFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(failure.describe())
        self.failure = failure


@dataclass
class _Attempt:
    """Where one attempt is, so a timeout can be blamed on the server it was waiting for."""
    headers: dict  # what every request to a server carries (its credential)
    context: Endpoint | None = None
    waiting_on: Endpoint | None = None


def _transport_failure(server: Endpoint, exc: httpx.HTTPError) -> Failure:
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):  # its text may hold the address: logs only
        return Failure("connect_error", "cannot connect", server, detail=repr(exc))
    return Failure("server_error", "connection lost", server, detail=repr(exc))


class Router:
    def __init__(self, pool: ServerPool, metrics: RouterMetrics, http: httpx.AsyncClient, queue: RequestQueue, *,
                 request_timeout: float, max_attempts: int, first_token_timeout: float | None = None,
                 selector: Selector | None = None):
        self.pool, self.metrics, self.http, self.queue = pool, metrics, http, queue
        self.selector = selector or Selector(pool)
        self.request_timeout, self.max_attempts = request_timeout, max_attempts
        self.first_token_timeout = first_token_timeout

    # -- the attempts ------------------------------------------------------------------------
    async def prepare(self, path: str, body: dict, deadline: float, headers: dict | None = None,
                      body_bytes: int = 0, prompt: Prompt | None = None) -> Answer | Relay:
        """Attempts until one succeeds, a server rejects the input (4xx), or none is left.
        `headers` go to every server (the credential, see auth.Credentials.upstream_headers);
        `body_bytes`: what `body` takes in memory, counted by the queue while it waits;
        `prompt`: its tokens, for the cache-aware policy (None: chosen by load)."""
        loop = asyncio.get_running_loop()
        failures: list[Failure] = []
        avoid: set[Endpoint] = set()
        queue_until: list[float] = []  # set when the request first has to wait: the queue timeout is per request
        attempts, queued = 0, 0.0

        def told(outcome: Answer | Relay) -> Answer | Relay:
            outcome.headers.update({ATTEMPTS_HEADER: str(attempts), QUEUED_HEADER: f"{queued:.3f}"})
            return outcome
        for attempt in range(1, self.max_attempts + 1):
            waited_from = loop.time()
            unplaceable = await self._wait_for_server(deadline, queue_until, body_bytes)
            queued += loop.time() - waited_from
            if unplaceable is not None:
                failures.append(unplaceable)
                self.metrics.errors.labels(unplaceable.reason).inc()
                log.warning("request not placed: %s", unplaceable.describe())
                break
            if attempt > 1:
                self.metrics.retries.inc()
            attempts = attempt
            state = _Attempt(headers or {})
            limit = deadline if not self.first_token_timeout else min(deadline, loop.time() + self.first_token_timeout)
            try:
                async with asyncio.timeout_at(limit):
                    return told(await self._attempt(state, path, body, avoid, prompt))
            except AttemptFailed as e:
                failure = e.failure
            except TimeoutError:
                if loop.time() >= deadline:
                    failure = Failure("deadline", f"no answer within the request deadline of {self.request_timeout:g} s",
                                      state.waiting_on)
                else:
                    failure = Failure("attempt_timeout", f"no first token within {self.first_token_timeout:g} s",
                                      state.waiting_on)
            failures.append(failure)
            self.metrics.errors.labels(failure.reason).inc()
            if failure.server is not None and failure.reason not in ("kv_transfer_failed", "deadline", "overloaded"):
                self.pool.report_failure(failure.server, time.monotonic())
            log.warning("attempt %d/%d failed: %s", attempt, self.max_attempts, failure.describe())
            if not should_retry(failure, attempt, self.max_attempts, False, deadline - loop.time()):
                break
            avoid |= servers_to_avoid(failure, state.context)
        status, err = final_error(failures, deadline_passed=loop.time() >= deadline)
        return told(Answer(status, err, {"Retry-After": str(RETRY_AFTER_S)} if retry_after(status, failures) else {}))

    async def _wait_for_server(self, deadline: float, queue_until: list[float], body_bytes: int) -> Failure | None:
        """None when the pool has usable servers for a mode, at once or after waiting in the
        queue; else why the request cannot be placed."""
        def placeable() -> bool:
            return self.pool.mode(time.monotonic()) is not None
        if placeable():
            return None
        if not queue_until:
            queue_until.append(asyncio.get_running_loop().time() + self.queue.timeout_s)
        outcome = await self.queue.wait(placeable, min(deadline, queue_until[0]),
                                        lambda: self.pool.recovery_in(time.monotonic()), body_bytes)
        if outcome == "placed":
            return None
        if asyncio.get_running_loop().time() >= deadline:
            return Failure("deadline", f"no usable server within the request deadline of {self.request_timeout:g} s")
        need = f"the router needs a usable context and generation server, or an aggregated server ({self._usable()})"
        known = "known: " + (", ".join(f"{ep.role} {ep.url}" for ep in self.pool.endpoints()) or "none")
        if outcome == "full":
            return Failure("queue_full", f"no usable server, and {self.queue.max_size} requests already wait for "
                                         f"one; retry shortly ({need})", detail=known)
        if outcome == "over_bytes":
            return Failure("queue_bytes", f"no usable server, and the bodies of the requests waiting for one take "
                                          f"{self.queue.held_bytes} bytes: with this one's {body_bytes} they would "
                                          f"pass the router's limit of {self.queue.max_bytes} (--queue-max-bytes); "
                                          f"retry shortly ({need})", detail=known)
        return Failure("no_server", f"no usable server within the queue timeout of {self.queue.timeout_s:g} s; {need}",
                       detail=known)

    def _usable(self) -> str:
        """How many servers of each role the router knows and can use now, without their addresses."""
        now = time.monotonic()
        return "usable: " + ", ".join(f"{role} {len(self.pool.usable(role, now))} of {len(self.pool.endpoints(role))}"
                                      for role in ROLES)

    async def _attempt(self, state: _Attempt, path: str, body: dict, avoid: set[Endpoint],
                       prompt: Prompt | None) -> Answer | Relay:
        stream = bool(body.get("stream"))
        mode = self.pool.mode(time.monotonic())
        if mode is None:  # _wait_for_server just saw usable servers, with no await since
            raise AttemptFailed(Failure("no_server", "no usable server"))
        if mode == "aggregated":
            return await self._answer_from(state, self._pick("aggregated", avoid, prompt), path, body, stream)

        ctx_pick = self._pick("context", avoid, prompt)
        ctx = state.context = ctx_pick.server
        ctx_body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
        status, raw = await self._post(state, ctx_pick, path, ctx_body)
        if is_client_error(status, raw):
            return Answer(status, raw)
        if status != 200:
            raise AttemptFailed(failure_from_status(ctx, status, raw))
        result = _json_object(raw)
        choices = result.get("choices") if result else None
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise AttemptFailed(Failure("bad_response", "the context server's answer has no choices", ctx))
        params = result.pop("disaggregated_params", None)
        if choices[0].get("finish_reason") is not None:  # finished at its first token: no generation step
            if not stream:
                return Answer(200, result)
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))  # a dict: app.py checked
            return Relay(sse.stream_of(result, path.endswith("/chat/completions"), include_usage))
        if not isinstance(params, dict):
            raise AttemptFailed(Failure("bad_response", "the context server answered without "
                                        "'disaggregated_params' (is it running with --role context?)", ctx))
        if not _kv_on_host(params.get("kv_endpoint"), ctx):  # the generation server trusts what the router sends
            raise AttemptFailed(Failure("bad_response", "the context server named a KV endpoint on another host",
                                        ctx, detail=f"{str(params.get('kv_endpoint'))[:80]!r}"))
        gen = self._pick("generation", avoid, None)  # it pulls the prompt's KV: chosen by load
        return await self._answer_from(state, gen, path, {**body, "disaggregated_params": params}, stream)

    def _pick(self, role: str, avoid: set[Endpoint], prompt: Prompt | None) -> Pick:
        pick = self.selector.pick(role, time.monotonic(), avoid, prompt)
        if pick is None:  # the pool changed since mode() was asked
            raise AttemptFailed(Failure("no_server", f"no {role} server is known"))
        return pick

    # -- talking to one server ---------------------------------------------------------------
    def _acquire(self, pick: Pick) -> None:
        self.pool.acquire(pick.server)
        self.metrics.set_in_flight(self.pool.in_flight())

    def _release(self, pick: Pick) -> None:
        self.pool.release(pick.server)
        self.metrics.set_in_flight(self.pool.in_flight())
        self.selector.request_ended(pick)

    async def _post(self, state: _Attempt, pick: Pick, path: str, body: dict) -> tuple[int, bytes]:
        server = state.waiting_on = pick.server
        self._acquire(pick)
        try:
            resp = await self.http.post(server.url + path, json=body, headers=_headers(state, pick))
            return resp.status_code, resp.content
        except httpx.HTTPError as e:
            raise AttemptFailed(_transport_failure(server, e)) from None
        finally:
            self._release(pick)

    async def _answer_from(self, state: _Attempt, pick: Pick, path: str, body: dict,
                           stream: bool) -> Answer | Relay:
        """The server that answers the whole request (generation or aggregated)."""
        server = pick.server
        if not stream:
            status, raw = await self._post(state, pick, path, body)
            if is_client_error(status, raw):
                return Answer(status, raw)
            if status != 200:
                raise AttemptFailed(failure_from_status(server, status, raw))
            if _json_object(raw) is None:
                raise AttemptFailed(Failure("bad_response", "the answer is not a JSON object", server))
            return Answer(200, raw)

        state.waiting_on = server
        self._acquire(pick)
        resp: httpx.Response | None = None
        relay: Relay | None = None
        try:
            resp = await self.http.send(self.http.build_request("POST", server.url + path, json=body,
                                                                headers=_headers(state, pick)), stream=True)
            if resp.status_code != 200:
                raw = await resp.aread()
                if is_client_error(resp.status_code, raw):
                    return Answer(resp.status_code, raw)
                raise AttemptFailed(failure_from_status(server, resp.status_code, raw))
            events = sse.events(sse.aiter_lines(resp.aiter_text()))
            held: list[bytes] = []
            async for event in events:  # hold events until one carries output: until then a retry is invisible
                if event.error:  # e.g. a failed KV pull reported in the stream instead of as a 502
                    kv = event.error.get("type") == "kv_transfer_failed"
                    what = ": the KV transfer from the context server failed" if kv else ""
                    raise AttemptFailed(Failure("kv_transfer_failed" if kv else "server_error",
                                                f"error event before any token{what}", server,
                                                detail=str(event.error.get("message"))[:300]))
                held.append(event.raw)
                if event.is_done or event.has_output:
                    relay = Relay(held, events, server)
                    relay.on_close += [self._releaser(pick), resp.aclose]  # run last to first
                    return relay
            raise AttemptFailed(Failure("server_error", "the stream ended before any token", server))
        except httpx.HTTPError as e:
            raise AttemptFailed(_transport_failure(server, e)) from None
        finally:
            if relay is None:
                if resp is not None:
                    await resp.aclose()
                self._release(pick)

    def _releaser(self, pick: Pick):
        async def release() -> None:
            self._release(pick)
        return release

    # -- after the point of no return --------------------------------------------------------
    async def relay(self, relay: Relay, deadline: float) -> AsyncIterator[bytes]:
        """The committed stream to its end. A failure now cannot be retried (the client has
        output): the stream ends with an error event (which OpenAI clients raise) and [DONE].
        The caller runs `finish` afterwards, also when the client left midway."""
        try:
            for chunk in relay.first:
                yield chunk
            if relay.rest is None:
                relay.outcome = "200"
                return
            failure = None
            while failure is None:
                try:
                    async with asyncio.timeout_at(deadline):
                        event = await anext(relay.rest, None)
                except TimeoutError:
                    failure = Failure("deadline", f"the request deadline of {self.request_timeout:g} s passed "
                                      "while streaming", relay.server)
                    break
                except httpx.HTTPError as e:
                    failure = Failure("stream_broken", "connection lost after tokens were sent", relay.server,
                                      detail=repr(e))
                    break
                except Exception as e:  # noqa: BLE001 - whatever it is, the client gets an explicit end
                    log.exception("relaying a stream failed")
                    failure = Failure("stream_broken", "the router failed to relay the stream", relay.server,
                                      detail=repr(e))
                    break
                if event is None:
                    failure = Failure("stream_broken", "the stream ended without [DONE]", relay.server)
                    break
                if event.error:
                    failure = Failure("stream_broken", "server error after tokens were sent", relay.server,
                                      detail=str(event.error.get("message"))[:300])
                    break
                yield event.raw
                if event.is_done:
                    relay.outcome = "200"
                    return
            self.metrics.errors.labels(failure.reason).inc()
            log.warning("stream failed after output: %s", failure.describe())
            code = "deadline_exceeded" if failure.reason == "deadline" else "stream_broken"
            yield sse.encode(error_body(f"the answer is incomplete: {failure.public()}", "server_error", code))
            yield sse.DONE
            relay.outcome = "stream_error"
        finally:
            await relay.close()

    async def finish(self, relay: Relay) -> None:
        await relay.close()
        self.metrics.requests.labels(relay.outcome).inc()


def _headers(state: _Attempt, pick: Pick) -> dict:
    """The credential, and the rank the policy chose on that server (if it chose one)."""
    return state.headers if pick.rank is None else {**state.headers, RANK_HEADER: str(pick.rank)}


def _kv_on_host(endpoint, ctx: Endpoint) -> bool:
    """Whether a KV endpoint is on the context server that announced it (and well formed)."""
    try:
        host, _ = parse_endpoint(endpoint)
    except ValueError:
        return False
    return host == urlsplit(ctx.url).hostname


def _json_object(raw: bytes) -> dict | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
