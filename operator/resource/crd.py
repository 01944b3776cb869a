"""The InferenceFleet CRD, generated from the pydantic models (`adpfleet crds` prints it).

Pydantic writes JSON Schema (2020-12); Kubernetes wants a *structural* OpenAPI v3 schema: every
node typed, no `$ref`, no `anyOf` around null, no `additionalProperties: false` next to
`properties` (unknown fields are refused by the API server's strict field validation instead),
and complete defaults on nested objects so that a user may leave any of them out.
`to_structural` does exactly that conversion; everything else (descriptions, bounds, enums,
patterns, CEL rules) passes through unchanged.
"""

from __future__ import annotations

import copy
import json
import typing
from typing import Any

import yaml
from pydantic import BaseModel

from adpfleet.operator.resource import names
from adpfleet.operator.resource.cel import KubeModel
from adpfleet.operator.resource.fleet_role import FleetRoleSpec, FleetRoleStatus
from adpfleet.operator.resource.models import ROOT_RULES, FleetSpec
from adpfleet.operator.resource.status import FleetStatus

# Keys of pydantic's JSON Schema that have no meaning (or no place) in a Kubernetes schema.
_DROPPED = {"title", "additionalProperties"}


def _condition(type_: str) -> str:
    return f'.status.conditions[?(@.type=="{type_}")].status'


# What `kubectl get ifleet` shows (the runbooks read the same columns). Observed is empty for a fleet
# no operator has reconciled; Deleting is set while a fleet waits for its operator to let it go.
PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": _condition("Ready"),
     "description": "The fleet serves: every role and the router have a Ready server"},
    {"name": "Roles Ready", "type": "string", "jsonPath": ".status.readyRoles",
     "description": "Roles (context, generation, router) with every server ready"},
    {"name": "Stalled", "type": "string", "jsonPath": _condition("Stalled")},
    {"name": "Remediating", "type": "string", "jsonPath": _condition("Remediating")},
    {"name": "Degraded", "type": "string", "jsonPath": _condition("Degraded")},
    {"name": "Model", "type": "string", "jsonPath": ".status.model.phase",
     "description": "Pending, Downloading, Available or Unavailable (status.model)"},
    {"name": "Observed", "type": "integer", "jsonPath": ".status.observedGeneration",
     "description": "The generation the operator last reconciled; empty: no operator watches the fleet"},
    {"name": "Deleting", "type": "date", "jsonPath": ".metadata.deletionTimestamp",
     "description": "Being deleted since (it waits for its operator to release it)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Generation", "type": "integer", "priority": 1, "jsonPath": ".metadata.generation",
     "description": "The spec's generation (compare with Observed)"},
    {"name": "Context", "type": "string", "priority": 1, "jsonPath": ".status.context.servers",
     "description": "Ready / desired context servers"},
    {"name": "Generation Servers", "type": "string", "priority": 1, "jsonPath": ".status.generation.servers",
     "description": "Ready / desired generation servers"},
    {"name": "Last Scale", "type": "string", "priority": 1, "jsonPath": ".status.lastScale.message",
     "description": "The last change of a role's desired server count, and why"},
    {"name": "Downloaded", "type": "string", "priority": 1, "jsonPath": ".status.model.progress",
     "description": "Bytes downloaded of the total, while servers download their model"},
]


