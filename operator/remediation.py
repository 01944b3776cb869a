"""Remediation policy: `plan = decide(verdicts, history, spec, servers, now)`, pure.

Inputs are what the operator observed (stall verdicts from `detection.py`, the fleet's server pods)
and what it did (`status.recentRemediations`, newest first). Because the history lives in the
fleet's status, a restarted operator decides exactly as the one before it: an action already
recorded is never repeated (cooldown, in-progress and budget all read the history).

For every **stalled** server, in order (the first rule that applies wins):

1. mode `Disabled`: nothing is decided at all.
2. `Halted`: an escalation `Halt` was recorded within `escalation.windowSeconds` → skip.
3. `InProgress`: the server is the target of a restart that has not finished (the record is
   `Pending`, or its pod is not yet replaced and Ready) → skip, quietly.
4. `Cooldown`: the server was the subject or target of a remediation within `cooldownSeconds`.
5. The escalation ladder picks the action from how often this server was remediated within
   `escalation.windowSeconds` (n):
   n = 0 → `RestartServer` (drain, then delete the pod; the reconcile recreates it);
   (n counts restarts not yet `Resolved`: once the server made progress after a restart, a later
   stall is a new one and starts again at the bottom of the ladder)
   0 < n < `afterRemediations` → `RestartPeers`: the stall persisted after the server's own restart,
   so restart the servers it waits on (the other role's servers; an aggregated server has none and
   is restarted again);
   n ≥ `afterRemediations` → `escalation.action`: `RestartRole` (every server of the role) or
   `Halt` (stop remediating the fleet, report Degraded).
   `RestartPeers` and `RestartRole` are rolling: `batch` servers at a time, each batch back Ready
   before the next, so they obey rules 8 and 9 at every step.
6. mode `DryRun` (or `budgetPerHour: 0`) → record what would have been done, do nothing.
7. `BudgetExhausted`: `budgetPerHour` actions were taken in the last hour → skip; the fleet is
   Degraded (reason RemediationBudgetExhausted) until the hour rolls on.
8. `ConcurrencyLimit`: restarting the targets would put more than `maxConcurrentPerRole` servers
   of a role under remediation at once.
9. `LastReadyServer`: a target is the last Ready server of its role, and that role is not wholly
   stalled (for a peer restart: neither the peer role nor the stalled server's own role is — when
   a whole role is stalled the fleet makes no progress at all, so nothing is lost).
10. otherwise: act.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Iterable, Mapping, Sequence

from adpfleet.operator.detection import StallVerdict, evidence_text
from adpfleet.operator.resource.models import FleetSpec

HISTORY_LIMIT = 20          # status.recentRemediations maxItems
BUDGET_PERIOD_SECONDS = 3600.0
RESTART_SLACK_SECONDS = 60.0  # beyond drain + startup timeouts before a restart is no longer "in progress"
PEER_ROLES = {"context": ("generation",), "generation": ("context",)}


class Action(str, enum.Enum):
    RESTART_SERVER = "RestartServer"
    RESTART_PEERS = "RestartPeers"
    RESTART_ROLE = "RestartRole"
    HALT = "Halt"


RESTARTS = (Action.RESTART_SERVER.value, Action.RESTART_PEERS.value, Action.RESTART_ROLE.value)


class Outcome(str, enum.Enum):
    PENDING = "Pending"        # decided and recorded; being carried out
    SUCCEEDED = "Succeeded"    # the pods were deleted (the reconcile recreates them)
    RESOLVED = "Resolved"      # ... and the server made progress again afterwards: the stall did not persist
    FAILED = "Failed"          # the API refused; see the message
    RECOVERED = "Recovered"    # progress resumed during the drain; nothing was deleted
    DRY_RUN = "DryRun"         # mode DryRun: what would have been done
    HALTED = "Halted"          # the escalation stopped remediation of the fleet


class Verdict(str, enum.Enum):
    """What `decide` concluded for one stalled server."""
    ACT = "Act"
    DRY_RUN = "DryRun"
    SKIP = "Skip"


# ---- what was done: one entry of status.recentRemediations -----------------------------------

@dataclass(frozen=True)
class Remediation:
    time: float                 # epoch seconds
    role: str
    server: str                 # the stalled server (the subject)
    signature: str
    action: str                 # Action value
    outcome: str                # Outcome value
    message: str = ""
    targets: tuple[str, ...] = ()  # the pods restarted (== (server,) for RestartServer)

    def to_status(self) -> dict:
        out = {"time": rfc3339(self.time), "role": self.role, "server": self.server, "signature": self.signature,
               "action": self.action, "outcome": self.outcome, "message": self.message[:1024]}
        if self.targets:
            out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_status(cls, entry: Mapping) -> "Remediation | None":
        """A record from status; None for one that cannot be read (it is then ignored, never fatal)."""
        try:
            server = str(entry["server"])
            targets = tuple(entry.get("targets") or ())
            action = str(entry["action"])
            if not targets and action == Action.RESTART_SERVER.value:
                targets = (server,)
            return cls(time=parse_rfc3339(entry["time"]), role=str(entry["role"]), server=server,
                       signature=str(entry.get("signature", "")), action=action, outcome=str(entry["outcome"]),
                       message=str(entry.get("message", "")), targets=targets)
        except (KeyError, TypeError, ValueError):
            return None

    def key(self) -> tuple:
        return (round(self.time, 3), self.server, self.action)


def history_from_status(status: Mapping | None) -> list[Remediation]:
    """status.recentRemediations as records, newest first."""
    entries = (status or {}).get("recentRemediations") or []
    records = [r for r in (Remediation.from_status(e) for e in entries) if r is not None]
    return sorted(records, key=lambda r: r.time, reverse=True)


def with_records(history: Sequence[Remediation], new: Iterable[Remediation],
                 limit: int = HISTORY_LIMIT) -> list[Remediation]:
    """History with `new` records added or updated (same key), newest first, bounded. When it is
    full, the actions of the last hour are kept before anything else: the budget is counted from
    them (so budgets above `limit` per hour act as `limit`)."""
    by_key = {r.key(): r for r in history}
    for r in new:
        by_key[r.key()] = r
    newest = sorted(by_key.values(), key=lambda r: r.time, reverse=True)
    if len(newest) <= limit:
        return newest
    latest = newest[0].time
    counted = [r for r in newest if _spends_budget(r, latest)][:limit]
    rest = [r for r in newest if r not in counted][:limit - len(counted)]
    return sorted(counted + rest, key=lambda r: r.time, reverse=True)


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_rfc3339(text: str) -> float:
    return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


# ---- what the policy sees of the fleet -------------------------------------------------------

@dataclass(frozen=True)
class ServerView:
    name: str
    role: str
    ready: bool
    terminating: bool = False
    created: float | None = None  # pod creationTimestamp (epoch); tells a replaced pod from the old one


# ---- what it decides ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    verdict: StallVerdict
    action: Action
    targets: tuple[str, ...]
    outcome: Verdict
    reason: str              # CamelCase: Act/DryRun → the action; Skip → why
    message: str
    level: int               # remediations of this server within the escalation window before this one
    source: str = "scrape"
    batch: int = 1           # rolling actions: targets restarted at once (each batch Ready before the next)

    @property
    def rolling(self) -> bool:
        return self.action in (Action.RESTART_PEERS, Action.RESTART_ROLE)

    def record(self, now: float) -> Remediation | None:
        """The history entry this decision adds (skips add none: they only emit Events)."""
        if self.outcome is Verdict.SKIP:
            return None
        if self.action is Action.HALT:
            outcome = Outcome.HALTED
        else:
            outcome = Outcome.DRY_RUN if self.outcome is Verdict.DRY_RUN else Outcome.PENDING
        sig = self.verdict.signature.value if self.verdict.signature else "hung"
        return Remediation(time=now, role=self.verdict.role, server=self.verdict.server, signature=sig,
                           action=self.action.value, outcome=outcome.value, message=self.message,
                           targets=self.targets)

    @property
    def event_reason(self) -> str:
        if self.outcome is Verdict.SKIP:
            return "RemediationSkipped" if self.reason != "BudgetExhausted" else "RemediationBudgetExhausted"
        if self.outcome is Verdict.DRY_RUN:
            return "RemediationDryRun"
        return {Action.RESTART_SERVER: "RestartingServer", Action.RESTART_PEERS: "RestartingPeers",
                Action.RESTART_ROLE: "RestartingRole", Action.HALT: "RemediationHalted"}[self.action]

    @property
    def quiet(self) -> bool:
        """Not worth an Event each time (it repeats on every scrape while a restart is underway)."""
        return self.outcome is Verdict.SKIP and self.reason == "InProgress"


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...] = ()
    mode: str = "Auto"
    budget: int = 0
    budget_used: int = 0
    halted: bool = False
    in_progress: Mapping[str, Remediation] = field(default_factory=dict)  # target pod -> record

    @property
    def budget_exhausted(self) -> bool:
        """No action may be taken this hour: the fleet is Degraded (RemediationBudgetExhausted)."""
        return self.mode == "Auto" and self.budget > 0 and self.budget_used >= self.budget

    @property
    def actions(self) -> list[Decision]:
        return [d for d in self.decisions if d.outcome is Verdict.ACT]


def decide(verdicts: Sequence[StallVerdict], history: Sequence[Remediation], spec: FleetSpec,
           servers: Sequence[ServerView], now: float, *, source: str | Mapping[str, str] = "scrape") -> Plan:
    """The decisions for the stalled servers among `verdicts` (see the module docstring). `source`
    says where each verdict came from ("scrape": the operator's own detection; or per server, e.g.
    the alert that asked for a re-check); it goes into the messages."""
    policy = spec.remediation
    if policy.mode == "Disabled":
        return Plan(mode="Disabled")
    by_name = {s.name: s for s in servers}
    in_progress = restarts_in_progress(history, servers, spec, now)
    used = budget_used(history, now)
    halted = any(r.action == Action.HALT.value and now - r.time < policy.escalation.window_seconds for r in history)
    budget = min(policy.budget_per_hour, HISTORY_LIMIT)  # counted from the history, which holds this many
    stalled = sorted((v for v in verdicts if v.stalled), key=lambda v: (v.role, v.server))
    stalled_names = {v.server for v in stalled}
    planned: list[Decision] = []
    planned_targets: dict[str, int] = {}  # role -> servers this pass will restart

    def role_of(name: str) -> str:
        return by_name[name].role if name in by_name else ""

    def wholly_stalled(role: str) -> bool:
        live = [s for s in servers if s.role == role and not s.terminating]
        return bool(live) and all(s.name in stalled_names for s in live)

    for v in stalled:
        origin = source.get(v.server, "scrape") if isinstance(source, Mapping) else source

        def skip(reason: str, message: str, action: Action = Action.RESTART_SERVER, targets=(v.server,), level=0):
            planned.append(Decision(v, action, tuple(targets), Verdict.SKIP, reason, message, level, origin))

        if halted:
            skip("Halted", f"{v.summary()}; remediation of this fleet is halted by escalation")
            continue
        if v.server in in_progress:
            skip("InProgress", f"{v.server} is being restarted ({in_progress[v.server].action} at "
                               f"{rfc3339(in_progress[v.server].time)})")
            continue
        last = next((r for r in history if v.server == r.server or v.server in r.targets), None)
        if last is not None and now - last.time < policy.cooldown_seconds:
            skip("Cooldown", f"{v.summary()}; {v.server} was remediated {now - last.time:.0f} s ago "
                             f"({last.action}, {last.outcome}), cooldown {policy.cooldown_seconds} s")
            continue
        level = sum(1 for r in history if r.server == v.server and r.action in RESTARTS
                    and r.outcome in (Outcome.PENDING.value, Outcome.SUCCEEDED.value)  # not Resolved
                    and now - r.time < policy.escalation.window_seconds)
        action, targets = _ladder(v, level, spec, servers)
        if action is not Action.HALT:
            busy = tuple(t for t in targets if t in in_progress)
            targets = tuple(t for t in targets if t not in in_progress)  # being restarted already
            if not targets:
                skip("InProgress", f"{', '.join(busy)} already being restarted", action, busy, level)
                continue
        evidence = f"{v.summary()}; evidence: {evidence_text(v.evidence)}"
        what = f"{action.value} {', '.join(targets)}" if targets else action.value
        if origin != "scrape":
            evidence = f"from {origin}: {evidence}"
        message = f"{what} (remediation {level + 1} of {v.server} within {policy.escalation.window_seconds} s): " \
                  f"{evidence}"
        if policy.mode == "DryRun" or policy.budget_per_hour == 0:
            planned.append(Decision(v, action, targets, Verdict.DRY_RUN, "DryRun", "would " + message, level, origin))
            continue
        if action is Action.HALT:
            planned.append(Decision(v, action, (), Verdict.ACT, "Halt", message, level, origin))
            halted = True
            continue
        taken = used + sum(1 for d in planned if d.outcome is Verdict.ACT)
        if taken >= budget:
            skip("BudgetExhausted", f"{v.summary()}; {taken} of {budget} remediations used in the "
                                    f"last hour", action, targets, level)
            continue
        overlap = sorted(set(targets) & {t for d in planned if d.outcome is Verdict.ACT for t in d.targets})
        if overlap:
            skip("InProgress", f"{', '.join(overlap)} restarted for another stalled server in this pass",
                 action, targets, level)
            continue
        rolling = action in (Action.RESTART_PEERS, Action.RESTART_ROLE)
        over = _over_concurrency(targets, role_of, in_progress, planned_targets, policy.max_concurrent_per_role,
                                 rolling)
        if over:
            skip("ConcurrencyLimit", f"{v.summary()}; {over}", action, targets, level)
            continue
        lonely, batch = _last_ready(targets, v, servers, in_progress, wholly_stalled, rolling,
                                    policy.max_concurrent_per_role)
        if lonely:
            skip("LastReadyServer", f"{v.summary()}; {lonely}", action, targets, level)
            continue
        if rolling:  # no more at once than the room the role has left
            role = role_of(targets[0])
            room = policy.max_concurrent_per_role - planned_targets.get(role, 0) - sum(
                1 for name in in_progress if role_of(name) == role)
            batch = max(1, min(batch, room))
        planned.append(Decision(v, action, targets, Verdict.ACT, action.value, message, level, origin, batch))
        for t in (targets[:batch] if rolling else targets):
            planned_targets[role_of(t)] = planned_targets.get(role_of(t), 0) + 1
    return Plan(decisions=tuple(planned), mode=policy.mode, budget=budget, budget_used=used,
                halted=halted, in_progress=in_progress)


def _ladder(v: StallVerdict, level: int, spec: FleetSpec, servers: Sequence[ServerView]) -> tuple[Action, tuple]:
    escalation = spec.remediation.escalation
    if level >= escalation.after_remediations:
        if escalation.action == "Halt":
            return Action.HALT, ()
        role = tuple(sorted(s.name for s in servers if s.role == v.role and not s.terminating))
        return Action.RESTART_ROLE, role or (v.server,)
    if level >= 1:
        peers = tuple(sorted(s.name for s in servers if s.role in PEER_ROLES.get(v.role, ()) and not s.terminating))
        if peers:
            return Action.RESTART_PEERS, peers
    return Action.RESTART_SERVER, (v.server,)


def _over_concurrency(targets, role_of, in_progress, planned_targets, limit: int, rolling: bool) -> str | None:
    roles: dict[str, int] = {}
    for t in targets:
        roles[role_of(t)] = roles.get(role_of(t), 0) + 1
    for role, n in roles.items():
        busy = sum(1 for name in in_progress if role_of(name) == role) + planned_targets.get(role, 0)
        wanted = 1 if rolling else n  # a rolling restart fits its batch to the room left
        if busy + wanted > limit:
            return f"{busy} {role} server(s) already under remediation, at most {limit} at once"
    return None


def _last_ready(targets, v: StallVerdict, servers, in_progress, wholly_stalled, rolling: bool,
                limit: int) -> tuple[str | None, int]:
    """(why the action would take a role's last Ready server, or None; the rolling batch size)."""
    by_role: dict[str, set[str]] = {}
    for s in servers:
        if s.name in targets:
            by_role.setdefault(s.role, set()).add(s.name)
    batch = limit
    for role, chosen in by_role.items():
        ready = [s.name for s in servers if s.role == role and s.ready and not s.terminating
                 and s.name not in in_progress]
        excused = wholly_stalled(role) or (role != v.role and wholly_stalled(v.role))
        if rolling:  # one batch at a time: at least one Ready server stays out of each batch
            if not excused:
                batch = min(batch, max(1, len(ready) - 1))
            if excused or len(ready) >= 2 or (ready and ready[0] not in chosen) or not ready:
                continue
        elif excused or any(name not in chosen for name in ready):
            continue
        return (f"restarting {', '.join(sorted(chosen))} would leave no Ready {role} server, and not every "
                f"{role} server is stalled"), batch
    return None, max(1, batch)


def budget_used(history: Sequence[Remediation], now: float) -> int:
    """Actions taken in the last hour (dry runs, recoveries and skips are free)."""
    return sum(1 for r in history if _spends_budget(r, now))


def _spends_budget(r: Remediation, now: float) -> bool:
    return (r.action in RESTARTS and now - r.time < BUDGET_PERIOD_SECONDS
            and r.outcome in (Outcome.PENDING.value, Outcome.SUCCEEDED.value, Outcome.RESOLVED.value,
                              Outcome.FAILED.value))


def restarts_in_progress(history: Sequence[Remediation], servers: Sequence[ServerView], spec: FleetSpec,
                         now: float) -> dict[str, Remediation]:
    """Target pod name -> the restart that has not finished: still Pending, or its pod not yet
    replaced by a Ready one. Bounded by the drain and startup timeouts so a server that never comes
    back does not block its role forever (the reconcile reports that one as Degraded)."""
    by_name = {s.name: s for s in servers}
    out: dict[str, Remediation] = {}
    for r in history:
        if r.action not in RESTARTS or r.outcome not in (Outcome.PENDING.value, Outcome.SUCCEEDED.value):
            continue
        for target in r.targets:
            if target in out:
                continue
            role = by_name[target].role if target in by_name else r.role
            startup = spec.role(role).probes.startup_timeout_seconds if role in ("context", "generation") else 600
            if now - r.time > spec.remediation.drain_timeout_seconds + startup + RESTART_SLACK_SECONDS:
                continue
            pod = by_name.get(target)
            if r.outcome == Outcome.PENDING.value or pod is None or pod.terminating or not pod.ready or \
                    (pod.created is not None and pod.created < int(r.time)):
                out[target] = r
    return out


def resolved(history: Sequence[Remediation], verdicts: Sequence[StallVerdict],
             servers: Sequence[ServerView]) -> list[Remediation]:
    """Succeeded restarts whose server has since made progress (a Progressing verdict from a pod
    created after the decision): they become Resolved, and no longer push the ladder up."""
    progressing = {v.server for v in verdicts if v.state.value == "Progressing"}
    pods = {s.name: s for s in servers}
    out = []
    for r in history:
        if r.outcome != Outcome.SUCCEEDED.value or r.action not in RESTARTS or r.server not in progressing:
            continue
        pod = pods.get(r.server)
        replaced_since = pod is not None and pod.created is not None and pod.created >= int(r.time)
        if replaced_since or r.action != Action.RESTART_SERVER.value:
            out.append(replace(r, outcome=Outcome.RESOLVED.value))
    return out


def still_to_delete(record: Remediation, pod_created: float | None) -> bool:
    """Whether the pod now named like a target of `record` is the one the record meant to delete
    (created before the decision), so carrying out a Pending record after an operator restart
    never deletes its replacement. creationTimestamp has whole seconds: a pod created in the
    decision's second cannot have been stalled for a window."""
    return pod_created is not None and pod_created < int(record.time)


# ---- conditions the remediation controller owns ------------------------------------------------

def stall_conditions(verdicts: Sequence[StallVerdict], plan: Plan, previous: Mapping[str, dict],
                     generation: int, now: str) -> list[dict]:
    """Stalled and Remediating, Kubernetes-style (lastTransitionTime moves only on a status change)."""
    from adpfleet.operator.decisions.conditions import condition

    stalled = [v for v in verdicts if v.stalled]
    if plan.mode == "Disabled":
        stalled_c = condition("Stalled", "Unknown", "DetectionDisabled", "remediation.mode is Disabled",
                              generation, previous, now)
    elif stalled:
        signatures = sorted({v.signature.value for v in stalled if v.signature})
        # stable while the stall lasts (no counters, no durations): the status is not rewritten every scrape
        stalled_c = condition("Stalled", True, "NoProgress",
                              "; ".join(_stall_line(v) for v in stalled[:5]) + (
                                  f" (+{len(stalled) - 5} more)" if len(stalled) > 5 else "")
                              + (f" [{','.join(signatures)}]" if signatures else ""), generation, previous, now)
    else:
        stalled_c = condition("Stalled", False, "NoStallDetected", "no server has had work without progress for "
                              "a stall window", generation, previous, now)
    acting = plan.actions
    if plan.in_progress or acting:
        names = sorted(set(plan.in_progress) | {t for d in acting for t in d.targets})
        remediating = condition("Remediating", True, "Restarting", "restarting " + ", ".join(names),
                                generation, previous, now)
    elif plan.halted:
        remediating = condition("Remediating", False, "Halted", "remediation halted by escalation; see Degraded",
                                generation, previous, now)
    elif plan.budget_exhausted:
        remediating = condition("Remediating", False, "RemediationBudgetExhausted",
                                f"{plan.budget_used} of {plan.budget} remediations used in the last hour",
                                generation, previous, now)
    else:
        remediating = condition("Remediating", False, "Idle", "no remediation underway", generation, previous, now)
    return [stalled_c, remediating]


def _stall_line(v: StallVerdict) -> str:
    ranks = f", ranks {','.join(map(str, v.ranks))}" if v.ranks else ""
    return f"{v.server} ({v.role}) has work but produces no tokens ({v.signature.value if v.signature else '?'}{ranks})"


def degraded_problem(plan: Plan) -> tuple[str, str] | None:
    """(reason, message) for the Degraded condition, or None."""
    if plan.halted:
        return "RemediationHalted", "a server kept stalling after escalation; remediation is halted (see " \
                                    "recentRemediations and docs/remediation.md)"
    if plan.budget_exhausted:
        return "RemediationBudgetExhausted", f"{plan.budget_used} of {plan.budget} remediations used in the last " \
                                             f"hour; stalls are reported as Events only"
    return None


def replaced(record: Remediation, outcome: Outcome, message: str | None = None) -> Remediation:
    return replace(record, outcome=outcome.value, message=(message or record.message)[:1024])
