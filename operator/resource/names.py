"""Names, labels and annotations the operator, the router and users rely on (docs/operator.md, "What a fleet owns").

Changing one of these is a contract change: the router's discovery and `kubectl` selectors read them.
"""

from __future__ import annotations

from dataclasses import dataclass

# The ports and env names a server and its pod agree on are the contract's (adpfleet/contract/);
# the operator's modules name them through this module, as every other name a fleet relies on.
from adpfleet.contract.env import LEADER_ADDRESS_ENV, RESERVED_ENV, VLLM_API_KEY_ENV  # noqa: F401
from adpfleet.contract.ports import ROUTER_HTTP_PORT, SERVER_GROUP_PORT, SERVER_HTTP_PORT, SERVER_KV_PORT  # noqa: F401
from adpfleet.model_uri import CACHE_MOUNT_PATH

GROUP = "adpfleet.io"
VERSION = "v1alpha1"
KIND = "InferenceFleet"
PLURAL = "inferencefleets"
SINGULAR = "inferencefleet"
SHORT_NAMES = ["ifleet"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

# One role's scale target (`kubectl scale ifrole <fleet>-<role>`, an HPA's or KEDA's scaleTargetRef):
# the CRD allows one scale subresource per kind, and a fleet has two roles.
ROLE_KIND = "InferenceFleetRole"
ROLE_PLURAL = "inferencefleetroles"
ROLE_SINGULAR = "inferencefleetrole"
ROLE_SHORT_NAMES = ["ifrole"]
ROLE_CRD_NAME = f"{ROLE_PLURAL}.{GROUP}"

ROLES = ("context", "generation")  # the server roles a fleet runs; each is a spec field of that name

MANAGER = "adpfleet-operator"  # app.kubernetes.io/managed-by, the field manager and the Events' source
FINALIZER = f"{GROUP}/operator"

# Labels on everything a fleet owns, plus role and index on server pods.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_FLEET = f"{GROUP}/fleet"
LABEL_ROLE = f"{GROUP}/role"    # context | generation; the router discovers servers by it
LABEL_INDEX = f"{GROUP}/index"  # the server's slot in its role: <fleet>-<role>-<index>
LABEL_NODE_RANK = f"{GROUP}/node-rank"  # a server over several pods: the pod's place in it (0 the leader)
LABEL_WORKER = f"{GROUP}/worker"        # "true" on a server's pods other than its leader: never discovered

ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"  # what the object was built from; a change means replace
ANNOTATION_PODS_PER_SERVER = f"{GROUP}/pods-per-server"  # a server over several pods: how many it has
ANNOTATION_DRAIN = f"{GROUP}/drain"                  # "true": the router sends this server no new requests
ANNOTATION_SCALE_DOWN = f"{GROUP}/scale-down"        # RFC 3339 time: drained since then, deleted once idle
ANNOTATION_SPEC_SERVERS = f"{GROUP}/spec-servers"    # on an InferenceFleetRole: the fleet's servers it last took
ANNOTATION_SCALE_DECISION = f"{GROUP}/scale-decision"  # on an InferenceFleetRole: the operator's last change (JSON)
RESERVED_ANNOTATIONS = (ANNOTATION_TEMPLATE_HASH, ANNOTATION_DRAIN, ANNOTATION_SCALE_DOWN)
RESERVED_LABEL_PREFIXES = (f"{GROUP}/", "app.kubernetes.io/")

FETCH_CONTAINER = "fetch-model"  # its init container fetching (or checking) the model; the operator reads its log


# What the operator sets in every pod of a fleet, and a pod template therefore may not
# (docs/operator.md, "Pod templates"). decisions/desired.py builds the pods from these names.
SERVER_CONTAINER = "server"  # the container running `adpfleet serve`; a template entry of this name amends it
ROUTER_CONTAINER = "router"
SCRATCH_VOLUME, SCRATCH_DIR = "scratch", "/var/tmp"  # HOME and TMPDIR (the root filesystem is read-only)
SHM_VOLUME, SHM_DIR = "shm", "/dev/shm"              # tensors shared by rank processes, NCCL
DOWNWARD_ENV = {"POD_IP": "status.podIP", "POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
SCRATCH_ENV = ("HOME", "TMPDIR")
THREADS_ENV = "OMP_NUM_THREADS"  # engine.threadsPerRank
TOKEN_ENV = "HF_TOKEN"           # model.tokenSecretRef (the fetch-model init container's)


@dataclass(frozen=True)
class OwnedPodParts:
    """The names in a pod that belong to the operator: its main container, and that container's
    environment variables, volumes and mount paths."""
    container: str
    env: tuple[str, ...]
    volumes: tuple[str, ...]
    mount_paths: tuple[str, ...]


# RESERVED_ENV (the contract's): the credentials from Secrets and fault injection, which neither a
# fleet's `env` nor a pod template may name (docs/security.md).
# The model's volumes (decisions/desired.py): the download cache (hf://, s3://) and a pvc:// claim.
# The server never carries TOKEN_ENV: credentials reach the fetch-model init container only.
MODEL_CACHE_VOLUME, MODEL_SOURCE_VOLUME = "model-cache", "model-source"
# vllm.cache (engines/vllm.py): vLLM's cache root on a volume that outlives the pod
VLLM_CACHE_VOLUME, VLLM_CACHE_DIR = "vllm-cache", "/var/cache/adpfleet/vllm"
SERVER_OWNS = OwnedPodParts(SERVER_CONTAINER, (*DOWNWARD_ENV, *SCRATCH_ENV, THREADS_ENV, *RESERVED_ENV),
                            (SCRATCH_VOLUME, SHM_VOLUME, MODEL_CACHE_VOLUME, MODEL_SOURCE_VOLUME, VLLM_CACHE_VOLUME),
                            (SCRATCH_DIR, SHM_DIR, CACHE_MOUNT_PATH, VLLM_CACHE_DIR))
# the router is adpfleet's whatever the servers run: vLLM's key name means nothing to it
ROUTER_OWNS = OwnedPodParts(ROUTER_CONTAINER, (*DOWNWARD_ENV, *SCRATCH_ENV,
                                               *(e for e in RESERVED_ENV if e != VLLM_API_KEY_ENV)), (SCRATCH_VOLUME,),
                            (SCRATCH_DIR,))
DEFAULT_CONTAINER_ANNOTATION = "kubectl.kubernetes.io/default-container"  # `kubectl logs` without -c

MAX_FLEET_NAME = 40  # "<fleet>-generation-<index>" and "<fleet>-router" must stay valid DNS labels


FleetKey = tuple[str, str]  # (namespace, fleet name): how the operator's loops, inbox and metrics index a fleet


@dataclass(frozen=True)
class FleetRef:
    """One InferenceFleet, as its children and Events point at it."""
    name: str
    namespace: str
    uid: str

    @property
    def key(self) -> FleetKey:
        return self.namespace, self.name

    def owner_reference(self) -> dict:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def server_name(fleet: str, role: str, index: int) -> str:
    return f"{fleet}-{role}-{index}"


def group_pod_name(fleet: str, role: str, index: int, node_rank: int) -> str:
    """Pod `node_rank` of a server over several pods (0: the leader)."""
    return f"{server_name(fleet, role, index)}-{node_rank}"


def group_service_name(fleet: str, role: str) -> str:
    """The headless Service whose DNS names the leaders of a role's servers over several pods."""
    return f"{fleet}-{role}-group"


def leader_address(fleet: str, role: str, index: int, namespace: str) -> str:
    """The leader's stable DNS name: <pod hostname>.<headless Service>.<namespace>.svc (the cluster
    domain comes from the pod's DNS search path)."""
    return f"{group_pod_name(fleet, role, index, 0)}.{group_service_name(fleet, role)}.{namespace}.svc"


def role_object_name(fleet: str, role: str) -> str:
    """The InferenceFleetRole of one role of a fleet."""
    return f"{fleet}-{role}"


def role_selector(fleet: str, role: str) -> str:
    """The label selector of one role's server pods."""
    return f"{LABEL_FLEET}={fleet},{LABEL_ROLE}={role}"


def router_name(fleet: str) -> str:
    """The router's Deployment, Service, ServiceAccount, Role and RoleBinding all share this name."""
    return f"{fleet}-router"


def budget_name(fleet: str, component: str) -> str:
    """The PodDisruptionBudget of a role (`context`, `generation`) or of the router."""
    return f"{fleet}-{component}"


def common_labels(fleet: str, component: str) -> dict[str, str]:
    return {LABEL_NAME: "adpfleet", LABEL_INSTANCE: fleet, LABEL_COMPONENT: component,
            LABEL_MANAGED_BY: MANAGER, LABEL_FLEET: fleet}


def server_labels(fleet: str, role: str, index: int) -> dict[str, str]:
    return {**common_labels(fleet, f"{role}-server"), LABEL_ROLE: role, LABEL_INDEX: str(index)}


def router_selector(fleet: str) -> dict[str, str]:
    return {LABEL_INSTANCE: fleet, LABEL_COMPONENT: "router", LABEL_MANAGED_BY: MANAGER}


def discovery_selector(fleet: str) -> str:
    """The label selector the router watches: this fleet's pods that have a server role (router
    pods carry the fleet label but no role, so they never discover themselves), leaders only (the
    workers of a server over several pods serve no API)."""
    return f"{LABEL_FLEET}={fleet},{LABEL_ROLE},!{LABEL_WORKER}"
