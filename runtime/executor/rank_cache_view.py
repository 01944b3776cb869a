"""The server process's view of what each ADP rank's prefix cache holds, from the ranks' own words.

Each rank drains its cache's event log (`engine/cache_events.py`) after every pass and sends it
to the server process *before* that pass's outputs, on the same pipe (through the group link for
a rank in another pod). The reader thread replays the events here in order. So:

- a block a pass computed is in this view before any client sees a token of that pass: turn 2 of
  a conversation, sent after turn 1's answer arrived, is looked up against turn 1's blocks;
- a block evicted in a pass is still believed present until that pass's events arrive: at most
  one pass (plus the pipe or link) stale. A wrong belief costs a miss where a hit was expected,
  never a wrong answer: the rank looks the prefix up again in its own cache at admission.

Nothing here is guessed from where requests were sent. Memory: one entry per cached block, at
most `kv_blocks` per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from adpfleet.runtime.engine.cache_events import CLEARED, KINDS, REMOVED, STORED, Event


class RankCacheView:
    def __init__(self, dp: int):
        self._held: list[set[str]] = [set() for _ in range(dp)]  # hex block hashes each rank holds
        self.events_applied = [0] * dp

    def apply(self, rank: int, events: Sequence[Event]) -> None:
        held = self._held[rank]
        for kind, block in events:
            if kind == STORED:
                held.add(block)
            elif kind == REMOVED:
                held.discard(block)
            elif kind == CLEARED:
                held.clear()
            else:
                raise ValueError(f"rank {rank} sent a cache event of kind {kind!r}, not one of {', '.join(KINDS)}")
        self.events_applied[rank] += len(events)

    def hits(self, hashes: Sequence[bytes]) -> list[int]:
        """Per rank, how many leading blocks of `hashes` it holds (a prefix hit stops at the first miss)."""
        keys = [h.hex() for h in hashes]
        out = []
        for held in self._held:
            n = 0
            while n < len(keys) and keys[n] in held:
                n += 1
            out.append(n)
        return out

    def blocks(self, rank: int) -> list[str]:
        return sorted(self._held[rank])
