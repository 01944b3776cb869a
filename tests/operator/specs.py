"""Fleet manifests the operator tests share: a valid one to start from, and a catalogue of invalid
ones, each with the words the API server's (and pydantic's) refusal must contain."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

STATUS_ONLY = {"adpfleet.io/node-agent": "status-only"}  # the node agent reports such pods Ready, runs nothing


def fleet_manifest(name: str = "demo", *, status_only: bool = False, **spec_overrides: Any) -> dict:
    """A small valid fleet. `status_only`: its pods run no process (the node agent's status-only mode)."""
    spec: dict[str, Any] = {
        "image": "adpfleet:dev",
        "model": {"name": "tiny"},
        "context": {"servers": 1, "adpRanks": 1, "engine": {"kvBlocks": 64},
                    "probes": {"readinessPeriodSeconds": 1}},
        "generation": {"servers": 1, "adpRanks": 1, "engine": {"kvBlocks": 64},
                       "probes": {"readinessPeriodSeconds": 1}},
    }
    if status_only:
        spec["podMetadata"] = {"annotations": dict(STATUS_ONLY)}
    for key, value in spec_overrides.items():
        spec[key] = value
    return {"apiVersion": "adpfleet.io/v1alpha1", "kind": "InferenceFleet", "metadata": {"name": name},
            "spec": spec}


# A pod template as a GPU cluster needs one (docs/operator.md, "Pod templates"): node affinity, a
# topology spread, a priority class, a scheduler and runtime class, an extra volume mounted into the
# server, RDMA and hugepages beside the GPUs, IPC_LOCK, a sidecar and an init container.
GPU_TEMPLATE: dict = {
    "metadata": {"labels": {"team": "inference"}, "annotations": {"example.com/owner": "ml-platform"}},
    "spec": {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway",
                                       "labelSelector": {"matchLabels": {"adpfleet.io/role": "context"}}}],
        "priorityClassName": "inference-high",
        "schedulerName": "volcano",
        "runtimeClassName": "nvidia",
        "volumes": [{"name": "models", "emptyDir": {}}],
        "initContainers": [{"name": "warm-cache", "image": "busybox:1.36", "command": ["true"]}],
        "containers": [
            {"name": "server", "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}],
             "envFrom": [{"configMapRef": {"name": "nccl-tuning"}}],
             "volumeMounts": [{"name": "models", "mountPath": "/models"}],
             "resources": {"limits": {"rdma/ib": "1", "hugepages-2Mi": "1Gi"}},
             "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
            {"name": "log-shipper", "image": "fluent/fluent-bit:3.0",
             "volumeMounts": [{"name": "scratch", "mountPath": "/logs", "readOnly": True}]},
        ],
    },
}


