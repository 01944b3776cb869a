"""What went wrong on an attempt, whether to try again, and what the client is told.

Pure functions over plain values; `pipeline.py` feeds them what it saw on the wire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from adpfleet.runtime.router.pool import Endpoint

# The `reason` label of adpfleet_router_errors_total: every failure the router saw, retried or not.
REASONS = (
    "no_server",           # no usable server of a needed role within the queue timeout (queue.py)
    "queue_full",          # no usable server, and the queue of waiting requests was full
    "connect_error",       # could not connect / send to a server
    "server_error",        # a server answered 5xx (or closed the connection before answering)
    "kv_transfer_failed",  # the generation server could not pull the KV from the context server
    "overloaded",          # a server answered 429 (its waiting requests are at their limit): tried elsewhere
    "bad_response",        # a 200 that breaks the contract (not JSON, no disaggregated_params, ...)
    "attempt_timeout",     # no first token within --first-token-timeout: tried elsewhere
    "deadline",            # the request's --request-timeout passed
    "stream_broken",       # the server failed after tokens had reached the client
)


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str
    server: Endpoint | None = None
    status: int | None = None

    def __post_init__(self):
        assert self.reason in REASONS, self.reason

    def describe(self) -> str:
        where = f"{self.server.role} server {self.server.url}" if self.server else "router"
        return f"{where}: {self.message}"


OVERLOADED = 429  # the one 4xx that is the server's state, not the client's input


def is_client_error(status: int) -> bool:
    """A 4xx is the client's problem on every server alike: passed through, never retried — but a
    429 says only that this server is full, so another one is tried."""
    return 400 <= status < 500 and status != OVERLOADED


def failure_from_status(server: Endpoint, status: int, body: bytes) -> Failure:
    """A non-2xx answer that is not the client's fault: which failure it is, with the server's own
    message if it sent one."""
    kind, message = None, body[:300].decode("utf-8", "replace").strip()
    try:
        err = json.loads(body).get("error") or {}
        kind, message = err.get("type"), err.get("message") or message
    except (ValueError, AttributeError):
        pass
    reason = ("overloaded" if status == OVERLOADED else
              "kv_transfer_failed" if kind == "kv_transfer_failed" else "server_error")
    return Failure(reason, f"HTTP {status}: {message or '(no body)'}", server, status)


def should_retry(failure: Failure, attempt: int, max_attempts: int, token_sent: bool, time_left: float) -> bool:
    """Retry only while nothing reached the client, attempts remain, and the deadline has not passed."""
    return (not token_sent and attempt < max_attempts and time_left > 0
            and failure.reason not in ("deadline", "no_server", "queue_full", "stream_broken"))


def servers_to_avoid(failure: Failure, context: Endpoint | None) -> set[Endpoint]:
    """Servers the next attempt of this request should not use. A failed KV pull may be either
    side's fault, so both the generation server and the context server are avoided."""
    avoid = {failure.server} if failure.server else set()
    if failure.reason == "kv_transfer_failed" and context is not None:
        avoid.add(context)
    return avoid


def final_error(failures: list[Failure], deadline_passed: bool) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body for a request on which every attempt failed."""
    detail = "; ".join(f"attempt {i}: {f.describe()}" for i, f in enumerate(failures, 1)) or "no attempt was made"
    if deadline_passed:
        status, code = 504, "deadline_exceeded"
        message = f"the request did not complete within its deadline ({detail})"
    elif failures and all(f.reason == "overloaded" for f in failures):  # the client should come back shortly
        status, code = OVERLOADED, "overloaded"
        message = f"every server tried is at its limit of waiting requests; retry shortly ({detail})"
    elif failures and failures[-1].reason in ("no_server", "queue_full"):
        status, code = 503, failures[-1].reason
        earlier = "; ".join(f"attempt {i}: {f.describe()}" for i, f in enumerate(failures[:-1], 1))
        message = failures[-1].message + (f" (before: {earlier})" if earlier else "")
    else:
        status, code = 503, "upstream_unavailable"
        message = f"no server could answer the request after {len(failures)} attempt(s) ({detail})"
    return status, error_body(message, "server_error", code)


def retry_after(status: int, failures: list[Failure]) -> bool:
    """Whether the client should just come back shortly (the answer gets `Retry-After`): every
    server tried is at its limit, or no server could take the request in time."""
    return status == OVERLOADED or (status == 503 and bool(failures)
                                    and failures[-1].reason in ("no_server", "queue_full"))


def error_body(message: str, kind: str = "server_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
