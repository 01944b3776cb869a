"""The objects a fleet should have, as plain manifests: a pure function of its spec.

Server pods (one per server, `<fleet>-<role>-<index>`, running the fleet's engine: its renderer in
`engines/` writes the server container's command, flags, env and probes), the router: a Deployment running
`adpfleet router` with Kubernetes discovery, its Service, and a ServiceAccount bound to a Role that
can read pods in the fleet's namespace and nothing else; and a PodDisruptionBudget per role and for
the router. A role's (or the router's) pod template is laid over its pods (`pod_template.py`).

Every object carries `adpfleet.io/template-hash`: a digest of what it was built from. A server pod
whose hash differs from its role's current one is rolled; any other child whose hash differs is
re-applied. Comparing digests instead of fields means defaults the API server adds never look like
drift.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass

from adpfleet.operator.decisions import security
from adpfleet.operator.decisions.security import SecurityConfig
from adpfleet.model_uri import CACHE_LIMIT_ENV, CACHE_MOUNT_PATH, PVC_MOUNT_ROOT, TERMINATION_LOG
from adpfleet.operator.decisions import gang as gangs
from adpfleet.operator.decisions import engines, pod_template
from adpfleet.operator.decisions.engines import adpfleet as adpfleet_engine
from adpfleet.contract import quantity
from adpfleet.contract.engines import ADPFLEET
from adpfleet.contract.router_policy import CACHE_AWARE
from adpfleet.operator.resource import names
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.resource.engine import LABEL_ENGINE
from adpfleet.operator.resource.kube_types import Resources
from adpfleet.operator.resource.model_source import ModelSource
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.server_role import GangScheduling


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


# ---- pieces shared by servers and router ----

_RESOURCE_KEYS = {"cpu": "cpu", "memory": "memory", "ephemeralStorage": "ephemeral-storage"}


def _resource_requirements(resources: Resources, gpus: int = 0, gpu_resource: str = "") -> dict:
    out: dict[str, dict] = {}
    for side in ("requests", "limits"):
        amounts = {_RESOURCE_KEYS[k]: v for k, v in getattr(resources, side).to_kube().items()}
        if gpus:
            amounts[gpu_resource] = str(gpus)  # extended resources: request must equal limit
        if amounts:
            out[side] = amounts
    return out


def _downward_env() -> list[dict]:
    return [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}} for var, path in names.DOWNWARD_ENV.items()]


# The uid of the images' `adpfleet` user (docker/*.Dockerfile).
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}
# The root filesystem is read-only, so the writable places are volumes: a scratch directory that
# HOME and TMPDIR point at (compiler and library caches, temporary files), and /dev/shm (tensors
# shared between rank processes, NCCL buffers; a container's default 64 MiB is too small).
# /var/tmp rather than /tmp: the local node agent keeps its pods' state under /tmp, and a volume
# mounted over it would hide that state from the container's own start-up.
SCRATCH_VOLUMES = [{"name": names.SCRATCH_VOLUME, "emptyDir": {}}, {"name": names.SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
SCRATCH_MOUNTS = [{"name": names.SCRATCH_VOLUME, "mountPath": names.SCRATCH_DIR},
                  {"name": names.SHM_VOLUME, "mountPath": names.SHM_DIR}]
# the EnvVars of names.SCRATCH_ENV
SCRATCH_ENV_VARS = [{"name": var, "value": names.SCRATCH_DIR} for var in names.SCRATCH_ENV]


# A container that cannot have its model (or crashes) says why where Kubernetes shows it: the JSON
# of adpfleet.model_uri.termination_message, else the end of its log.
TERMINATION_MESSAGE = {"terminationMessagePath": TERMINATION_LOG, "terminationMessagePolicy": "FallbackToLogsOnError"}


def _pod_metadata_extras(spec: FleetSpec, template) -> tuple[dict, dict]:
    labels, annotations = pod_template.metadata(spec.pod_metadata.labels, spec.pod_metadata.annotations, template)
    return labels, {**annotations, **pod_template.default_container(template)}


# ---- the model: fetched by an init container, read by the server ----
#
# hf:// and s3:// sources are downloaded by `adpfleet fetch-model` (the same image) into the cache
# volume (an emptyDir, or the claim named in model.cache), which the server mounts read-only and
# finds complete; a pvc:// source's claim is mounted read-only at PVC_MOUNT_ROOT/<claim>, and
# fetch-model checks it (and an in-image directory) the way loading would refuse it, so a model that
# cannot be had is the init container's termination message, not a server crash loop. Credentials
# reach the init container only: the server reads files.

CACHE_VOLUME = names.MODEL_CACHE_VOLUME
MODEL_CLAIM_VOLUME = names.MODEL_SOURCE_VOLUME


def _model_volumes(model: ModelSource) -> list[dict]:
    uri = model.parsed
    volumes = []
    if uri.downloads:
        if model.cache.claim_name:
            volumes.append({"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": model.cache.claim_name}})
        else:
            volumes.append({"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": model.cache.size_limit}
                            if model.cache.size_limit else {}})
    if uri.kind == "pvc":
        volumes.append({"name": MODEL_CLAIM_VOLUME,
                        "persistentVolumeClaim": {"claimName": uri.name, "readOnly": True}})
    return volumes


def _model_mounts(model: ModelSource, fetching: bool) -> list[dict]:
    uri = model.parsed
    mounts = []
    if uri.downloads:
        mounts.append({"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT_PATH, **({} if fetching else {"readOnly": True})})
    if uri.kind == "pvc":
        mounts.append({"name": MODEL_CLAIM_VOLUME, "mountPath": f"{PVC_MOUNT_ROOT}/{uri.name}", "readOnly": True})
    return mounts


def _source_env(model: ModelSource) -> list[dict]:
    """What the download needs: HF_TOKEN and HF_ENDPOINT (hf://), the AWS variables (s3://), the
    emptyDir cache's size limit."""
    kind = model.parsed.kind
    env = []
    if model.token_secret_ref:
        ref = model.token_secret_ref
        env.append({"name": names.TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    if model.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL" if kind == "s3" else "HF_ENDPOINT", "value": model.endpoint})
    if model.parsed.downloads and model.cache.size_limit:
        # the kubelet enforces an emptyDir's sizeLimit by evicting the pod: fetch-model checks it first
        env.append({"name": CACHE_LIMIT_ENV, "value": str(int(quantity.parse(model.cache.size_limit)))})
    if model.credentials_secret_ref:
        name = model.credentials_secret_ref.name
        for key, optional in S3_SECRET_KEYS.items():
            ref = {"name": name, "key": key, **({"optional": True} if optional else {})}
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


# The keys of model.credentialsSecretRef, each the variable it becomes: required, or used when present.
S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID": False, "AWS_SECRET_ACCESS_KEY": False, "AWS_SESSION_TOKEN": True,
                  "AWS_REGION": True}


def _fetch_container(spec: FleetSpec, role: str) -> dict | None:
    """The init container that fetches (or checks) the model; None for a built-in model."""
    if spec.model.parsed.kind == "builtin":
        return None
    r = spec.role(role)
    return {
        "name": names.FETCH_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["adpfleet"],
        # adpfleet's image fetches, and checks the model as the fleet's engine will load it
        "args": ["fetch-model", *adpfleet_engine.model_args(spec.model), "--engine", spec.engine],
        "env": _downward_env() + SCRATCH_ENV_VARS + _source_env(spec.model) + [e.to_kube() for e in r.env],
        "resources": _resource_requirements(r.resources),  # no GPUs: a download needs none
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [SCRATCH_MOUNTS[0]] + _model_mounts(spec.model, fetching=True),
        **TERMINATION_MESSAGE,
    }


# ---- servers ----
#
# One way through: the role's shared container parts, then the engine's renderer (engines/), then the
# credentials the engine takes, then the role's pod template over the whole pod.

def _server_container(fleet: FleetRef, spec: FleetSpec, role: str) -> dict:
    """The `server` container: the engine's part, inside what every server shares."""
    r = spec.role(role)
    engine = engines.renderer(spec.engine)
    part = engine.server_container(spec, role)
    return {
        "name": names.SERVER_CONTAINER,
        "imagePullPolicy": spec.image_pull_policy,
        **part,
        # the role's env after the engine's (it may use them); the credentials last (nothing overrides them)
        "env": _downward_env() + SCRATCH_ENV_VARS + part["env"] + [e.to_kube() for e in r.env]
        + engine.credential_env(fleet, spec),
        "resources": _resource_requirements(r.resources, r.gpus_per_server // r.pods_per_server,
                                            spec.gpu_resource_name),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": SCRATCH_MOUNTS + _model_mounts(spec.model, fetching=False) + part["volumeMounts"],
        **TERMINATION_MESSAGE,
    }


def _server_pod_spec(fleet: FleetRef, spec: FleetSpec, role: str) -> dict:
    r = spec.role(role)
    pod_spec = {
        "containers": [_server_container(fleet, spec, role)],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": r.termination_grace_period_seconds,
        "automountServiceAccountToken": False,  # servers never talk to the API server
        "enableServiceLinks": False,
        "securityContext": POD_SECURITY,
        "volumes": SCRATCH_VOLUMES + _model_volumes(spec.model) + engines.renderer(spec.engine).server_volumes(spec),
    }
    fetch = _fetch_container(spec, role)
    if fetch:
        pod_spec["initContainers"] = [fetch]
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = [t.to_kube() for t in r.tolerations]
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_kube() for s in spec.image_pull_secrets]
    return pod_template.pod_spec(pod_spec, r.pod_template)


@dataclass(frozen=True)
class ServerTemplate:
    """Everything the servers of one role share; `pods(index)` adds the identity of one server."""
    fleet: FleetRef
    role: str
    pod_spec: dict
    extra_labels: dict
    extra_annotations: dict
    template_hash: str
    pods_per_server: int = 1
    gang: GangScheduling | None = None  # the role's gang scheduling (gang.py), None: off
    engine: str = "adpfleet"  # the engine its servers run (the pods' LABEL_ENGINE)

    def pod(self, index: int) -> dict:
        """The pod of a one-pod server."""
        labels = {**self.extra_labels, **names.server_labels(self.fleet.name, self.role, index),
                  LABEL_ENGINE: self.engine}
        annotations = {**self.extra_annotations, names.ANNOTATION_TEMPLATE_HASH: self.template_hash}
        if self.gang is not None:  # in the server's PodGroup, named after the server
            group_labels, group_annotations = gangs.pod_markers(
                self.gang, names.server_name(self.fleet.name, self.role, index))
            labels, annotations = {**labels, **group_labels}, {**annotations, **group_annotations}
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": names.server_name(self.fleet.name, self.role, index),
                         "namespace": self.fleet.namespace, "labels": labels, "annotations": annotations,
                         "ownerReferences": [self.fleet.owner_reference()]},
            "spec": self.pod_spec,
        }

    def pod_group(self, index: int) -> dict | None:
        """The PodGroup of server `index` (None without gang scheduling): applied before its pods."""
        if self.gang is None:
            return None
        return gangs.pod_group(self.fleet, self.role, index, self.gang, self.pods(index))

    def pods(self, index: int) -> list[dict]:
        """Every pod of server `index`, leader first: created together, as one unit."""
        if self.pods_per_server == 1:
            return [self.pod(index)]
        return [self._group_pod(index, j) for j in range(self.pods_per_server)]

    def _group_pod(self, index: int, node_rank: int) -> dict:
        """Pod `node_rank` of a server over several pods: `<fleet>-<role>-<index>-<node_rank>`, named in
        DNS through the role's headless Service (hostname + subdomain, as a StatefulSet's pods are),
        told its share of the ranks and where its leader is."""
        pod = self.pod(index)
        fleet, role = self.fleet.name, self.role
        name = names.group_pod_name(fleet, role, index, node_rank)
        pod["metadata"]["name"] = name
        pod["metadata"]["labels"] = {**pod["metadata"]["labels"], names.LABEL_NODE_RANK: str(node_rank),
                                     **({names.LABEL_WORKER: "true"} if node_rank else {})}
        pod["metadata"]["annotations"] = {**pod["metadata"]["annotations"],
                                          names.ANNOTATION_PODS_PER_SERVER: str(self.pods_per_server)}
        spec = copy.deepcopy(self.pod_spec)
        spec["hostname"], spec["subdomain"] = name, names.group_service_name(fleet, role)
        for container in spec["containers"]:
            if container["name"] == names.SERVER_CONTAINER:
                container["args"] = [*container["args"], "--nodes", str(self.pods_per_server),
                                     "--node-rank", str(node_rank), "--group-port", str(names.SERVER_GROUP_PORT)]
                leader = names.leader_address(fleet, role, index, self.fleet.namespace)
                container["env"] = [*container.get("env", []), {"name": names.LEADER_ADDRESS_ENV, "value": leader}]
                container["ports"] = [*container.get("ports", []), {"name": "group", "containerPort":
                                                                    names.SERVER_GROUP_PORT, "protocol": "TCP"}]
        pod["spec"] = spec
        return pod