def gpu_role(template: dict = GPU_TEMPLATE, **extra) -> dict:
    """A role of one GPU server (memory 8Gi) with `template`."""
    return {"servers": 1, "adpRanks": 1, "gpusPerServer": 1, "engine": {"kvBlocks": 64, "device": "cuda"},
            "resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi"}}, "podTemplate": template,
            **extra}


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation setting spec.<path> (dotted); value DELETE removes the key."""
    def mutate(manifest: dict) -> None:
        node = manifest
        keys = path.split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return mutate


DELETE = object()


def _vllm(aggregated: bool = True) -> tuple[Callable[[dict], None], ...]:
    """Mutations making the small fleet a vLLM one (aggregated, unless not)."""
    out = (_set("spec.engine", "vllm"), _set("spec.vllm", {"image": "vllm/vllm-openai:v0.32.0"}),
           _set("spec.model", {"uri": "/models/llama"}))
    if aggregated:
        out += (_set("spec.context", DELETE), _set("spec.generation", DELETE), _set("spec.aggregated", {"servers": 1}))
    return out


@dataclass(frozen=True)
class InvalidSpec:
    what: str
    mutations: tuple[Callable[[dict], None], ...]
    api_words: tuple[str, ...]       # all must appear in `kubectl apply --server-side`'s error
    pydantic_words: tuple[str, ...]  # all must appear in pydantic's ValidationError ("" for none)

    def manifest(self, name: str = "bad") -> dict:
        m = copy.deepcopy(fleet_manifest(name))
        for mutate in self.mutations:
            mutate(m)
        return m


def bad(what: str, *mutations, api: tuple[str, ...], py: tuple[str, ...] | None = None) -> InvalidSpec:
    return InvalidSpec(what, tuple(mutations), api, api if py is None else py)


INVALID_SPECS = [
    bad("zero context servers", _set("spec.context.servers", 0),
        api=("spec.context.servers", "should be greater than or equal to 1"), py=("context.servers",)),
    bad("negative generation servers", _set("spec.generation.servers", -2),
        api=("spec.generation.servers", "greater than or equal to 1"), py=("generation.servers",)),
    bad("zero ADP ranks", _set("spec.context.adpRanks", 0),
        api=("spec.context.adpRanks",), py=("context.adpRanks",)),
    bad("GPUs per server not a multiple of the ADP ranks",
        _set("spec.generation.adpRanks", 2), _set("spec.generation.gpusPerServer", 3),
        _set("spec.generation.engine.device", "cuda"),
        api=("spec.generation.gpusPerServer", "multiple of adpRanks"), py=("multiple of adpRanks",)),
    bad("ADP ranks not a multiple of the pods per server",
        _set("spec.generation.adpRanks", 3), _set("spec.generation.podsPerServer", 2),
        api=("spec.generation.podsPerServer", "adpRanks must be a multiple of podsPerServer"),
        py=("multiple of podsPerServer",)),
    bad("gang scheduling by an unknown provider", _set("spec.generation.gangScheduling", {"provider": "Kueue"}),
        api=("spec.generation.gangScheduling.provider", "Unsupported value"), py=("gangScheduling.provider",)),
    bad("a Volcano PodGroup given a schedule timeout (Coscheduling's field)",
        _set("spec.generation.gangScheduling", {"provider": "Volcano", "scheduleTimeoutSeconds": 60}),
        api=("spec.generation.gangScheduling.scheduleTimeoutSeconds", "Coscheduling PodGroup's"),
        py=("Coscheduling PodGroup's",)),
    bad("a Coscheduling PodGroup given a queue (Volcano's field)",
        _set("spec.context.gangScheduling", {"provider": "Coscheduling", "queue": "high"}),
        api=("spec.context.gangScheduling.queue", "Volcano PodGroup's"), py=("Volcano PodGroup's",)),
    bad("gang scheduling and a pod template naming another scheduler",
        _set("spec.generation.gangScheduling", {"provider": "Volcano"}),
        _set("spec.generation.podTemplate", {"spec": {"schedulerName": "my-scheduler"}}),
        api=("spec.generation.podTemplate.spec.schedulerName", "gangScheduling.schedulerName"),
        py=("gangScheduling.schedulerName",)),
    bad("GPUs without the cuda device", _set("spec.context.gpusPerServer", 1),
        api=("spec.context.engine.device", "must be cuda"), py=("must be cuda",)),
    bad("missing image", _set("spec.image", DELETE), api=("spec.image", "Required value"), py=("image", "required")),
    bad("empty image", _set("spec.image", ""), api=("spec.image",), py=("image",)),
    bad("missing model", _set("spec.model", DELETE), api=("spec.model", "Required value"), py=("model", "required")),
    bad("empty model name", _set("spec.model.name", ""), api=("spec.model.name",), py=("model.name",)),
    bad("unknown remediation mode", _set("spec.remediation", {"mode": "Sometimes"}),
        api=("spec.remediation.mode", "Unsupported value", "Sometimes"), py=("remediation.mode",)),
    bad("stall window shorter than two scrape intervals",
        _set("spec.monitoring", {"scrapeIntervalSeconds": 10}), _set("spec.remediation", {"stallWindowSeconds": 15}),
        api=("spec.remediation.stallWindowSeconds", "two monitoring.scrapeIntervalSeconds"),
        py=("two monitoring.scrapeIntervalSeconds",)),
    bad("stall window the collective timeout would cut short (a hung server exits before it is seen)",
        _set("spec.monitoring", {"scrapeIntervalSeconds": 10}), _set("spec.remediation", {"stallWindowSeconds": 120}),
        api=("spec.remediation.stallWindowSeconds", "must not exceed engine.collectiveTimeoutSeconds"),
        py=("must not exceed engine.collectiveTimeoutSeconds",)),
    bad("malformed memory quantity", _set("spec.context.resources", {"requests": {"memory": "lots"}}),
        api=("spec.context.resources.requests.memory",), py=("context.resources.requests.memory",)),
    bad("memory limit below its request",
        _set("spec.generation.resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
        api=("spec.generation.resources.limits.memory", "must not be less than requests.memory"),
        py=("must not be less than requests.memory",)),
    bad("cpu limit below its request (millicores)",
        _set("spec.router.resources", {"requests": {"cpu": "1"}, "limits": {"cpu": "500m"}}),
        api=("spec.router.resources.limits.cpu",), py=("limits.cpu",)),
    bad("unknown field", _set("spec.contxt", {"servers": 2}), api=("spec.contxt", "field not declared in schema"),
        py=("contxt", "Extra inputs are not permitted")),
    bad("unknown engine field", _set("spec.context.engine.kvBlock", 64),
        api=("spec.context.engine.kvBlock", "not declared"), py=("kvBlock",)),
    bad("unknown dtype", _set("spec.context.engine.dtype", "int4"),
        api=("spec.context.engine.dtype", "Unsupported value"), py=("context.engine.dtype",)),
    bad("zero KV blocks", _set("spec.generation.engine.kvBlocks", 0),
        api=("spec.generation.engine.kvBlocks",), py=("generation.engine.kvBlocks",)),
    bad("batch larger than the active requests",
        _set("spec.context.engine.maxBatchSize", 512), _set("spec.context.engine.maxNumActiveRequests", 256),
        api=("spec.context.engine.maxBatchSize", "must not exceed maxNumActiveRequests"),
        py=("must not exceed maxNumActiveRequests",)),
    bad("zero scrape interval", _set("spec.monitoring", {"scrapeIntervalSeconds": 0}),
        api=("spec.monitoring.scrapeIntervalSeconds",), py=("monitoring.scrapeIntervalSeconds",)),
    bad("zero servers remediated at once", _set("spec.remediation", {"maxConcurrentPerRole": 0}),
        api=("spec.remediation.maxConcurrentPerRole",), py=("remediation.maxConcurrentPerRole",)),
    bad("unknown escalation action", _set("spec.remediation", {"escalation": {"action": "Panic"}}),
        api=("spec.remediation.escalation.action", "Unsupported value"), py=("escalation.action",)),
    bad("unknown router service type", _set("spec.router", {"serviceType": "Ingress"}),
        api=("spec.router.serviceType", "Unsupported value"), py=("router.serviceType",)),
    bad("unknown router policy", _set("spec.router", {"policy": "fastest"}),
        api=("spec.router.policy", "Unsupported value"), py=("router.policy",)),
    bad("servers given as a string", _set("spec.context.servers", "two"),
        api=("spec.context.servers", "expected numeric"), py=("context.servers",)),
    bad("reserved pod label", _set("spec.podMetadata", {"labels": {"adpfleet.io/role": "x"}}),
        api=("spec.podMetadata.labels", "set by the operator"), py=("set by the operator",)),
    bad("duplicate env names", _set("spec.context.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        api=("spec.context.env", "duplicate entries", 'name="A"'), py=("duplicate names",)),
    bad("token secret without a name", _set("spec.model.tokenSecretRef", {"key": "token"}),
        api=("spec.model.tokenSecretRef.name", "Required value"), py=("tokenSecretRef.name",)),
    bad("fault injection through env", _set("spec.generation.env", [{"name": "ADPFLEET_FAULT_INJECTION", "value": "1"}]),
        api=("spec.generation.env", "spec.faultInjection"), py=("spec.faultInjection",)),
    bad("the internal token through env", _set("spec.context.env", [{"name": "ADPFLEET_INTERNAL_TOKEN", "value": "x"}]),
        api=("spec.context.env", "must not set"), py=("must not set",)),
    bad("API key secret without a name", _set("spec.auth", {"apiKeySecret": {"key": "k"}}),
        api=("spec.auth.apiKeySecret.name", "Required value"), py=("apiKeySecret.name",)),
    bad("client CIDR without a prefix length", _set("spec.networkPolicy", {"clientCidrs": ["10.0.0.1"]}),
        api=("spec.networkPolicy.clientCidrs[0]",), py=("networkPolicy.clientCidrs",)),
    bad("prompt lookup min above max", _set("spec.context.engine.promptLookupMin", 5),
        api=("spec.context.engine.promptLookupMin", "must not exceed promptLookupMax"),
        py=("must not exceed promptLookupMax",)),
    bad("draft tokens beyond the token budget", _set("spec.context.engine.draftTokens", 8),
        _set("spec.context.engine.maxNumTokens", 8),
        api=("spec.context.engine.maxNumTokens", "decode query"), py=("decode query",)),
    # model sources (the URI rules are URI_RULES in model_source.py, twinned with adpfleet/model_uri.py)
    bad("a model URI with an unknown scheme", _set("spec.model", {"uri": "gs://models/llama"}),
        api=("spec.model.uri", "the scheme must be hf://, s3://, pvc:// or file://"),
        py=("model.uri", "the scheme must be")),
    bad("an hf:// URI without a repository", _set("spec.model", {"uri": "hf://@main"}),
        api=("spec.model.uri", "hf:// needs a repository"), py=("model.uri", "hf:// needs a repository")),
    bad("an hf:// revision that is not one", _set("spec.model", {"uri": "hf://org/repo@a..b"}),
        api=("spec.model.uri", "the revision after '@'"), py=("model.uri", "the revision after '@'")),
    bad("a pvc:// claim that is not a DNS name", _set("spec.model", {"uri": "pvc://Model_Store/llama"}),
        api=("spec.model.uri", "pvc:// needs a PersistentVolumeClaim name"),
        py=("model.uri", "pvc:// needs a PersistentVolumeClaim name")),
    bad("an s3:// bucket that is not one", _set("spec.model", {"uri": "s3://My_Bucket/llama"}),
        api=("spec.model.uri", "s3:// needs a bucket name"), py=("model.uri", "s3:// needs a bucket name")),
    bad("a model name (the older field) with a bad URI", _set("spec.model", {"name": "pvc://claim/../etc"}),
        api=("spec.model.name", "must not contain '.' or '..' segments"),
        py=("model.name", "must not contain '.' or '..' segments")),
    bad("both uri and name", _set("spec.model", {"uri": "tiny", "name": "tiny"}),
        api=("spec.model.uri", "set exactly one of uri and name"), py=("set exactly one of uri and name",)),
    bad("a cache size that is not a quantity", _set("spec.model", {"uri": "hf://org/repo", "cache": {"sizeLimit": "lots"}}),
        api=("spec.model.cache.sizeLimit",), py=("model.cache.sizeLimit",)),
    bad("a cache claim that is not a DNS name",
        _set("spec.model", {"uri": "hf://org/repo", "cache": {"claimName": "Model_Cache"}}),
        api=("spec.model.cache.claimName",), py=("model.cache.claimName",)),
    bad("a cache with both a size limit and a claim",
        _set("spec.model", {"uri": "hf://org/repo", "cache": {"sizeLimit": "1Gi", "claimName": "cache"}}),
        api=("spec.model.cache.sizeLimit", "set one of sizeLimit and claimName"),
        py=("set one of sizeLimit and claimName",)),
    bad("an endpoint that is not an http(s) URL", _set("spec.model", {"uri": "s3://models/x", "endpoint": "minio:9000"}),
        api=("spec.model.endpoint",), py=("model.endpoint",)),
    bad("an endpoint for a pvc:// source", _set("spec.model", {"uri": "pvc://models/x", "endpoint": "http://minio:9000"}),
        api=("spec.model.endpoint", "endpoint is for hf:// and s3:// sources"),
        py=("endpoint is for hf:// and s3:// sources",)),
    bad("S3 credentials for an hf:// source",
        _set("spec.model", {"uri": "hf://org/repo", "credentialsSecretRef": {"name": "s3"}}),
        api=("spec.model.credentialsSecretRef", "credentialsSecretRef is for s3:// sources"),
        py=("credentialsSecretRef is for s3:// sources",)),
    # engines and the aggregated role (resource/engine.py)
    bad("an engine the operator does not know", _set("spec.engine", "sglang"),
        api=("spec.engine", "Unsupported value"), py=("engine",)),
    bad("an aggregated role beside context and generation", _set("spec.aggregated", {"servers": 1}),
        api=("spec.aggregated", "set either aggregated or context and generation"),
        py=("set either aggregated or context and generation",)),
    bad("a disaggregated vLLM fleet", *_vllm(aggregated=False),
        api=("spec.engine", "aggregated fleets only"), py=("aggregated fleets only",)),
    bad("a vLLM fleet without its vllm section", *_vllm(), _set("spec.vllm", DELETE),
        api=("spec.vllm", "set exactly when engine is vllm"), py=("set exactly when engine is vllm",)),
    bad("a vllm section on an adpfleet fleet", _set("spec.vllm", {"image": "vllm/vllm-openai:v0.32.0"}),
        api=("spec.vllm", "set exactly when engine is vllm"), py=("set exactly when engine is vllm",)),
    bad("vllm.args setting the operator's port",
        *_vllm(), _set("spec.vllm.args", ["--dtype", "float32", "--port", "9000"]),
        api=("spec.vllm.args", "must not set --host, --port"), py=("vllm.args must not set",)),
    bad("vllm.args setting the data-parallel size as --flag=value",
        *_vllm(), _set("spec.vllm.args", ["--data-parallel-size=4"]),
        api=("spec.vllm.args", "must not set"), py=("vllm.args must not set",)),
    bad("a vLLM cache with neither hostPath nor persistentVolumeClaim", *_vllm(), _set("spec.vllm.cache", {}),
        api=("spec.vllm.cache.hostPath", "vllm.cache needs exactly one of hostPath and persistentVolumeClaim"),
        py=("vllm.cache needs exactly one of hostPath and persistentVolumeClaim",)),
    bad("a vLLM cache on both a hostPath and a claim", *_vllm(),
        _set("spec.vllm.cache", {"hostPath": {"path": "/var/cache/vllm"}, "persistentVolumeClaim": {"claimName": "c"}}),
        api=("spec.vllm.cache.hostPath", "vllm.cache needs exactly one of hostPath and persistentVolumeClaim"),
        py=("vllm.cache needs exactly one of hostPath and persistentVolumeClaim",)),
    bad("a vLLM cache on a relative hostPath", *_vllm(), _set("spec.vllm.cache", {"hostPath": {"path": "cache"}}),
        api=("spec.vllm.cache.hostPath.path", "should match"), py=("cache.hostPath.path",)),
    bad("a vLLM cache on a hostPath with a '..' segment", *_vllm(),
        _set("spec.vllm.cache", {"hostPath": {"path": "/var/cache/../vllm"}}),
        api=("spec.vllm.cache.hostPath.path", "must not contain '..' segments"), py=("must not contain '..'",)),
    bad("a vLLM fleet serving a built-in model", *_vllm(), _set("spec.model", {"uri": "tiny"}),
        api=("spec.model", "built-in models tiny, tiny-dense are adpfleet's own"), py=("adpfleet's own",)),
    bad("a vLLM server over several pods", *_vllm(), _set("spec.aggregated.adpRanks", 2),
        _set("spec.aggregated.podsPerServer", 2),
        api=("spec.aggregated.podsPerServer", "must be 1"), py=("podsPerServer must be 1",)),
    bad("vLLM's API key through env", _set("spec.generation.env", [{"name": "VLLM_API_KEY", "value": "k"}]),
        api=("spec.generation.env", "must not set", "VLLM_API_KEY"), py=("must not set", "VLLM_API_KEY")),
]


def _template(role: str, spec: dict | None = None, **template) -> Callable[[dict], None]:
    """A mutation giving `role` (context, generation or router) a pod template."""
    return _set(f"spec.{role}.podTemplate", {**({"spec": spec} if spec is not None else {}), **template})


def _server(**fields) -> dict:
    return {"name": "server", **fields}


SIDECAR = {"name": "log-shipper", "image": "fluent/fluent-bit:3.0"}
T = "spec.context.podTemplate"

# Pod templates the API server refuses, by the Kubernetes schema or by the operator's rules.
INVALID_TEMPLATES = [
    bad("template: a misspelt affinity field",
        _template("context", {"affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}}),
        api=(f"{T}.spec.affinity.nodeAffinity.requiredDuringScheduling", "field not declared in schema"),
        py=("spec.affinity.nodeAffinity.requiredDuringScheduling", "field not declared")),
    bad("template: priorityClassName given as a number", _template("generation", {"priorityClassName": 5}),
        api=("spec.generation.podTemplate.spec.priorityClassName", "expected string"),
        py=("spec.priorityClassName", "must be of type string")),
    bad("template: a topology spread without topologyKey",
        _template("context", {"topologySpreadConstraints": [{"maxSkew": 1, "whenUnsatisfiable": "DoNotSchedule"}]}),
        api=(f"{T}.spec.topologySpreadConstraints[0].topologyKey", "Required value"),
        py=("spec.topologySpreadConstraints[0].topologyKey: Required value",)),
    bad("template: an unknown whenUnsatisfiable",
        _template("context", {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                             "whenUnsatisfiable": "Sometimes"}]}),
        api=(f"{T}.spec.topologySpreadConstraints[0].whenUnsatisfiable", "Unsupported value", "Sometimes"),
        py=("whenUnsatisfiable: Unsupported value",)),
    bad("template: a pod field the operator owns (hostNetwork)", _template("context", {"hostNetwork": True}),
        api=(f"{T}.spec.hostNetwork", "field not declared in schema"), py=("spec.hostNetwork", "not declared")),
    bad("template: a sidecar without a name", _template("context", {"containers": [{"image": "busybox"}]}),
        api=(f"{T}.spec.containers", "omits all key fields [\"name\"]"),
        py=("spec.containers[0].name: Required value",)),
    bad("template: a sidecar without an image", _template("context", {"containers": [{"name": "log-shipper"}]}),
        api=(f"{T}.spec.containers", "sidecars) need an image"), py=("sidecars) need an image",)),
    bad("template: the server container's command",
        _template("context", {"containers": [_server(command=["sleep", "infinity"])]}),
        api=(f"{T}.spec.containers", "containers[name=server] may set only env", "set by the operator"),
        py=("containers[name=server] may set only env",)),
    bad("template: the server container's probes",
        _template("generation", {"containers": [_server(readinessProbe={"tcpSocket": {"port": 8000}})]}),
        api=("spec.generation.podTemplate.spec.containers", "probes"), py=("may set only env",)),
    bad("template: a volume named like the operator's", _template("context", {"volumes": [{"name": "shm",
                                                                                          "emptyDir": {}}]}),
        api=(f"{T}.spec.volumes", "volumes scratch, shm, model-cache, model-source, vllm-cache are the operator's"),
        py=("volumes scratch, shm, model-cache, model-source, vllm-cache are the operator's",)),
    bad("template: two volumes of one name",
        _template("context", {"volumes": [{"name": "models", "emptyDir": {}}, {"name": "models", "emptyDir": {}}]}),
        api=(f"{T}.spec.volumes", "duplicate entries for key", 'name="models"'),
        py=("spec.volumes[1]: Duplicate value",)),
    bad("template: a mount of a volume that is not there",
        _template("context", {"containers": [_server(volumeMounts=[{"name": "models", "mountPath": "/models"}])]}),
        api=(f"{T}.spec.containers", "every volumeMount names a volume of the template"),
        py=("every volumeMount names a volume",)),
    bad("template: a mount over the operator's /dev/shm",
        _template("context", {"volumes": [{"name": "big-shm", "emptyDir": {"medium": "Memory"}}],
                              "containers": [_server(volumeMounts=[{"name": "big-shm", "mountPath": "/dev/shm"}])]}),
        api=(f"{T}.spec.containers",
             "/var/tmp, /dev/shm, /var/cache/adpfleet/models, /var/cache/adpfleet/vllm are mounted by the operator"),
        py=("/dev/shm, /var/cache/adpfleet/models, /var/cache/adpfleet/vllm are mounted by the operator",)),
    bad("template: the server's POD_IP", _template("context", {"containers": [_server(env=[{"name": "POD_IP",
                                                                                             "value": "1.2.3.4"}])]}),
        api=(f"{T}.spec.containers", "POD_IP", "set by the operator"), py=("POD_IP",)),
    bad("template: vLLM's API key in the server container",
        _template("generation", {"containers": [_server(env=[{"name": "VLLM_API_KEY", "value": "k"}])]}),
        api=("spec.generation.podTemplate.spec.containers", "VLLM_API_KEY", "set by the operator"),
        py=("VLLM_API_KEY",)),
    bad("template: an env name set twice (env and the template)",
        _set("spec.generation.env", [{"name": "NCCL_DEBUG", "value": "INFO"}]),
        _template("generation", {"containers": [_server(env=[{"name": "NCCL_DEBUG", "value": "WARN"}])]}),
        api=("spec.generation.podTemplate.spec.containers", "set both in env and in the server container's env"),
        py=("set both in env",)),
    bad("template: cpu in the server container (the role's resources set it)",
        _template("context", {"containers": [_server(resources={"limits": {"cpu": "4"}})]}),
        api=(f"{T}.spec.containers", "cpu, memory, ephemeral-storage are set by"),
        py=("cpu, memory, ephemeral-storage are set by",)),
    bad("template: GPUs in the server container (gpusPerServer requests them)",
        _template("context", {"containers": [_server(resources={"limits": {"nvidia.com/gpu": "1"}})]}),
        api=(f"{T}.spec.containers", "requested by gpusPerServer"), py=("requested by gpusPerServer",)),
    bad("template: a malformed quantity in a sidecar",
        _template("context", {"containers": [{**SIDECAR, "resources": {"limits": {"memory": "lots"}}}]}),
        api=(f"{T}.spec.containers[0].resources.limits.memory", "should match"), py=("memory", "should match")),
    bad("template: an init container named server",
        _template("context", {"initContainers": [{"name": "server", "image": "busybox"}]}),
        api=(f"{T}.spec.initContainers", "names of their own"), py=("names of their own",)),
    bad("template: a reserved label", _template("context", metadata={"labels": {"adpfleet.io/role": "x"}}),
        api=(f"{T}.metadata.labels", "set by the operator"), py=("set by the operator",)),
    bad("template: the router container's ports",
        _template("router", {"containers": [{"name": "router", "ports": [{"containerPort": 9000}]}]}),
        api=("spec.router.podTemplate.spec.containers", "containers[name=router] may set only env"),
        py=("containers[name=router] may set only env",)),
]
INVALID_SPECS += INVALID_TEMPLATES

# Names the root rule refuses: (name, words)
INVALID_NAMES = [
    ("a" * 41, ("metadata.name", "at most 40 characters")),
    ("9lives", ("metadata.name", "starting with a letter")),
]
