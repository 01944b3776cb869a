"""The server process's ADP dispatcher: places each request on a rank and keeps the books.

It owns what placement needs and nothing else:
- the pending tokens of every request in flight, by rank: its prefill still to compute (its
  prompt less the hit on its rank; none on a generation server, whose prompt KV is pulled) until
  its first output, plus `max_tokens` less what it has produced — an upper bound, as a request
  may stop early;
- the view of each rank's prefix cache, from the ranks' own events (`rank_cache_view.py`);
- the rule (`adp_router.place`): the longest prefix hit within the lockstep imbalance bound.

A rank named by the router (`X-Data-Parallel-Rank`, validated at the HTTP edge) is honoured as
it is: the router bounds the imbalance at its own level (docs/adp.md).
Not thread-safe on its own: the rank group calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.executor.adp_router import IMBALANCE_BOUND, imbalance_after, place
from adpfleet.runtime.executor.rank_cache_view import RankCacheView


@dataclass
class Placement:
    rank: int
    prefill: int  # prompt tokens the rank still has to compute for it (0 once it has answered)
    max_tokens: int
    produced: int = 0

    @property
    def pending(self) -> int:
        return self.prefill + max(0, self.max_tokens - self.produced)


class ADPDispatcher:
    def __init__(self, dp: int, tokens_per_block: int, bound: float = IMBALANCE_BOUND):
        self.dp, self.tokens_per_block, self.bound = dp, tokens_per_block, bound
        self.view = RankCacheView(dp)
        self.placed: dict[str, Placement] = {}
        self.pending = [0] * dp  # tokens, by rank
        self.requests = [0] * dp  # in flight, by rank
        self.hinted = 0  # placements a router chose
        self.hit_blocks = 0  # blocks the chosen ranks were believed to hold, over every placement

    def assign(self, request: Request, rank: int | None = None) -> int:
        """The rank for `request` (the router's `rank` when it named one), booked as pending there."""
        if rank is not None and not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} does not exist (this server has {self.dp})")
        pulled = request.remote_kv is not None  # a generation server computes no prefill
        hashes = [] if pulled else block_hash.prefix_hashes(request.prompt_token_ids, self.tokens_per_block)
        hits = self.view.hits(hashes)
        decode = request.params.max_tokens
        prefill = [0 if pulled else request.num_prompt_tokens - hit * self.tokens_per_block for hit in hits]
        if rank is None:
            rank = place(self.pending, [p + decode for p in prefill], hits, self.bound)
        else:
            self.hinted += 1
        self.hit_blocks += hits[rank]
        self.placed[request.request_id] = placement = Placement(rank, prefill[rank], decode)
        self.pending[rank] += placement.pending
        self.requests[rank] += 1
        return rank

    def progress(self, request_id: str, completion_tokens: int) -> None:
        """An output arrived: the prompt is done, `completion_tokens` are produced."""
        placement = self.placed.get(request_id)
        if placement is None:
            return
        before = placement.pending
        placement.prefill, placement.produced = 0, completion_tokens
        self.pending[placement.rank] += placement.pending - before

    def release(self, request_id: str) -> int | None:
        """The request is gone (finished, failed or aborted); returns the rank it was on."""
        placement = self.placed.pop(request_id, None)
        if placement is None:
            return None
        self.pending[placement.rank] -= placement.pending
        self.requests[placement.rank] -= 1
        return placement.rank

    def imbalance(self) -> float:
        """max/mean of the ranks' pending tokens now (1.0 when nothing is pending)."""
        return imbalance_after(self.pending, 0, 0)

    def snapshot(self) -> dict:
        """What each rank holds and has pending, for a router (`GET /internal/prefix_cache`)."""
        return {"hash": block_hash.SCHEME, "tokens_per_block": self.tokens_per_block,
                "imbalance_bound": self.bound, "imbalance": round(self.imbalance(), 4),
                "ranks": [{"rank": r, "requests": self.requests[r], "pending_tokens": self.pending[r],
                           "events": self.view.events_applied[r], "blocks": self.view.blocks(r)}
                          for r in range(self.dp)]}
