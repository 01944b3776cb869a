"""Remediation's part of a fleet's status: the Stalled and Remediating conditions, its Degraded
reasons and `recentRemediations`, laid over the status the reconcile pass computed (`overlay`).

Pure, like `conditions.py` beside it: a pass that changes nothing produces the same status, so a
stall that lasts does not rewrite the status on every scrape (no counters or durations in the
messages).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from adpfleet.operator.decisions.conditions import condition
from adpfleet.operator.decisions.detection import StallVerdict
from adpfleet.operator.decisions.history import Remediation
from adpfleet.operator.decisions.remediation import Plan
from adpfleet.operator.resource.vocabulary import RemediationMode

OWNED_CONDITIONS = ("Stalled", "Remediating")
STALLED_LISTED = 5  # stalled servers named in the Stalled condition's message; the rest are counted


def stall_conditions(verdicts: Sequence[StallVerdict], plan: Plan, previous: Mapping[str, dict],
                     generation: int, now: str) -> list[dict]:
    """Stalled and Remediating, Kubernetes-style (lastTransitionTime moves only on a status change)."""
    stalled = [v for v in verdicts if v.stalled]
    if plan.mode is RemediationMode.DISABLED:
        stalled_c = condition("Stalled", "Unknown", "DetectionDisabled", "remediation.mode is Disabled",
                              generation, previous, now)
    elif stalled:
        signatures = sorted({v.signature.value for v in stalled})
        more = f" (+{len(stalled) - STALLED_LISTED} more)" if len(stalled) > STALLED_LISTED else ""
        stalled_c = condition("Stalled", True, "NoProgress",
                              "; ".join(_stall_line(v) for v in stalled[:STALLED_LISTED]) + more
                              + f" [{','.join(signatures)}]", generation, previous, now)
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
    return f"{v.server} ({v.role}) has work but produces no tokens ({v.signature.value}{ranks})"


def degraded_problem(plan: Plan) -> tuple[str, str] | None:
    """(reason, message) for the Degraded condition, or None."""
    if plan.halted:
        return "RemediationHalted", "a server kept stalling after escalation; remediation is halted (see " \
                                    "recentRemediations and docs/remediation.md)"
    if plan.budget_exhausted:
        return "RemediationBudgetExhausted", f"{plan.budget_used} of {plan.budget} remediations used in the last " \
                                             f"hour; stalls are reported as Events only"
    return None


def overlay(status: dict, stored: Mapping | None, verdicts: Sequence[StallVerdict], plan: Plan,
            history: Sequence[Remediation], now: str, *, generation: int) -> dict:
    """`status` (computed by the reconcile pass) with remediation's part laid over it. `stored` is
    the status in the API server (transition times carry over from it); `generation` stands in
    when `status` names none. The reconcile's own Degraded problems win over remediation's."""
    previous = {c.get("type"): c for c in (stored or {}).get("conditions") or []}
    generation = status.get("observedGeneration", generation) or 0
    mine = stall_conditions(verdicts, plan, previous, generation, now)
    conditions = [c for c in status.get("conditions") or [] if c.get("type") not in OWNED_CONDITIONS]
    problem = degraded_problem(plan)
    if problem:
        for i, c in enumerate(conditions):
            if c.get("type") == "Degraded" and c.get("status") != "True":
                conditions[i] = condition("Degraded", True, problem[0], problem[1], generation, previous, now)
    out = {**status, "conditions": conditions + mine}
    if history:
        out["recentRemediations"] = [r.to_status() for r in history]
    else:
        out.pop("recentRemediations", None)
    return out
