"""The built-in autoscaling policy: `decision = decide(history, policy, current, ...)`, pure.

Each scrape interval the operator reduces the scrapes of a role's serving servers to one `RoleLoad`
(`role_load`: means per ADP rank), and keeps the loads since the role last settled at its present
size. From that history alone, like the remediation policy from its records, `decide` says what the
role's desired server count should be, and why:

1. `minServers` and `maxServers` bound everything: a count outside them is brought back at once
   (`BelowMinimum`, `AboveMaximum`), whatever the signals say.
2. Nothing else changes while the role has not settled — a server still starting, one being drained
   or remediated: the last decision has not taken effect, and the signals do not show its effect yet.
3. Each load gives a recommendation (`recommend`), from one model of what the same requests would
   show on another number of servers (`projected`): requests per rank scale inversely with the
   servers; a rank runs what fits (its batch, or what its KV allows) and queues the rest — the
   requests it has admitted beyond one batch count as queued too (`observed`); KV use
   follows the requests held; latencies scale in proportion. Up, when a signal is above its
   target by more than the tolerance: the fewest servers at which every set target holds (for a
   proportional signal this is the HPA's `ceil(servers x signal / target)`). Down: the fewest
   servers at which every set target, less the tolerance, and the engine's batch capacity would
   still hold. Otherwise it stays. Up and down read the same model, so the size a scale-up
   reaches is not one a scale-down leaves, and back.
4. Stabilisation, as the HPA's: a scale-up needs every load of the last
   `scaleUp.stabilizationWindowSeconds` to ask for it (the lowest recommendation wins); a scale-down
   needs every load of the last `scaleDown.stabilizationWindowSeconds` to allow it (the highest
   wins). Recommendations are server counts, so loads taken at another size still count. The
   history must cover the window (after an operator restart nothing moves until it does), and
   a decision needs one load taken since the role settled at its size.
5. Step limits: `maxServersPerStep` servers per decision each way; the next waits for rule 2.

Context and generation are not scaled alike. A context server whose KV cache is mostly filled by
blocks held for transfers to generation servers (`held_for_transfers`, a share of its capacity)
is waiting on the generation role, not short of capacity: its queue does not add context servers;
instead the generation role gets one more server (`GenerationBacklog`), as it is the one that
does not keep up. A share of the capacity, not of the blocks in use: a context server prefills in
moments and holds every finished prompt until its pull, so nearly all the blocks it uses are held
for transfers even when generation keeps up and most of its cache is free. TTFT is a context signal and
inter-token latency a generation one in a disaggregated fleet; any set target counts on either role.

The tolerance and the down rule's projection make a steady load find one size and stay there: the
size it scales down to is one at which no signal exceeds its target, so it never scales back up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.resource.server_role import AutoscalingSpec
from adpfleet.operator.resource.vocabulary import ScaleReason

TRANSFER_BOUND = 0.5  # a context role with more of its KV capacity held for transfers waits on generation
MAX_SERVERS = 256     # the most any role may ask for (ServerRole.servers' bound)

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
    peer_held_for_transfers: float = 0.0  # generation roles: the context role's held_for_transfers at the same scrape

    @property
    def held_for_transfers(self) -> float:
        """The share of the KV capacity held for transfers."""
        return self.kv_cache_utilization * self.transfer_share

    def signal(self, name: str) -> float | None:
        return getattr(self, name)


def with_context_peer(generation: RoleLoad, context: RoleLoad) -> RoleLoad:
    """The generation role's load, knowing how much KV the context role holds for it at the same scrape."""
    return replace(generation, peer_held_for_transfers=context.held_for_transfers)


def role_load(at: float, now: Mapping[str, Scrape], before: Mapping[str, Scrape]) -> RoleLoad | None:
    """The load of a role from this interval's scrapes of its servers (`now`) and the previous
    ones (`before`, for the latency histograms' means over the interval). None without one
    successful scrape. A value a rank does not know (vLLM: no KV transfers; an engine's queue before
    its first step) is left out of its mean, never read as 0."""
    ok = [s for s in now.values() if s.ok]
    if not ok:
        return None
    ranks = [r for s in ok for r in s.ranks.values()]
    kv = [r for r in ranks if r.kv_cache_blocks_used is not None and r.kv_cache_capacity_blocks is not None]
    used = sum(r.kv_cache_blocks_used for r in kv)
    total = sum(r.kv_cache_capacity_blocks for r in kv)
    held = sum(r.kv_transfers_in_flight for r in kv if r.kv_transfers_in_flight is not None)

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

    return RoleLoad(at=at, servers=len(ok), ranks=len(ranks),
                    waiting_per_rank=_known_mean(r.requests_waiting for r in ranks),
                    running_per_rank=_known_mean(r.requests_running for r in ranks),
                    kv_cache_utilization=used / total if total else 0.0,
                    transfer_share=held / used if used else 0.0,
                    time_to_first_token_seconds=interval_mean("ttft_sum", "ttft_count"),
                    inter_token_latency_seconds=interval_mean("itl_sum", "itl_count"))


def _known_mean(values) -> float:
    """The mean over the ranks that know the value (0 when none does: no rank has published a queue)."""
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else 0.0


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


