"""Moving held KV from a context rank to a generation rank over TCP.

Wire format (version 2), one request per connection:

    client -> server   b"ADPKV2 GET <handle> <proof>\\n"
                       handle: 1-128 of [A-Za-z0-9._:-]; proof: the hex HMAC-SHA256 of the handle
                       keyed with the fleet's internal token, or "-" when the fleet has none
    server -> client   one JSON line: {"status": "ok", "layers": L, "tokens": T, "kv_heads": H,
                       "head_dim": D, "dtype": "float32", "nbytes": N}
                       or {"status": "error", "message": "..."}
                       then N raw bytes: K of every layer, then V, each [L, T, H, D], C order,
                       native (little-endian) byte order
    client -> server   b"OK\\n" once every byte arrived

A handle is pulled once. When its transfer ends — acknowledged, failed, timed out or dropped — the
context rank frees the blocks: a generation server whose pull failed fails its request (the router
starts the request again from a context server), it never pulls the same handle again. A request
that is refused (bad proof, unknown handle, too many connections) leaves the held KV alone.

Nothing a peer does can pin KV, threads or memory:
- the request line must arrive within REQUEST_LINE_TIMEOUT_S of the connection;
- the whole transfer, acknowledgement included, ends within the transfer timeout (at both ends);
- a rank serves at most MAX_CONNECTIONS connections at once; more are answered "busy" and closed;
- the client checks the header against its own model (`KVLayout`) and the prompt length before it
  allocates anything, and reads exactly the bytes that layout implies.

The server gathers the request's blocks from the paged cache with one vectorised index_select per
cache (K, then V) and sends each with one sendall; the client receives straight into one
preallocated tensor. No pickling, no per-block round trips.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

import torch

from adpfleet.runtime.executor.kv_endpoint import HANDLE, format_endpoint, parse_endpoint

log = logging.getLogger(__name__)

MAGIC = b"ADPKV2"
FAILED = "KV transfer failed"  # how a failed pull is reported, so the server answers 502 and the router retries
REQUEST_LINE_TIMEOUT_S = 5.0  # a real client sends its one line at once; an idle connection is closed
MAX_CONNECTIONS = 16  # per rank; each is one thread for at most the transfer timeout
MAX_HEADER_BYTES = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTransferError(RuntimeError):
    pass


@dataclass
class KVPayload:
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV in a model's cache: what both ends of a transfer must agree on."""
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, cache: torch.Tensor) -> "KVLayout":
        """Of a [layers, slots, kv_heads, head_dim] cache."""
        return cls(cache.shape[0], cache.shape[2], cache.shape[3], str(cache.dtype).removeprefix("torch."))

    def nbytes(self, tokens: int) -> int:
        """K and V of `tokens` tokens."""
        return 2 * self.layers * tokens * self.kv_heads * self.head_dim * _DTYPES[self.dtype].itemsize

    def header(self, tokens: int) -> dict:
        return {"status": "ok", "layers": self.layers, "tokens": tokens, "kv_heads": self.kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "nbytes": self.nbytes(tokens)}

    def check(self, header, tokens: int) -> None:
        """A context server's header against this model and the prompt: every field equal, or
        KVTransferError naming the first that is not."""
        if not isinstance(header, dict):
            raise KVTransferError("the context server's header is not a JSON object")
        if header.get("status") != "ok":
            message = header.get("message")
            raise KVTransferError(f"the context server refused: {str(message)[:300]}" if message is not None else
                                  "the context server closed the connection without a header")
        for field, want in self.header(tokens).items():
            got = header.get(field)
            if type(got) is not type(want) or got != want:  # type: a JSON true is not the integer 1
                raise KVTransferError(f"the context server's KV does not fit this server's model and prompt: "
                                      f"'{field}' is {str(got)[:40]!r}, expected {want!r}")


def proof(token: str | None, handle: str) -> str:
    """What a puller sends to show it holds the fleet's internal token (without sending the token)."""
    if token is None:
        return "-"
    return hmac.new(token.encode(), handle.encode(), hashlib.sha256).hexdigest()


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the transfer deadline passed")
    return left


def _read_line(conn: socket.socket, limit: int, deadline: float) -> tuple[bytes, bytes]:
    """One line, and whatever arrived after it, by the deadline."""
    data = bytearray()
    while b"\n" not in data:
        conn.settimeout(_left(deadline))
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit and b"\n" not in data[:limit]:
            raise KVTransferError(f"line longer than {limit} bytes")
    line, _, rest = bytes(data).partition(b"\n")
    return line, rest


def _send(conn: socket.socket, data, deadline: float) -> None:
    conn.settimeout(_left(deadline))  # bounds the whole sendall (Python >= 3.5)
    conn.sendall(data)


