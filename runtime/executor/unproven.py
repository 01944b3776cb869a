"""Connections that have not yet proven they hold the fleet's internal token, on the internal ports
anyone on the pod network may reach (the KV port, the group link).

Such a connection costs a thread that waits for its proof, nothing more: it counts against no
slot of the port's real work until the proof checked. Their number is bounded on its own, and a
new one beyond the bound closes the OLDEST one still waiting: a real peer proves itself within one
round trip, so strangers who hold connections open (and reopen each one that is closed) push out
only each other. To push out a real peer's connection they must open more than the bound in the
moment between its connect and its proof. Each connection's own deadline is its reader's: it
closes the connection when the proof has not come by then.
"""

from __future__ import annotations

import socket
import threading


class UnprovenConnections:
    def __init__(self, limit: int):
        self.limit = limit
        self._waiting: dict[socket.socket, None] = {}  # oldest first
        self._lock = threading.Lock()

    def admit(self, conn: socket.socket) -> None:
        """Count a new connection, closing the oldest waiting one for it when `limit` are waiting."""
        with self._lock:
            oldest = next(iter(self._waiting)) if len(self._waiting) >= self.limit else None
            if oldest is not None:
                del self._waiting[oldest]
            self._waiting[conn] = None
        if oldest is not None:
            try:  # its reader sees the end of the stream at once, answers 'busy' and closes it
                oldest.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def settle(self, conn: socket.socket) -> bool:
        """The connection proved itself, failed to, or ended: it waits no longer. False when it had
        been closed to make room (whatever it sent is not to be served)."""
        with self._lock:
            return self._waiting.pop(conn, False) is None

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)
