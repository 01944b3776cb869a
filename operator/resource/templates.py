"""Pod templates: a part of a pod laid over the operator's (docs/operator.md, "Pod templates"), and the
rules that keep a template off what the operator owns; the fleet's extra pod labels and annotations."""

from __future__ import annotations

from typing import Annotated, Any, Callable, ClassVar

from pydantic import Field, WithJsonSchema, model_validator

from adpfleet.operator.resource import names, pod_schema
from adpfleet.operator.resource.cel import CelRule, KubeModel, cel_list


def _no_reserved_labels(labels: dict[str, str]) -> bool:
    return not any(k.startswith(names.RESERVED_LABEL_PREFIXES) for k in labels)


class PodMetadata(KubeModel):
    """Extra labels and annotations on every pod of the fleet (servers and router)."""
    labels: dict[str, str] = Field(default_factory=dict, max_length=32,
                                   description="Must not use the adpfleet.io/ or app.kubernetes.io/ prefixes.")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=64,
                                        description="Must not set the operator's own annotations.")
    cel_rules: ClassVar = (
        CelRule("self.labels.all(k, !k.startsWith('adpfleet.io/') && !k.startsWith('app.kubernetes.io/'))",
                "labels with the adpfleet.io/ or app.kubernetes.io/ prefix are set by the operator",
                ".labels", lambda m: _no_reserved_labels(m.labels)),
        CelRule("self.annotations.all(k, !(k in " + str(list(names.RESERVED_ANNOTATIONS)).replace("'", '"') + "))",
                "annotations " + ", ".join(names.RESERVED_ANNOTATIONS) + " are set by the operator",
                ".annotations", lambda m: not set(m.annotations) & set(names.RESERVED_ANNOTATIONS)),
    )


PodSpecPart = Annotated[dict[str, Any], WithJsonSchema(pod_schema.structural())]
OPERATOR_RESOURCES = ("cpu", "memory", "ephemeral-storage")  # the role's `resources` sets these


def _entries(template: "PodTemplate", field: str) -> list[dict]:
    return [c for c in (template.spec.get(field) or []) if isinstance(c, dict)]


def main_containers(template: "PodTemplate") -> list[dict]:
    """The template's entries for the operator's own container (`server` or `router`)."""
    return [c for c in _entries(template, "containers") if c.get("name") == template.owns.container]


def _mounts_resolve(template: "PodTemplate", field: str) -> bool:
    volumes = {v.get("name") for v in _entries(template, "volumes")} | set(template.owns.volumes)
    return all(m.get("name") in volumes for c in _entries(template, field) for m in c.get("volumeMounts") or [])