def projected(load: RoleLoad, name: str, servers: int, batch_capacity: int) -> float | None:
    """Signal `name` of `load` were the same requests spread over `servers` servers instead of
    `load.servers`. Requests per rank scale by servers/`servers`; a rank runs what fits (the batch
    capacity, or less when its KV is the limit: then it is as many as it runs now) and queues the
    rest; KV use follows the requests it holds; a latency grows in proportion."""
    value = load.signal(name)
    if value is None:
        return None
    scale = load.servers / servers
    demand = (load.running_per_rank + load.waiting_per_rank) * scale
    if name == "waiting_per_rank":
        fits = min(load.running_per_rank, batch_capacity) if load.waiting_per_rank > 0 else batch_capacity
        return max(0.0, demand - fits)
    if name == "kv_cache_utilization":
        if load.running_per_rank > 0:  # KV per request now, times the requests it would hold
            return value / load.running_per_rank * min(demand, batch_capacity)
        return value * scale
    return value * scale


def observed(load: RoleLoad, name: str, batch_capacity: int) -> float | None:
    """Signal `name` of `load` as the policy judges it. A rank admits more requests than one batch
    holds (up to maxNumActiveRequests) and runs `batch_capacity` of them per pass: those beyond its
    batch wait pass by pass, so they count as waiting."""
    if name == "waiting_per_rank":
        return load.waiting_per_rank + max(0.0, load.running_per_rank - batch_capacity)
    return load.signal(name)


def recommend(load: RoleLoad, role: str, policy: AutoscalingSpec, batch_capacity: int) -> Recommendation:
    """The server count `load` alone asks for (rule 3). `batch_capacity`: requests one rank runs at once
    (the engine's maxBatchSize): a scale-down never leaves more running+waiting per rank than that."""
    n = max(1, load.servers)
    tol = policy.tolerance
    targets = policy.targets.given()
    blocked_on_generation = role == "context" and load.held_for_transfers > TRANSFER_BOUND
    if blocked_on_generation:  # its queue is the generation role's to fix
        targets = {k: v for k, v in targets.items() if k not in ("waiting_per_rank", "time_to_first_token_seconds")}

    def holds(m: int, slack: float) -> bool:
        return all((v := projected(load, name, m, batch_capacity)) is None or v <= target * slack
                   for name, target in targets.items())

    # up: a signal above its target by more than the tolerance; as many servers as bring every
    # signal back to its target
    worst: tuple[float, str] | None = None
    for name, target in targets.items():
        value = observed(load, name, batch_capacity)
        if value is not None and value > target * (1 + tol) and (worst is None or value / target > worst[0]):
            worst = (value / target, name)
    if worst is not None:
        name = worst[1]
        label, reason = SIGNALS[name]
        m = n + 1
        while m < MAX_SERVERS and not holds(m, 1.0):
            m += 1
        return Recommendation(m, reason, f"{label} {observed(load, name, batch_capacity):.3g} > target "
                                         f"{targets[name]:g}")
    if role == "generation" and load.peer_held_for_transfers > TRANSFER_BOUND:
        return Recommendation(n + 1, ScaleReason.GENERATION_BACKLOG,
                              f"context servers hold {load.peer_held_for_transfers:.0%} of their KV for transfers")
    if blocked_on_generation:
        return Recommendation(n, None, f"{load.held_for_transfers:.0%} of the KV cache waits for generation servers")
    # down: the fewest servers that would hold the same load under every target, less the
    # tolerance, and within the engine's batch capacity
    fewest = n
    for m in range(n - 1, 0, -1):
        if not holds(m, 1 - tol) or (load.running_per_rank + load.waiting_per_rank) * n / m > batch_capacity * (1 - tol):
            break
        fewest = m
    if fewest < n:
        shown = ", ".join(f"{SIGNALS[k][0]} {v:.3g}" for k in targets
                          if (v := observed(load, k, batch_capacity)) is not None)
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
    if not history or history[-1].at < settled_since:
        return ScaleDecision(role, current, current, None, "waiting for a scrape of the role at its size")
    up_window = policy.scale_up.stabilization_window_seconds
    down_window = policy.scale_down.stabilization_window_seconds
    observed = now - history[0].at
    latest = recommend(history[-1], role, policy, batch_capacity)

    def window(seconds: float) -> list[Recommendation]:
        # Recommendations are server counts, comparable whatever size the role had at each scrape.
        return [recommend(h, role, policy, batch_capacity) for h in history if h.at >= now - seconds] or [latest]

    if latest.servers > current:
        if observed < up_window:
            return ScaleDecision(role, current, current, None, f"{latest.detail}; observed for {observed:.0f} of "
                                                               f"{up_window} s")
        lowest = min(window(up_window), key=lambda r: r.servers)
        if lowest.servers > current:
            desired = min(high, lowest.servers, current + policy.scale_up.max_servers_per_step)
            if desired > current:
                return ScaleDecision(role, current, desired, lowest.reason, _limited(lowest, desired, high))
        return ScaleDecision(role, current, current, None, f"{latest.detail}, not for {up_window} s yet")
    if latest.servers < current:
        if observed < down_window:
            return ScaleDecision(role, current, current, None, f"{latest.detail}; observed for {observed:.0f} of "
                                                               f"{down_window} s")
        highest = max(window(down_window), key=lambda r: r.servers)
        if highest.servers < current:
            desired = max(low, highest.servers, current - policy.scale_down.max_servers_per_step)
            if desired < current:
                return ScaleDecision(role, current, desired, ScaleReason.BELOW_TARGETS,
                                     _limited(highest, desired, low))
        return ScaleDecision(role, current, current, None, f"{latest.detail}, not for {down_window} s yet")
    return ScaleDecision(role, current, current, None, latest.detail)


def _limited(rec: Recommendation, desired: int, bound: int) -> str:
    if desired == rec.servers:
        return rec.detail
    why = "maxServers" if desired == bound and rec.servers > bound else \
        "minServers" if desired == bound and rec.servers < bound else "the step limit"
    return f"{rec.detail} (asks for {rec.servers}, {why} allows {desired})"