def server_template(fleet: FleetRef, spec: FleetSpec, role: str) -> ServerTemplate:
    pod_spec = _server_pod_spec(fleet, spec, role)
    labels, annotations = _pod_metadata_extras(spec, spec.role(role).pod_template)
    pods_per_server = spec.role(role).pods_per_server
    gang = spec.role(role).gang_scheduling
    if gang is not None:  # (a pod template may not name a scheduler then: models.py)
        pod_spec = {**pod_spec, "schedulerName": gangs.scheduler_name(gang)}
    hashed = {"spec": pod_spec, "labels": labels, "annotations": annotations}
    if pods_per_server > 1:  # a change of the split replaces the servers; a one-pod server's hash stays as it was
        hashed["podsPerServer"] = pods_per_server
    if gang is not None:  # so does a change of the PodGroups' settings: new groups get new PodGroups
        hashed["gangScheduling"] = gang.to_kube()
    return ServerTemplate(fleet, role, pod_spec, labels, annotations, digest(hashed), pods_per_server, gang,
                          spec.engine)


def group_services(fleet: FleetRef, spec: FleetSpec) -> list[dict]:
    """Per role whose servers span several pods, the headless Service that gives each leader its
    DNS name (`names.leader_address`); published before the leader is Ready, since the leader turns
    Ready only once its workers have found it."""
    out = []
    for role in spec.roles():
        if spec.role(role).pods_per_server == 1:
            continue
        out.append(_with_hash({
            "apiVersion": "v1", "kind": "Service",
            "metadata": _meta(fleet, names.group_service_name(fleet.name, role), f"{role}-group"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {names.LABEL_FLEET: fleet.name, names.LABEL_ROLE: role, names.LABEL_NODE_RANK: "0"},
                     "ports": [{"name": "group", "port": names.SERVER_GROUP_PORT, "targetPort": "group",
                                "protocol": "TCP"}]}}))
    return out


