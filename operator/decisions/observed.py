"""What the operator observed, reduced to what its decisions need.

The kopf indexes call `server_pod` and `owned_object` on every watch event, so the reconciler
reads a fleet's pods and children from memory (no API request) and every decision below is a pure
function of these small frozen records.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from adpfleet.operator.resource import names

# Container states a server will not get out of by waiting: surfaced as Degraded with the reason.
_STUCK_WAITING = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "ErrImagePull",
                  "ImagePullBackOff", "InvalidImageName", "RunContainerError", "StartError"}


@dataclass(frozen=True)
class ServerPod:
    name: str
    uid: str
    role: str
    index: int
    template_hash: str
    owner_uid: str | None
    phase: str              # Pending, Running, Succeeded, Failed, Unknown
    ready: bool
    terminating: bool       # deletionTimestamp set: on its way out
    unschedulable: bool     # PodScheduled=False/Unschedulable: no room for it now
    problem: str | None     # "<Reason>: <message>" when it is stuck (crash loop, missing Secret, no room)
    restarts: int = 0
    ip: str = ""            # status.podIP: where stall detection scrapes /metrics
    created: float | None = None  # creationTimestamp (epoch): tells a replaced pod from the one it replaced
    draining: bool = False  # adpfleet.io/drain: the router sends it no new requests

    @property
    def view(self) -> "ServerView":
        return ServerView(self.name, self.role, self.ready, self.terminating, self.created, self.draining)

    @property
    def finished(self) -> bool:
        """A pod that will never run again (restartPolicy Always makes this rare: eviction, node loss)."""
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class ServerView:
    """What the remediation policy reads of a server pod."""
    name: str
    role: str
    ready: bool
    terminating: bool = False
    created: float | None = None  # pod creationTimestamp (epoch); tells a replaced pod from the old one
    draining: bool = False


@dataclass(frozen=True)
class OwnedObject:
    """A child other than a server pod: the router's Deployment, Service, ServiceAccount, Role,
    RoleBinding, and the disruption budgets."""
    kind: str
    name: str
    uid: str
    owner_uid: str | None
    template_hash: str | None
    terminating: bool = False
    replicas: int | None = None        # Deployments: spec.replicas
    ready_replicas: int | None = None  # Deployments: status.readyReplicas


def controller_uid(meta: dict) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def server_pod(body: dict) -> ServerPod:
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled") or {}
    unschedulable = scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
    problem = None
    if unschedulable:
        problem = f"Unschedulable: {scheduled.get('message', '')}".rstrip(": ")
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _STUCK_WAITING:
            problem = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
    if status.get("phase") == "Failed":
        problem = f"Failed: {status.get('reason', '')} {status.get('message', '')}".strip()
    try:
        index = int(labels.get(names.LABEL_INDEX, "-1"))
    except ValueError:
        index = -1
    return ServerPod(
        name=meta.get("name", ""), uid=meta.get("uid", ""), role=labels.get(names.LABEL_ROLE, ""), index=index,
        template_hash=annotations.get(names.ANNOTATION_TEMPLATE_HASH, ""), owner_uid=controller_uid(meta),
        phase=status.get("phase", "Pending"),
        ready=(conditions.get("Ready") or {}).get("status") == "True",
        terminating=bool(meta.get("deletionTimestamp")), unschedulable=unschedulable, problem=problem,
        restarts=sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or []),
        ip=status.get("podIP") or "", created=_epoch(meta.get("creationTimestamp")),
        draining=annotations.get(names.ANNOTATION_DRAIN) == "true")


def _epoch(timestamp) -> float | None:
    if not timestamp:
        return None
    if hasattr(timestamp, "timestamp"):
        return timestamp.timestamp()
    try:
        return datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def owned_object(kind: str, body: dict) -> OwnedObject:
    meta = body.get("metadata") or {}
    spec, status = body.get("spec") or {}, body.get("status") or {}
    replicas = ready = None
    if kind == "Deployment":
        replicas = spec.get("replicas", 1)
        # readyReplicas of an older generation's pods still counts: they do serve
        ready = status.get("readyReplicas", 0)
    return OwnedObject(kind=kind, name=meta.get("name", ""), uid=meta.get("uid", ""),
                       owner_uid=controller_uid(meta),
                       template_hash=(meta.get("annotations") or {}).get(names.ANNOTATION_TEMPLATE_HASH),
                       terminating=bool(meta.get("deletionTimestamp")), replicas=replicas, ready_replicas=ready)


@dataclass(frozen=True)
class FleetObservation:
    """One fleet and everything it owns, as last seen."""
    name: str
    namespace: str
    uid: str
    generation: int
    resource_version: str
    spec: dict
    status: dict
    pods: tuple[ServerPod, ...]
    objects: tuple[OwnedObject, ...]

    def role_pods(self, role: str) -> list[ServerPod]:
        """This fleet's pods of `role`; pods left by an earlier fleet of the same name are not ours."""
        return sorted((p for p in self.pods if p.role == role and p.owner_uid == self.uid), key=lambda p: p.index)

    def foreign_pods(self) -> list[ServerPod]:
        return [p for p in self.pods if p.owner_uid != self.uid]
