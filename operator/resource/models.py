"""The InferenceFleet resource as pydantic models: the single source of truth (DESIGN.md §3.4).

The CRD's OpenAPI schema is generated from these classes (`crd.py`): field descriptions, defaults,
bounds and enums come from the `Field`s, and every cross-field rule is written once as a `CelRule`
that carries both its CEL text (enforced by the API server at apply time) and the same check in
Python (enforced by `model_validate`, so the operator and the unit tests apply identical rules).

YAML names are camelCase (`adpRanks`); Python names are snake_case (`adp_ranks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from adpfleet.operator.resource import names, quantity
from adpfleet.operator.resource.vocabulary import Action, Outcome, RemediationMode, ScaleReason, Signature


@dataclass(frozen=True)
class CelRule:
    """A cross-field rule: `rule` is CEL over `self` (the object the rule sits on), `check` is the
    same predicate in Python over the model instance, `field_path` is where the API server points
    its error (relative to the object, e.g. `.gpusPerServer`)."""
    rule: str
    message: str
    field_path: str | None
    check: Callable[[Any], bool]

    def to_schema(self) -> dict:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
            out["reason"] = "FieldValueInvalid"
        return out


def _add_cel_rules(schema: dict, model: type) -> None:
    rules = getattr(model, "cel_rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.to_schema() for r in rules]


class KubeModel(BaseModel):
    """camelCase in YAML, unknown fields refused, CEL rules checked in Python too."""
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              json_schema_extra=_add_cel_rules)
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self):
        for rule in type(self).cel_rules:
            if not rule.check(self):
                raise ValueError(rule.message)  # the message names the field
        return self

    def to_kube(self) -> dict:
        """The object as it appears in Kubernetes (camelCase, unset optional fields left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---- small shared types ----

Quantity = Annotated[str, Field(pattern=quantity.PATTERN, max_length=32)]
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


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
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)


class ModelSource(KubeModel):
    """What the servers load."""
    name: str = Field(min_length=1, max_length=512, pattern=r"^\S+$",
                      description="Passed to `adpfleet serve --model`: 'tiny' or 'tiny-dense' (built in, no "
                                  "download) or a Hugging Face model directory inside the image.")
    served_name: str | None = Field(None, min_length=1, max_length=256, pattern=r"^\S+$",
                                    description="Model id the OpenAI API reports and accepts; default: derived "
                                                "from `name`.")
    token_secret_ref: SecretKeyRef | None = Field(None, description="Secret key exposed to the servers as "
                                                                    "HF_TOKEN (gated Hugging Face models).")


class EngineSettings(KubeModel):
    """Engine knobs of each server, passed to `adpfleet serve` (vLLM / TensorRT-LLM vocabulary)."""
    device: Literal["cpu", "cuda"] = Field("cpu", description="cuda exactly when gpusPerServer > 0.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and activations.")
    kv_blocks: int = Field(512, ge=1, le=10_000_000, description="Paged KV-cache blocks per ADP rank.")
    tokens_per_block: int = Field(16, ge=1, le=1024, description="Tokens per KV-cache block.")
    max_num_tokens: int = Field(2048, ge=1, le=10_000_000, description="Token budget of one batch.")
    max_batch_size: int = Field(64, ge=1, le=100_000, description="Requests in one batch.")
    max_num_active_requests: int = Field(256, ge=1, le=100_000,
                                         description="Requests a rank holds at once (running + waiting for KV).")
    collective_timeout_seconds: int = Field(60, ge=1, le=3600,
                                            description="Seconds a rank may block in a collective before the "
                                                        "server declares it hung, turns unhealthy and exits.")
    pad_empty_batch: bool = Field(True, description="Post-schedule padding of empty ADP batches (DESIGN §1.1). "
                                                    "false only to reproduce the stall.")
    threads_per_rank: int = Field(1, ge=1, le=512, description="CPU threads of each rank process "
                                                               "(OMP_NUM_THREADS).")
    cel_rules: ClassVar = (
        CelRule("self.maxBatchSize <= self.maxNumActiveRequests",
                "maxBatchSize must not exceed maxNumActiveRequests (a batch is drawn from the active requests)",
                ".maxBatchSize", lambda e: e.max_batch_size <= e.max_num_active_requests),
    )


class Probes(KubeModel):
    """How the kubelet checks each server (all on the runtime's HTTP port)."""
    startup_timeout_seconds: int = Field(600, ge=10, le=86_400,
                                         description="How long a server may take to load the model and start "
                                                     "every rank before it is restarted.")
    readiness_period_seconds: int = Field(5, ge=1, le=300, description="Seconds between /health checks.")


