"""Each role's scale target: an InferenceFleetRole `<fleet>-<role>`, owned by the fleet. Pure.

Why an object of its own: `kubectl scale`, a HorizontalPodAutoscaler and KEDA drive anything that
has the `scale` subresource, and a CRD may give each kind only one. A fleet has two roles, so each
role gets a small object whose `spec.replicas` is that role's server count (Dynamo's scaling adapter
and Grove's PodClique do the same); the fleet keeps everything else.

How many servers a role runs (`replicas_of`): the fleet's `spec.<role>.servers` until someone scales
the InferenceFleetRole — then its `spec.replicas`, until the fleet's `servers` is changed again (the
object records which `servers` it last took, so the newer of the two wins and re-applying an
unchanged fleet manifest does not undo an autoscaler). With the built-in autoscaling on, the count
is bounded by `minServers..maxServers`; the policy writes its decisions into the same field.

The object's status says what the operator runs (`desiredReplicas`), what exists and is Ready, the
pods' label selector (for an HPA's pod metrics), and the last change with its reason and source
(`lastScale`): the operator's own decision annotation when the operator set the count, else the
field manager that last set `spec.replicas` (kubectl, the HPA controller, KEDA).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from adpfleet.operator.decisions.observed import RoleObject
from adpfleet.operator.decisions.rollout import Wording
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.resource.vocabulary import ScaleReason

SOURCE_POLICY = "policy"  # lastScale.source of the built-in autoscaling's decisions
SOURCE_SPEC = "spec"      # ... of a change of the fleet's spec.<role>.servers


@dataclass(frozen=True)
class CreateRoleObject:
    role: str
    name: str
    manifest: dict
    why: str = "missing"
    wording: ClassVar[Wording] = Wording("create", "created", "CreatedScaleTarget", "CreateScaleTargetFailed")

    def describe(self, fleet: str) -> str:
        return f"{names.ROLE_KIND} {self.name}"


@dataclass(frozen=True)
class SetRoleReplicas:
    """Write a role's count into its InferenceFleetRole (with the decision that says why)."""
    role: str
    name: str
    uid: str
    replicas: int
    decision: str             # the decision annotation (JSON)
    spec_servers: int | None  # the fleet's servers it now took; None: unchanged
    why: str
    wording: ClassVar[Wording] = Wording("scale", "scaled", "SetServers", "ScaleFailed")

    def describe(self, fleet: str) -> str:
        return f"{names.ROLE_KIND} {self.name} to {self.replicas}"

    def patch(self) -> dict:
        annotations = {names.ANNOTATION_SCALE_DECISION: self.decision}
        if self.spec_servers is not None:
            annotations[names.ANNOTATION_SPEC_SERVERS] = str(self.spec_servers)
        return {"metadata": {"uid": self.uid, "annotations": annotations}, "spec": {"replicas": self.replicas}}


def role_object_manifest(fleet: FleetRef, spec: FleetSpec, role: str) -> dict:
    servers = spec.role(role).servers
    return {
        "apiVersion": names.API_VERSION, "kind": names.ROLE_KIND,
        "metadata": {"name": names.role_object_name(fleet.name, role), "namespace": fleet.namespace,
                     "labels": {**names.common_labels(fleet.name, f"{role}-scale"), names.LABEL_ROLE: role},
                     "annotations": {names.ANNOTATION_SPEC_SERVERS: str(servers)},
                     "ownerReferences": [fleet.owner_reference()]},
        "spec": {"fleet": fleet.name, "role": role, "replicas": servers},
    }


def requested(spec: FleetSpec, role: str, obj: RoleObject | None) -> int:
    """The count asked for, before autoscaling's bounds: the object's once it took the fleet's
    current `servers`, else the fleet's."""
    servers = spec.role(role).servers
    if obj is None or obj.terminating or obj.spec_servers != servers:
        return servers
    return obj.replicas


