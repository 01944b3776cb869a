"""Remediation policy: `plan = decide(verdicts, history, spec, servers, now)`, pure.

Inputs are what the operator observed (stall verdicts from `detection.py`, the fleet's server pods)
and what it did (`status.recentRemediations`, newest first, read by `history.py`). Because the history lives in the
fleet's status, a restarted operator decides exactly as the one before it: an action already
recorded is never repeated (cooldown, in-progress and budget all read the history).

For every **stalled** server, in order (the first rule that applies wins):

1. mode `Disabled`: nothing is decided at all.
2. `Halted`: an escalation `Halt` was recorded within `escalation.windowSeconds` → skip.
3. `InProgress`: the server is the target of a restart that has not finished (the record is
   `Pending`, or its pod is not yet replaced and Ready) → skip, quietly.
4. `Cooldown`: the server was the subject or target of a remediation within `cooldownSeconds`
   (a `DryRun` record counts only for the next dry run: it is not a remediation).
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
   before the next, so they obey rules 8 and 9 at every step. Neither targets a server that is
   not Ready because it is still fetching its model or cannot have it (`waiting_for_model`).
6. mode `DryRun` (or `budgetPerHour: 0`) → record what would have been done, do nothing (once per
   cooldown; the skips in between are quiet).
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

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from adpfleet.operator.decisions.detection import StallVerdict, evidence_text
from adpfleet.operator.decisions.history import (Remediation, budget_used, restarts_in_progress, rfc3339)
from adpfleet.operator.decisions.observed import ServerView
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.status import HISTORY_LIMIT
from adpfleet.operator.resource.vocabulary import Action, Choice, Outcome, RemediationMode, SkipReason

PEER_ROLES = {"context": ("generation",), "generation": ("context",)}  # whom a server's progress waits on


@dataclass(frozen=True)
class Decision:
    verdict: StallVerdict
    action: Action
    targets: tuple[str, ...]
    choice: Choice
    reason: str              # CamelCase: Act → the action; DryRun; Skip → the SkipReason
    message: str
    level: int               # remediations of this server within the escalation window before this one
    source: str = "scrape"
    batch: int = 1           # rolling actions: targets restarted at once (each batch Ready before the next)
    quiet: bool = False      # a skip not worth an Event: it repeats every scrape (a restart underway, a
                             # dry run already reported)

    @property
    def rolling(self) -> bool:
        return self.action.rolling

    def record(self, now: float) -> Remediation | None:
        """The history entry this decision adds (skips add none: they only emit Events)."""
        if self.choice is Choice.SKIP:
            return None
        if self.action is Action.HALT:
            outcome = Outcome.HALTED
        else:
            outcome = Outcome.DRY_RUN if self.choice is Choice.DRY_RUN else Outcome.PENDING
        return Remediation(time=now, role=self.verdict.role, server=self.verdict.server,
                           signature=self.verdict.signature, action=self.action, outcome=outcome,
                           message=self.message, targets=self.targets)

    @property
    def event_reason(self) -> str:
        if self.choice is Choice.SKIP:
            return "RemediationBudgetExhausted" if self.reason == SkipReason.BUDGET_EXHAUSTED else \
                "RemediationSkipped"
        if self.choice is Choice.DRY_RUN:
            return "RemediationDryRun"
        return self.action.event_reason


@dataclass(frozen=True)
class Plan:
    decisions: tuple[Decision, ...] = ()
    mode: RemediationMode = RemediationMode.AUTO
    budget: int = 0
    budget_used: int = 0
    halted: bool = False
    in_progress: Mapping[str, Remediation] = field(default_factory=dict)  # target pod -> record

    @property
    def budget_exhausted(self) -> bool:
        """No action may be taken this hour: the fleet is Degraded (RemediationBudgetExhausted)."""
        return self.mode is RemediationMode.AUTO and self.budget > 0 and self.budget_used >= self.budget

    @property
    def actions(self) -> list[Decision]:
        return [d for d in self.decisions if d.choice is Choice.ACT]


def decide(verdicts: Sequence[StallVerdict], history: Sequence[Remediation], spec: FleetSpec,
           servers: Sequence[ServerView], now: float, *, source: str | Mapping[str, str] = "scrape") -> Plan:
    """The decisions for the stalled servers among `verdicts` (see the module docstring). `source`
    says where each verdict came from ("scrape": the operator's own detection; or per server, e.g.
    the alert that asked for a re-check); it goes into the messages."""
    policy = spec.remediation
    if policy.mode is RemediationMode.DISABLED:
        return Plan(mode=RemediationMode.DISABLED)
    by_name = {s.name: s for s in servers}
    in_progress = restarts_in_progress(history, servers, spec, now)
    used = budget_used(history, now)
    halted = any(r.action is Action.HALT and r.outcome is Outcome.HALTED
                 and now - r.time < policy.escalation.window_seconds for r in history)
    dry_run = policy.mode is RemediationMode.DRY_RUN or policy.budget_per_hour == 0
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

        def skip(reason: SkipReason, message: str, action: Action = Action.RESTART_SERVER, targets=(v.server,), level=0,
                 quiet: bool = False):
            planned.append(Decision(v, action, tuple(targets), Choice.SKIP, reason.value, message, level, origin,
                                    quiet=quiet or reason is SkipReason.IN_PROGRESS))

        if halted:
            skip(SkipReason.HALTED, f"{v.summary()}; remediation of this fleet is halted by escalation")
            continue
        if v.server in in_progress:
            skip(SkipReason.IN_PROGRESS, f"{v.server} is being restarted ({in_progress[v.server].action} at "
                               f"{rfc3339(in_progress[v.server].time)})")
            continue
        # A dry run is not a remediation: it cools down only the next dry run (reported once per
        # cooldown, quietly in between), never an action once the mode is Auto.
        last = next((r for r in history if (v.server == r.server or v.server in r.targets)
                     and (dry_run or r.outcome is not Outcome.DRY_RUN)), None)
        if last is not None and now - last.time < policy.cooldown_seconds:
            skip(SkipReason.COOLDOWN, f"{v.summary()}; {v.server} was remediated {now - last.time:.0f} s ago "
                             f"({last.action.value}, {last.outcome.value}), cooldown {policy.cooldown_seconds} s",
                 quiet=last.outcome is Outcome.DRY_RUN)
            continue
        level = sum(1 for r in history if r.server == v.server and r.action.restarts and r.outcome.unresolved
                    and now - r.time < policy.escalation.window_seconds)
        action, targets = _ladder(v, level, spec, servers)
        if action is not Action.HALT:
            busy = tuple(t for t in targets if t in in_progress)
            targets = tuple(t for t in targets if t not in in_progress)  # being restarted already
            if not targets:
                skip(SkipReason.IN_PROGRESS, f"{', '.join(busy)} already being restarted", action, busy, level)
                continue
        evidence = f"{v.summary()}; evidence: {evidence_text(v.evidence)}"
        what = f"{action.value} {', '.join(targets)}" if targets else action.value
        if origin != "scrape":
            evidence = f"from {origin}: {evidence}"
        message = f"{what} (remediation {level + 1} of {v.server} within {policy.escalation.window_seconds} s): " \
                  f"{evidence}"
        if dry_run:
            planned.append(Decision(v, action, targets, Choice.DRY_RUN, Choice.DRY_RUN.value, "would " + message, level, origin))
            continue
        if action is Action.HALT:
            planned.append(Decision(v, action, (), Choice.ACT, action.value, message, level, origin))
            halted = True
            continue
        taken = used + sum(1 for d in planned if d.choice is Choice.ACT)
        if taken >= budget:
            skip(SkipReason.BUDGET_EXHAUSTED, f"{v.summary()}; {taken} of {budget} remediations used in the "
                                    f"last hour", action, targets, level)
            continue
        overlap = sorted(set(targets) & {t for d in planned if d.choice is Choice.ACT for t in d.targets})
        if overlap:
            skip(SkipReason.IN_PROGRESS, f"{', '.join(overlap)} restarted for another stalled server in this pass",
                 action, targets, level)
            continue
        rolling = action.rolling
        over = _over_concurrency(targets, role_of, in_progress, planned_targets, policy.max_concurrent_per_role,
                                 rolling)
        if over:
            skip(SkipReason.CONCURRENCY_LIMIT, f"{v.summary()}; {over}", action, targets, level)
            continue
        lonely, batch = _last_ready(targets, v, servers, in_progress, wholly_stalled, rolling,
                                    policy.max_concurrent_per_role)
        if lonely:
            skip(SkipReason.LAST_READY_SERVER, f"{v.summary()}; {lonely}", action, targets, level)
            continue
        if rolling:  # no more at once than the room the role has left
            role = role_of(targets[0])
            room = policy.max_concurrent_per_role - planned_targets.get(role, 0) - sum(
                1 for name in in_progress if role_of(name) == role)
            batch = max(1, min(batch, room))
        planned.append(Decision(v, action, targets, Choice.ACT, action.value, message, level, origin, batch))
        for t in (targets[:batch] if rolling else targets):
            planned_targets[role_of(t)] = planned_targets.get(role_of(t), 0) + 1
    return Plan(decisions=tuple(planned), mode=policy.mode, budget=budget, budget_used=used,
                halted=halted, in_progress=in_progress)


def _ladder(v: StallVerdict, level: int, spec: FleetSpec, servers: Sequence[ServerView]) -> tuple[Action, tuple]:
    escalation = spec.remediation.escalation
    # A server still fetching its model, or one that cannot have it, never got to stall anything:
    # restarting it would only throw its download away.
    restartable = [s for s in servers if not s.terminating and not s.waiting_for_model]
    if level >= escalation.after_remediations:
        if escalation.action is Action.HALT:
            return Action.HALT, ()
        role = tuple(sorted(s.name for s in restartable if s.role == v.role))
        return Action.RESTART_ROLE, role or (v.server,)
    if level >= 1:
        peers = tuple(sorted(s.name for s in restartable if s.role in PEER_ROLES.get(v.role, ())))
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