class Toleration(KubeModel):
    """A Kubernetes toleration (see the Pod API)."""
    key: str | None = Field(None, max_length=317, pattern=LABEL_KEY)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0)
    cel_rules: ClassVar = (
        CelRule("self.operator != 'Exists' || !has(self.value)", "a toleration with operator Exists has no value",
                ".value", lambda t: t.operator != "Exists" or t.value is None),
    )


class EnvVar(KubeModel):
    """An extra environment variable of the server containers."""
    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str = Field("", max_length=32_768)


class ScalingTargets(KubeModel):
    """The level of each signal the policy holds a role at, per ADP rank (docs/autoscaling.md). A signal
    left out is not used; the role scales on the one furthest above its target."""
    waiting_per_rank: float | None = Field(None, gt=0, le=100_000,
                                           description="Mean requests waiting per rank (adpfleet_requests_waiting): "
                                                       "a queue longer than this adds servers.")
    kv_cache_utilization: float | None = Field(None, gt=0, le=1,
                                               description="Mean fraction of each rank's KV-cache blocks in use "
                                                           "(adpfleet_kv_cache_blocks_used / _total).")
    time_to_first_token_seconds: float | None = Field(None, gt=0, le=3600,
                                                      description="Mean time to first token "
                                                                  "(adpfleet_time_to_first_token_seconds).")
    inter_token_latency_seconds: float | None = Field(None, gt=0, le=60,
                                                      description="Mean time between two tokens of a request "
                                                                  "(adpfleet_inter_token_latency_seconds).")

    def given(self) -> dict[str, float]:
        """The targets that are set: signal name (snake_case) -> target."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class ScaleUpBehavior(KubeModel):
    """How fast a role grows."""
    stabilization_window_seconds: int = Field(10, ge=0, le=3600,
                                              description="Every scrape over this long must ask for more servers "
                                                          "before a scale-up (the lowest recommendation wins).")
    max_servers_per_step: int = Field(2, ge=1, le=256, description="Servers added by one decision at most; the next "
                                                                   "decision waits until they are Ready.")


class ScaleDownBehavior(KubeModel):
    """How fast a role shrinks."""
    stabilization_window_seconds: int = Field(120, ge=0, le=86_400,
                                              description="Every scrape over this long must allow fewer servers "
                                                          "before a scale-down (the highest recommendation wins).")
    max_servers_per_step: int = Field(1, ge=1, le=256, description="Servers removed by one decision at most.")


def _default_targets() -> "ScalingTargets":
    return ScalingTargets(waiting_per_rank=2.0, kv_cache_utilization=0.8)


class AutoscalingSpec(KubeModel):
    """The built-in autoscaling policy of one role (docs/autoscaling.md); off by default. Off, the role's
    count is `servers`, or what `kubectl scale`, an HPA or KEDA set on its InferenceFleetRole."""
    enabled: bool = Field(False, description="Scale this role between minServers and maxServers on the signals "
                                             "the operator scrapes.")
    min_servers: int = Field(1, ge=1, le=256, description="Fewest servers the policy keeps.")
    max_servers: int = Field(4, ge=1, le=256, description="Most servers the policy runs.")
    targets: ScalingTargets = Field(default_factory=_default_targets, description="Per-rank signal targets.")
    tolerance: float = Field(0.1, ge=0, le=0.9, description="Relative band around each target in which nothing "
                                                           "changes (as the HPA's).")
    scale_up: ScaleUpBehavior = Field(default_factory=ScaleUpBehavior, description="Growth limits.")
    scale_down: ScaleDownBehavior = Field(default_factory=ScaleDownBehavior, description="Shrink limits.")
    cel_rules: ClassVar = (
        CelRule("self.minServers <= self.maxServers", "minServers must not exceed maxServers", ".minServers",
                lambda a: a.min_servers <= a.max_servers),
        CelRule("!self.enabled || has(self.targets.waitingPerRank) || has(self.targets.kvCacheUtilization) || "
                "has(self.targets.timeToFirstTokenSeconds) || has(self.targets.interTokenLatencySeconds)",
                "autoscaling needs at least one target when enabled", ".targets",
                lambda a: not a.enabled or bool(a.targets.given())),
    )


class ServerRole(KubeModel):
    """One role of the fleet: its servers are identical pods, each one engine with `adpRanks` ranks."""
    servers: int = Field(1, ge=1, le=256, description="Servers (pods) of this role.")
    adp_ranks: int = Field(1, ge=1, le=64, description="Attention-data-parallel ranks per server (`--dp`).")
    gpus_per_server: int = Field(0, ge=0, le=64, description="GPUs each server requests; a multiple of adpRanks "
                                                             "(every rank drives whole GPUs).")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="Engine knobs.")
    resources: Resources = Field(default_factory=Resources, description="CPU and memory of each server.")
    probes: Probes = Field(default_factory=Probes, description="Startup and readiness checking.")
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=32,
                                          description="Node labels the servers must run on.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32, description="Taints tolerated.")
    env: list[EnvVar] = Field(default_factory=list, max_length=64,
                              json_schema_extra={"x-kubernetes-list-type": "map",
                                                 "x-kubernetes-list-map-keys": ["name"]},
                              description="Extra environment variables (names unique).")
    termination_grace_period_seconds: int = Field(30, ge=0, le=3600,
                                                  description="Time a server gets to finish requests when stopped.")
    drain_timeout_seconds: int = Field(60, ge=0, le=3600,
                                       description="A server removed by a scale-down is drained first: the router "
                                                   "sends it nothing new and it may finish its requests (and hand "
                                                   "back its KV) for this long before its pod is deleted.")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec,
                                         description="The built-in autoscaling policy (off by default).")
    cel_rules: ClassVar = (
        CelRule("self.gpusPerServer % self.adpRanks == 0",
                "gpusPerServer must be a multiple of adpRanks (each ADP rank drives whole GPUs)",
                ".gpusPerServer", lambda r: r.gpus_per_server % r.adp_ranks == 0),
        CelRule("(self.engine.device == 'cuda') == (self.gpusPerServer > 0)",
                "engine.device must be cuda when gpusPerServer > 0 and cpu when it is 0",
                ".engine.device", lambda r: (r.engine.device == "cuda") == (r.gpus_per_server > 0)),
    )

    @model_validator(mode="after")
    def _unique_env_names(self):
        seen = [e.name for e in self.env]
        duplicates = sorted({n for n in seen if seen.count(n) > 1})
        if duplicates:
            raise ValueError(f"env: duplicate names {duplicates}")
        return self


class RouterSpec(KubeModel):
    """The router: `adpfleet router` discovering this fleet's servers, behind one Service."""
    enabled: bool = Field(True, description="false: no router (bring your own gateway).")
    replicas: int = Field(1, ge=1, le=32, description="Router pods.")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP",
                                                                             description="Type of the router's Service.")
    resources: Resources = Field(default_factory=Resources, description="CPU and memory of each router pod.")
    queue_size: int = Field(256, ge=0, le=100_000,
                            description="Requests the router holds while it cannot place them (no Ready server of a "
                                        "role: starting, drained, restarting, failed); one more is answered 503 with "
                                        "Retry-After at once. 0: no queue (router --queue-size).")
    queue_timeout_seconds: int = Field(60, ge=1, le=3600,
                                       description="How long a held request waits in all for a server before the "
                                                   "router answers 503 with Retry-After (router --queue-timeout).")


