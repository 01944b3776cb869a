"""The built-in autoscaling policy: `decision = decide(history, policy, current, ...)`, pure.

Each scrape interval the operator reduces the scrapes of a role's serving servers to one `RoleLoad`
(`role_load`: means per ADP rank), and keeps the loads since the role last settled at its present
size. From that history alone, like the remediation policy from its records, `decide` says what the
role's desired server count should be, and why:

1. `minServers` and `maxServers` bound everything: a count outside them is brought back at once
   (`BelowMinimum`, `AboveMaximum`), whatever the signals say.
2. Nothing else changes while the role has not settled — a server still starting, one being drained
   or remediated: the last decision has not taken effect, and the signals do not show its effect yet.
3. Each load gives a recommendation (`recommend`). Up, when a signal is above its target by more
   than the tolerance: `ceil(servers x signal / target)`, the HPA's rule, at least one more. Down,
   to the fewest servers at which every set target — and the engine's batch capacity — would still
   hold with the same load spread over them, less the tolerance (`servers x signal / fewer`).
   Otherwise it stays.
4. Stabilisation: a scale-up needs every load of the last `scaleUp.stabilizationWindowSeconds` to ask
   for it (the lowest recommendation wins); a scale-down needs every load of the last
   `scaleDown.stabilizationWindowSeconds` to allow it (the highest wins). The history must cover the
   window: just after a change, nothing moves until it does.
5. Step limits: `maxServersPerStep` servers per decision each way; the next waits for rule 2.

Context and generation are not scaled alike. A context server whose KV is mostly held for transfers
to generation servers (`transfer_share`) is waiting on the generation role, not short of capacity:
its queue does not add context servers; instead the generation role gets one more server
(`GenerationBacklog`), as it is the one that does not keep up. TTFT is a context signal and
inter-token latency a generation one in a disaggregated fleet; any set target counts on either role.

The tolerance and the down rule's projection make a steady load find one size and stay there: the
size it scales down to is one at which no signal exceeds its target, so it never scales back up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.resource.models import AutoscalingSpec
from adpfleet.operator.resource.vocabulary import ScaleReason

TRANSFER_BOUND = 0.5  # a context role with more than this share of its KV held for transfers waits on generation

# signal (a ScalingTargets field) -> (what it is called in messages, the reason when it is above target)
SIGNALS = {
    "waiting_per_rank": ("waiting/rank", ScaleReason.WAITING),
    "kv_cache_utilization": ("KV use", ScaleReason.KV_CACHE),
    "time_to_first_token_seconds": ("TTFT s", ScaleReason.TTFT),
    "inter_token_latency_seconds": ("ITL s", ScaleReason.ITL),
}


@dataclass(frozen=True)
class RoleLoad:
    """One scrape of a role's serving servers, as means per ADP rank."""
    at: float
    servers: int                      # servers scraped successfully
    ranks: int
    waiting_per_rank: float = 0.0
    running_per_rank: float = 0.0
    kv_cache_utilization: float = 0.0
    transfer_share: float = 0.0       # of the KV blocks in use, the share held for transfers
    time_to_first_token_seconds: float | None = None  # mean over the last interval (None: no first token)
    inter_token_latency_seconds: float | None = None
    peer_transfer_share: float = 0.0  # generation roles: the context role's transfer_share at the same scrape

    def signal(self, name: str) -> float | None:
        return getattr(self, name)


def role_load(at: float, now: Mapping[str, Scrape], before: Mapping[str, Scrape]) -> RoleLoad | None:
    """The load of a role from this interval's scrapes of its servers (`now`) and the previous
    ones (`before`, for the latency histograms' means over the interval). None without one
    successful scrape."""
    ok = [s for s in now.values() if s.ok]
    if not ok:
        return None
    ranks = [r for s in ok for r in s.ranks.values()]
    n = len(ranks)
    used = sum(r.kv_cache_blocks_used for r in ranks)
    total = sum(r.kv_cache_blocks_total for r in ranks)
    held = sum(r.kv_transfers_in_flight for r in ranks)

    def interval_mean(sum_attr: str, count_attr: str) -> float | None:
        total_sum = total_count = 0.0
        for server, scrape in now.items():
            old = before.get(server)
            if not scrape.ok or old is None or not old.ok or set(old.ranks) != set(scrape.ranks):
                continue
            d_sum = sum(getattr(scrape.ranks[r], sum_attr) - getattr(old.ranks[r], sum_attr) for r in scrape.ranks)
            d_count = sum(getattr(scrape.ranks[r], count_attr) - getattr(old.ranks[r], count_attr)
                          for r in scrape.ranks)
            if d_count > 0 and d_sum >= 0:  # a counter that went back is a restarted server: skipped
                total_sum, total_count = total_sum + d_sum, total_count + d_count
        return total_sum / total_count if total_count else None

    return RoleLoad(at=at, servers=len(ok), ranks=n,
                    waiting_per_rank=sum(r.requests_waiting for r in ranks) / n,
                    running_per_rank=sum(r.requests_running for r in ranks) / n,
                    kv_cache_utilization=used / total if total else 0.0,
                    transfer_share=held / used if used else 0.0,
                    time_to_first_token_seconds=interval_mean("ttft_sum", "ttft_count"),
                    inter_token_latency_seconds=interval_mean("itl_sum", "itl_count"))


@dataclass(frozen=True)
class Recommendation:
    servers: int
    reason: ScaleReason | None  # None: stay
    detail: str


