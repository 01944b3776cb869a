"""The InferenceFleet's status: what the operator last observed and did."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from adpfleet.operator.resource.cel import KubeModel
from adpfleet.operator.resource.vocabulary import Action, ConditionType, Outcome, ScaleReason, Signature

Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class Condition(KubeModel):
    """A Kubernetes-style condition."""
    type: Literal[tuple(ConditionType)] = Field(description="Ready, Progressing, Degraded; Stalled and Remediating come from "
                                            "stall remediation.")
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="CamelCase, machine-readable.")
    message: str = Field("", max_length=32_768, description="For people.")
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="The generation this condition was set for.")


class ScaleRecord(KubeModel):
    """A change of a role's desired server count: who made it and why."""
    time: Timestamp = Field(description="When the desired count changed.")
    role: Literal["context", "generation", "aggregated"] = Field(description="The role scaled.")
    previous: int = Field(ge=0, le=256, description="Desired servers before.")
    desired: int = Field(ge=0, le=256, description="Desired servers after.")
    reason: ScaleReason = Field(description="Why (docs/autoscaling.md lists the reasons).")
    source: str = Field(max_length=128, description="Who: 'policy' (the built-in autoscaling), 'spec' (the "
                                                    "fleet's servers), or the field manager that set the "
                                                    "InferenceFleetRole's replicas (kubectl, an HPA, KEDA).")
    message: str = Field("", max_length=1024, description="The signals against their targets, for people.")


class RoleStatus(KubeModel):
    """Server counts of one role."""
    desired: int = Field(0, ge=0, description="Servers wanted: spec servers, or the role's InferenceFleetRole "
                                              "replicas once it was scaled.")
    current: int = Field(0, ge=0, description="Server pods that exist and are not being deleted.")
    updated: int = Field(0, ge=0, description="Of those, the ones built from the current spec.")
    ready: int = Field(0, ge=0, description="Of those that exist, the ones that are Ready.")
    servers: str | None = Field(None, max_length=16, description="'<ready>/<desired>' (kubectl get -o wide).")
    last_scale: ScaleRecord | None = Field(None, description="The last change of desired.")


class RouterStatus(KubeModel):
    """Router pod counts."""
    desired: int = Field(0, ge=0, description="spec router replicas (0 when the router is disabled).")
    ready: int = Field(0, ge=0, description="Router pods that are Ready.")


RECORD_MESSAGE_LIMIT = 1024  # characters of a remediation record's message (the verdict and its evidence)
HISTORY_LIMIT = 20           # records in status.recentRemediations (newest first)


class RemediationRecord(KubeModel):
    """One remediation, newest first in recentRemediations."""
    time: Timestamp = Field(description="When the remediation was decided.")
    role: Literal["context", "generation", "aggregated"] = Field(description="The stalled server's role.")
    server: str = Field(max_length=253, description="Pod name.")
    signature: Signature = Field(description="How the server made no progress (docs/remediation.md).")
    action: Action = Field(description="What was done.")
    outcome: Outcome = Field(description="Pending, Succeeded (pods deleted), Resolved (and progress resumed), "
                                         "Failed, Recovered, DryRun or Halted.")
    message: str = Field("", max_length=RECORD_MESSAGE_LIMIT,
                         description="The verdict and its evidence (metric values).")
    targets: list[str] = Field(default_factory=list, max_length=256,
                               description="The server pods the action restarts (the stalled server, its peers, "
                                           "or its role).")


ModelPhase = Literal["Pending", "Downloading", "Available", "Unavailable"]


class ModelStatus(KubeModel):
    """The fleet's model as its servers last showed it."""
    source: str = Field(max_length=512, description="spec.model.uri (or name).")
    phase: ModelPhase = Field(description="Downloading: a server waits for its download. Unavailable: the model "
                                          "cannot be had (reason; the Degraded condition says why). Available: "
                                          "every server that started has it. Pending: no server has got that far.")
    reason: str | None = Field(None, max_length=128, description="Unavailable: why (docs/engine.md's failure "
                                                                 "reasons, or ClaimNotFound).")
    revision: str | None = Field(None, max_length=512, description="Available, hf://: the commit the servers "
                                 "fetched the model at (several, comma-separated, if their caches differ).")
    bytes_done: int | None = Field(None, ge=0, description="Downloading: bytes on disk, summed over the servers "
                                                          "downloading (where their log has said).")
    bytes_total: int | None = Field(None, ge=0, description="Downloading: bytes those downloads fetch in all.")
    progress: str | None = Field(None, max_length=64, description="Downloading: bytes done of total, for people.")


class FleetStatus(KubeModel):
    """What the operator last observed and did."""
    observed_generation: int | None = Field(None, ge=0, description="The generation the status describes.")
    conditions: list[Condition] = Field(default_factory=list, max_length=16,
                                        json_schema_extra={"x-kubernetes-list-type": "map",
                                                           "x-kubernetes-list-map-keys": ["type"]},
                                        description="Ready (the fleet serves: every role has a Ready server, "
                                                    "and the router), Progressing, Degraded, Stalled, "
                                                    "Remediating (docs/operator.md, docs/remediation.md).")
    context: RoleStatus | None = Field(None, description="Context server counts.")
    generation: RoleStatus | None = Field(None, description="Generation server counts.")
    aggregated: RoleStatus | None = Field(None, description="Aggregated server counts.")
    router: RouterStatus | None = Field(None, description="Router pod counts.")
    ready_roles: str | None = Field(None, max_length=16, description="'<roles with every server ready>/<roles>', "
                                                                     "the router counting as a role.")
    recent_remediations: list[RemediationRecord] = Field(default_factory=list, max_length=HISTORY_LIMIT,
                                                         description="The last remediations, newest first.")
    last_scale: ScaleRecord | None = Field(None, description="The newest of the roles' lastScale.")
    model: ModelStatus | None = Field(None, description="The model source and whether the servers have it.")
