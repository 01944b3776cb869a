"""A role's (or the router's) pod template laid over the pod the operator builds: pure.

The merge rules (docs/operator.md, "Pod templates"); the CRD refuses a template that would break
them, so nothing here has to choose between the two sides:

- metadata: the template's labels and annotations are added to `spec.podMetadata`'s (the template
  wins a key both set); the operator's own labels and annotations are never the template's.
- pod spec: `affinity`, `topologySpreadConstraints`, `priorityClassName`, `schedulerName` and
  `runtimeClassName` are the template's (the operator sets none of them); `securityContext` is the
  operator's restricted one with the template's keys laid over it; `volumes` and `initContainers`
  are added after the operator's own.
- containers: the entry named like the operator's main container (`server`, `router`) amends it:
  `env` after the operator's (so `$(POD_IP)` may be used), `envFrom`, `volumeMounts` and
  `volumeDevices` added, `resources` merged key by key (extended resources beside the role's CPU
  and memory), `securityContext` laid over the operator's key by key. Every other entry is a
  sidecar, run beside it in the template's order, after the main container (which stays first:
  `kubectl logs` and `exec` pick it without `-c`).
"""

from __future__ import annotations

import copy

from adpfleet.operator.resource import names
from adpfleet.operator.resource.templates import PodTemplate

COPIED_POD_FIELDS = ("affinity", "topologySpreadConstraints", "priorityClassName", "schedulerName",
                     "runtimeClassName")
APPENDED_POD_FIELDS = ("volumes", "initContainers")
APPENDED_CONTAINER_FIELDS = ("env", "envFrom", "volumeMounts", "volumeDevices")


def metadata(labels: dict, annotations: dict, template: PodTemplate | None) -> tuple[dict, dict]:
    """The pod's extra labels and annotations: the fleet's, then the template's."""
    if template is None:
        return dict(labels), dict(annotations)
    return {**labels, **template.metadata.labels}, {**annotations, **template.metadata.annotations}


def pod_spec(spec: dict, template: PodTemplate | None) -> dict:
    """`spec` (a pod spec the operator built, main container first) with `template` laid over it."""
    if template is None or not template.spec:
        return spec
    part = copy.deepcopy(template.spec)
    out = copy.deepcopy(spec)
    for field in COPIED_POD_FIELDS:
        if field in part:
            out[field] = part[field]
    if "securityContext" in part:
        out["securityContext"] = {**out.get("securityContext", {}), **part["securityContext"]}
    for field in APPENDED_POD_FIELDS:
        if part.get(field):
            out[field] = out.get(field, []) + part[field]
    main_name = template.owns.container
    entries = part.get("containers") or []
    out["containers"] = [_amend(out["containers"][0], next((c for c in entries if c["name"] == main_name), None)),
                         *out["containers"][1:], *(c for c in entries if c["name"] != main_name)]
    return out


def _amend(container: dict, part: dict | None) -> dict:
    if part is None:
        return container
    out = dict(container)
    for field in APPENDED_CONTAINER_FIELDS:
        if part.get(field):
            out[field] = out.get(field, []) + part[field]
    if "resources" in part:
        resources = dict(out.get("resources", {}))
        for side, amounts in part["resources"].items():
            resources[side] = {**resources.get(side, {}), **amounts} if isinstance(amounts, dict) else amounts
        out["resources"] = resources
    if "securityContext" in part:
        out["securityContext"] = {**out.get("securityContext", {}), **part["securityContext"]}
    return out


def default_container(template: PodTemplate | None) -> dict:
    """The annotation that keeps `kubectl logs` on the main container once a template adds sidecars."""
    if template is None or not any(c.get("name") != template.owns.container
                                   for c in template.spec.get("containers") or []):
        return {}
    return {names.DEFAULT_CONTAINER_ANNOTATION: template.owns.container}
