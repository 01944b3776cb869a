"""What the operator observed, reduced to what its decisions need.

The kopf indexes call `server_pod` and `owned_object` on every watch event, so the reconciler
reads a fleet's pods and children from memory (no API request) and every decision below is a pure
function of these small frozen records.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from adpfleet.model_uri import REASONS, parse_fetched_revision, parse_termination_message, reason_of_exit_code
from adpfleet.operator.decisions.gang import PodGroupRef, pod_group_of
from adpfleet.operator.resource import names

# Container states a server will not get out of by waiting: surfaced as Degraded with the reason.
_STUCK_WAITING = {"CrashLoopBackOff", "CreateContainerConfigError", "CreateContainerError", "ErrImagePull",
                  "ImagePullBackOff", "InvalidImageName", "RunContainerError", "StartError"}

# What a server pod's model is doing, from its fetch-model init container (ServerPod.model).
FETCHING, FETCHED, UNAVAILABLE = "Fetching", "Fetched", "Unavailable"


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
    leaving_since: float | None = None  # adpfleet.io/scale-down: drained by a scale-down since then (epoch)
    model: str = ""         # FETCHING (running), FETCHED or UNAVAILABLE; "" before fetch-model runs, or without it
    model_failure: tuple[str, str] | None = None  # UNAVAILABLE: (reason, message) from the termination message
    model_revision: str = ""  # FETCHED: the commit fetch-model fetched the model at (its termination message)
    node_rank: int = 0        # a server over several pods: this pod's place in it (0 the leader)
    pods_per_server: int = 1  # ... and how many pods it has
    members: tuple["ServerPod", ...] = ()  # a server over several pods, seen as one (groups.py): its pods
    pod_group: PodGroupRef | None = None  # gang scheduling: the server's PodGroup the pod is in (gang.py)

    @property
    def pods(self) -> tuple["ServerPod", ...]:
        """The pods of this server: its members, or itself."""
        return self.members or (self,)

    @property
    def leaving(self) -> bool:
        """Being removed by a scale-down: drained, deleted once idle."""
        return self.leaving_since is not None

    @property
    def waiting_for_model(self) -> bool:
        """Not Ready because its model is still being fetched or cannot be had: restarting it cannot help."""
        return not self.ready and self.model in (FETCHING, UNAVAILABLE)

    @property
    def view(self) -> "ServerView":
        return ServerView(self.name, self.role, self.ready, self.terminating, self.created, self.draining,
                          self.waiting_for_model)

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
    waiting_for_model: bool = False  # never Ready yet because its model is being fetched or cannot be had


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
    model, model_failure = _model_state(status)
    model_revision = _fetched_revision(status) if model == FETCHED else ""
    for container in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _STUCK_WAITING and not model_failure:  # that one is the fleet's model's
            problem = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
        crashed = _crash(container)
        if crashed and not model_failure:  # a model that cannot be had is the fleet's model's problem
            problem = crashed
    if status.get("phase") == "Failed":
        problem = f"Failed: {status.get('reason', '')} {status.get('message', '')}".strip()
    index = _int(labels.get(names.LABEL_INDEX), -1)
    role = labels.get(names.LABEL_ROLE, "")
    return ServerPod(
        name=meta.get("name", ""), uid=meta.get("uid", ""), role=role, index=index,
        template_hash=annotations.get(names.ANNOTATION_TEMPLATE_HASH, ""), owner_uid=controller_uid(meta),
        phase=status.get("phase", "Pending"),
        ready=(conditions.get("Ready") or {}).get("status") == "True",
        terminating=bool(meta.get("deletionTimestamp")), unschedulable=unschedulable, problem=problem,
        restarts=sum(c.get("restartCount", 0) for c in status.get("containerStatuses") or []),
        ip=status.get("podIP") or "", created=_epoch(meta.get("creationTimestamp")),
        draining=annotations.get(names.ANNOTATION_DRAIN) == "true",
        leaving_since=_epoch(annotations.get(names.ANNOTATION_SCALE_DOWN)), model=model, model_failure=model_failure,
        model_revision=model_revision, node_rank=_int(labels.get(names.LABEL_NODE_RANK), 0),
        pods_per_server=max(1, _int(annotations.get(names.ANNOTATION_PODS_PER_SERVER), 1)),
        pod_group=pod_group_of(labels, annotations, names.server_name(labels.get(names.LABEL_FLEET, ""), role, index)))


def _int(text, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _model_state(status: dict) -> tuple[str, tuple[str, str] | None]:
    """(ServerPod.model, the failure) from the fetch-model init container and the server container.

    A failure is the JSON termination message `adpfleet fetch-model` or `serve` leaves (or, without
    one, the reason its exit code stands for), in the container's current or last termination. It
    stands until that container gets past it (the init container succeeds, the server turns ready),
    so a retry in its back-off does not make the fleet flap between Degraded and not."""
    by_name = {c.get("name"): c for c in (status.get("initContainerStatuses") or [])}
    fetch = by_name.get(names.FETCH_CONTAINER)
    server = next((c for c in status.get("containerStatuses") or [] if c.get("name") == names.SERVER_CONTAINER), None)
    fetched = fetch is not None and ((fetch.get("state") or {}).get("terminated") or {}).get("exitCode") == 0
    for container, past_it in ((fetch, fetched), (server, bool(server and server.get("ready")))):
        failure = None if container is None or past_it else _model_failure(container)
        if failure:
            return UNAVAILABLE, failure
    if fetched:
        return FETCHED, None
    if fetch is not None and "running" in (fetch.get("state") or {}):
        return FETCHING, None
    return "", None


def _fetched_revision(status: dict) -> str:
    """The revision the fetch-model init container's successful termination message reports, or ""."""
    fetch = next((c for c in status.get("initContainerStatuses") or [] if c.get("name") == names.FETCH_CONTAINER), {})
    ended = (fetch.get("state") or {}).get("terminated") or {}
    return (parse_fetched_revision(ended.get("message")) or "") if ended.get("exitCode") == 0 else ""