class MonitoringSpec(KubeModel):
    """How the operator watches the servers' per-rank metrics."""
    scrape_interval_seconds: int = Field(5, ge=1, le=300, description="Seconds between scrapes of each "
                                                                       "server's /metrics.")


class EscalationSpec(KubeModel):
    """What happens when restarting a stalled server does not help."""
    after_remediations: int = Field(3, ge=1, le=100, description="Remediations of the same server within "
                                                                 "windowSeconds after which the operator escalates.")
    window_seconds: int = Field(3600, ge=60, le=86_400, description="The window of afterRemediations.")
    action: Literal[Action.RESTART_ROLE, Action.HALT] = Field(
        Action.HALT, description="RestartRole: restart every server of the role, one at a time. Halt: stop "
                                 "remediating the fleet and report Degraded.")


class RemediationSpec(KubeModel):
    """What the operator does about a stalled server (docs/remediation.md)."""
    mode: RemediationMode = Field(RemediationMode.AUTO, description="Auto: drain and restart stalled servers. "
                                                                    "DryRun: detect and report only. Disabled: "
                                                                    "do not watch for stalls.")
    stall_window_seconds: int = Field(60, ge=2, le=3600, description="No real tokens while having work for this "
                                                                     "long means stalled; at least two scrape "
                                                                     "intervals.")
    cooldown_seconds: int = Field(300, ge=0, le=86_400, description="Seconds after remediating a server before it "
                                                                    "may be remediated again.")
    max_concurrent_per_role: int = Field(1, ge=1, le=64, description="Servers of one role remediated at once.")
    budget_per_hour: int = Field(6, ge=0, le=1000, description="Remediations per fleet per rolling hour; 0 "
                                                               "remediates nothing (like DryRun).")
    drain_timeout_seconds: int = Field(30, ge=0, le=3600, description="How long a drained server may finish "
                                                                      "in-flight requests before its restart.")
    escalation: EscalationSpec = Field(default_factory=EscalationSpec, description="When remediation fails.")


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


