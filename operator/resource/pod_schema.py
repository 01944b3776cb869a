"""The Kubernetes pod schema that a fleet's pod templates are checked against.

`pod_schema.json` beside this file is the subset of a real kube-apiserver's `/openapi/v3/api/v1`
that a template may reach, verbatim: the definitions reachable from the pod-spec fields in
`POD_SPEC_FIELDS`, from the Kubernetes version in its `kubernetesVersion` (the project's pinned
control plane, tools/k8s/versions.env). `tools/k8s/vendor_pod_schema.py` writes it (`vendor` below);
nothing else edits it.

`structural` turns those definitions into a CRD's structural schema, the way the API server's own
CRD tooling writes pod templates: `$ref`s inlined; quantities and int-or-string values as
`x-kubernetes-int-or-string` (quantities with their pattern); list types and map keys kept (so
duplicate container, volume or env names are refused by the API server itself); upstream defaults
dropped (the pod's own defaults apply when the operator creates it), except on the keys of keyed
lists, which a CRD requires; descriptions kept on the template's own fields only, to keep the
CRD small (docs/operator.md says how large it is).

`problems` is the same check in Python (types, enums, required fields, unknown fields, patterns,
duplicate keys), so the operator and the unit tests refuse exactly what the API server refuses.
"""

from __future__ import annotations

import copy
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from adpfleet.contract import quantity

VENDORED_FILE = Path(__file__).with_name("pod_schema.json")
SOURCE = "/openapi/v3/api/v1"
PREFIX = "io.k8s.api.core.v1."
POD_SPEC = PREFIX + "PodSpec"
CONTAINER = PREFIX + "Container"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"

# The pod-spec fields a template may set (docs/operator.md, "Pod templates"). Everything else of a
# pod is the operator's (restartPolicy, the service account, the grace period, hostNetwork, ...) or
# has its own field in the fleet (nodeSelector, tolerations, imagePullSecrets).
POD_SPEC_FIELDS = ("affinity", "topologySpreadConstraints", "priorityClassName", "schedulerName",
                   "runtimeClassName", "securityContext", "volumes", "initContainers", "containers")

# What a template may set of the operator's main container (`server`, `router`); the rest of it
# (image, command, args, ports, probes, lifecycle, ...) is the operator's.
MAIN_CONTAINER_FIELDS = ("name", "env", "envFrom", "volumeMounts", "volumeDevices", "resources", "securityContext")

# Bounds a CRD needs so that the API server can price its CEL rules (upstream lists are unbounded).
# Bounds are by field name (lists, maps) or by (definition, field) for strings; each is well above
# what a template needs, and the strings' are Kubernetes' own limits (DNS labels) where it has one.
MAX_ITEMS = {"containers": 8, "initContainers": 8, "volumes": 32, "volumeMounts": 32, "env": 64,
             "envFrom": 16, "topologySpreadConstraints": 8, "volumeDevices": 8}
MAX_PROPERTIES = {"requests": 32, "limits": 32}
MAX_LENGTH = {(CONTAINER, "name"): 63, (PREFIX + "Volume", "name"): 63, (PREFIX + "VolumeMount", "name"): 63,
              (PREFIX + "VolumeMount", "mountPath"): 1024, (PREFIX + "EnvVar", "name"): 128}

_KEPT_EXTENSIONS = ("x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")


# ---- vendoring (tools/k8s/vendor_pod_schema.py) -------------------------------------------------

def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if "$ref" in node else set()
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node)) if node else set()
    return set()


def vendor(openapi: dict, kubernetes_version: str) -> dict:
    """The file's content: PodSpec cut to `POD_SPEC_FIELDS` and every definition it reaches, verbatim."""
    schemas = openapi["components"]["schemas"]
    pod_spec = copy.deepcopy(schemas[POD_SPEC])
    missing = [f for f in POD_SPEC_FIELDS if f not in pod_spec["properties"]]
    if missing:
        raise ValueError(f"Kubernetes {kubernetes_version}'s PodSpec has no {missing}")
    pod_spec["properties"] = {k: v for k, v in pod_spec["properties"].items() if k in POD_SPEC_FIELDS}
    pod_spec["required"] = [r for r in pod_spec.get("required", []) if r in POD_SPEC_FIELDS]
    definitions = {POD_SPEC: pod_spec}
    todo = sorted(_refs(pod_spec))
    while todo:
        name = todo.pop()
        if name not in definitions:
            definitions[name] = schemas[name]
            todo += sorted(_refs(schemas[name]) - set(definitions))
    return {"kubernetesVersion": kubernetes_version, "source": SOURCE, "podSpecFields": list(POD_SPEC_FIELDS),
            "definitions": definitions}


@lru_cache(maxsize=1)
def vendored() -> dict:
    return json.loads(VENDORED_FILE.read_text())


def kubernetes_version() -> str:
    return vendored()["kubernetesVersion"]


def owned_container_fields() -> tuple[str, ...]:
    """The fields of a Container that a template may not set on the operator's main container."""
    return tuple(sorted(set(_definition(CONTAINER)["properties"]) - set(MAIN_CONTAINER_FIELDS)))


# ---- the CRD's structural schema ----------------------------------------------------------------

def structural(name: str = POD_SPEC, *, with_descriptions: bool = True) -> dict:
    """Definition `name` as a structural schema; descriptions on its own fields only (depth one).
    A template is a part of a pod: none of its own fields is required."""
    out = _convert(vendored()["definitions"][name], depth=0, keep_descriptions=with_descriptions, field="",
                   definition=name)
    out.pop("required", None)
    return out


def _definition(name: str) -> dict:
    return vendored()["definitions"][name]


