"""Moving held KV from a context rank to a generation rank over TCP.

Wire format (version 2); a connection carries one pull after another:

    client -> server   b"ADPKV2 GET <handle> <proof>\\n"
                       handle: 1-128 of [A-Za-z0-9._:-]; proof: the hex HMAC-SHA256 of the handle
                       keyed with the fleet's internal token, or "-" when the fleet has none
    server -> client   one JSON line: {"status": "ok", "layers": L, "tokens": T, "kv_heads": H,
                       "head_dim": D, "dtype": "float32", "nbytes": N}
                       or {"status": "error", "message": "..."} (and the server closes)
                       then N raw bytes: K of every layer, then V, each [L, T, H, D], C order,
                       native (little-endian) byte order
    client -> server   b"OK\\n" once every byte arrived; the connection then waits for the next pull

A handle is pulled once. When its transfer ends — acknowledged, failed, timed out or dropped — the
context rank frees the blocks: a generation server whose pull failed fails its request (the router
starts the request again from a context server), it never pulls the same handle again. A request
that is refused (bad proof, unknown handle, too many connections) leaves the held KV alone, and
closes the connection.

Nothing a peer does can pin KV, threads or memory:
- a connection is unproven until its first request line came with a proof that checks: it must
  do so within UNPROVEN_TIMEOUT_S, it takes none of the rank's slots meanwhile, and at most
  MAX_UNPROVEN wait at once (one more closes the oldest, answered "busy": `unproven`), so
  strangers without the token can neither hold a slot nor push out a puller's connection;
- only a pull that was acknowledged keeps the connection open, for at most KEEPALIVE_S until the
  next line (which must then be whole within REQUEST_LINE_TIMEOUT_S, and carry its own proof);
- the whole transfer, acknowledgement included, ends within the transfer timeout (at both ends);
- a rank serves at most MAX_CONNECTIONS proven connections at once; when they are all taken, a
  new one closes a connection that waits between pulls, or is answered "busy" and closed;
- the client checks the header against its own model (`KVLayout`) and the prompt length before it
  allocates anything, and reads exactly the bytes that layout implies.

Speed (`docs/benchmarks.md`): a generation rank keeps a few connections per context rank open
(`KVPuller`), so a short prompt's pull pays no TCP or thread set-up; the sender gathers the
request's blocks from the paged cache into a reused buffer with one vectorised index_select per
cache and sends it with one sendall; the receiver receives into a reused buffer, which goes back
once the generation rank placed the KV into its blocks. No pickling, no per-block round trips.
A pooled connection that fails before any byte of its answer (the context server restarted or
closed it) is dropped and the pull retried once on a new connection; nothing read from a
connection that failed later is ever used.
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
from typing import Callable

import torch

from adpfleet.runtime.executor.kv_buffers import BufferPool
from adpfleet.runtime.executor.kv_endpoint import FAILED, HANDLE, format_endpoint, parse_endpoint
from adpfleet.runtime.executor.unproven import UnprovenConnections

log = logging.getLogger(__name__)

MAGIC = b"ADPKV2"
UNPROVEN_TIMEOUT_S = 2.0  # a real puller sends its first line with its proof at once
MAX_UNPROVEN = 64  # per rank: connections waiting for their proof (a thread each); one more closes the oldest
REQUEST_LINE_TIMEOUT_S = 5.0  # on an acknowledged connection: a line that has started must be whole by then
KEEPALIVE_S = 30.0  # how long an acknowledged connection waits for its next pull
POOL_IDLE_S = KEEPALIVE_S / 2  # the puller drops a connection long before the server would
POOL_PER_PEER = 4  # connections a puller keeps open to one context rank
MAX_CONNECTIONS = 16  # proven connections per rank; each is one thread
ACK_GRACE_S = 0.5  # at the cap, how long a new connection may wait for a pull's acknowledgement to free a slot
MAX_HEADER_BYTES = 4096
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTransferError(RuntimeError):
    pass


@dataclass
class KVPayload:
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor
    on_release: Callable[[], None] | None = None

    def release(self) -> None:
        """The KV was placed: its receive buffer may take the next pull (this payload reads nothing
        any more)."""
        give, self.on_release = self.on_release, None
        self.k = self.v = None
        if give is not None:
            give()


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

    def split(self, buffer: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, [layers, tokens, kv_heads, head_dim] each, as views of the first
        nbytes(tokens) bytes of a uint8 buffer (the wire order)."""
        kv = buffer[:self.nbytes(tokens)].view(_DTYPES[self.dtype])
        half = kv.numel() // 2
        shape = (self.layers, tokens, self.kv_heads, self.head_dim)
        return kv[:half].view(shape), kv[half:].view(shape)