# ---- router ----

def router_args(fleet: FleetRef, spec: FleetSpec) -> list[str]:
    router = spec.router
    args = ["router", "--host", "$(POD_IP)", "--port", str(names.ROUTER_HTTP_PORT),
            "--kube-namespace", "$(POD_NAMESPACE)", "--kube-selector", names.discovery_selector(fleet.name),
            "--server-port", str(names.SERVER_HTTP_PORT),
            "--queue-size", str(router.queue_size), "--queue-timeout", str(router.queue_timeout_seconds),
            "--policy", router.policy]
    # the router has adpfleet's image, not the download cache (nor a vLLM image's directories), and only
    # adpfleet's servers publish their prefix caches: a vLLM fleet's router goes by load
    reads_model = spec.model.parsed.kind in ("builtin", "directory")
    if router.policy == CACHE_AWARE and spec.engine == ADPFLEET and reads_model:
        args += ["--tokenizer", spec.model.source]
    return args


def _with_hash(manifest: dict) -> dict:
    manifest["metadata"].setdefault("annotations", {})[names.ANNOTATION_TEMPLATE_HASH] = digest(manifest)
    return manifest


def _meta(fleet: FleetRef, name: str, component: str) -> dict:
    return {"name": name, "namespace": fleet.namespace, "labels": names.common_labels(fleet.name, component),
            "ownerReferences": [fleet.owner_reference()]}


