"""Peers that play a context server's KV port, for tests of what a generation rank trusts, and
strangers that crowd a port, for tests of what a server lets them hold."""

from __future__ import annotations

import json
import selectors
import socket
import threading
import time


class RogueKVPeer:
    """Accepts one pull and sends `header` (a dict, or raw bytes) and `body`; then closes, or
    stalls for `stall_s`, or (`drip`) sends everything one byte at a time, every read a success."""

    def __init__(self, header, body: bytes = b"", stall_s: float = 0.0, drip: bool = False):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        raw = header if isinstance(header, bytes) else json.dumps(header).encode() + b"\n"

        def run():
            conn, _ = self.sock.accept()
            with conn:
                try:
                    conn.recv(1000)
                    if drip:
                        for byte in raw + body:
                            conn.sendall(bytes([byte]))
                            time.sleep(0.2)
                    else:
                        conn.sendall(raw + body)
                        time.sleep(stall_s)
                except OSError:  # the puller gave up on us: what it should do
                    pass
        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        self.sock.close()


class SilentCrowd:
    """Strangers that hold `n` connections to `address` open and send nothing; each connection the
    server closes is opened again at once (an attacker's way to keep whatever a connection holds)."""

    def __init__(self, address: tuple[str, int], n: int):
        self.address, self.n = address, n
        self.opened = 0
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._full = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)
        self._thread.start()
        if not self._full.wait(30):
            raise TimeoutError(f"could not open {n} connections to {address}")

    def _open(self) -> None:
        conn = socket.create_connection(self.address, timeout=5)
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ)
        self.opened += 1

    def _hold(self) -> None:
        for _ in range(self.n):
            self._open()
        self._full.set()
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                self._selector.unregister(key.fileobj)
                key.fileobj.close()  # answered or closed by the server: a new one takes its place
                self._open()

    def __enter__(self) -> "SilentCrowd":
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
