"""What went wrong on an attempt, whether to try again, and what the client is told.

Pure functions over plain values; `pipeline.py` feeds them what it saw on the wire. What the client
is told names roles, never a server's address, a KV endpoint or a server's own words (they may
name pods): those go to the router's log (`Failure.describe`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from adpfleet.runtime.router.pool import Endpoint

# The `reason` label of adpfleet_router_errors_total: every failure the router saw, retried or not.
REASONS = (
    "no_server",           # no usable server of a needed role within the queue timeout (queue.py)
    "queue_full",          # no usable server, and the queue of waiting requests was full
    "queue_bytes",         # no usable server, and the bodies waiting leave no room for this one's (--queue-max-bytes)
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
    message: str  # what the client may read: no address, no server's own words
    server: Endpoint | None = None
    status: int | None = None
    detail: str = ""  # for the log only: what the server said, the exception, the addresses involved

    def __post_init__(self):
        assert self.reason in REASONS, self.reason

    def describe(self) -> str:
        """For the router's log: the server's URL and the detail."""
        where = f"{self.server.role} server {self.server.url}" if self.server else "router"
        return f"{where}: {self.message}" + (f" ({self.detail})" if self.detail else "")

    def public(self) -> str:
        """For the client: the server's role, not its address."""
        where = f"{self.server.role} server" if self.server else "router"
        return f"{where}: {self.message}"


OVERLOADED = 429  # the one 4xx that is the server's state, not the client's input
ROUTER_PARAM = "disaggregated_params"  # only the router sends it (a client's own is refused before)
UNPLACED = ("no_server", "queue_full", "queue_bytes")  # no usable server took the request, and it waits no longer


def is_client_error(status: int, body: bytes = b"") -> bool:
    """A 4xx is the client's problem on every server alike: passed through, never retried — but a
    429 says only that this server is full, so another one is tried, and a refusal of
    `disaggregated_params` is of what the router sent (the fleet's own failure, and its answer
    would name the context server's address)."""
    return 400 <= status < 500 and status != OVERLOADED and _server_error(body).get("param") != ROUTER_PARAM


def failure_from_status(server: Endpoint, status: int, body: bytes) -> Failure:
    """A non-2xx answer that is not the client's fault: which failure it is; the server's own
    message goes to the log only."""
    err = _server_error(body)
    said = str(err.get("message") or body[:300].decode("utf-8", "replace").strip() or "(no body)")[:300]
    if status == OVERLOADED:
        return Failure("overloaded", f"HTTP {status}: at its limit of waiting requests", server, status, said)
    if err.get("type") == "kv_transfer_failed":
        return Failure("kv_transfer_failed", f"HTTP {status}: the KV transfer from the context server failed", server,
                       status, said)
    if err.get("param") == ROUTER_PARAM:
        return Failure("server_error", f"HTTP {status}: refused the {ROUTER_PARAM} the router sent (do the router and "
                                       "its servers share the fleet's internal token?)", server, status, said)
    return Failure("server_error", f"HTTP {status}", server, status, said)


def _server_error(body: bytes) -> dict:
    """The `error` object of an OpenAI-shaped error answer, or {}."""
    try:
        err = json.loads(body).get("error") if body else None
    except (ValueError, AttributeError):
        return {}
    return err if isinstance(err, dict) else {}


def should_retry(failure: Failure, attempt: int, max_attempts: int, token_sent: bool, time_left: float) -> bool:
    """Retry only while nothing reached the client, attempts remain, and the deadline has not passed."""
    return (not token_sent and attempt < max_attempts and time_left > 0
            and failure.reason not in ("deadline", *UNPLACED, "stream_broken"))


def servers_to_avoid(failure: Failure, context: Endpoint | None) -> set[Endpoint]:
    """Servers the next attempt of this request should not use. A failed KV pull may be either
    side's fault, so both the generation server and the context server are avoided."""
    avoid = {failure.server} if failure.server else set()
    if failure.reason == "kv_transfer_failed" and context is not None:
        avoid.add(context)
    return avoid


def final_error(failures: list[Failure], deadline_passed: bool) -> tuple[int, dict]:
    """The HTTP status and OpenAI-shaped body for a request on which every attempt failed."""
    detail = "; ".join(f"attempt {i}: {f.public()}" for i, f in enumerate(failures, 1)) or "no attempt was made"
    if deadline_passed:
        status, code = 504, "deadline_exceeded"
        message = f"the request did not complete within its deadline ({detail})"
    elif failures and all(f.reason == "overloaded" for f in failures):  # the client should come back shortly
        status, code = OVERLOADED, "overloaded"
        message = f"every server tried is at its limit of waiting requests; retry shortly ({detail})"
    elif failures and failures[-1].reason in UNPLACED:  # 429 when the queue's bytes are full: the clients send much
        status, code = OVERLOADED if failures[-1].reason == "queue_bytes" else 503, failures[-1].reason
        earlier = "; ".join(f"attempt {i}: {f.public()}" for i, f in enumerate(failures[:-1], 1))
        message = failures[-1].message + (f" (before: {earlier})" if earlier else "")
    else:
        status, code = 503, "upstream_unavailable"
        message = f"no server could answer the request after {len(failures)} attempt(s) ({detail})"
    return status, error_body(message, "server_error", code)


def retry_after(status: int, failures: list[Failure]) -> bool:
    """Whether the client should just come back shortly (the answer gets `Retry-After`): every
    server tried is at its limit, or no server could take the request in time."""
    return status == OVERLOADED or (status == 503 and bool(failures) and failures[-1].reason in UNPLACED)


def error_body(message: str, kind: str = "server_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