def proof(token: str | None, handle: str) -> str:
    """What a puller sends to show it holds the fleet's internal token (without sending the token)."""
    if token is None:
        return "-"
    return hmac.new(token.encode(), handle.encode(), hashlib.sha256).hexdigest()


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the transfer deadline passed")
    return left


class _Lines:
    """Lines read from a connection that carries more than one exchange: what arrived after a line
    waits for the next read."""

    def __init__(self, conn: socket.socket):
        self.conn, self.pending = conn, b""

    def read(self, limit: int, deadline: float) -> bytes:
        """One line (empty if the peer closed first), by the deadline."""
        data = bytearray(self.pending)
        while b"\n" not in data:
            if len(data) > limit:
                raise KVTransferError(f"line longer than {limit} bytes")
            self.conn.settimeout(_left(deadline))
            chunk = self.conn.recv(4096)
            if not chunk:
                self.pending = b""
                return bytes(data)
            data += chunk
        line, _, self.pending = bytes(data).partition(b"\n")
        if len(line) > limit:
            raise KVTransferError(f"line longer than {limit} bytes")
        return line


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
                 max_connections: int = MAX_CONNECTIONS, max_unproven: int = MAX_UNPROVEN):
        self.k_cache, self.v_cache, self.lookup = k_cache, v_cache, lookup
        self.layout = KVLayout.of(k_cache)
        self.tokens_per_block = tokens_per_block
        self.token, self.transfer_timeout_s = token, transfer_timeout_s
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.endpoint = format_endpoint(host, self.sock.getsockname()[1])
        self.bytes_sent = 0
        self.accepted = 0  # connections taken: a puller that reuses its connections keeps this low
        self.buffers = BufferPool()
        self._slots = threading.BoundedSemaphore(max_connections)
        self.unproven = UnprovenConnections(max_unproven)
        self._waiting: set[socket.socket] = set()  # acknowledged connections waiting for their next pull
        self._acking = 0  # pulls whose bytes are all sent, waiting for their acknowledgement
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        threading.Thread(target=self._accept, name="kv-transfer-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.unproven.admit(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-transfer", daemon=True).start()

    def _admit(self) -> bool:
        """A slot for a new connection. When all are taken, a connection between pulls makes room:
        it loses nothing by closing (its puller opens another), and its thread gives its slot back
        at once. A pull whose bytes are all sent is about to become one: its acknowledgement is
        waited for, briefly."""
        if self._slots.acquire(blocking=False):
            return True
        with self._changed:
            self._changed.wait_for(lambda: self._waiting or not self._acking, timeout=ACK_GRACE_S)
            if not self._waiting:  # a slot given back since the first try was given back under this lock
                return self._slots.acquire(blocking=False)
            conn = self._waiting.pop()
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return self._slots.acquire(timeout=1.0)

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

    def _pull_line(self, lines: _Lines, deadline: float) -> tuple[str | None, str | None]:
        """(handle, None) of the next request line, whose proof checked, by `deadline`; else (None, why)."""
        try:
            return self._handle(lines.read(512, deadline)), None
        except TimeoutError:
            return None, "no whole request line in time"
        except Exception as e:  # noqa: BLE001 - whatever it sent, it is refused
            return None, str(e)

    def _serve(self, conn: socket.socket) -> None:
        """One connection: unproven until its first line's proof checked, then holding a slot."""
        lines = _Lines(conn)
        with conn:
            handle, refusal = self._pull_line(lines, time.monotonic() + UNPROVEN_TIMEOUT_S)
            if not self.unproven.settle(conn):
                refusal = "busy: too many connections waiting to prove the token on this rank"
            elif refusal is None and not self._admit():
                refusal = "busy: too many KV transfers at once on this rank"
            if refusal is not None:
                _refuse_request(conn, refusal)
                return
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._transfer(conn, lines, handle):
                    while self._next_transfer(conn, lines):
                        pass
            finally:
                with self._lock:  # together: a new connection never sees a slot neither waiting nor free
                    self._waiting.discard(conn)
                    self._slots.release()

    def _next_transfer(self, conn: socket.socket, lines: _Lines) -> bool:
        """Wait for the next pull on an acknowledged connection (in `_waiting`): it ends quietly when
        the puller closes it, when KEEPALIVE_S pass, or when a new connection needs the slot."""
        waiting = lines.pending  # the line may have come with the last acknowledgement
        try:
            if not waiting:
                conn.settimeout(KEEPALIVE_S)
                waiting = conn.recv(1, socket.MSG_PEEK)  # a line has started: the pull's own clock starts
        except OSError:
            waiting = b""
        with self._lock:
            if conn not in self._waiting:  # closed to make room: the handle was not touched
                return False
            if not waiting:  # the puller closed it or it idled out: it stays waiting until its slot is back
                return False
            self._waiting.discard(conn)
        handle, refusal = self._pull_line(lines, time.monotonic() + REQUEST_LINE_TIMEOUT_S)
        if refusal is not None:
            _refuse_request(conn, refusal)
            return False
        return self._transfer(conn, lines, handle)

    def _transfer(self, conn: socket.socket, lines: _Lines, handle: str) -> bool:
        """One pull of a proven handle: True when it was acknowledged (the connection may carry the next one)."""
        deadline = time.monotonic() + self.transfer_timeout_s
        on_done = None
        header_sent = acknowledged = False
        try:
            found = self.lookup(handle)
            if found is None:
                raise KVTransferError(f"no held KV for handle {handle!r} (pulled, expired or unknown)")
            (block_table, tokens), on_done = found
            header = self.layout.header(tokens)
            buffer = self.buffers.take(header["nbytes"])
            try:
                k, v = self.layout.split(buffer, tokens)
                slots = _slots(block_table, tokens, self.tokens_per_block)
                torch.index_select(self.k_cache, 1, slots, out=k)
                torch.index_select(self.v_cache, 1, slots, out=v)
                _send(conn, json.dumps(header).encode() + b"\n", deadline)
                header_sent = True
                with self._lock:
                    self._acking += 1
                _send(conn, memoryview(buffer[:header["nbytes"]].numpy()), deadline)
            finally:
                self.buffers.give(buffer)  # sendall returned: the kernel holds its own copy
            acknowledged = lines.read(16, deadline).strip() == b"OK"
            if not acknowledged:
                raise KVTransferError("the puller closed the connection without acknowledging")
            self.bytes_sent += header["nbytes"]
            return True
        except Exception as e:  # noqa: BLE001 - whatever it was, it ends this transfer only
            log.warning("KV transfer ended without success: %s", e)
            if not header_sent:
                _refuse(conn, str(e))
            return False
        finally:
            if header_sent:
                with self._changed:  # at once a connection between pulls: a new connection may take its slot
                    self._acking -= 1
                    if acknowledged:
                        self._waiting.add(conn)
                    self._changed.notify_all()
            if on_done is not None:
                on_done()  # one pull per handle, whatever its outcome: the blocks go back

    def close(self) -> None:
        self.sock.close()


