"""Remediation's part of a fleet's status: the Stalled and Remediating conditions, its Degraded
reasons and `recentRemediations`, laid over the status the reconcile pass computed (`overlay`).

Pure, like `conditions.py` beside it: a pass that changes nothing produces the same status, so a
stall that lasts does not rewrite the status on every scrape (no counters or durations in the
messages), and Stalled follows stall *episodes* (`follow_stalls`), not each scrape's verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from adpfleet.operator.decisions.conditions import condition
from adpfleet.operator.decisions.detection import StallVerdict
from adpfleet.operator.decisions.history import Remediation
from adpfleet.operator.decisions.observed import ServerPod
from adpfleet.operator.decisions.remediation import Plan
from adpfleet.operator.resource.vocabulary import STALL_CONDITIONS, ConditionType, Reason, RemediationMode, ServerState

STALLED_LISTED = 5  # stalled servers named in the Stalled condition's message; the rest are counted
NO_STALL = "no server has had work without progress for a stall window"


@dataclass(frozen=True)
class Episode:
    """One server's stall, from its first confirmed verdict until the server shows progress or
    idles, restarts, or its pod goes: not ended by a failed scrape or a verdict not yet confirmed
    again, so the Stalled condition changes only when the server's state does."""
    uid: str
    verdict: StallVerdict  # the latest stalled verdict


def follow_stalls(episodes: Mapping[str, Episode], verdicts: Sequence[StallVerdict],
                  pods: Sequence[ServerPod]) -> tuple[dict[str, Episode], list[StallVerdict], list[str]]:
    """(the episodes now, the verdicts that began one, why each episode that ended did)."""
    by_pod = {p.name: p for p in pods}
    by_server: dict[str, list[StallVerdict]] = {}
    for v in verdicts:
        by_server.setdefault(v.server, []).append(v)
    out, began, ended = {}, [], []
    for server, episode in episodes.items():
        pod = by_pod.get(server)
        states = {v.state for v in by_server.get(server, ())}
        why = None
        if pod is None or pod.uid != episode.uid or pod.terminating:
            why = f"{server} was deleted"
        elif ServerState.STALLED in states:
            pass
        elif ServerState.PROGRESSING in states:
            why = f"{server} made progress"
        elif ServerState.IDLE in states:
            why = f"{server} has no work left"
        elif ServerState.WARMING_UP in states:
            why = f"{server} restarted"
        if why:
            ended.append(why)
        else:
            out[server] = episode
    for v in verdicts:
        pod = by_pod.get(v.server)
        if not v.stalled or pod is None:
            continue
        if v.server not in out:
            began.append(v)
        out[v.server] = Episode(pod.uid, v)
    return out, began, ended


def stall_conditions(verdicts: Sequence[StallVerdict], plan: Plan, previous: Mapping[str, dict],
                     generation: int, now: str, *, ended: str | None = None, settling: bool = False) -> list[dict]:
    """Stalled and Remediating, Kubernetes-style (lastTransitionTime moves only on a status change).
    `verdicts`: the ongoing stall episodes' verdicts; `ended`: why the last episode ended (the
    message of a Stalled condition turning False); `settling`: the controller has not judged a
    whole window yet (just started), so a stored Stalled=True stands until it has."""
    stalled = [v for v in verdicts if v.stalled]
    before = previous.get(ConditionType.STALLED) or {}
    if plan.mode is RemediationMode.DISABLED:
        stalled_c = condition(ConditionType.STALLED, "Unknown", "DetectionDisabled", "remediation.mode is Disabled",
                              generation, previous, now)
    elif stalled:
        signatures = sorted({v.signature.value for v in stalled})
        more = f" (+{len(stalled) - STALLED_LISTED} more)" if len(stalled) > STALLED_LISTED else ""
        stalled_c = condition(ConditionType.STALLED, True, "NoProgress",
                              "; ".join(_stall_line(v) for v in stalled[:STALLED_LISTED]) + more
                              + f" [{','.join(signatures)}]", generation, previous, now)
    elif settling and before.get("status") == "True":
        stalled_c = {**before, "observedGeneration": generation}
    else:
        if ended and before.get("status") == "True":
            message = f"the stall ended: {ended}"
        elif before.get("status") == "False" and before.get("reason") == "NoStallDetected":
            message = before.get("message") or NO_STALL  # said when it turned False; kept until the next stall
        else:
            message = NO_STALL
        stalled_c = condition(ConditionType.STALLED, False, "NoStallDetected", message, generation, previous, now)
    acting = plan.actions
    if plan.in_progress or acting:
        names = sorted(set(plan.in_progress) | {t for d in acting for t in d.targets})
        remediating = condition(ConditionType.REMEDIATING, True, "Restarting", "restarting " + ", ".join(names),
                                generation, previous, now)
    elif plan.halted:
        remediating = condition(ConditionType.REMEDIATING, False, "Halted", "remediation halted by escalation; see Degraded",
                                generation, previous, now)
    elif plan.budget_exhausted:
        remediating = condition(ConditionType.REMEDIATING, False, Reason.BUDGET_EXHAUSTED,
                                f"{plan.budget_used} of {plan.budget} remediations used in the last hour",
                                generation, previous, now)
    else:
        remediating = condition(ConditionType.REMEDIATING, False, "Idle", "no remediation underway", generation, previous, now)
    return [stalled_c, remediating]


def _stall_line(v: StallVerdict) -> str:
    ranks = f", {v.ranks_text()}" if v.ranks else ""
    return f"{v.server} ({v.role}) has work but produces no tokens ({v.signature.value}{ranks})"


def degraded_problem(plan: Plan) -> tuple[str, str] | None:
    """(reason, message) for the Degraded condition, or None."""
    if plan.halted:
        return Reason.REMEDIATION_HALTED, "a server kept stalling after escalation; remediation is halted (see " \
                                    "recentRemediations and docs/remediation.md)"
    if plan.budget_exhausted:
        return Reason.BUDGET_EXHAUSTED, f"{plan.budget_used} of {plan.budget} remediations used in the last " \
                                             f"hour; stalls are reported as Events only"
    return None


def overlay(status: dict, stored: Mapping | None, verdicts: Sequence[StallVerdict], plan: Plan,
            history: Sequence[Remediation], now: str, *, generation: int, ended: str | None = None,
            settling: bool = False) -> dict:
    """`status` (computed by the reconcile pass) with remediation's part laid over it. `stored` is
    the status in the API server (transition times carry over from it); `generation` stands in
    when `status` names none. The reconcile's own Degraded problems win over remediation's."""
    previous = {c.get("type"): c for c in (stored or {}).get("conditions") or []}
    generation = status.get("observedGeneration", generation) or 0
    mine = stall_conditions(verdicts, plan, previous, generation, now, ended=ended, settling=settling)
    conditions = [c for c in status.get("conditions") or [] if c.get("type") not in STALL_CONDITIONS]
    problem = degraded_problem(plan)
    if problem:
        for i, c in enumerate(conditions):
            if c.get("type") == ConditionType.DEGRADED and c.get("status") != "True":
                conditions[i] = condition(ConditionType.DEGRADED, True, problem[0], problem[1], generation, previous, now)
    out = {**status, "conditions": conditions + mine}
    if history:
        out["recentRemediations"] = [r.to_status() for r in history]
    else:
        out.pop("recentRemediations", None)
    return out