def replicas_of(spec: FleetSpec, role: str, obj: RoleObject | None) -> int:
    """The servers `role` runs (see the module docstring)."""
    count = requested(spec, role, obj)
    scaling = spec.role(role).autoscaling
    if scaling.enabled:
        count = min(max(count, scaling.min_servers), scaling.max_servers)
    return count


def decision(time: str, previous: int, desired: int, reason: ScaleReason, message: str, source: str) -> str:
    """The annotation an operator-made change carries, read back by `role_status`."""
    return json.dumps({"time": time, "previous": previous, "desired": desired, "reason": reason.value,
                       "message": message[:1024], "source": source}, sort_keys=True)


def plan_role_object(fleet: FleetRef, spec: FleetSpec, role: str, obj: RoleObject | None, name_taken: bool,
                     now: str) -> list:
    """Create the object when missing (unless an earlier fleet's object of that name is still there),
    and give it the fleet's `servers` when they changed since it last took them."""
    if obj is None:
        return [] if name_taken else [CreateRoleObject(role, names.role_object_name(fleet.name, role),
                                                       role_object_manifest(fleet, spec, role))]
    servers = spec.role(role).servers
    if obj.terminating or obj.spec_servers == servers:
        return []
    before = obj.replicas
    note = decision(now, before, servers, ScaleReason.SPEC_CHANGED,
                    f"{role} {before} -> {servers}: spec.{role}.servers is {servers}", SOURCE_SPEC)
    return [SetRoleReplicas(role, obj.name, obj.uid, servers, note, servers, f"spec.{role}.servers changed")]


def role_status(spec: FleetSpec, role: str, obj: RoleObject, fleet_name: str, counts: dict, now: str,
                pending: SetRoleReplicas | None = None) -> dict:
    """The InferenceFleetRole's status: counts, selector, and `lastScale` (a new record when the
    desired count differs from the one the status holds). `pending`: this pass's own write of the
    count, which the cached object does not show yet."""
    stored = obj.status or {}
    desired = counts["desired"]
    last = stored.get("lastScale")
    previous = stored.get("desiredReplicas")
    if isinstance(previous, int) and previous != desired:
        last = _record(spec, role, obj, previous, desired, now, pending)
    status = {"replicas": counts["current"], "readyReplicas": counts["ready"], "desiredReplicas": desired,
              "selector": names.role_selector(fleet_name, role)}
    if last:
        status["lastScale"] = last
    return status


def _record(spec: FleetSpec, role: str, obj: RoleObject, previous: int, desired: int, now: str,
            pending: SetRoleReplicas | None) -> dict:
    """Who changed the count from `previous` to `desired`, and why."""
    made = _decision(pending.decision if pending else obj.decision)
    ours = pending is not None or obj.replicas_manager in (None, names.MANAGER)
    requested_now = pending.replicas if pending else requested(spec, role, obj)
    if made and made.get("desired") == desired and ours:
        reason, source, message = made["reason"], made["source"], made.get("message", "")
        time = made.get("time") or now
    elif requested_now != desired:  # autoscaling's bounds hold it
        reason = ScaleReason.BELOW_MINIMUM.value if desired > requested_now else ScaleReason.ABOVE_MAXIMUM.value
        source, time = SOURCE_POLICY, now
        message = f"{role} {previous} -> {desired}: {requested_now} asked for, autoscaling allows " \
                  f"{spec.role(role).autoscaling.min_servers}..{spec.role(role).autoscaling.max_servers}"
    else:
        reason, source, time = ScaleReason.SCALED_EXTERNALLY.value, obj.replicas_manager or "unknown", now
        message = f"{role} {previous} -> {desired}: {names.ROLE_KIND} {obj.name} spec.replicas set by {source}"
    return {"time": time, "role": role, "previous": previous, "desired": desired, "reason": reason,
            "source": source[:128], "message": message[:1024]}


def _decision(text: str | None) -> dict | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("reason") not in {r.value for r in ScaleReason}:
        return None
    return value