def _template_rules(owns: names.OwnedPodParts) -> tuple[CelRule, ...]:
    """The rules that keep a template off what the operator owns (`owns`), each with its twin."""
    main = owns.container
    owned_fields = pod_schema.owned_container_fields()
    may_set = pod_schema.MAIN_CONTAINER_FIELDS[1:]
    of_main = f"!has(self.spec.containers) || self.spec.containers.all(c, c.name != '{main}' || "

    def main_has(check: Callable[[dict], bool]) -> Callable[["PodTemplate"], bool]:
        return lambda t: all(check(c) for c in main_containers(t))

    def mounts_rule(field: str) -> CelRule:
        return CelRule(
            f"!has(self.spec.{field}) || self.spec.{field}.all(c, !has(c.volumeMounts) || c.volumeMounts.all(m, "
            f"m.name in {cel_list(owns.volumes)} || (has(self.spec.volumes) && "
            f"self.spec.volumes.exists(v, v.name == m.name))))",
            f"{field}: every volumeMount names a volume of the template (or {', '.join(owns.volumes)})",
            f".spec.{field}", lambda t: _mounts_resolve(t, field))

    return (
        CelRule(of_main + " && ".join(f"!has(c.{f})" for f in owned_fields) + ")",
                f"containers[name={main}] may set only {', '.join(may_set)}: its command, args, image, ports, "
                f"probes and lifecycle are set by the operator",
                ".spec.containers", main_has(lambda c: not set(c) & set(owned_fields))),
        CelRule(of_main + f"!has(c.env) || c.env.all(e, !(e.name in {cel_list(owns.env)})))",
                f"containers[name={main}].env: {', '.join(owns.env)} are set by the operator",
                ".spec.containers", main_has(lambda c: not {e.get("name") for e in c.get("env") or []} & set(owns.env))),
        CelRule(of_main + f"!has(c.volumeMounts) || c.volumeMounts.all(m, !(m.mountPath in "
                f"{cel_list(owns.mount_paths)})))",
                f"containers[name={main}].volumeMounts: {', '.join(owns.mount_paths)} are mounted by the operator",
                ".spec.containers",
                main_has(lambda c: not {m.get("mountPath") for m in c.get("volumeMounts") or []} & set(owns.mount_paths))),
        CelRule(of_main + "!has(c.resources) || ("
                + " && ".join(f"(!has(c.resources.{side}) || !c.resources.{side}.exists(k, k in "
                              f"{cel_list(OPERATOR_RESOURCES)}))" for side in ("requests", "limits")) + "))",
                f"containers[name={main}].resources: {', '.join(OPERATOR_RESOURCES)} are set by the role's "
                f"resources field; a template adds other resources (RDMA devices, hugepages, ...)",
                ".spec.containers",
                main_has(lambda c: not any(set((c.get("resources") or {}).get(side) or {}) & set(OPERATOR_RESOURCES)
                                           for side in ("requests", "limits")))),
        CelRule(f"!has(self.spec.containers) || self.spec.containers.all(c, c.name == '{main}' || has(c.image))",
                f"containers other than {main} (sidecars) need an image",
                ".spec.containers", lambda t: all(c.get("image") for c in _entries(t, "containers")
                                                  if c.get("name") != main)),
        CelRule("!has(self.spec.initContainers) || self.spec.initContainers.all(c, has(c.image))",
                "initContainers need an image",
                ".spec.initContainers", lambda t: all(c.get("image") for c in _entries(t, "initContainers"))),
        CelRule(f"!has(self.spec.initContainers) || self.spec.initContainers.all(c, c.name != '{main}' && "
                f"(!has(self.spec.containers) || !self.spec.containers.exists(s, s.name == c.name)))",
                f"initContainers need names of their own (not {main}, not a container's)",
                ".spec.initContainers",
                lambda t: not {c.get("name") for c in _entries(t, "initContainers")}
                & ({c.get("name") for c in _entries(t, "containers")} | {main})),
        CelRule(f"!has(self.spec.volumes) || self.spec.volumes.all(v, !(v.name in {cel_list(owns.volumes)}))",
                f"volumes {', '.join(owns.volumes)} are the operator's",
                ".spec.volumes", lambda t: not {v.get("name") for v in _entries(t, "volumes")} & set(owns.volumes)),
        mounts_rule("containers"),
        mounts_rule("initContainers"),
    )


class PodTemplate(KubeModel):
    """Part of a pod template, laid over the pods the operator builds (docs/operator.md, "Pod templates")."""
    owns: ClassVar[names.OwnedPodParts]
    metadata: PodMetadata = Field(default_factory=PodMetadata, description="Labels and annotations of the pods.")
    spec: PodSpecPart = Field(
        default_factory=dict,
        description=f"A subset of the Kubernetes PodSpec (schema of Kubernetes {pod_schema.kubernetes_version()}): "
                    + ", ".join(pod_schema.POD_SPEC_FIELDS) + ".")

    @model_validator(mode="before")
    @classmethod
    def _kubernetes_schema(cls, data):
        if isinstance(data, dict) and isinstance(data.get("spec"), dict):
            found = pod_schema.problems(data["spec"], pod_schema.structural(), "spec")
            if found:
                raise ValueError("; ".join(found))
        return data


class ServerPodTemplate(PodTemplate):
    """Part of the pod template of this role's servers: scheduling (affinity, topology spread, priority,
    scheduler, runtime class), volumes, sidecars and init containers, and for the `server` container its
    env, envFrom, volumeMounts, volumeDevices, extra resources and securityContext."""
    owns: ClassVar = names.SERVER_OWNS
    cel_rules: ClassVar = _template_rules(names.SERVER_OWNS)


class RouterPodTemplate(PodTemplate):
    """Part of the router pods' template (as for servers; its main container is `router`)."""
    owns: ClassVar = names.ROUTER_OWNS
    cel_rules: ClassVar = _template_rules(names.ROUTER_OWNS)
