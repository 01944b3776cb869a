"""A fleet's status from what was observed and planned: pure, so a pass that changes nothing
produces an identical status (and therefore writes nothing).

Conditions follow the Kubernetes conventions: `lastTransitionTime` moves only when `status`
changes; reason is CamelCase; message is for people. This module owns Ready, Progressing and
Degraded; Stalled, Remediating and recentRemediations are carried over untouched for the
remediation controller, which owns them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from adpfleet.operator.decisions.observed import FleetObservation, OwnedObject, ServerPod
from adpfleet.operator.decisions.rollout import RolePlan
from adpfleet.operator.resource.vocabulary import RECONCILE_CONDITIONS, ConditionType, Reason

MODEL_DOWNLOADING = "ModelDownloading"  # Progressing: servers wait for their model's download
MODEL_UNAVAILABLE = "ModelUnavailable"  # Degraded: the model cannot be had (model_status.py says why)


@dataclass(frozen=True)
class Problem:
    """Something that needs a person (or time) and that the operator cannot fix by itself."""
    reason: str
    message: str


def role_counts(desired: int, template_hash: str, pods: list[ServerPod]) -> dict:
    """desired/current/updated/ready of a role; servers a scale-down is draining no longer count."""
    live = [p for p in pods if not p.terminating and not p.leaving]
    return {"desired": desired, "current": len(live),
            "updated": sum(p.template_hash == template_hash for p in live),
            "ready": sum(p.ready for p in live)}


def router_counts(enabled: bool, replicas: int, objects: list[OwnedObject]) -> dict:
    deployment = next((o for o in objects if o.kind == "Deployment"), None)
    return {"desired": replicas if enabled else 0,
            "ready": (deployment.ready_replicas or 0) if (enabled and deployment) else 0}


# The kubelet's words for a Secret a container's environment needs and cannot get:
# `secret "NAME" not found`, `couldn't find key KEY in Secret NAMESPACE/NAME`.
_MISSING_SECRET = re.compile(r'secret "(?P<name>[^"]+)" not found|in Secret [^/\s]+/(?P<name2>\S+)', re.IGNORECASE)


def pod_problems(pods: list[ServerPod], secret_fields: dict[str, str] | None = None) -> list[Problem]:
    """Servers stuck in a way waiting will not fix (crash loops, missing Secrets, no room).
    `secret_fields`: Secret name -> the spec field that names it, to say where a missing one comes from."""
    out = []
    for p in pods:
        if p.problem and not p.terminating:
            reason = p.problem.split(":", 1)[0]
            missing = _MISSING_SECRET.search(p.problem) if reason == "CreateContainerConfigError" else None
            if missing:
                secret = missing.group("name") or missing.group("name2")
                where = (secret_fields or {}).get(secret)
                out.append(Problem("SecretNotFound", f"{p.name}: {p.problem}" + (f" ({where})" if where else "")))
                continue
            out.append(Problem("ServersFailing" if reason != "Unschedulable" else "ServersUnschedulable",
                               f"{p.name}: {p.problem}"))
    return out


def condition(type_: ConditionType, status: bool | str, reason: str, message: str, generation: int,
              previous: dict[str, dict], now: str) -> dict:
    value = status if isinstance(status, str) else ("True" if status else "False")
    before = previous.get(type_)
    since = before["lastTransitionTime"] if before and before.get("status") == value and \
        before.get("lastTransitionTime") else now
    return {"type": type_, "status": value, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def fleet_status(obs: FleetObservation, counts: dict[str, dict], router: dict | None,
                 plans: list[RolePlan], objects_waiting: str | None, problems: list[Problem],
                 now: str, downloading: str | None = None) -> dict:
    """The whole `status` for `obs`'s generation. `counts`: role -> role_counts; `router`:
    router_counts or None when the spec could not be read; `downloading`: servers waiting for their
    model's download (model_status.py), which Progressing names first."""
    previous = {c.get("type"): c for c in (obs.status or {}).get("conditions") or []}
    gen = obs.generation
    lagging = [f"{role} {c['ready']}/{c['desired']} ready" for role, c in counts.items() if c["ready"] < c["desired"]]
    if router and router["ready"] < router["desired"]:
        lagging.append(f"router {router['ready']}/{router['desired']} ready")
    invalid = next((p for p in problems if p.reason == Reason.INVALID_SPEC), None)
    ready = condition(*_ready(counts, router, invalid, lagging), gen, previous, now)
    progressing = condition(*_progressing(router, plans, objects_waiting, invalid, lagging, downloading),
                            gen, previous, now)
    degraded = condition(*_degraded(problems), gen, previous, now)

    kept = [c for t, c in previous.items() if t not in RECONCILE_CONDITIONS]  # Stalled, Remediating
    status = {"observedGeneration": gen, "conditions": [ready, progressing, degraded] + kept}
    status.update({role: c for role, c in counts.items()})
    if router is not None:
        status["router"] = router
    if counts:
        groups = [c["ready"] >= c["desired"] for c in counts.values()]
        if router and router["desired"]:
            groups.append(router["ready"] >= router["desired"])
        status["readyRoles"] = f"{sum(groups)}/{len(groups)}"
    if (obs.status or {}).get("recentRemediations"):
        status["recentRemediations"] = obs.status["recentRemediations"]
    return status