def router_objects(fleet: FleetRef, spec: FleetSpec) -> list[dict]:
    """The router's ServiceAccount, Role, RoleBinding, Deployment and Service (in apply order)."""
    if not spec.router.enabled:
        return []
    name = names.router_name(fleet.name)
    extra_labels, extra_annotations = _pod_metadata_extras(spec, spec.router.pod_template)
    selector = names.router_selector(fleet.name)
    container = {
        "name": names.ROUTER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["adpfleet"],
        "args": router_args(fleet, spec),
        "env": _downward_env() + SCRATCH_ENV_VARS,
        "ports": [{"name": "http", "containerPort": names.ROUTER_HTTP_PORT, "protocol": "TCP"}],
        # Ready while it listens, not only while servers are usable: it holds requests it cannot place
        # yet (--queue-size), which is what a client should get while a role has no Ready server
        "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 2, "timeoutSeconds": 3,
                           "failureThreshold": 2},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5,
                          "failureThreshold": 3},
        "resources": _resource_requirements(spec.router.resources),
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [SCRATCH_MOUNTS[0]],
    }
    pod_spec = {"serviceAccountName": name, "containers": [container], "enableServiceLinks": False,
                "securityContext": POD_SECURITY, "volumes": [SCRATCH_VOLUMES[0]],
                "terminationGracePeriodSeconds": 30}
    sends_token = engines.renderer(spec.engine).ROUTER_SENDS_INTERNAL_TOKEN
    pod_spec = security.with_credentials(pod_spec, names.ROUTER_CONTAINER,
                                         security.reserved_env(fleet, spec, internal_token=sends_token))
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_kube() for s in spec.image_pull_secrets]
    pod_spec = pod_template.pod_spec(pod_spec, spec.router.pod_template)
    pod_labels = {**extra_labels, **names.common_labels(fleet.name, "router")}
    objects = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(fleet, name, "router")},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(fleet, name, "router"),
         # discovery: the router watches its fleet's pods (IP, readiness, role, drain); nothing else
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(fleet, name, "router"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": fleet.namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(fleet, name, "router"),
         "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": selector},
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                  "template": {"metadata": {"labels": pod_labels, "annotations": extra_annotations},
                               "spec": pod_spec}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(fleet, name, "router"),
         "spec": {"type": spec.router.service_type, "selector": selector,
                  "ports": [{"name": "http", "port": names.ROUTER_HTTP_PORT, "targetPort": "http",
                             "protocol": "TCP"}]}},
    ]
    return [_with_hash(o) for o in objects]


