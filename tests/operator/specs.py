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
]

# Names the root rule refuses: (name, words)
INVALID_NAMES = [
    ("a" * 41, ("metadata.name", "at most 40 characters")),
    ("9lives", ("metadata.name", "starting with a letter")),
]
