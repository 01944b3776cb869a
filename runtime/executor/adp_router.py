"""The server's ADP router: which rank gets a new request — by prefix, within a lockstep bound.

A request is placed on the rank that holds the longest run of its leading blocks (its prefix
hit), unless that would leave the ranks' pending work more unbalanced than `bound` allows.

Why a bound, and why on max/mean of pending tokens. Ranks step in lockstep: every pass, every
rank pads its forward to the largest token count any rank scheduled (docs/adp.md, step 5), so a
pass costs what the busiest rank costs, and the useful share of the fleet's work is
mean/max = 1/I, where I = max/mean of the ranks' scheduled tokens. A rank's scheduled tokens are
drawn from its pending work — the prefill it still has to compute (its prompt less its hit *on
that rank*) plus the tokens it may still decode — so the router bounds I over pending tokens:
while the ranks drain what they were given, their passes stay within that imbalance. With
I <= 1.25 (the issue's hot-prefix target) at least 80 % of every pass is real work. A hit saves
its blocks' prefill once; a rank made hot by it would tax every pass of every rank for as long
as its excess lasts. The bound lets affinity win until that tax reaches 20 %.

The rule, per request, with L[r] the pending tokens of rank r and c[r] what the request adds on
r (c differs per rank: the hit differs):
  1. I(r) = max(L[r] + c[r], max over s != r of L[s]) / ((sum L + c[r]) / N), the imbalance
     after placing it on r;
  2. the ranks allowed are those with I(r) <= max(bound, min over s of I(s)): when no rank
     keeps the bound (an idle server: one request on N ranks is imbalance N whatever its rank),
     any rank as balanced as the best is allowed — there is nothing to balance against yet;
  3. of those, the longest hit; then the smallest L[r] + c[r]; then the lowest rank.

What the bound costs in hits: a request is moved off the rank of its longest hit only when that
rank's pending work would pass `bound` x the mean, and it then recomputes what it would have
found. For a hot prefix that every session shares, this happens once per rank: the first request
moved computes the prefix on another rank, whose cache then holds it too, and from there on the
hits tie and load decides (N - 1 extra prefills of the prefix instead of one). For a
conversation, it costs the session's history once, and the next turn follows it to its new rank.
Sequential traffic (nothing pending) never pays: any rank is as balanced as any other.
"""

from __future__ import annotations

from collections.abc import Sequence

IMBALANCE_BOUND = 1.25  # max/mean of the ranks' pending tokens, see above
_EPS = 1e-9


def imbalance_after(pending: Sequence[int], cost: int, rank: int) -> float:
    """max/mean of the ranks' pending tokens once `cost` tokens are added to `rank`'s."""
    loads = list(pending)
    loads[rank] += cost
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0


def place(pending: Sequence[int], costs: Sequence[int], hits: Sequence[int],
          bound: float = IMBALANCE_BOUND) -> int:
    """The rank for a request: pending[r] tokens rank r still has to process, costs[r] the tokens
    the request would add there, hits[r] the leading blocks of it that rank holds."""
    ranks = range(len(pending))
    after = [imbalance_after(pending, costs[r], r) for r in ranks]
    allowed = max(bound, min(after)) + _EPS
    return max((r for r in ranks if after[r] <= allowed), key=lambda r: (hits[r], -(pending[r] + costs[r]), -r))