# ---- disruption budgets ----

def min_available(replicas: int, max_unavailable: int) -> int:
    """A budget's minAvailable: `maxUnavailable` fewer than the replicas, but never below one, so
    that an eviction (a node drain) never takes the last Ready pod of a role. An integer, not a
    percentage or maxUnavailable: the disruption controller can count a fleet's server pods only
    when it need not ask their controller (the fleet) for a scale."""
    return max(1, replicas - max_unavailable)


def disruption_budgets(fleet: FleetRef, spec: FleetSpec) -> list[dict]:
    """A PodDisruptionBudget per role (`<fleet>-<role>`) and one for the router (`<fleet>-router`)."""
    wanted = [(role, spec.role(role).disruption_budget, spec.role(role).servers,
               {names.LABEL_FLEET: fleet.name, names.LABEL_ROLE: role}, spec.role(role).pods_per_server)
              for role in spec.roles()]
    if spec.router.enabled:
        wanted.append(("router", spec.router.disruption_budget, spec.router.replicas,
                       names.router_selector(fleet.name), 1))
    return [_with_hash({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(fleet, names.budget_name(fleet.name, component), component),
        # a server over several pods counts all its pods: evicting any one takes the whole server down
        "spec": {"minAvailable": min_available(replicas, budget.max_unavailable) * pods,
                 "selector": {"matchLabels": selector},
                 # a pod that is not Ready serves nothing: evicting it never costs the budget
                 "unhealthyPodEvictionPolicy": "AlwaysAllow"}})
        for component, budget, replicas, selector, pods in wanted if budget.enabled]


@dataclass(frozen=True)
class DesiredFleet:
    servers: dict[str, ServerTemplate]   # role -> template
    replicas: dict[str, int]             # role -> servers
    objects: list[dict]                  # router objects and disruption budgets, in apply order


def desired_fleet(fleet: FleetRef, spec: FleetSpec, config: SecurityConfig = SecurityConfig()) -> DesiredFleet:
    objects = group_services(fleet, spec) + router_objects(fleet, spec) + disruption_budgets(fleet, spec)
    if config.network_policies is not None:
        objects += [_with_hash(p) for p in security.network_policies(fleet, spec, config.network_policies)]
    return DesiredFleet(
        servers={role: server_template(fleet, spec, role) for role in spec.roles()},
        replicas={role: spec.role(role).servers for role in spec.roles()},
        objects=objects)
