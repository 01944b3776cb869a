"""A peer that plays a context server's KV port, for tests of what a generation rank trusts."""

from __future__ import annotations

import json
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
