"""Kubernetes values the resource's fields share: quantities, object names, requests and limits, Secret
references, tolerations, environment variables."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field
from pydantic.alias_generators import to_camel

from adpfleet.contract import quantity
from adpfleet.operator.resource.cel import CelRule, KubeModel

Quantity = Annotated[str, Field(pattern=quantity.PATTERN, max_length=32)]
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
NAMESPACE_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CIDR = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"


def _quantity_not_below(field: str) -> CelRule:
    def check(resources: "Resources") -> bool:
        request, limit = getattr(resources.requests, field), getattr(resources.limits, field)
        return request is None or limit is None or quantity.parse(limit) >= quantity.parse(request)
    camel = to_camel(field)
    return CelRule(
        rule=(f"!has(self.requests.{camel}) || !has(self.limits.{camel}) || "
              f"quantity(self.limits.{camel}).compareTo(quantity(self.requests.{camel})) >= 0"),
        message=f"limits.{camel} must not be less than requests.{camel}",
        field_path=f".limits.{camel}", check=check)


class ResourceList(KubeModel):
    """Amounts of CPU, memory and ephemeral storage."""
    cpu: Quantity | None = Field(None, description="CPU, in cores ('2') or millicores ('500m').")
    memory: Quantity | None = Field(None, description="Memory, e.g. '8Gi'.")
    ephemeral_storage: Quantity | None = Field(None, description="Scratch disk, e.g. '10Gi'.")


class Resources(KubeModel):
    """Requests and limits of each container (GPUs are set with `gpusPerServer`, not here)."""
    requests: ResourceList = Field(default_factory=ResourceList,
                                   description="What the scheduler reserves for the container.")
    limits: ResourceList = Field(default_factory=ResourceList,
                                 description="The most the container may use; not below the request.")
    cel_rules: ClassVar = tuple(_quantity_not_below(f) for f in ("cpu", "memory", "ephemeral_storage"))


class SecretKeyRef(KubeModel):
    """A key of a Secret in the fleet's namespace."""
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The Secret's name.")
    key: str = Field("token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key within the Secret.")


class LocalObjectReference(KubeModel):
    """A named object in the fleet's namespace."""
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The object's name.")


class Toleration(KubeModel):
    """A Kubernetes toleration (see the Pod API)."""
    key: str | None = Field(None, max_length=317, pattern=LABEL_KEY,
                            description="The taint key tolerated; empty with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] = Field("Equal", description="Equal: the taint's value must be `value`; "
                                                                      "Exists: any value.")
    value: str | None = Field(None, max_length=63, description="The taint value tolerated (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint effect tolerated; empty: every effect.")
    toleration_seconds: int | None = Field(None, ge=0, description="NoExecute only: how long the server stays "
                                                                   "on a node after the taint appears; empty: "
                                                                   "forever.")
    cel_rules: ClassVar = (
        CelRule("self.operator != 'Exists' || !has(self.value)", "a toleration with operator Exists has no value",
                ".value", lambda t: t.operator != "Exists" or t.value is None),
    )


class EnvVar(KubeModel):
    """An extra environment variable of the server containers."""
    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="The variable's name (unique in the list).")
    value: str = Field("", max_length=32_768, description="Its value.")