def _refuse_request(conn: socket.socket, refusal: str) -> None:
    log.warning("KV request refused: %s", refusal)
    _refuse(conn, refusal)


def _refuse(conn: socket.socket, message: str) -> None:
    with conn:
        try:
            conn.settimeout(1.0)
            conn.sendall(json.dumps({"status": "error", "message": message}).encode() + b"\n")
        except OSError:
            pass


def _slots(block_table: list[int], tokens: int, bs: int) -> torch.Tensor:
    """The cache slots of positions 0..tokens-1, built with tensor ops. (Sending block views straight
    from the cache was measured slower: blocks are a few KiB, and the per-view overhead outweighs
    the copy.)"""
    table = torch.tensor(block_table[:-(-tokens // bs)], dtype=torch.long)
    return (table[:, None] * bs + torch.arange(bs)).flatten()[:tokens]


class _Stale(Exception):
    """A pooled connection failed before any byte of the answer: the peer closed or restarted."""


class KVPuller:
    """A generation rank's side of the transfer: pulls KV laid out as `layout`, each pull within
    `timeout` seconds in all, keeping up to `per_peer` connections open to each context rank
    (0: one connection per pull) and receiving into reused buffers."""

    def __init__(self, layout: KVLayout, timeout: float, token: str | None = None, per_peer: int = POOL_PER_PEER):
        self.layout, self.timeout, self.token, self.per_peer = layout, timeout, token, per_peer
        self.buffers = BufferPool()
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()

    def pull(self, endpoint: str, handle: str, tokens: int) -> KVPayload:
        """One request's KV of `tokens` tokens; KVTransferError with the reason on any failure.
        Call `release()` on the payload once its KV was copied out."""
        if not HANDLE.match(handle):
            raise KVTransferError("malformed handle")
        deadline = time.monotonic() + self.timeout
        try:
            peer = parse_endpoint(endpoint)
            conn = self._pooled(peer)
            if conn is not None:
                try:
                    return self._pull_on(conn, peer, handle, tokens, deadline, reused=True)
                except _Stale:
                    pass  # retried once, on a new connection
            conn = socket.create_connection(peer, timeout=_left(deadline))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return self._pull_on(conn, peer, handle, tokens, deadline, reused=False)
        except TimeoutError:
            raise KVTransferError(f"no complete transfer within {self.timeout:g} s") from None
        except (OSError, ValueError, RecursionError) as e:  # refused, reset, unreachable; a header that is not JSON
            raise KVTransferError(f"{type(e).__name__}: {e}") from None

    def _pull_on(self, conn: socket.socket, peer, handle: str, tokens: int, deadline: float,
                 reused: bool) -> KVPayload:
        done = False
        try:
            lines = _Lines(conn)
            try:
                _send(conn, b" ".join([MAGIC, b"GET", handle.encode(), proof(self.token, handle).encode()]) + b"\n",
                      deadline)
                line = lines.read(MAX_HEADER_BYTES, deadline)
                if not line and not lines.pending:
                    raise ConnectionAbortedError("the context server closed the connection without a header")
            except OSError as e:
                if reused and not isinstance(e, TimeoutError):
                    raise _Stale() from None
                raise
            self.layout.check(json.loads(line) if line else {}, tokens)
            nbytes = self.layout.nbytes(tokens)
            if len(lines.pending) > nbytes:
                raise KVTransferError(f"the context server sent more than the {nbytes} bytes of its header")
            buffer = self.buffers.take(nbytes)
            payload = KVPayload(*self.layout.split(buffer, tokens), on_release=lambda: self.buffers.give(buffer))
            view = memoryview(buffer.numpy())
            got = len(lines.pending)  # bytes that arrived with the header line
            view[:got] = lines.pending
            while got < nbytes:
                conn.settimeout(_left(deadline))
                n = conn.recv_into(view[got:nbytes], min(nbytes - got, 1 << 22))
                if n == 0:
                    raise KVTransferError(f"connection closed after {got} of {nbytes} bytes")
                got += n
            _send(conn, b"OK\n", deadline)
            done = True
            return payload
        finally:
            if done:
                self._keep(peer, conn)
            else:
                conn.close()

    def _pooled(self, peer) -> socket.socket | None:
        """An open connection to `peer` that is quiet (nothing unread, not closed by the peer), or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                idle = self._idle.get(peer)
                if not idle:
                    return None
                conn, since = idle.pop()
            if now - since < POOL_IDLE_S:
                try:
                    conn.setblocking(False)
                    conn.recv(1, socket.MSG_PEEK)  # data or b"": closed, or not what we expect
                except BlockingIOError:
                    return conn
                except OSError:
                    pass
            conn.close()

    def _keep(self, peer, conn: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < self.per_peer:
                idle.append((conn, time.monotonic()))
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn, _ in conns:
                conn.close()


def fetch(endpoint: str, handle: str, timeout: float, expect: KVLayout, tokens: int,
          token: str | None = None) -> KVPayload:
    """Pull one request's KV of `tokens` tokens, laid out as `expect`, within `timeout` seconds in
    all, on a connection of its own; raises KVTransferError with the reason on any failure."""
    return KVPuller(expect, timeout, token, per_peer=0).pull(endpoint, handle, tokens)
