"""One role of the fleet (context, generation or aggregated): its servers' engine, probes, scheduling, environment,
autoscaling, disruption budget and gang scheduling."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from adpfleet.operator.resource import names
from adpfleet.operator.resource.cel import CelRule, KubeModel
from adpfleet.operator.resource.kube_types import DNS_SUBDOMAIN, EnvVar, Resources, Toleration
from adpfleet.operator.resource.templates import ServerPodTemplate, main_containers


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
    collective_timeout_seconds: int = Field(120, ge=1, le=3600,
                                            description="Seconds a rank may block in a collective before the "
                                                        "server declares it hung, turns unhealthy and exits; "
                                                        "longer than remediation.stallWindowSeconds plus two "
                                                        "scrape intervals, so a hang is detected as a stall "
                                                        "first.")
    pad_empty_batch: bool = Field(True, description="Post-schedule padding: a rank whose batch is empty "
                                                    "joins the forward with a one-token dummy, so one starved "
                                                    "rank cannot veto every rank's forward (docs/adp.md). "
                                                    "false only to reproduce that stall.")
    threads_per_rank: int = Field(1, ge=1, le=512, description="CPU threads of each rank process "
                                                               "(OMP_NUM_THREADS).")
    draft_tokens: int = Field(0, ge=0, le=64, description="Speculative decoding: draft tokens per decode step, "
                                                          "proposed by prompt lookup (`--draft-tokens`; 0: off).")
    prompt_lookup_max: int = Field(3, ge=1, le=64, description="Longest n-gram prompt lookup matches "
                                                               "(`--prompt-lookup-max`).")
    prompt_lookup_min: int = Field(1, ge=1, le=64, description="Shortest n-gram prompt lookup matches "
                                                               "(`--prompt-lookup-min`).")
    padding_reserve: bool = Field(True, description="Admission keeps the padding dummy's KV blocks free; false "
                                                    "(`--no-padding-reserve`) only to measure what the reserve "
                                                    "rescues.")
    cel_rules: ClassVar = (
        CelRule("self.maxBatchSize <= self.maxNumActiveRequests",
                "maxBatchSize must not exceed maxNumActiveRequests (a batch is drawn from the active requests)",
                ".maxBatchSize", lambda e: e.max_batch_size <= e.max_num_active_requests),
        CelRule("self.promptLookupMin <= self.promptLookupMax",
                "promptLookupMin must not exceed promptLookupMax",
                ".promptLookupMin", lambda e: e.prompt_lookup_min <= e.prompt_lookup_max),
        CelRule("self.maxNumTokens >= 1 + self.draftTokens",
                "maxNumTokens must fit one decode query of 1 + draftTokens tokens",
                ".maxNumTokens", lambda e: e.max_num_tokens >= 1 + e.draft_tokens),
    )


class Probes(KubeModel):
    """How the kubelet checks each server (all on the runtime's HTTP port)."""
    startup_timeout_seconds: int = Field(600, ge=10, le=86_400,
                                         description="How long a server may take to load the model and start "
                                                     "every rank before it is restarted.")
    readiness_period_seconds: int = Field(5, ge=1, le=300, description="Seconds between /health checks.")


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


GangProvider = Literal["Volcano", "Coscheduling"]


class GangScheduling(KubeModel):
    """Gang scheduling of this role's servers by a scheduler that schedules a PodGroup all or nothing
    (docs/operator.md, "Gang scheduling"); off when absent. The operator creates one PodGroup per
    server, named after it (`<fleet>-<role>-<index>`), with minMember = podsPerServer, and points the
    server's pods at it and at the scheduler."""
    provider: GangProvider = Field(description="Volcano: a scheduling.volcano.sh/v1beta1 PodGroup (with the "
                                               "group's summed requests as minResources) and the pods' annotation "
                                               "scheduling.k8s.io/group-name. Coscheduling: the scheduler-plugins "
                                               "Coscheduling plugin's scheduling.x-k8s.io/v1alpha1 PodGroup and "
                                               "the pods' label scheduling.x-k8s.io/pod-group.")
    scheduler_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                                       description="The pods' schedulerName; default: 'volcano' (Volcano), "
                                                   "'scheduler-plugins-scheduler' (Coscheduling: the name its "
                                                   "second-scheduler chart installs).")
    schedule_timeout_seconds: int | None = Field(None, ge=1, le=86_400,
                                                 description="Coscheduling only: how long the group's pods may "
                                                             "wait for each other before the plugin gives the "
                                                             "group up and retries it (the PodGroup's "
                                                             "scheduleTimeoutSeconds); default: the plugin's "
                                                             "permitWaitingTimeSeconds.")
    queue: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                              description="Volcano only: the Queue the PodGroups are placed in; default: "
                                          "Volcano's 'default' queue.")
    cel_rules: ClassVar = (
        CelRule("!has(self.scheduleTimeoutSeconds) || self.provider == 'Coscheduling'",
                "scheduleTimeoutSeconds is the Coscheduling PodGroup's (Volcano's PodGroup has none)",
                ".scheduleTimeoutSeconds", lambda g: g.schedule_timeout_seconds is None or g.provider == "Coscheduling"),
        CelRule("!has(self.queue) || self.provider == 'Volcano'",
                "queue is the Volcano PodGroup's (Coscheduling has no queues)",
                ".queue", lambda g: g.queue is None or g.provider == "Volcano"),
    )


