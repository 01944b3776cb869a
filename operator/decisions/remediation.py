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
from adpfleet.operator.resource.vocabulary import Action, Choice, Outcome, Reason, RemediationMode, SkipReason

PEER_ROLES = {"context": ("generation",), "generation": ("context",)}  # whom a server's progress waits on
Hold = tuple[SkipReason, str]  # a rule that holds an action back: why, and the message


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
            return Reason.BUDGET_EXHAUSTED if self.reason == SkipReason.BUDGET_EXHAUSTED else \
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
    if spec.remediation.mode is RemediationMode.DISABLED:  # rule 1
        return Plan(mode=RemediationMode.DISABLED)
    stalled = sorted((v for v in verdicts if v.stalled), key=lambda v: (v.role, v.server))
    rules = _Rules(spec, history, servers, now, frozenset(v.server for v in stalled))
    for v in stalled:
        rules.add(rules.decision(v, source.get(v.server, "scrape") if isinstance(source, Mapping) else source))
    return rules.plan()


class _Rules:
    """The rules applied to one fleet's stalled servers in turn: what they read of the fleet and its
    history, and what this pass has planned so far (later servers see the earlier ones' actions)."""

    def __init__(self, spec: FleetSpec, history: Sequence[Remediation], servers: Sequence[ServerView], now: float,
                 stalled: frozenset[str]):
        self.spec, self.policy, self.history, self.servers, self.now = spec, spec.remediation, history, servers, now
        self.stalled = stalled
        self.by_name = {s.name: s for s in servers}
        self.in_progress = restarts_in_progress(history, servers, spec, now)
        self.used = budget_used(history, now)
        self.halted = any(r.action is Action.HALT and r.outcome is Outcome.HALTED
                          and now - r.time < self.policy.escalation.window_seconds for r in history)
        self.dry_run = self.policy.mode is RemediationMode.DRY_RUN or self.policy.budget_per_hour == 0
        self.budget = min(self.policy.budget_per_hour, HISTORY_LIMIT)  # counted from the history, which holds this many
        self.planned: list[Decision] = []
        self.planned_targets: dict[str, int] = {}  # role -> servers this pass will restart

    def decision(self, v: StallVerdict, origin: str) -> Decision:
        """The first rule that applies to `v`'s stall (the numbers are the module docstring's)."""
        held = self._held(v)  # 2-4
        if held:
            return self._skip(v, origin, *held)
        level = sum(1 for r in self.history if r.server == v.server and r.action.restarts and r.outcome.unresolved
                    and self.now - r.time < self.policy.escalation.window_seconds)
        action, targets = _ladder(v, level, self.spec, self.servers)  # 5
        if action is not Action.HALT:
            busy = tuple(t for t in targets if t in self.in_progress)
            targets = tuple(t for t in targets if t not in self.in_progress)  # being restarted already
            if not targets:
                return self._skip(v, origin, SkipReason.IN_PROGRESS, f"{', '.join(busy)} already being restarted",
                                  action=action, targets=busy, level=level)
        message = self._message(v, origin, action, targets, level)
        if self.dry_run:  # 6
            return Decision(v, action, targets, Choice.DRY_RUN, Choice.DRY_RUN.value, "would " + message, level,
                            origin)
        if action is Action.HALT:
            self.halted = True
            return Decision(v, action, (), Choice.ACT, action.value, message, level, origin)
        limit, batch = self._limit(v, action, targets)  # 7-9
        if limit:
            return self._skip(v, origin, *limit, action=action, targets=targets, level=level)
        return Decision(v, action, targets, Choice.ACT, action.value, message, level, origin, batch)  # 10

    def add(self, d: Decision) -> None:
        self.planned.append(d)
        if d.choice is Choice.ACT:
            for t in (d.targets[:d.batch] if d.rolling else d.targets):
                self.planned_targets[self.role_of(t)] = self.planned_targets.get(self.role_of(t), 0) + 1

    def plan(self) -> Plan:
        return Plan(decisions=tuple(self.planned), mode=self.policy.mode, budget=self.budget, budget_used=self.used,
                    halted=self.halted, in_progress=self.in_progress)

    def _held(self, v: StallVerdict) -> tuple[SkipReason, str, bool] | None:
        """Rules 2-4, which hold whatever the action would be: (why, message, quiet)."""
        if self.halted:
            return SkipReason.HALTED, f"{v.summary()}; remediation of this fleet is halted by escalation", False
        if v.server in self.in_progress:
            return SkipReason.IN_PROGRESS, f"{v.server} is being restarted ({self.in_progress[v.server].action} at " \
                                           f"{rfc3339(self.in_progress[v.server].time)})", False
        # A dry run is not a remediation: it cools down only the next dry run (reported once per
        # cooldown, quietly in between), never an action once the mode is Auto.
        last = next((r for r in self.history if (v.server == r.server or v.server in r.targets)
                     and (self.dry_run or r.outcome is not Outcome.DRY_RUN)), None)
        if last is not None and self.now - last.time < self.policy.cooldown_seconds:
            return SkipReason.COOLDOWN, f"{v.summary()}; {v.server} was remediated {self.now - last.time:.0f} s ago " \
                f"({last.action.value}, {last.outcome.value}), cooldown {self.policy.cooldown_seconds} s", \
                last.outcome is Outcome.DRY_RUN
        return None

    def _limit(self, v: StallVerdict, action: Action, targets: tuple[str, ...]) -> tuple[Hold | None, int]:
        """Rules 7-9, and a target another stall restarts in this pass: (what holds the action, or
        None; how many targets a rolling action restarts at once)."""
        limit = self.policy.max_concurrent_per_role
        taken = self.used + sum(1 for d in self.planned if d.choice is Choice.ACT)
        if taken >= self.budget:
            return (SkipReason.BUDGET_EXHAUSTED, f"{v.summary()}; {taken} of {self.budget} remediations used in the "
                                                 f"last hour"), 1
        overlap = sorted(set(targets) & {t for d in self.planned if d.choice is Choice.ACT for t in d.targets})
        if overlap:
            return (SkipReason.IN_PROGRESS, f"{', '.join(overlap)} restarted for another stalled server in this "
                                            f"pass"), 1
        over = _over_concurrency(targets, self.role_of, self.in_progress, self.planned_targets, limit, action.rolling)
        if over:
            return (SkipReason.CONCURRENCY_LIMIT, f"{v.summary()}; {over}"), 1
        lonely, batch = _last_ready(targets, v, self.servers, self.in_progress, self.wholly_stalled, action.rolling,
                                    limit)
        if lonely:
            return (SkipReason.LAST_READY_SERVER, f"{v.summary()}; {lonely}"), 1
        if action.rolling:  # no more at once than the room the role has left
            role = self.role_of(targets[0])
            room = limit - self.planned_targets.get(role, 0) - sum(
                1 for name in self.in_progress if self.role_of(name) == role)
            batch = max(1, min(batch, room))
        return None, batch

    def _message(self, v: StallVerdict, origin: str, action: Action, targets: tuple[str, ...], level: int) -> str:
        evidence = f"{v.summary()}; evidence: {evidence_text(v.evidence)}"
        what = f"{action.value} {', '.join(targets)}" if targets else action.value
        if origin != "scrape":
            evidence = f"from {origin}: {evidence}"
        return f"{what} (remediation {level + 1} of {v.server} within {self.policy.escalation.window_seconds} s): " \
               f"{evidence}"

    def _skip(self, v: StallVerdict, origin: str, reason: SkipReason, message: str, quiet: bool = False, *,
              action: Action = Action.RESTART_SERVER, targets: tuple[str, ...] | None = None,
              level: int = 0) -> Decision:
        return Decision(v, action, tuple(targets) if targets is not None else (v.server,), Choice.SKIP, reason.value,
                        message, level, origin, quiet=quiet or reason is SkipReason.IN_PROGRESS)

    def role_of(self, name: str) -> str:
        return self.by_name[name].role if name in self.by_name else ""

    def wholly_stalled(self, role: str) -> bool:
        live = [s for s in self.servers if s.role == role and not s.terminating]
        return bool(live) and all(s.name in self.stalled for s in live)


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


