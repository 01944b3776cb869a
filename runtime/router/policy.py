"""Which server — and for the cache-aware policy which of its ADP ranks — gets a request.

Policies (`adpfleet router --policy`, the CRD's `router.policy`):
- `round-robin`: usable servers in turn, load ignored;
- `least-loaded`: fewest requests in flight from this router, ties in turn (`pool.py`);
- `cache-aware` (the default): context and aggregated servers by the prefill they save and by
  load, generation servers by load (they pull their KV: there is no prefill to save).

**The cache-aware score** of a server s, for a request of P prompt tokens and D tokens to decode,
from the router's view of s (`prefix_view.py`): L[r] the pending tokens of rank r, h[r] the
leading blocks of the prompt rank r holds (B tokens each), prefill[r] = P - B·h[r]:
  1. the rank: r* = `adp_router.place(L, prefill + D, h, bound)` — the rank with the longest hit
     among those whose placement keeps the server's max/mean pending within its lockstep bound
     (the server's own ADP dispatcher's rule, `docs/adp.md`), so a hot prefix spreads over ranks;
  2. cost(s) = OVERLAP_WEIGHT · prefill[r*] + max(L[r*] + prefill[r*] + D, max over r ≠ r* of L[r])
     — Dynamo's `overlap_weight × blocks to prefill + active decode blocks`, in tokens, with the
     load term taken as the server's **busiest rank after placement**: ranks step in lockstep, so
     every pass of the server costs what its busiest rank scheduled;
  3. the cheapest server wins (ties: the lower URL) and the request carries `X-Data-Parallel-Rank: r*`.
When no rank in any server's view holds even one block of the prompt (or the prompt cannot be
read, or no server has a view), the request falls back to least-loaded and carries no hint: the
server's dispatcher places it. (A request moved off its hit rank by the bound still goes by the
score, with its hint: the score has seen the load that moved it.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from adpfleet.contract.router_policy import CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN, ROUTER_POLICIES
from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.executor.adp_router import place
from adpfleet.runtime.router.pool import Endpoint, ServerPool
from adpfleet.runtime.router.prefix_view import PREFIX_ROLES, PrefixViews, ServerView
from adpfleet.runtime.router.prompt_tokens import Prompt

# A prompt token not computed is worth one pending token of load: a prefill token costs less time
# than a decode token, but the load term counts every pending token of the busiest rank, so with
# weight 1 a hit still wins until the rank it is on is more loaded than the prefill it saves.
OVERLAP_WEIGHT = 1.0


@dataclass(frozen=True)
class Pick:
    server: Endpoint
    rank: int | None = None  # the ADP rank named to the server (X-Data-Parallel-Rank), or None
    hit_blocks: int = 0  # the leading blocks of the prompt the router expects that rank to hold
    prefill: int = 0  # prompt tokens the rank still has to compute, as the router expects
    cost: float = 0.0
    tokens: int = 0  # the load it adds to that rank: its prefill plus max_tokens
    expected_block: bytes | None = None  # the last of those blocks (checked against the next snapshot)


def score(ep: Endpoint, view: ServerView, load: Sequence[int], hashes: Sequence[bytes], hits: Sequence[int],
          prompt: Prompt) -> Pick:
    """The rank of one server for `prompt` (whose blocks are `hashes`, of which rank r holds the
    first hits[r]; `load` its ranks' pending tokens) and what choosing it costs (see the module's
    formula)."""
    prefill = [len(prompt.token_ids) - h * view.tokens_per_block for h in hits]
    adds = [p + prompt.max_tokens for p in prefill]
    rank = place(load, adds, hits, view.bound)
    busiest = max([load[rank] + adds[rank]] + [load[r] for r in range(len(load)) if r != rank])
    return Pick(ep, rank, hits[rank], prefill[rank], OVERLAP_WEIGHT * prefill[rank] + busiest, adds[rank],
                hashes[hits[rank] - 1] if hits[rank] else None)


def best_by_prefix(views: Mapping[Endpoint, ServerView], candidates: Sequence[Endpoint], prompt: Prompt,
                   routed: Mapping[Endpoint, Sequence[int]] | None = None) -> Pick | None:
    """The cheapest (server, rank) among `candidates` with a view, or None when no rank of them
    holds a block of the prompt. `routed`: this router's tokens in flight by server and rank."""
    hashes_by_size: dict[int, list[bytes]] = {}
    picks, matched = [], False
    for ep in candidates:
        view = views.get(ep)
        if view is None:
            continue
        size = view.tokens_per_block
        if size not in hashes_by_size:
            hashes_by_size[size] = block_hash.prefix_hashes(prompt.token_ids, size)
        hits = view.hits(hashes_by_size[size])
        matched = matched or any(hits)
        load = view.load((routed or {}).get(ep, ()))
        picks.append(score(ep, view, load, hashes_by_size[size], hits, prompt))
    if not matched:
        return None
    return min(picks, key=lambda p: (p.cost, p.server.url))


class Selector:
    """The policy over the pool: `pick` is what the request path calls for each server it needs."""

    def __init__(self, pool: ServerPool, policy: str = LEAST_LOADED, views: PrefixViews | None = None,
                 metrics=None):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(ROUTER_POLICIES)}, got {policy!r}")
        self.pool, self.policy, self.views, self.metrics = pool, policy, views, metrics

    def pick(self, role: str, now: float, avoid: set[Endpoint], prompt: Prompt | None) -> Pick | None:
        if self.policy == CACHE_AWARE and role in PREFIX_ROLES:
            chosen = self._by_prefix(role, now, avoid, prompt)
            if chosen is not None:
                return chosen
        server = self.pool.pick(role, now, avoid, by_load=self.policy != ROUND_ROBIN)
        return None if server is None else Pick(server)

    def _by_prefix(self, role: str, now: float, avoid: set[Endpoint], prompt: Prompt | None) -> Pick | None:
        if prompt is None or self.views is None:
            self._count("unread")
            return None
        candidates = [ep for ep in self.pool.usable(role, now) if ep not in avoid]
        chosen = best_by_prefix(self.views.views, candidates, prompt, self.views.routed)
        if chosen is None:
            self._count("no_match")
            return None
        self._count("prefix")
        self.views.sent(chosen.server, chosen.rank, chosen.tokens, chosen.expected_block)
        if self.metrics is not None:
            self.metrics.prefix_predicted_tokens.inc(len(prompt.token_ids) - chosen.prefill)
        return chosen

    def request_ended(self, pick: Pick) -> None:
        """The request `pick` was for ended on its server (answered, failed, or abandoned)."""
        if self.views is None or pick.server.role not in PREFIX_ROLES:
            return
        if pick.rank is not None:
            self.views.ended(pick.server, pick.rank, pick.tokens)
        self.views.request_ended(pick.server)

    def _count(self, decision: str) -> None:
        if self.metrics is not None:
            self.metrics.prefix_decisions.labels(decision).inc()
