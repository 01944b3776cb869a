"""Bounds on what one HTTP client can make a server or the router spend, shared by both.

- reading a request: headers and body must arrive within the read timeout (`ReadTimeoutProtocol`:
  slowloris), the body within `--max-request-bytes` (413), as one standard JSON object (no NaN or
  Infinity) nested at most MAX_JSON_DEPTH deep whose strings are all valid Unicode (400 otherwise,
  never a 500);
- what a body expands to: at most MAX_JSON_VALUES values, counted before anything is built (413);
  a few MiB of `{"a":0},` would otherwise take ~25 times their size in Python objects. What the
  parsed body then takes is measured (`JsonBody.footprint`), so the router bounds the bytes its
  queue holds in all (`router/queue.py`);
- waiting: a server answers 429 with Retry-After once `--max-waiting-requests` requests are
  accepted and not yet generating (`WaitingQueue`); the router tries another server.
(The per-request deadline and the off-loop request preparation live where requests run:
`completions.py`.)
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass

import h11
from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_JSON_DEPTH = 64  # OpenAI bodies nest a handful of levels (tools' JSON schemas a few more)
MAX_JSON_VALUES = 1 << 18  # array elements and object members: a prompt of 256k token ids fits
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
DEFAULT_READ_TIMEOUT_S = 15.0
DEFAULT_MAX_WAITING_REQUESTS = 128
RETRY_AFTER_S = 1


class Refused(Exception):
    """A request answered with a 4xx before it reaches the engine (or the router's servers)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return error_response(self.message, self.status, self.param, code=self.code, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    def render(self, content) -> bytes:  # \u escapes: any string, even one a client made up, renders
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(message: str, status: int, param: str | None = None, kind: str = "invalid_request_error",
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-shaped error."""
    return _AsciiJSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                              status_code=status, headers=headers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or Refused(413) as soon as it is known to exceed `max_bytes` (from its
    Content-Length, or while a chunked body arrives)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise Refused(413, f"the request body is {int(length)} bytes; this server takes at most {max_bytes}")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise Refused(413, f"the request body is over the limit of {max_bytes} bytes")
    except ClientDisconnect:
        raise Refused(400, "the client disconnected before sending the whole body") from None
    return bytes(body)


@dataclass(frozen=True)
class JsonBody:
    """A request body parsed within the bounds."""
    fields: dict
    footprint: int  # bytes its parsed form takes (sys.getsizeof of every part; shared small values each time)


def parse_json_object(raw: bytes) -> JsonBody:
    """A request body as a JSON object, or Refused saying why not: 413 when it has more than
    MAX_JSON_VALUES values (counted before it is parsed), else 400. (CPU-bound for large bodies:
    call it off the event loop.)"""
    values = _json_values(raw, MAX_JSON_VALUES)
    if values > MAX_JSON_VALUES:
        raise Refused(413, f"the request body has {values} JSON values (array elements and object members); "
                           f"this server takes at most {MAX_JSON_VALUES}", code="too_many_values")
    try:  # UTF-8 only (RFC 8259), which is what _json_values counts in
        fields = json.loads(raw.decode("utf-8-sig", "surrogatepass"), parse_constant=_not_a_number,
                            parse_float=_finite)
    except RecursionError:
        raise Refused(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise Refused(400, "the request body must be a JSON object")
    return JsonBody(fields, sys.getsizeof(fields) + sum(_checked_footprint(k, v) for k, v in fields.items()))


_STRUCTURE = b'",[{'
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in _STRUCTURE)
_COUNT_CHUNK = 1 << 14


def _json_values(raw: bytes, limit: int) -> int:
    """How many values (array elements and object members; an empty array or object counts one) a
    JSON text would build, or more, read without building anything: its commas, '[' and '{' outside
    strings, plus one. When the quick count (strings included) is within `limit`, that is the
    answer; else strings are skipped and the count is exact. Counted in UTF-8, where these bytes
    are never part of another character; on a text with an error, exact up to the error, which is
    as far as a parser builds anything."""
    count = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    if count <= limit:  # commas in strings counted too: still at most the limit
        return count
    if b"\\" in raw:  # escapes go first, so that every quote left opens or closes a string
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    structure = raw.translate(None, _NOT_STRUCTURE)
    count, in_string = 1, False
    for start in range(0, len(structure), _COUNT_CHUNK):  # in chunks: the pieces of a split are objects too
        pieces = structure[start:start + _COUNT_CHUNK].split(b'"')
        outside = b"".join(pieces[int(in_string)::2])
        count += outside.count(b",") + outside.count(b"[") + outside.count(b"{")
        in_string ^= len(pieces) % 2 == 0  # an odd number of quotes in the chunk
    return count


def _not_a_number(name: str):
    raise ValueError(f"{name} is not a JSON number")  # Python's json reads NaN and Infinity; nothing else does


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of range for a number")
    return value


def _checked_footprint(key: str, value) -> int:
    """The bytes a top-level field takes; Refused(400) naming it when it is nested beyond
    MAX_JSON_DEPTH or holds a string that is not valid Unicode (a lone surrogate such as "\\ud800",
    which JSON allows and text cannot hold). Level by level, so no depth recurses."""
    footprint, level = 0, [key, value]
    for depth in range(1, MAX_JSON_DEPTH + 2):
        if not level:
            return footprint
        if depth > MAX_JSON_DEPTH:
            break
        below: list = []
        for item in level:
            footprint += sys.getsizeof(item)
            if isinstance(item, str):
                if not item.isascii():
                    _check_text(key, item)
            elif isinstance(item, dict):
                below += item.keys()
                below += item.values()
            elif isinstance(item, list):
                below += item
        level = below
    raise Refused(400, f"'{_printable(key)}': nested deeper than {MAX_JSON_DEPTH} levels", _printable(key))


def _check_text(key: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Refused(400, f"'{_printable(key)}': is not valid Unicode text ({e.reason} at position {e.start})",
                      _printable(key)) from None


def _printable(key: str) -> str:
    return key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")


class WaitingQueue:
    """Requests accepted and not yet generating (their body being read, prepared, or queued on a
    rank). `enter()` gives a ticket or raises Refused(429) with Retry-After; the ticket `start()`s
    at the request's first output and `leave()`s when the request ends (both idempotent)."""

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"--max-waiting-requests must be at least 1, got {limit}")
        self.limit = limit
        self.waiting = 0

    def enter(self) -> "Ticket":
        if self.waiting >= self.limit:
            raise Refused(429, f"the server is at its limit of {self.limit} waiting requests; retry shortly",
                          code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.waiting += 1
        return Ticket(self)


class Ticket:
    def __init__(self, queue: WaitingQueue):
        self._queue = queue
        self._waiting = True

    def start(self) -> None:
        if self._waiting:
            self._waiting = False
            self._queue.waiting -= 1

    leave = start  # a request that ends without output stops waiting the same way


LINGER_S = 2.0  # how long an answer sent before the whole body arrived waits for the client to stop sending


class _LingeringTransport:
    """The connection as uvicorn sees it, with nginx's lingering close: closing while the client
    is still sending its body (an answer such as 413 that did not read it) would make the kernel
    reset the connection, and the client would lose the answer. Instead: half-close after the
    answer, discard what still arrives, close when the client stops or after LINGER_S."""

    def __init__(self, transport, protocol: "ReadTimeoutProtocol"):
        self._transport, self._protocol = transport, protocol
        self.lingering = False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        t = self._transport
        body_unread = self._protocol.conn.their_state is h11.SEND_BODY
        if self.lingering or t.is_closing() or not body_unread or not t.can_write_eof():
            t.close()
            return
        self.lingering = True
        t.write_eof()  # the answer goes out, then FIN
        t.resume_reading()
        self._protocol.loop.call_later(LINGER_S, t.close)


class ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for reading each request: from the moment the
    connection opens, or its previous response completed, the client has `read_timeout` seconds
    to send a whole request, headers and body. Otherwise the connection is closed (slowloris
    clients hold no socket for longer). Once the request is in, the time is the application's.
    An answer sent before the body was read closes the connection gently (`_LingeringTransport`)."""

    def __init__(self, *args, read_timeout: float = DEFAULT_READ_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self._read_timer = None

    def data_received(self, data: bytes) -> None:
        if isinstance(self.transport, _LingeringTransport) and self.transport.lingering:
            return  # the rest of a body nobody will read
        super().data_received(data)

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _reading(self) -> bool:
        return self.conn.their_state in (h11.IDLE, h11.SEND_BODY)

    def connection_made(self, transport) -> None:
        super().connection_made(_LingeringTransport(transport, self))
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if not self._reading():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._reading():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._reading() and not self.transport.is_closing():
            self.logger.info("closing a connection that did not send its request within %g s", self.read_timeout)
            self.transport.abort()  # nothing to say to it, and no reason to linger


def uvicorn_config(app, host: str, port: int, read_timeout: float):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning",
                          http=functools.partial(ReadTimeoutProtocol, read_timeout=read_timeout))
