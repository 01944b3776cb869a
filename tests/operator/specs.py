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
    bad("servers given as a string", _set("spec.context.servers", "two"),
        api=("spec.context.servers", "expected numeric"), py=("context.servers",)),
    bad("reserved pod label", _set("spec.podMetadata", {"labels": {"adpfleet.io/role": "x"}}),
        api=("spec.podMetadata.labels", "set by the operator"), py=("set by the operator",)),
    bad("duplicate env names", _set("spec.context.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
        api=("spec.context.env", "duplicate entries", 'name="A"'), py=("duplicate names",)),
    bad("token secret without a name", _set("spec.model.tokenSecretRef", {"key": "token"}),
        api=("spec.model.tokenSecretRef.name", "Required value"), py=("tokenSecretRef.name",)),
    # model sources (the URI rules are URI_RULES in models.py, twinned with adpfleet/model_uri.py)
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
]

# Names the root rule refuses: (name, words)
INVALID_NAMES = [
    ("a" * 41, ("metadata.name", "at most 40 characters")),
    ("9lives", ("metadata.name", "starting with a letter")),
]
