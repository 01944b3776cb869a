"""The InferenceFleetRole: one role's scale target, behind the `scale` subresource (its own CRD)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from adpfleet.operator.resource import names
from adpfleet.operator.resource.cel import KubeModel
from adpfleet.operator.resource.status import ScaleRecord


def _immutable(message: str) -> dict:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": message}]}


class FleetRoleSpec(KubeModel):
    """The desired server count of one role of a fleet, behind the `scale` subresource."""
    fleet: str = Field(min_length=1, max_length=names.MAX_FLEET_NAME, json_schema_extra=_immutable(
        "fleet is immutable"), description="The InferenceFleet this object scales (set by the operator).")
    role: Literal["context", "generation", "aggregated"] = Field(json_schema_extra=_immutable("role is immutable"),
                                                   description="The role it scales (set by the operator).")
    replicas: int = Field(ge=1, le=256, description="Servers of the role: what `kubectl scale`, an HPA or KEDA "
                                                    "set through the scale subresource.")


class FleetRoleStatus(KubeModel):
    """The role as the operator last saw it."""
    replicas: int = Field(0, ge=0, description="Server pods that exist and are not being removed.")
    ready_replicas: int = Field(0, ge=0, description="Of those, the Ready ones.")
    desired_replicas: int = Field(0, ge=0, description="What the operator runs: spec.replicas, within "
                                                       "autoscaling's minServers..maxServers when it is on.")
    selector: str = Field("", max_length=512, description="Label selector of the role's server pods "
                                                          "(the scale subresource's, for an HPA's pod metrics).")
    last_scale: ScaleRecord | None = Field(None, description="The last change of the desired count.")