def to_structural(node: Any, defs: dict[str, Any]) -> Any:
    """Convert one node of pydantic's JSON Schema into a structural OpenAPI v3 schema node."""
    if isinstance(node, list):
        return [to_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:  # inline the definition; the field's own keys (description, default) win
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        target.update(node)
        node = target
    if "anyOf" in node:  # Optional[X] is anyOf [X, null]: absent is how Kubernetes says "not set"
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express a union of {options} in a structural schema")
        merged = dict(options[0])
        merged.update(node)
        return to_structural(merged, defs)
    for bound, inclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[inclusive] = node.pop(bound)  # JSON Schema 2020's number; OpenAPI v3.0 wants a flag
            node[bound] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    if node.get("default", ...) is None:  # "no default" in pydantic; Kubernetes has no null default
        del node["default"]
    is_map = node.get("type") == "object" and "properties" not in node and \
        isinstance(node.get("additionalProperties"), dict)
    # dict[str, X]: additionalProperties is the values' schema, and stays
    out = {k: to_structural(v, defs) if (k == "additionalProperties" and is_map) else v for k, v in node.items()
           if k not in _DROPPED or (k == "additionalProperties" and is_map)}
    if "items" in out:
        out["items"] = to_structural(out["items"], defs)
    if "properties" in out:
        out["properties"] = {name: to_structural(sub, defs) for name, sub in out["properties"].items()}
    return out


def _schema_of(model: type[KubeModel], *, with_factory_defaults: bool) -> dict:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema = to_structural(raw, defs)
    if with_factory_defaults:
        _add_factory_defaults(model, schema)
    return schema


def _add_factory_defaults(model: type[BaseModel], schema: dict) -> None:
    """Give every field that has a default_factory its complete default value.

    Complete, not `{}`: the API server checks each default against the CEL rules *without* applying
    the nested defaults first, so `engine: {}` would fail `self.maxBatchSize <= ...`. Lists and maps
    default to empty so that rules over them (`self.labels.all(...)`) always have a value.
    """
    for name, field in model.model_fields.items():
        sub = schema.get("properties", {}).get(field.alias or name)
        if sub is None:
            continue
        if field.default_factory is not None:
            value = field.default_factory()
            sub["default"] = value.to_kube() if isinstance(value, KubeModel) else value
        inner = _model_of(field.annotation)
        if inner is not None:
            _add_factory_defaults(inner, sub.get("items", sub))


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as `X`, `X | None` or `list[X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def allowed_values(node: dict) -> str:
    """A schema node's enum, bounds and limits, in words (the reference's "allowed" column)."""
    parts = []
    if "enum" in node:
        parts.append(" \\| ".join(f"`{v}`" for v in node["enum"]))
    if node.get("exclusiveMinimum") is True:
        parts.append(f"> {node['minimum']}" + (f", ≤ {node['maximum']}" if "maximum" in node else ""))
    elif "minimum" in node and "maximum" in node:
        parts.append(f"{node['minimum']}–{node['maximum']}")
    elif "minimum" in node:
        parts.append(f"≥ {node['minimum']}")
    elif "maximum" in node:
        parts.append(f"≤ {node['maximum']}")
    if "minLength" in node:
        parts.append("non-empty" if node["minLength"] == 1 else f"≥ {node['minLength']} chars")
    if "maxItems" in node:
        parts.append(f"≤ {node['maxItems']} items")
    if "maxProperties" in node:
        parts.append(f"≤ {node['maxProperties']} entries")
    if node.get("pattern") and "enum" not in node:
        parts.append("quantity" if "KMGTPE" in node["pattern"] else "pattern")
    if node.get("x-kubernetes-validations") and node.get("type") != "object":
        parts.append("rules below")
    return ", ".join(parts)


def default_text(node: dict) -> str:
    """A schema node's default as JSON in backquotes; "" when it has none (or is a whole object)."""
    if "default" not in node or isinstance(node["default"], dict) and node["default"]:
        return ""
    return f"`{json.dumps(node['default'])}`"


def explained(node: dict) -> dict:
    """The schema with each field's default and allowed values written into its description, which
    is all `kubectl explain` shows of a field."""
    node = dict(node)
    if "properties" in node:
        node["properties"] = {name: explained(sub) for name, sub in node["properties"].items()}
    if isinstance(node.get("items"), dict):
        node["items"] = explained(node["items"])
    extra = []
    if default_text(node):
        extra.append(f"Default: {default_text(node).strip('`')}.")
    if allowed_values(node):
        words = allowed_values(node).replace("\\", "").replace("–", " to ").replace("≥ ", "at least ")
        extra.append(f"Allowed: {words.replace('≤ ', 'at most ')}.")
    if extra and "description" in node:
        node["description"] = f"{node['description'].rstrip()} {' '.join(extra)}"
    return node


def openapi_schema() -> dict:
    """The schema of the whole object, as it goes into the CRD's `openAPIV3Schema`."""
    spec = _schema_of(FleetSpec, with_factory_defaults=True)
    status = _schema_of(FleetStatus, with_factory_defaults=False)
    spec["description"] = FleetSpec.__doc__.strip()
    status["description"] = FleetStatus.__doc__.strip()
    return {
        "type": "object",
        "description": "InferenceFleet runs a disaggregated attention-data-parallel inference fleet: context "
                       "servers, generation servers and a router, kept running and remediated by adpfleet.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": f"{names.API_VERSION}."},
            "kind": {"type": "string", "description": f"{names.KIND}."},
            "metadata": {"type": "object"},  # the API server allows nothing more (ObjectMeta is described)
            "spec": spec,
            "status": status,
        },
        "x-kubernetes-validations": [r.to_schema() for r in ROOT_RULES],
    }