class KVTransferServer:
    """Serves held KV of one context rank. `lookup(handle)` returns ((block_table, num_tokens),
    on_done) or None; `on_done()` ends the handle's transfer (its blocks are freed).
    `k_cache`/`v_cache` are the rank's [layers, slots, kv_heads, head_dim] caches with
    `tokens_per_block` slots per block."""

    def __init__(self, host: str, port: int, k_cache: torch.Tensor, v_cache: torch.Tensor, lookup,
                 tokens_per_block: int, *, token: str | None = None, transfer_timeout_s: float = 30.0,
                 max_connections: int = MAX_CONNECTIONS):
        self.k_cache, self.v_cache, self.lookup = k_cache, v_cache, lookup
        self.layout = KVLayout.of(k_cache)
        self.tokens_per_block = tokens_per_block
        self.token, self.transfer_timeout_s = token, transfer_timeout_s
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.endpoint = format_endpoint(host, self.sock.getsockname()[1])
        self.bytes_sent = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        threading.Thread(target=self._accept, name="kv-transfer-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                _refuse(conn, "busy: too many KV transfers at once on this rank")
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-transfer", daemon=True).start()

    def _handle(self, line: bytes) -> str:
        parts = line.split(b" ")
        if len(parts) != 4 or parts[0] != MAGIC or parts[1] != b"GET":
            raise KVTransferError(f"malformed request line (expected {MAGIC.decode()} GET <handle> <proof>)")
        handle, given = parts[2].decode("ascii", "replace"), parts[3].decode("ascii", "replace").strip()
        if not HANDLE.match(handle):
            raise KVTransferError("malformed handle")
        if self.token is not None and not hmac.compare_digest(proof(self.token, handle), given):
            raise KVTransferError("unauthorized: the proof does not match this fleet's internal token")
        return handle

    def _serve(self, conn: socket.socket) -> None:
        started = time.monotonic()
        deadline = started + self.transfer_timeout_s
        on_done = None
        header_sent = False
        try:
            with conn:
                try:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    line, _ = _read_line(conn, 512, min(deadline, started + REQUEST_LINE_TIMEOUT_S))
                    handle = self._handle(line)
                    found = self.lookup(handle)
                    if found is None:
                        raise KVTransferError(f"no held KV for handle {handle!r} (pulled, expired or unknown)")
                    (block_table, tokens), on_done = found
                    header = self.layout.header(tokens)
                    _send(conn, json.dumps(header).encode() + b"\n", deadline)
                    header_sent = True
                    for cache in (self.k_cache, self.v_cache):
                        _send(conn, _as_bytes(_gather(cache, block_table, tokens, self.tokens_per_block)), deadline)
                    ack, _ = _read_line(conn, 16, deadline)
                    if ack.strip() != b"OK":
                        raise KVTransferError("the puller closed the connection without acknowledging")
                    self.bytes_sent += header["nbytes"]
                except Exception as e:  # noqa: BLE001 - whatever it was, it ends this transfer only
                    log.warning("KV transfer ended without success: %s", e)
                    if not header_sent:
                        _refuse(conn, str(e))
        finally:
            if on_done is not None:
                on_done()  # one pull per handle, whatever its outcome: the blocks go back
            self._slots.release()

    def close(self) -> None:
        self.sock.close()


def _refuse(conn: socket.socket, message: str) -> None:
    with conn:
        try:
            conn.settimeout(1.0)
            conn.sendall(json.dumps({"status": "error", "message": message}).encode() + b"\n")
        except OSError:
            pass


def _gather(cache: torch.Tensor, block_table: list[int], tokens: int, bs: int) -> torch.Tensor:
    """Positions 0..tokens-1 of every layer, [layers, tokens, kv_heads, head_dim], in one copy.
    (Sending block views straight from the cache was measured slower: blocks are a few KiB, and
    the per-view overhead outweighs the copy.)"""
    table = torch.tensor(block_table[:-(-tokens // bs)], dtype=torch.long)
    slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:tokens]
    return cache.index_select(1, slots)


def fetch(endpoint: str, handle: str, timeout: float, expect: KVLayout, tokens: int,
          token: str | None = None) -> KVPayload:
    """Pull one request's KV of `tokens` tokens, laid out as `expect`, within `timeout` seconds in
    all; raises KVTransferError with the reason on any failure."""
    if not HANDLE.match(handle):
        raise KVTransferError("malformed handle")
    deadline = time.monotonic() + timeout
    try:
        host, port = parse_endpoint(endpoint)
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send(conn, b" ".join([MAGIC, b"GET", handle.encode(), proof(token, handle).encode()]) + b"\n", deadline)
            line, extra = _read_line(conn, MAX_HEADER_BYTES, deadline)
            expect.check(json.loads(line) if line else {}, tokens)
            nbytes = expect.nbytes(tokens)
            buf = torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            if len(extra) > nbytes:
                raise KVTransferError(f"the context server sent more than the {nbytes} bytes of its header")
            got = len(extra)  # bytes that arrived with the header line
            view[:got] = extra
            while got < nbytes:
                conn.settimeout(_left(deadline))
                n = conn.recv_into(view[got:], min(nbytes - got, 1 << 22))
                if n == 0:
                    raise KVTransferError(f"connection closed after {got} of {nbytes} bytes")
                got += n
            _send(conn, b"OK\n", deadline)
    except TimeoutError:
        raise KVTransferError(f"no complete transfer within {timeout:g} s") from None
    except (OSError, ValueError, RecursionError) as e:  # refused, reset, unreachable; a header that is not JSON
        raise KVTransferError(f"{type(e).__name__}: {e}") from None
    dtype = _DTYPES[expect.dtype]
    kv = buf.view(dtype)
    half = kv.numel() // 2
    shape = (expect.layers, tokens, expect.kv_heads, expect.head_dim)
    return KVPayload(kv[:half].view(shape), kv[half:].view(shape))