class FleetSpec(KubeModel):
    """A disaggregated ADP inference fleet: context servers, generation servers and a router."""
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$",
                       description="Container image with adpfleet installed (servers and router).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    model: ModelSource = Field(description="The model every server loads.")
    gpu_resource_name: str = Field("nvidia.com/gpu", max_length=253, pattern=LABEL_KEY,
                                   description="Extended resource that gpusPerServer requests.")
    context: ServerRole = Field(default_factory=ServerRole, description="Prefill servers.")
    generation: ServerRole = Field(default_factory=ServerRole, description="Decode servers.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router in front of the servers.")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Metrics scraping.")
    remediation: RemediationSpec = Field(default_factory=RemediationSpec, description="Stall remediation policy.")
    pod_metadata: PodMetadata = Field(default_factory=PodMetadata, description="Extra pod labels and annotations.")
    cel_rules: ClassVar = (
        CelRule("self.remediation.stallWindowSeconds >= 2 * self.monitoring.scrapeIntervalSeconds",
                "remediation.stallWindowSeconds must be at least two monitoring.scrapeIntervalSeconds "
                "(a stall is judged from at least two scrapes)",
                ".remediation.stallWindowSeconds",
                lambda s: s.remediation.stall_window_seconds >= 2 * s.monitoring.scrape_interval_seconds),
    )

    def role(self, name: str) -> ServerRole:
        return getattr(self, name)


# ---- status ----

ConditionType = Literal["Ready", "Progressing", "Degraded", "Stalled", "Remediating"]
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class Condition(KubeModel):
    """A Kubernetes-style condition."""
    type: ConditionType = Field(description="Ready, Progressing, Degraded; Stalled and Remediating come from "
                                            "stall remediation.")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="CamelCase, machine-readable.")
    message: str = Field("", max_length=32_768, description="For people.")
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="The generation this condition was set for.")


class ScaleRecord(KubeModel):
    """A change of a role's desired server count: who made it and why."""
    time: Timestamp
    role: Literal["context", "generation"]
    previous: int = Field(ge=0, le=256, description="Desired servers before.")
    desired: int = Field(ge=0, le=256, description="Desired servers after.")
    reason: ScaleReason = Field(description="Why (docs/autoscaling.md lists the reasons).")
    source: str = Field(max_length=128, description="Who: 'policy' (the built-in autoscaling), 'spec' (the "
                                                    "fleet's servers), or the field manager that set the "
                                                    "InferenceFleetRole's replicas (kubectl, an HPA, KEDA).")
    message: str = Field("", max_length=1024, description="The signals against their targets, for people.")


class RoleStatus(KubeModel):
    """Server counts of one role."""
    desired: int = Field(0, ge=0, description="Servers wanted: spec servers, or the role's InferenceFleetRole "
                                              "replicas once it was scaled.")
    current: int = Field(0, ge=0, description="Server pods that exist and are not being deleted.")
    updated: int = Field(0, ge=0, description="Of those, the ones built from the current spec.")
    ready: int = Field(0, ge=0, description="Of those that exist, the ones that are Ready.")
    servers: str | None = Field(None, max_length=16, description="'<ready>/<desired>' (kubectl get -o wide).")
    last_scale: ScaleRecord | None = Field(None, description="The last change of desired.")


class RouterStatus(KubeModel):
    """Router pod counts."""
    desired: int = Field(0, ge=0)
    ready: int = Field(0, ge=0)


RECORD_MESSAGE_LIMIT = 1024  # characters of a remediation record's message (the verdict and its evidence)
HISTORY_LIMIT = 20           # records in status.recentRemediations (newest first)