@dataclass(frozen=True)
class ScaleDecision:
    """What the policy wants for one role now. `reason` None: no change (`detail` says why)."""
    role: str
    current: int
    desired: int
    reason: ScaleReason | None
    detail: str

    @property
    def changes(self) -> bool:
        return self.reason is not None and self.desired != self.current

    def message(self) -> str:
        return f"{self.role} {self.current} -> {self.desired}: {self.detail}"


def recommend(load: RoleLoad, role: str, policy: AutoscalingSpec, batch_capacity: int) -> Recommendation:
    """The server count `load` alone asks for (rule 3). `batch_capacity`: requests one rank runs at once
    (the engine's maxBatchSize): a scale-down never leaves more running+waiting per rank than that."""
    n = max(1, load.servers)
    tol = policy.tolerance
    targets = policy.targets.given()
    blocked_on_generation = role == "context" and load.transfer_share > TRANSFER_BOUND
    # up: the signal furthest above its target
    worst: tuple[float, str] | None = None
    for name, target in targets.items():
        value = load.signal(name)
        if value is None:
            continue
        if blocked_on_generation and name in ("waiting_per_rank", "time_to_first_token_seconds"):
            continue  # its queue is the generation role's to fix
        ratio = value / target
        if ratio > 1 + tol and (worst is None or ratio > worst[0]):
            worst = (ratio, name)
    if worst is not None:
        ratio, name = worst
        label, reason = SIGNALS[name]
        return Recommendation(max(n + 1, math.ceil(n * ratio)), reason,
                              f"{label} {load.signal(name):.3g} > target {targets[name]:g}")
    if role == "generation" and load.peer_transfer_share > TRANSFER_BOUND:
        return Recommendation(n + 1, ScaleReason.GENERATION_BACKLOG,
                              f"context servers hold {load.peer_transfer_share:.0%} of their KV for transfers")
    if blocked_on_generation:
        return Recommendation(n, None, f"{load.transfer_share:.0%} of the KV in use waits for generation servers")
    # down: the fewest servers that would hold the same load under every target
    fewest = n
    for m in range(n - 1, 0, -1):
        scale = n / m
        fits = all(load.signal(name) is None or load.signal(name) * scale <= target * (1 - tol)
                   for name, target in targets.items())
        fits = fits and (load.running_per_rank + load.waiting_per_rank) * scale <= batch_capacity * (1 - tol)
        if not fits:
            break
        fewest = m
    if fewest < n:
        shown = ", ".join(f"{SIGNALS[k][0]} {load.signal(k):.3g}" for k in targets if load.signal(k) is not None)
        return Recommendation(fewest, ScaleReason.BELOW_TARGETS, f"{shown or 'no load'}: under every target with "
                                                                 f"{fewest} server(s)")
    return Recommendation(n, None, "within targets")


def decide(role: str, history: Sequence[RoleLoad], policy: AutoscalingSpec, current: int, now: float, *,
           settled_since: float | None, batch_capacity: int) -> ScaleDecision:
    """The desired count of `role` (now `current`) from `history` (loads, oldest first). `settled_since`:
    since when the role has been settled at `current` (every server Ready, none starting, leaving or
    remediated); None while it is not."""
    low, high = policy.min_servers, policy.max_servers
    if current < low:
        return ScaleDecision(role, current, low, ScaleReason.BELOW_MINIMUM, f"raised to minServers {low}")
    if current > high:
        return ScaleDecision(role, current, high, ScaleReason.ABOVE_MAXIMUM, f"lowered to maxServers {high}")
    if settled_since is None:
        return ScaleDecision(role, current, current, None, "waiting for the role to settle")
    loads = [h for h in history if h.at >= settled_since and h.servers == current]
    if not loads:
        return ScaleDecision(role, current, current, None, "no scrape of the role yet")
    recs = [(h, recommend(h, role, policy, batch_capacity)) for h in loads]
    latest = recs[-1][1]

    up_window = policy.scale_up.stabilization_window_seconds
    if latest.servers > current:
        if now - settled_since < up_window:
            return ScaleDecision(role, current, current, None, f"{latest.detail}; stabilising ({up_window} s)")
        window = [r for h, r in recs if h.at >= now - up_window] or [latest]
        lowest = min(window, key=lambda r: r.servers)
        if lowest.servers > current:
            desired = min(high, lowest.servers, current + policy.scale_up.max_servers_per_step)
            if desired > current:
                return ScaleDecision(role, current, desired, lowest.reason, _limited(lowest, desired, high))
        return ScaleDecision(role, current, current, None, f"{latest.detail}, not for {up_window} s yet")

    down_window = policy.scale_down.stabilization_window_seconds
    if latest.servers < current:
        if now - settled_since < down_window:
            return ScaleDecision(role, current, current, None, f"{latest.detail}; stabilising ({down_window} s)")
        window = [r for h, r in recs if h.at >= now - down_window] or [latest]
        highest = max(window, key=lambda r: r.servers)
        if highest.servers < current:
            desired = max(low, highest.servers, current - policy.scale_down.max_servers_per_step)
            if desired < current:
                return ScaleDecision(role, current, desired, ScaleReason.BELOW_TARGETS,
                                     _limited(highest, desired, low))
    return ScaleDecision(role, current, current, None, latest.detail)


def _limited(rec: Recommendation, desired: int, bound: int) -> str:
    if desired == rec.servers:
        return rec.detail
    why = "maxServers" if desired == bound and rec.servers > bound else \
        "minServers" if desired == bound and rec.servers < bound else "the step limit"
    return f"{rec.detail} (asks for {rec.servers}, {why} allows {desired})"