def _convert(node: dict, *, depth: int, keep_descriptions: bool, field: str, definition: str = "") -> dict:
    node = dict(node)
    description = node.pop("description", None)
    if "allOf" in node:  # {allOf: [{$ref}]} is how OpenAPI v3 attaches a description to a reference
        (only,) = node.pop("allOf")
        node = {**only, **node}
    if "$ref" in node:
        target = node.pop("$ref").rsplit("/", 1)[-1]
        if target == QUANTITY:
            out = {"x-kubernetes-int-or-string": True, "pattern": quantity.SIGNED_PATTERN}
        elif target == INT_OR_STRING:
            out = {"x-kubernetes-int-or-string": True}
        else:
            out = _convert(_definition(target), depth=depth, keep_descriptions=False, field=field, definition=target)
        out.pop("description", None)
    else:
        out = {}
        for key in ("type", "format", "enum", "required", *_KEPT_EXTENSIONS):
            if key in node:
                out[key] = copy.deepcopy(node[key])
        if node.get("type") == "array":
            out["items"] = _convert(node["items"], depth=depth + 1, keep_descriptions=False, field=field)
            if field in MAX_ITEMS:
                out["maxItems"] = MAX_ITEMS[field]
            _keep_key_defaults(out, node["items"])
        elif "properties" in node:
            out["type"] = "object"
            out["properties"] = {k: _convert(v, depth=depth + 1, keep_descriptions=keep_descriptions, field=k)
                                 for k, v in node["properties"].items()}
            for key, sub in out["properties"].items():
                if (definition, key) in MAX_LENGTH:
                    sub["maxLength"] = MAX_LENGTH[(definition, key)]
        elif isinstance(node.get("additionalProperties"), dict):
            out["type"] = "object"
            out["additionalProperties"] = _convert(node["additionalProperties"], depth=depth + 1,
                                                   keep_descriptions=False, field=field)
            if field in MAX_PROPERTIES:
                out["maxProperties"] = MAX_PROPERTIES[field]
    if keep_descriptions and description and depth <= 1:
        out["description"] = _first_paragraph(description)
    return out


def _keep_key_defaults(array: dict, raw_items: dict) -> None:
    """A keyed list's keys must be required or defaulted in a CRD: upstream defaults kept for those."""
    keys = array.get("x-kubernetes-list-map-keys") or []
    items = array["items"]
    if not keys or "properties" not in items:
        return
    raw = _resolve(raw_items)
    for key in keys:
        if key in items.get("required", []):
            continue
        default = (_resolve(raw["properties"][key])).get("default")
        if default is None:
            raise ValueError(f"list key {key!r} has neither a default nor is it required")
        items["properties"][key]["default"] = default


def _resolve(node: dict) -> dict:
    if "allOf" in node:
        (only,) = node["allOf"]
        node = {**only, **{k: v for k, v in node.items() if k != "allOf"}}
    if "$ref" in node:
        return {**_definition(node["$ref"].rsplit("/", 1)[-1]), **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _first_paragraph(text: str) -> str:
    return text.split("\n\n", 1)[0].strip()


# ---- the same checks in Python -----------------------------------------------------------------

def problems(value: Any, schema: dict, path: str) -> list[str]:
    """What the API server would refuse in `value` under the structural `schema`, each naming the
    field as the API server does (`spec.context.podTemplate.spec.volumes[0].name: Required value`)."""
    out: list[str] = []
    _check(value, schema, path, out)
    return out


_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
          "array": (list,)}


def _check(value: Any, schema: dict, path: str, out: list[str]) -> None:
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            out.append(f"{path}: Invalid value: must be an integer or a string")
        elif isinstance(value, str) and "pattern" in schema and not re.match(schema["pattern"], value):
            out.append(f"{path}: Invalid value: {value!r}: should match '{schema['pattern']}'")
        return
    kind = schema.get("type")
    if kind and (not isinstance(value, _TYPES[kind]) or (kind in ("integer", "number") and isinstance(value, bool))):
        out.append(f"{path}: Invalid value: {type(value).__name__}: {path} in body must be of type {kind}")
        return
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{path}: Unsupported value: {value!r}: supported values: "
                   + ", ".join(f'"{v}"' for v in schema["enum"]))
    if "maxLength" in schema and isinstance(value, str) and len(value) > schema["maxLength"]:
        out.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
    if "pattern" in schema and isinstance(value, str) and not re.match(schema["pattern"], value):
        out.append(f"{path}: Invalid value: {value!r}: should match '{schema['pattern']}'")
    if kind == "array":
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            out.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]", out)
        keys = schema.get("x-kubernetes-list-map-keys")
        if keys and all(isinstance(i, dict) for i in value):
            defaults = {k: schema["items"]["properties"][k].get("default") for k in keys}
            seen = set()
            for i, item in enumerate(value):
                key = tuple(item.get(k, defaults[k]) for k in keys)
                if key in seen:
                    out.append(f"{path}[{i}]: Duplicate value: "
                               + ", ".join(f"{k}={v!r}" for k, v in zip(keys, key)))
                seen.add(key)
    elif kind == "object":
        if "properties" in schema:
            for key in schema.get("required", []):
                if key not in value:
                    out.append(f"{path}.{key}: Required value")
            for key, sub in value.items():
                if key not in schema["properties"]:
                    out.append(f'{path}.{key}: field not declared in schema')
                else:
                    _check(sub, schema["properties"][key], f"{path}.{key}", out)
        elif "additionalProperties" in schema:
            if "maxProperties" in schema and len(value) > schema["maxProperties"]:
                out.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxProperties']} items")
            for key, sub in value.items():
                _check(sub, schema["additionalProperties"], f"{path}[{key}]", out)