class DisruptionBudget(KubeModel):
    """The PodDisruptionBudget of this role's pods: how many an eviction (a node drain) may take at once."""
    enabled: bool = Field(True, description="false: no budget (evictions are not limited).")
    max_unavailable: int = Field(1, ge=0, le=256, description="Pods an eviction may take at once; never the last "
                                                              "Ready one (minAvailable = max(1, replicas - this)).")


class ServerRole(KubeModel):
    """One role of the fleet: its servers are identical pods, each one engine with `adpRanks` ranks."""
    servers: int = Field(1, ge=1, le=256, description="Servers of this role (each of `podsPerServer` pods).")
    adp_ranks: int = Field(1, ge=1, le=64, description="Attention-data-parallel ranks per server (`--dp`).")
    gpus_per_server: int = Field(0, ge=0, le=64, description="GPUs each server requests; a multiple of adpRanks "
                                                             "(every rank drives whole GPUs).")
    pods_per_server: int = Field(1, ge=1, le=16, description="Pods one server spans (multi-node ADP): pod j of "
                                 "a server runs ranks j*adpRanks/podsPerServer onwards; pod 0, the leader, serves "
                                 "the API. adpRanks divides evenly by it (so gpusPerServer, a multiple of adpRanks, does too). The pods are one unit: "
                                 "created together, Ready together, replaced together.")
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
    pod_template: ServerPodTemplate | None = Field(None, description=" ".join(ServerPodTemplate.__doc__.split()))
    disruption_budget: DisruptionBudget = Field(default_factory=DisruptionBudget,
                                                description="The role's PodDisruptionBudget.")
    gang_scheduling: GangScheduling | None = Field(None, description=" ".join(GangScheduling.__doc__.split()))
    cel_rules: ClassVar = (
        CelRule("self.gpusPerServer % self.adpRanks == 0",
                "gpusPerServer must be a multiple of adpRanks (each ADP rank drives whole GPUs)",
                ".gpusPerServer", lambda r: r.gpus_per_server % r.adp_ranks == 0),
        CelRule("self.adpRanks % self.podsPerServer == 0",
                "adpRanks must be a multiple of podsPerServer (every pod of a server runs as many ranks)",
                ".podsPerServer", lambda r: r.adp_ranks % r.pods_per_server == 0),
        CelRule("(self.engine.device == 'cuda') == (self.gpusPerServer > 0)",
                "engine.device must be cuda when gpusPerServer > 0 and cpu when it is 0",
                ".engine.device", lambda r: (r.engine.device == "cuda") == (r.gpus_per_server > 0)),
        CelRule("self.env.all(e, !(e.name in " + str(list(names.RESERVED_ENV)).replace("'", '"') + "))",
                "env must not set " + ", ".join(names.RESERVED_ENV) + ": the operator sets the credentials from "
                "spec.auth and its own token Secret, and fault injection only from spec.faultInjection",
                ".env", lambda r: not {e.name for e in r.env} & set(names.RESERVED_ENV)),
        CelRule(f"!has(self.podTemplate) || !has(self.podTemplate.spec.containers) || "
                f"self.podTemplate.spec.containers.all(c, c.name != '{names.SERVER_CONTAINER}' || !has(c.env) || "
                f"c.env.all(e, !self.env.exists(x, x.name == e.name)))",
                "podTemplate: an environment variable is set both in env and in the server container's env",
                ".podTemplate.spec.containers", lambda r: _env_once(r)),
        CelRule("!has(self.gangScheduling) || !has(self.podTemplate) || !has(self.podTemplate.spec.schedulerName)",
                "podTemplate.spec.schedulerName: with gangScheduling the scheduler is gangScheduling.schedulerName",
                ".podTemplate.spec.schedulerName", lambda r: r.gang_scheduling is None or r.pod_template is None
                or "schedulerName" not in r.pod_template.spec),
    )

    @model_validator(mode="after")
    def _unique_env_names(self):
        seen = [e.name for e in self.env]
        duplicates = sorted({n for n in seen if seen.count(n) > 1})
        if duplicates:
            raise ValueError(f"env: duplicate names {duplicates}")
        return self


def _env_once(role: "ServerRole") -> bool:
    if role.pod_template is None:
        return True
    names_in_template = {e.get("name") for c in main_containers(role.pod_template) for e in c.get("env") or []}
    return not names_in_template & {e.name for e in role.env}
