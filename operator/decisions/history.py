"""What remediation did: the records of `status.recentRemediations`, and what they say now.

The history lives in the fleet's status, newest first, so a restarted operator reads exactly what
the one before it did: which restarts are still in progress (and must not be repeated), how much
of the hour's budget is spent, which `Pending` actions to finish and which pods those actions
still mean. Every function here is pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Iterable, Mapping, Sequence

from adpfleet.operator.decisions.detection import StallVerdict
from adpfleet.operator.decisions.observed import ServerView
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.status import HISTORY_LIMIT, RECORD_MESSAGE_LIMIT
from adpfleet.operator.resource.vocabulary import Action, Outcome, ServerState, Signature

BUDGET_PERIOD_SECONDS = 3600.0  # budgetPerHour counts the actions of this last stretch
RESTART_SLACK_SECONDS = 60.0    # beyond drain + startup timeouts before a restart is no longer "in progress"


@dataclass(frozen=True)
class Remediation:
    """One entry of status.recentRemediations."""
    time: float                 # epoch seconds of the decision
    role: str
    server: str                 # the stalled server (the subject)
    signature: Signature
    action: Action
    outcome: Outcome
    message: str = ""
    targets: tuple[str, ...] = ()  # the pods restarted (== (server,) for RestartServer)

    def to_status(self) -> dict:
        out = {"time": rfc3339(self.time), "role": self.role, "server": self.server,
               "signature": self.signature.value, "action": self.action.value, "outcome": self.outcome.value,
               "message": self.message[:RECORD_MESSAGE_LIMIT]}
        if self.targets:
            out["targets"] = list(self.targets)
        return out

    @classmethod
    def from_status(cls, entry: Mapping) -> "Remediation | None":
        """A record from status; None for one that cannot be read (it is then ignored, never fatal)."""
        try:
            server = str(entry["server"])
            action = Action(entry["action"])
            targets = tuple(entry.get("targets") or ())
            if not targets and action is Action.RESTART_SERVER:
                targets = (server,)
            return cls(time=parse_rfc3339(entry["time"]), role=str(entry["role"]), server=server,
                       signature=Signature(entry["signature"]), action=action, outcome=Outcome(entry["outcome"]),
                       message=str(entry.get("message", "")), targets=targets)
        except (KeyError, TypeError, ValueError):
            return None

    def key(self) -> tuple:
        return (round(self.time, 3), self.server, self.action)

    def ended(self, outcome: Outcome, message: str) -> "Remediation":
        """The same record with its result."""
        return replace(self, outcome=outcome, message=message)


def history_from_status(status: Mapping | None) -> list[Remediation]:
    """status.recentRemediations as records, newest first."""
    entries = (status or {}).get("recentRemediations") or []
    records = [r for r in (Remediation.from_status(e) for e in entries) if r is not None]
    return sorted(records, key=lambda r: r.time, reverse=True)


def with_records(history: Sequence[Remediation], new: Iterable[Remediation],
                 limit: int = HISTORY_LIMIT) -> list[Remediation]:
    """History with `new` records added or updated (same key), newest first, bounded. When it is
    full, the actions of the last budget period are kept before anything else: the budget is
    counted from them (so budgets above `limit` per hour act as `limit`)."""
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


# ---- what the records say now -----------------------------------------------------------------

def budget_used(history: Sequence[Remediation], now: float) -> int:
    """Actions taken in the last budget period (dry runs, recoveries and skips are free)."""
    return sum(1 for r in history if _spends_budget(r, now))


def _spends_budget(r: Remediation, now: float) -> bool:
    return r.action.restarts and now - r.time < BUDGET_PERIOD_SECONDS and r.outcome.spends_budget


def restart_deadline(record: Remediation, spec: FleetSpec, role: str | None = None) -> float:
    """When a restart that has not brought its pod back Ready stops counting as in progress: the
    drain, the server's startup timeout (of `role`; the longest of the roles when it is not one of
    them) and a slack. After it, a server that never came back no longer blocks its role (the
    reconcile reports it as Degraded), and a Pending record is too old to finish."""
    startups = {r: spec.role(r).probes.startup_timeout_seconds for r in spec.roles()}
    startup = startups.get(role, max(startups.values()))
    return record.time + spec.remediation.drain_timeout_seconds + startup + RESTART_SLACK_SECONDS


def restarts_in_progress(history: Sequence[Remediation], servers: Sequence[ServerView], spec: FleetSpec,
                         now: float) -> dict[str, Remediation]:
    """Target pod name -> the restart that has not finished: still Pending, or its pod not yet
    replaced by a Ready one, until `restart_deadline`."""
    by_name = {s.name: s for s in servers}
    out: dict[str, Remediation] = {}
    for r in history:
        if not r.action.restarts or not r.outcome.unresolved:
            continue
        for target in r.targets:
            if target in out:
                continue
            pod = by_name.get(target)
            if now > restart_deadline(r, spec, pod.role if pod else r.role):
                continue
            if r.outcome is Outcome.PENDING or pod is None or pod.terminating or not pod.ready or \
                    (pod.created is not None and pod.created < int(r.time)):
                out[target] = r
    return out


def resolved(history: Sequence[Remediation], verdicts: Sequence[StallVerdict],
             servers: Sequence[ServerView]) -> list[Remediation]:
    """Succeeded restarts whose server has since made progress (a Progressing verdict from a pod
    created after the decision): they become Resolved, and no longer push the ladder up."""
    progressing = {v.server for v in verdicts if v.state is ServerState.PROGRESSING}
    pods = {s.name: s for s in servers}
    out = []
    for r in history:
        if r.outcome is not Outcome.SUCCEEDED or not r.action.restarts or r.server not in progressing:
            continue
        pod = pods.get(r.server)
        replaced_since = pod is not None and pod.created is not None and pod.created >= int(r.time)
        if replaced_since or r.action is not Action.RESTART_SERVER:
            out.append(r.ended(Outcome.RESOLVED, r.message))
    return out


def still_to_delete(record: Remediation, pod_created: float | None) -> bool:
    """Whether the pod now named like a target of `record` is the one the record meant to delete
    (created before the decision), so carrying out a Pending record after an operator restart
    never deletes its replacement. creationTimestamp has whole seconds: a pod created in the
    decision's second cannot have been stalled for a window."""
    return pod_created is not None and pod_created < int(record.time)


def pending(history: Sequence[Remediation], spec: FleetSpec, now: float) -> tuple[list[Remediation], list[Remediation]]:
    """The Pending records a (re)started operator finds: (to finish, too old to finish — past
    `restart_deadline`, they end Failed)."""
    waiting = [r for r in history if r.outcome is Outcome.PENDING]
    return ([r for r in waiting if now <= restart_deadline(r, spec)],
            [r for r in waiting if now > restart_deadline(r, spec)])


def left_drained(history: Sequence[Remediation], servers: Sequence[ServerView], now: float) -> list[str]:
    """Drained servers an action left drained although it ended Recovered (the operator died
    between the two): the drain annotation comes off. Looks as far back as the history reliably
    reaches (it keeps the last budget period's actions)."""
    recent = [r for r in history if r.outcome is Outcome.RECOVERED and now - r.time < BUDGET_PERIOD_SECONDS]
    return [s.name for s in servers if s.draining and not s.terminating and any(
        s.name in r.targets and still_to_delete(r, s.created) for r in recent)]
