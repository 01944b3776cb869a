"""Gang scheduling of a role's servers (`spec.<role>.gangScheduling`): the PodGroup of each server
and what its pods carry so that the named scheduler places the server's pods all together or none.

One PodGroup per server, named after it (`<fleet>-<role>-<index>`), minMember = podsPerServer: a
server over several pods is useless until every pod runs (its ranks wait for each other in their
first collective), and a half-placed group holds GPUs another group could have used. One-pod servers
of such a role get one too (minMember 1): the role's pods all go through the same scheduler and
queue, and Volcano would otherwise make a PodGroup of its own for each.

The PodGroup is the fleet's (ownerReference: removed with the fleet) and lives as long as its
server: applied just before the server's pods are created (so the scheduler finds it when the pods
arrive), deleted with the server's pods when the server is removed (scale-down, roll, a broken
group). A server recreated in the same slot (remediation, a lost pod) finds its PodGroup there.

Per provider (the scheduler's own API, not adpfleet's):
- Volcano: `scheduling.volcano.sh/v1beta1` PodGroup with minMember, minResources (the summed
  requests of the server's pods, which Volcano's enqueue step holds the group to), queue and
  priorityClassName; the pods carry the annotation `scheduling.k8s.io/group-name`.
- Coscheduling (kubernetes-sigs/scheduler-plugins): `scheduling.x-k8s.io/v1alpha1` PodGroup with
  minMember and scheduleTimeoutSeconds; the pods carry the label `scheduling.x-k8s.io/pod-group`.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from adpfleet.contract.pod_requests import add_requests, pod_requests
from adpfleet.operator.resource import names
from adpfleet.operator.resource.server_role import GangScheduling
from adpfleet.operator.resource.names import FleetRef

POD_GROUP_KIND = "PodGroup"
POD_GROUP_PLURAL = "podgroups"
POD_GROUP_API_MISSING = "PodGroupAPIMissing"  # Degraded: the role's gang scheduling names an API not installed


@dataclass(frozen=True)
class PodGroupAPI:
    """One provider's PodGroup API and how a pod names its group."""
    provider: str
    group: str
    version: str
    default_scheduler: str
    install: str                       # what a cluster without this API needs, for the Degraded message
    pod_label: str | None = None       # the pod names its group with this label ...
    pod_annotation: str | None = None  # ... or this annotation

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    @property
    def resource(self) -> str:
        """`podgroups.<group>`: what RBAC grants, and how messages name the API."""
        return f"{POD_GROUP_PLURAL}.{self.group}"


VOLCANO = PodGroupAPI("Volcano", "scheduling.volcano.sh", "v1beta1", "volcano", "install Volcano (volcano.sh)",
                      pod_annotation="scheduling.k8s.io/group-name")
COSCHEDULING = PodGroupAPI("Coscheduling", "scheduling.x-k8s.io", "v1alpha1", "scheduler-plugins-scheduler",
                           "install the scheduler-plugins scheduler and controller with the Coscheduling plugin "
                           "(kubernetes-sigs/scheduler-plugins)", pod_label="scheduling.x-k8s.io/pod-group")
APIS = {api.provider: api for api in (VOLCANO, COSCHEDULING)}


@dataclass(frozen=True)
class PodGroupRef:
    """A server's PodGroup, as its pods name it."""
    provider: str
    name: str

    @property
    def api(self) -> PodGroupAPI:
        return APIS[self.provider]


def api_of(gang: GangScheduling) -> PodGroupAPI:
    return APIS[gang.provider]


def scheduler_name(gang: GangScheduling) -> str:
    return gang.scheduler_name or api_of(gang).default_scheduler


def pod_markers(gang: GangScheduling, group_name: str) -> tuple[dict, dict]:
    """(labels, annotations) that put a pod in PodGroup `group_name`."""
    api = api_of(gang)
    return ({api.pod_label: group_name} if api.pod_label else {},
            {api.pod_annotation: group_name} if api.pod_annotation else {})


def pod_group_of(labels: dict, annotations: dict, server: str) -> PodGroupRef | None:
    """The PodGroup the operator made for this pod's server, read back from the pod: a group label
    or annotation naming `server` (a user's own group of another name is never the operator's)."""
    for api in APIS.values():
        value = labels.get(api.pod_label) if api.pod_label else annotations.get(api.pod_annotation)
        if value and value == server:
            return PodGroupRef(api.provider, value)
    return None


def pod_group(fleet: FleetRef, role: str, index: int, gang: GangScheduling, pods: list[dict]) -> dict:
    """The PodGroup of server `index` of `role`, whose pods are `pods` (all of them, as created)."""
    api = api_of(gang)
    spec: dict = {"minMember": len(pods)}
    if api is VOLCANO:
        spec["minResources"] = group_requests(pods)
        if gang.queue:
            spec["queue"] = gang.queue
        priority = pods[0]["spec"].get("priorityClassName")
        if priority:
            spec["priorityClassName"] = priority
    elif gang.schedule_timeout_seconds is not None:
        spec["scheduleTimeoutSeconds"] = gang.schedule_timeout_seconds
    server = names.server_name(fleet.name, role, index)
    return {
        "apiVersion": api.api_version, "kind": POD_GROUP_KIND,
        "metadata": {"name": server, "namespace": fleet.namespace,
                     "labels": {**names.common_labels(fleet.name, f"{role}-server"), names.LABEL_ROLE: role,
                                names.LABEL_INDEX: str(index)},
                     "ownerReferences": [fleet.owner_reference()]},
        "spec": spec,
    }


# ---- the requests of a group: what the scheduler must find free before it places any of it ----

def group_requests(pods: list[dict]) -> dict[str, str]:
    """The summed requests of a group's pods (each Kubernetes' PodRequests, the contract's), as
    quantities (PodGroup minResources)."""
    total: dict[str, Decimal] = {}
    for pod in pods:
        add_requests(total, pod_requests(pod["spec"]))
    return {k: format_quantity(k, v) for k, v in sorted(total.items()) if v}


_BYTES = ("memory", "ephemeral-storage", "hugepages-")
_BINARY = (("Ei", 2**60), ("Pi", 2**50), ("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10))


def format_quantity(resource: str, value: Decimal) -> str:
    """`value` as Kubernetes writes it: bytes with the largest binary suffix that divides them,
    whole amounts as integers, fractions in milli-units (CPU)."""
    if value == value.to_integral_value():
        whole = int(value)
        if resource.startswith(_BYTES):
            for suffix, size in _BINARY:
                if whole >= size and whole % size == 0:
                    return f"{whole // size}{suffix}"
        return str(whole)
    return f"{int((value * 1000).to_integral_value(rounding='ROUND_CEILING'))}m"