class RemediationRecord(KubeModel):
    """One remediation, newest first in recentRemediations."""
    time: Timestamp
    role: Literal["context", "generation"]
    server: str = Field(max_length=253, description="Pod name.")
    signature: Signature = Field(description="How the server made no progress (docs/remediation.md).")
    action: Action = Field(description="What was done.")
    outcome: Outcome = Field(description="Pending, Succeeded (pods deleted), Resolved (and progress resumed), "
                                         "Failed, Recovered, DryRun or Halted.")
    message: str = Field("", max_length=RECORD_MESSAGE_LIMIT,
                         description="The verdict and its evidence (metric values).")
    targets: list[str] = Field(default_factory=list, max_length=256,
                               description="The server pods the action restarts (the stalled server, its peers, "
                                           "or its role).")


class FleetStatus(KubeModel):
    """What the operator last observed and did."""
    observed_generation: int | None = Field(None, ge=0, description="The generation the status describes.")
    conditions: list[Condition] = Field(default_factory=list, max_length=16,
                                        json_schema_extra={"x-kubernetes-list-type": "map",
                                                           "x-kubernetes-list-map-keys": ["type"]})
    context: RoleStatus | None = Field(None, description="Context server counts.")
    generation: RoleStatus | None = Field(None, description="Generation server counts.")
    router: RouterStatus | None = Field(None, description="Router pod counts.")
    ready_roles: str | None = Field(None, max_length=16, description="'<roles with every server ready>/<roles>', "
                                                                     "the router counting as a role.")
    recent_remediations: list[RemediationRecord] = Field(default_factory=list, max_length=HISTORY_LIMIT,
                                                         description="The last remediations, newest first.")
    last_scale: ScaleRecord | None = Field(None, description="The newest of the roles' lastScale.")


class InferenceFleet(KubeModel):
    """An InferenceFleet: the whole object (spec and status)."""
    api_version: Literal["adpfleet.io/v1alpha1"] = Field(names.API_VERSION, alias="apiVersion")
    kind: Literal["InferenceFleet"] = names.KIND
    metadata: dict = Field(default_factory=dict)
    spec: FleetSpec
    status: FleetStatus | None = None


# ---- InferenceFleetRole: one role's scale target ----

def _immutable(message: str) -> dict:
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": message}]}


class FleetRoleSpec(KubeModel):
    """The desired server count of one role of a fleet, behind the `scale` subresource."""
    fleet: str = Field(min_length=1, max_length=names.MAX_FLEET_NAME, json_schema_extra=_immutable(
        "fleet is immutable"), description="The InferenceFleet this object scales (set by the operator).")
    role: Literal["context", "generation"] = Field(json_schema_extra=_immutable("role is immutable"),
                                                   description="The role it scales (set by the operator).")
    replicas: int = Field(ge=1, le=256, description="Servers of the role: what `kubectl scale`, an HPA or KEDA "
                                                    "set through the scale subresource.")


class FleetRoleStatus(KubeModel):
    """The role as the operator last saw it."""
    replicas: int = Field(0, ge=0, description="Server pods that exist and are not being removed.")
    ready_replicas: int = Field(0, ge=0, description="Of those, the Ready ones.")
    desired_replicas: int = Field(0, ge=0, description="What the operator runs: spec.replicas, within "
                                                       "autoscaling's minServers..maxServers when it is on.")
    selector: str = Field("", max_length=512, description="Label selector of the role's server pods "
                                                          "(the scale subresource's, for an HPA's pod metrics).")
    last_scale: ScaleRecord | None = Field(None, description="The last change of the desired count.")


class InferenceFleetRole(KubeModel):
    """An InferenceFleetRole: the whole object."""
    api_version: Literal["adpfleet.io/v1alpha1"] = Field(names.API_VERSION, alias="apiVersion")
    kind: Literal["InferenceFleetRole"] = names.ROLE_KIND
    metadata: dict = Field(default_factory=dict)
    spec: FleetRoleSpec
    status: FleetRoleStatus | None = None


def fleet_name_problem(name: str) -> str | None:
    """Why `name` cannot name a fleet (the CRD's root rule, also checked in Python), or None."""
    import re
    if len(name) > names.MAX_FLEET_NAME:
        return f"metadata.name must be at most {names.MAX_FLEET_NAME} characters (it prefixes pod names)"
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name):
        return "metadata.name must be a DNS label starting with a letter (it names the router's Service)"
    return None


ROOT_RULES = (
    {"rule": f"size(self.metadata.name) <= {names.MAX_FLEET_NAME}",
     "message": f"metadata.name must be at most {names.MAX_FLEET_NAME} characters (it prefixes pod names)"},
    {"rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
     "message": "metadata.name must be a DNS label starting with a letter (it names the router's Service)"},
)
