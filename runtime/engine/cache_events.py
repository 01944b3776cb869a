"""What entered and left one rank's prefix cache, in order, for whoever places requests by it.

vLLM's KV events in three words: `stored` (a block entered the cache under its chained hash),
`removed` (it was handed out to new tokens and left), `cleared` (forget everything said before:
the `stored` events that follow are the whole cache). Each event is `(kind, hash as hex)`, plain
data, so it crosses a pipe and the group link as it is.

The log is drained by the rank after every pass (`take`) and sent to the server process, whose
ADP dispatcher replays it into its view of the rank (`runtime/executor/rank_cache_view.py`).
When nobody drains it (an engine used offline, the progress search) it never grows past
`capacity`: it is then compacted to `cleared` + one `stored` per cached block, which says the
same, so replaying it still yields exactly the cache's contents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
KINDS = (STORED, REMOVED, CLEARED)
Event = tuple[str, str]


class CacheEventLog:
    def __init__(self, capacity: int, contents: Callable[[], Iterable[bytes]]):
        self.capacity = max(1, capacity)
        self._contents = contents  # the cache's hashes now, for a compaction
        self._events: list[Event] = []

    def stored(self, block_hash: bytes) -> None:
        self._append((STORED, block_hash.hex()))

    def removed(self, block_hash: bytes) -> None:
        self._append((REMOVED, block_hash.hex()))

    def take(self) -> list[Event]:
        """Every event since the last take, oldest first."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)

    def _append(self, event: Event) -> None:
        self._events.append(event)
        if len(self._events) > self.capacity:
            self._events = [(CLEARED, "")] + [(STORED, h.hex()) for h in self._contents()]
