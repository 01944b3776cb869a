"""The server's ADP router: which rank gets a new request.

Balanced by request count, then token count, and blind to each rank's free KV cache — as
upstream is by default. Capacity blindness is why one rank can be handed a request it cannot
fit while its peers have work: the condition post-schedule padding makes survivable.
"""

from __future__ import annotations


def pick_rank(loads: list[tuple[int, int]]) -> int:
    """loads[r] = (active requests, tokens) of rank r; returns the least-loaded rank."""
    return min(range(len(loads)), key=lambda r: (loads[r][0], loads[r][1], r))