def _model_failure(container: dict) -> tuple[str, str] | None:
    for state in (container.get("state") or {}, container.get("lastState") or {}):
        ended = state.get("terminated") or {}
        if not ended or ended.get("exitCode") == 0:
            continue
        error = parse_termination_message(ended.get("message"))
        if error is not None:
            return error.reason, error.message
        reason = reason_of_exit_code(ended.get("exitCode"))
        if reason is not None:
            return reason, REASONS[reason][1]
    return None


def _crash(container: dict) -> str | None:
    """A container that keeps failing: its last run ended in an error and the run since has not got
    past its startup probe. Said the same way whether the kubelet is backing off or running it
    again (and without the back-off's growing delay), so the fleet's Degraded condition stays put
    through a crash loop and reads the container's own error."""
    if container.get("ready") or container.get("started"):
        return None
    for state in (container.get("state") or {}, container.get("lastState") or {}):
        ended = state.get("terminated") or {}
        if ended and ended.get("exitCode") not in (0, None):
            why = (ended.get("message") or ended.get("reason") or "").strip()
            return f"CrashLoopBackOff: container {container.get('name', '')} exited with code " \
                   f"{ended['exitCode']}" + (f": {why}" if why else "")
        if ended:
            return None
    return None


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
class RoleObject:
    """A fleet's InferenceFleetRole: one role's scale target."""
    name: str
    uid: str
    owner_uid: str | None
    role: str
    replicas: int                  # spec.replicas
    spec_servers: int | None       # the fleet's servers it last took (annotation); None: never
    replicas_manager: str | None   # the field manager that last set spec.replicas (kubectl, an HPA, ...)
    decision: str | None           # the operator's last scale decision on it (JSON annotation)
    status: dict
    terminating: bool = False


def role_object(body: dict) -> RoleObject:
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    annotations = meta.get("annotations") or {}
    try:
        spec_servers = int(annotations[names.ANNOTATION_SPEC_SERVERS])
    except (KeyError, TypeError, ValueError):
        spec_servers = None
    return RoleObject(name=meta.get("name", ""), uid=meta.get("uid", ""), owner_uid=controller_uid(meta),
                      role=str(spec.get("role", "")), replicas=int(spec.get("replicas") or 0),
                      spec_servers=spec_servers, replicas_manager=_replicas_manager(meta.get("managedFields")),
                      decision=annotations.get(names.ANNOTATION_SCALE_DECISION),
                      status=body.get("status") or {}, terminating=bool(meta.get("deletionTimestamp")))


def _replicas_manager(managed_fields) -> str | None:
    """Who last set spec.replicas, from the server-side field ownership (the newest entry owning it)."""
    owners = [(str(m.get("time") or ""), m.get("manager") or "") for m in managed_fields or []
              if "f:replicas" in ((m.get("fieldsV1") or {}).get("f:spec") or {})]
    return max(owners)[1] if owners else None


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
    role_objects: tuple[RoleObject, ...] = ()

    def role_object(self, role: str) -> RoleObject | None:
        """This fleet's InferenceFleetRole of `role` (not one left by an earlier fleet of the same name)."""
        return next((o for o in self.role_objects if o.role == role and o.owner_uid == self.uid), None)

    def role_pods(self, role: str) -> list[ServerPod]:
        """This fleet's pods of `role`; pods left by an earlier fleet of the same name are not ours."""
        return sorted((p for p in self.pods if p.role == role and p.owner_uid == self.uid), key=lambda p: p.index)

    def foreign_pods(self) -> list[ServerPod]:
        return [p for p in self.pods if p.owner_uid != self.uid]