ROLE_PRINTER_COLUMNS = [
    {"name": "Fleet", "type": "string", "jsonPath": ".spec.fleet"},
    {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas",
     "description": "Servers the operator runs"},
    {"name": "Current", "type": "integer", "jsonPath": ".status.replicas", "description": "Server pods that exist"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Last Scale", "type": "string", "jsonPath": ".status.lastScale.reason",
     "description": "Why the desired count last changed"},
    {"name": "Message", "type": "string", "priority": 1, "jsonPath": ".status.lastScale.message"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def role_openapi_schema() -> dict:
    """The InferenceFleetRole's schema (spec and status), as it goes into its CRD."""
    spec = _schema_of(FleetRoleSpec, with_factory_defaults=False)
    status = _schema_of(FleetRoleStatus, with_factory_defaults=False)
    spec["description"] = FleetRoleSpec.__doc__.strip()
    status["description"] = FleetRoleStatus.__doc__.strip()
    return {
        "type": "object",
        "description": "InferenceFleetRole is the scale target of one role of an InferenceFleet (`kubectl scale`, "
                       "a HorizontalPodAutoscaler, KEDA); the operator creates one per role and owns nothing else "
                       "through it.",
        "required": ["spec"],
        "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                       "metadata": {"type": "object"}, "spec": spec, "status": status},
    }


def _crd(plural: str, singular: str, kind: str, short_names: list[str], subresources: dict, columns: list,
         schema: dict) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{names.GROUP}",
                     "labels": {names.LABEL_NAME: "adpfleet", "app.kubernetes.io/part-of": "adpfleet"}},
        "spec": {
            "group": names.GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": singular, "shortNames": list(short_names),
                      "listKind": f"{kind}List", "categories": ["adpfleet"]},
            "versions": [{"name": names.VERSION, "served": True, "storage": True, "subresources": subresources,
                          "additionalPrinterColumns": columns, "schema": {"openAPIV3Schema": explained(schema)}}],
        },
    }


def role_crd() -> dict:
    """The InferenceFleetRole CRD: status, and the scale subresource over spec.replicas."""
    scale = {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
             "labelSelectorPath": ".status.selector"}
    return _crd(names.ROLE_PLURAL, names.ROLE_SINGULAR, names.ROLE_KIND, names.ROLE_SHORT_NAMES,
                {"status": {}, "scale": scale}, ROLE_PRINTER_COLUMNS, role_openapi_schema())


def crd() -> dict:
    """The InferenceFleet CRD."""
    return _crd(names.PLURAL, names.SINGULAR, names.KIND, names.SHORT_NAMES, {"status": {}}, PRINTER_COLUMNS,
                openapi_schema())


HEADER = ("# Generated by `adpfleet crds` from the pydantic models in operator/resource/models.py.\n"
          "# Do not edit: change the models and regenerate (docs/operator.md says how).\n")


def crd_yaml() -> str:
    """Both CRDs, one YAML document each: InferenceFleet, then InferenceFleetRole."""
    return HEADER + "---\n".join(yaml.safe_dump(d, sort_keys=False, width=100) for d in (crd(), role_crd()))


FILE_NAME = f"{names.CRD_NAME}.yaml"  # inferencefleets.adpfleet.io.yaml, in crds/ and charts/adpfleet/crds/
