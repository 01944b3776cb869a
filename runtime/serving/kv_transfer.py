"""Moving held KV from a context rank to a generation rank over TCP.

Wire format (version 1), one request per connection:

    client -> server   b"ADPKV1 GET <handle>\\n"
    server -> client   one JSON line: {"status": "ok", "layers": L, "tokens": T, "kv_heads": H,
                       "head_dim": D, "dtype": "float32", "nbytes": N}
                       or {"status": "error", "message": "..."}
                       then N raw bytes: K of every layer, then V, each [L, T, H, D], C order,
                       native (little-endian) byte order
    client -> server   b"OK\\n" once every byte arrived; only then does the context rank count the
                       transfer as pulled and free the blocks (a dropped connection leaves them
                       held until the lease expires)

The server gathers the request's blocks from the paged cache with one vectorised index_select per
cache (K, then V) and sends each with one sendall; the client receives straight into one
preallocated tensor. No pickling, no per-block round trips.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MAGIC = b"ADPKV1"
FAILED = "KV transfer failed"  # how a failed pull is reported, so the server answers 502 and the router retries
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTransferError(RuntimeError):
    pass


@dataclass
class KVPayload:
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


class KVTransferServer:
    """Serves held KV of one context rank. `lookup(handle)` returns ((block_table, num_tokens),
    ended) or None; `ended(True)` is called once the generation server confirmed every byte,
    `ended(False)` when the pull did not complete. `k_cache`/`v_cache` are the rank's [layers,
    slots, kv_heads, head_dim] caches with `tokens_per_block` slots per block."""

    def __init__(self, host: str, port: int, k_cache: torch.Tensor, v_cache: torch.Tensor, lookup,
                 tokens_per_block: int):
        self.k_cache, self.v_cache, self.lookup = k_cache, v_cache, lookup
        self.tokens_per_block = tokens_per_block
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.endpoint = f"{host}:{self.sock.getsockname()[1]}"
        self.bytes_sent = 0
        threading.Thread(target=self._accept, name="kv-transfer-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        ended = None  # the hold's callback once a held prompt was found: told whether the pull completed
        confirmed = False
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            f = conn.makefile("rb")
            try:
                line = f.readline(4096).split()
                if len(line) != 3 or line[0] != MAGIC or line[1] != b"GET":
                    raise KVTransferError("malformed request line")
                found = self.lookup(line[2].decode())
                if found is None:
                    raise KVTransferError(f"no held KV for handle {line[2].decode()!r} (pulled, expired or unknown)")
                (block_table, tokens), ended = found
                k = self.k_cache
                header = {"status": "ok", "layers": k.shape[0], "tokens": tokens, "kv_heads": k.shape[2],
                          "head_dim": k.shape[3], "dtype": str(k.dtype).removeprefix("torch."),
                          "nbytes": 2 * k.shape[0] * tokens * k.shape[2] * k.shape[3] * k.element_size()}
                conn.sendall(json.dumps(header).encode() + b"\n")
                for cache in (self.k_cache, self.v_cache):
                    conn.sendall(_as_bytes(_gather(cache, block_table, tokens, self.tokens_per_block)))
                self.bytes_sent += header["nbytes"]
                confirmed = f.readline(16).strip() == b"OK"
            except (KVTransferError, OSError, ValueError) as e:
                try:
                    conn.sendall(json.dumps({"status": "error", "message": str(e)}).encode() + b"\n")
                except OSError:
                    pass
            finally:
                if ended is not None:  # a pull that did not complete leaves the blocks for another one
                    ended(confirmed)

    def close(self) -> None:
        self.sock.close()


def _gather(cache: torch.Tensor, block_table: list[int], tokens: int, bs: int) -> torch.Tensor:
    """Positions 0..tokens-1 of every layer, [layers, tokens, kv_heads, head_dim], in one copy.
    (Sending block views straight from the cache was measured slower: blocks are a few KiB, and
    the per-view overhead outweighs the copy.)"""
    table = torch.tensor(block_table[:-(-tokens // bs)], dtype=torch.long)
    slots = (table[:, None] * bs + torch.arange(bs)).flatten()[:tokens]
    return cache.index_select(1, slots)


def _read_line(conn: socket.socket, limit: int = 65536) -> tuple[bytes, bytes]:
    """One line, and whatever arrived after it."""
    data = bytearray()
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise KVTransferError("header line too long")
    line, _, rest = bytes(data).partition(b"\n")
    return line, rest


def fetch(endpoint: str, handle: str, timeout: float) -> KVPayload:
    """Pull one request's KV; raises KVTransferError with the reason on any failure."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(MAGIC + b" GET " + handle.encode() + b"\n")
            line, extra = _read_line(conn)
            header = json.loads(line or b"{}")
            if header.get("status") != "ok":
                raise KVTransferError(header.get("message", "the context server closed the connection"))
            dtype = _DTYPES[header["dtype"]]
            shape = (header["layers"], header["tokens"], header["kv_heads"], header["head_dim"])
            buf = torch.empty(header["nbytes"], dtype=torch.uint8)
            view = memoryview(buf.numpy())
            got = min(len(extra), header["nbytes"])  # bytes that arrived with the header line
            view[:got] = extra[:got]
            while got < header["nbytes"]:
                n = conn.recv_into(view[got:], min(header["nbytes"] - got, 1 << 22))
                if n == 0:
                    raise KVTransferError(f"connection closed after {got} of {header['nbytes']} bytes")
                got += n
            conn.sendall(b"OK\n")
    except (OSError, ValueError, KeyError) as e:
        raise KVTransferError(f"{type(e).__name__}: {e}") from None
    kv = buf.view(torch.int16 if dtype != torch.float32 else torch.float32)
    kv = kv.view(dtype) if dtype != torch.float32 else kv
    half = kv.numel() // 2
    return KVPayload(kv[:half].view(shape), kv[half:].view(shape))
