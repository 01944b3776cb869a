"""A server's graceful shutdown: what `adpfleet serve` does on SIGTERM (a pod deleted, scaled down
or rolled; the kubelet sends SIGTERM, then SIGKILL after `terminationGracePeriodSeconds`).

    SIGTERM ─► draining: GET /health answers 503 (the pod turns NotReady; the router, which already
               dropped the pod when it saw its deletion, stops sending it requests), and a new
               completion is refused with 503 and Retry-After, which the router retries elsewhere
           ─► in-flight requests run to their end; a context server also waits until the KV it
               holds has been pulled (or its lease ran out)
           ─► at `--drain-timeout` (the operator passes the grace period less a margin) whatever is
               still running is handed back: it ends with an explicit error, which the router
               retries on another server if no token reached the client yet
           ─► the HTTP server stops, the ranks stop on the same pass (the stop is agreed through
               the fetch all-gather) and the process exits 0: the pod ends Succeeded.

The rank processes ignore SIGTERM (the kubelet signals the whole process group): their server
stops them. A second SIGTERM, or SIGINT, stops at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time

import uvicorn

from adpfleet.runtime.serving.limits import uvicorn_config

log = logging.getLogger("adpfleet.server")

POLL_S = 0.1
HAND_BACK_S = 2.0  # after handing requests back: time for their error responses to leave
RETRY_AFTER_S = 1  # Retry-After of a refused request: another server can take it now
ADMITTING = ("/v1/completions", "/v1/chat/completions")


class Drain:
    """Whether the server is draining, and the sequence above."""

    def __init__(self, engine, timeout_s: float):
        self.engine = engine
        self.timeout_s = timeout_s
        self.since: float | None = None

    @property
    def draining(self) -> bool:
        return self.since is not None

    def idle(self) -> bool:
        """No request in flight, and no KV held for a generation server to pull."""
        return self.engine.requests_in_flight == 0 and self.engine.kv_held == 0

    async def run(self, server: uvicorn.Server) -> None:
        self.since = time.monotonic()
        log.info("SIGTERM: draining (%d requests in flight, %d KV blocks held); at most %g s",
                 self.engine.requests_in_flight, self.engine.kv_held, self.timeout_s)
        deadline = self.since + self.timeout_s
        while not self.idle() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        left = self.engine.requests_in_flight
        if left:
            log.warning("drain timeout: handing %d requests back", left)
            self.engine.hand_back("the server is shutting down; retry on another server")
            end = time.monotonic() + HAND_BACK_S
            while self.engine.requests_in_flight and time.monotonic() < end:
                await asyncio.sleep(POLL_S)
        log.info("drained in %.1f s; stopping", time.monotonic() - self.since)
        server.should_exit = True


class DrainGate:
    """ASGI middleware: while draining, /health is 503 and new completions are refused (retryable)."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.drain.draining:
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path == "/health":
            return await _json(send, 503, {"status": "draining", "reason": "shutting down"})
        if path in ADMITTING:
            body = {"error": {"message": "the server is shutting down; retry on another server",
                              "type": "server_error", "param": None, "code": "server_draining"}}
            return await _json(send, 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())])
        return await self.app(scope, receive, send)


async def _json(send, status: int, body: dict, headers=()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class GracefulServer(uvicorn.Server):
    """uvicorn, with SIGTERM turned into the drain above (SIGINT, or a SIGTERM before start-up
    finished or during the drain, stops as uvicorn does)."""

    def __init__(self, app, engine, *, host: str, port: int, read_timeout: float, drain_timeout_s: float):
        self.drain = Drain(engine, drain_timeout_s)
        config = uvicorn_config(DrainGate(app, self.drain), host, port, read_timeout)
        config.timeout_graceful_shutdown = HAND_BACK_S
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and self.started and not self.drain.draining and self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain.run(self)))
            return
        super().handle_exit(sig, frame)