Said = tuple[ConditionType, bool, str, str]  # a condition's type, status, reason and message


def _ready(counts: dict[str, dict], router: dict | None, invalid: Problem | None, lagging: list[str]) -> Said:
    """The fleet serves: every role has a Ready server, and so does the router. A role short of
    servers (scaling up, a server restarting) is Progressing, not unready, while one serves."""
    dark = [role for role, c in counts.items() if c["desired"] and not c["ready"]]
    router_dark = bool(router and router["desired"] and not router["ready"])
    summary = ", ".join(f"{role} {c['ready']}/{c['desired']}" for role, c in counts.items()) + " ready" + (
        f", router {router['ready']}/{router['desired']}" if router and router["desired"] else "")
    if invalid:
        return ConditionType.READY, False, Reason.INVALID_SPEC, invalid.message
    if dark or router_dark:
        return ConditionType.READY, False, "ServersNotReady" if dark else "RouterNotReady", \
            f"no Ready {' or '.join(dark + ['router'] * router_dark)} server: {summary}"
    return ConditionType.READY, True, "MinimumServersReady" if lagging else "AllServersReady", summary


def _progressing(router: dict | None, plans: list[RolePlan], objects_waiting: str | None, invalid: Problem | None,
                 lagging: list[str], downloading: str | None) -> Said:
    moving = [p for p in plans if not p.converged]
    if invalid:
        return ConditionType.PROGRESSING, False, Reason.INVALID_SPEC, "nothing is changed until the spec is fixed"
    if not (moving or objects_waiting or lagging or downloading):
        return ConditionType.PROGRESSING, False, "Complete", "every server runs the current spec"
    reason = MODEL_DOWNLOADING if downloading else next(
        (ph for ph in ("RollingUpdate", "Replacing", "Scaling") if any(p.phase == ph for p in moving)), "Converging")
    parts = [downloading] if downloading else []
    parts += [f"{p.role}: {p.phase}" + (f", waiting for {p.waiting_for}" if p.waiting_for else "") for p in moving]
    if objects_waiting:
        parts.append(f"waiting for {objects_waiting}")
    if router and router["ready"] < router["desired"] and not parts:
        parts.append(f"router {router['ready']}/{router['desired']} ready")
    return ConditionType.PROGRESSING, True, reason, "; ".join(parts) or ", ".join(lagging)


def _degraded(problems: list[Problem]) -> Said:
    if not problems:
        return ConditionType.DEGRADED, False, "AsExpected", "no problems seen"
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return ConditionType.DEGRADED, True, problems[0].reason, "; ".join(p.message for p in problems[:5]) + more


def transitions(before: dict, after: dict) -> list[tuple[str, dict]]:
    """(type, new condition) for each owned condition whose status or reason changed."""
    old = {c.get("type"): c for c in (before or {}).get("conditions") or []}
    out = []
    for c in after.get("conditions") or []:
        if c["type"] not in RECONCILE_CONDITIONS:
            continue
        prev = old.get(c["type"])
        if prev is None or prev.get("status") != c["status"] or prev.get("reason") != c["reason"]:
            out.append((c["type"], c))
    return out
