"""The InferenceFleet's spec: the root the CRD's schema and docs/configuration.md are generated from
(`crd.py`, `reference.py`); field descriptions, defaults, bounds and enums come from the `Field`s,
cross-field rules are `CelRule`s (`cel.py`). Its parts have files of their own: the model source
(`model_source.py`), a server role (`server_role.py`), pod templates (`templates.py`), shared
Kubernetes values (`kube_types.py`); the status is `status.py`, the InferenceFleetRole `fleet_role.py`.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from adpfleet.contract.roles import AGGREGATED, SPLIT_ROLES
from adpfleet.contract.router_policy import DEFAULT_ROUTER_POLICY, ROUTER_POLICIES
from adpfleet.model_uri import BUILTIN_MODELS
from adpfleet.operator.resource import names
from adpfleet.operator.resource.cel import CelRule, KubeModel, cel_list
from adpfleet.operator.resource.engine import EngineName, VllmEngine
from adpfleet.operator.resource.kube_types import (CIDR, LABEL_KEY, NAMESPACE_NAME, LocalObjectReference, Resources,
                                                  SecretKeyRef)
from adpfleet.operator.resource.model_source import ModelSource
from adpfleet.operator.resource.server_role import DisruptionBudget, EngineSettings, ServerRole
from adpfleet.operator.resource.templates import PodMetadata, RouterPodTemplate, main_containers
from adpfleet.operator.resource.vocabulary import Action, RemediationMode


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
    policy: Literal[ROUTER_POLICIES] = Field(
        DEFAULT_ROUTER_POLICY,
        description="How the router chooses servers (router --policy). cache-aware: context and aggregated servers, "
                    "and their ADP rank, by the prefill their prefix cache saves and their load (the servers' "
                    "GET /internal/prefix_cache, polled every 0.5 s; generation servers by load); it tokenizes "
                    "prompts with the model's tokenizer, which it can load for a built-in model or a directory in "
                    "the image, and routes by load otherwise. least-loaded: fewest requests in flight. "
                    "round-robin: in turn.")
    pod_template: RouterPodTemplate | None = Field(None, description=" ".join(RouterPodTemplate.__doc__.split()))
    disruption_budget: DisruptionBudget = Field(default_factory=DisruptionBudget,
                                                description="The router's PodDisruptionBudget.")


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


class AuthSpec(KubeModel):
    """Who may call the fleet (docs/security.md). The router and every server also get the fleet's
    internal token, from a Secret the operator creates (`<fleet>-internal-token`)."""
    api_key_secret: SecretKeyRef | None = Field(
        None, description="Secret key holding the fleet's API key: clients must send `Authorization: Bearer "
                          "<key>` on every path but /health and /metrics (ADPFLEET_API_KEY of the router and "
                          "servers, resolved by the kubelet). Unset: the router's API is open.")


class NetworkPolicySpec(KubeModel):
    """Who may connect to the fleet's ports, when the operator runs with `--network-policies` (the
    chart's default). Server HTTP ports take only the fleet's router, the operator and
    `monitoringNamespaces`; KV ports only the fleet's generation servers."""
    client_namespaces: list[Annotated[str, Field(max_length=63, pattern=NAMESPACE_NAME)]] = Field(
        default_factory=list, max_length=32,
        description="Namespaces whose pods may call the router (the servers when router.enabled is false). "
                    "With clientCidrs empty too, anyone may (the API key is then the gate).")
    client_cidrs: list[Annotated[str, Field(max_length=64, pattern=CIDR)]] = Field(
        default_factory=list, max_length=32,
        description="IP ranges (CIDR) that may call the router (the servers when router.enabled is false).")
    monitoring_namespaces: list[Annotated[str, Field(max_length=63, pattern=NAMESPACE_NAME)]] = Field(
        default_factory=list, max_length=8,
        description="Namespaces whose pods (Prometheus) may reach the servers' HTTP port for /metrics.")


def _gpu_resource_not_in_template(role: str) -> CelRule:
    def check(spec: "FleetSpec") -> bool:
        template = getattr(spec, role).pod_template if getattr(spec, role) is not None else None
        return template is None or not any(spec.gpu_resource_name in ((c.get("resources") or {}).get(side) or {})
                                           for c in main_containers(template) for side in ("requests", "limits"))
    sides = " && ".join(f"(!has(c.resources.{side}) || !(self.gpuResourceName in c.resources.{side}))"
                        for side in ("requests", "limits"))
    return CelRule(f"!has(self.{role}) || !has(self.{role}.podTemplate) || "
                   f"!has(self.{role}.podTemplate.spec.containers) || "
                   f"self.{role}.podTemplate.spec.containers.all(c, c.name != '{names.SERVER_CONTAINER}' || "
                   f"!has(c.resources) || ({sides}))",
                   f"{role}.podTemplate: the GPU resource (gpuResourceName) is requested by gpusPerServer, not by "
                   f"the server container's resources", f".{role}.podTemplate.spec.containers", check)


def _collective_timeout(role: str) -> str:
    """CEL: the role's collective timeout; a split role left out has the default (it is filled in
    after admission, `FleetSpec._split_by_default`); an absent aggregated role never times out."""
    absent = EngineSettings().collective_timeout_seconds if role in SPLIT_ROLES else "2147483647"
    if role in SPLIT_ROLES:
        absent = f"(has(self.aggregated) ? 2147483647 : {absent})"
    return f"(has(self.{role}) ? self.{role}.engine.collectiveTimeoutSeconds : {absent})"


_TOPOLOGY_RULES = (
    CelRule("!has(self.aggregated) || (!has(self.context) && !has(self.generation))",
            "aggregated servers prefill and decode themselves: set either aggregated or context and generation",
            ".aggregated", lambda s: s.aggregated is None or (s.context is None and s.generation is None)),
    CelRule("self.engine != 'vllm' || has(self.aggregated)",
            "engine vllm runs aggregated fleets only: vLLM's prefill/decode split needs a KV connector "
            "(NIXL, NCCL) the operator does not configure; set aggregated instead of context and generation",
            ".engine", lambda s: s.engine != "vllm" or s.aggregated is not None),
    CelRule("(self.engine == 'vllm') == has(self.vllm)",
            "vllm (its image and args) is set exactly when engine is vllm",
            ".vllm", lambda s: (s.engine == "vllm") == (s.vllm is not None)),
    CelRule("self.engine != 'vllm' || !has(self.aggregated) || self.aggregated.podsPerServer == 1",
            "engine vllm: aggregated.podsPerServer must be 1 (a vLLM server over several pods is not rendered)",
            ".aggregated.podsPerServer",
            lambda s: s.engine != "vllm" or s.aggregated is None or s.aggregated.pods_per_server == 1),
    CelRule(f"self.engine != 'vllm' || !((has(self.model.uri) ? self.model.uri : self.model.name) in "
            f"{cel_list(BUILTIN_MODELS)})",
            "engine vllm needs model weights (hf://, s3://, pvc:// or a directory): the built-in models "
            f"{', '.join(BUILTIN_MODELS)} are adpfleet's own", ".model",
            lambda s: s.engine != "vllm" or s.model.parsed.kind != "builtin"),
    # a transition rule: the API server compares with the stored spec; its twin cannot (no old object)
    CelRule("has(self.aggregated) == has(oldSelf.aggregated)",
            "aggregated is immutable: an aggregated fleet and a disaggregated one have different servers; "
            "create a new fleet", ".aggregated", lambda s: True),
)


class FleetSpec(KubeModel):
    """An ADP inference fleet: context and generation servers, or aggregated ones, and a router in front."""
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$",
                       description="Container image with adpfleet installed (servers and router).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="When the kubelet pulls `image` (the pods' imagePullPolicy).")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets in the fleet's namespace with the registry "
                                                         "credentials for `image` (the pods' imagePullSecrets).")
    model: ModelSource = Field(description="The model every server loads.")
    gpu_resource_name: str = Field("nvidia.com/gpu", max_length=253, pattern=LABEL_KEY,
                                   description="Extended resource that gpusPerServer requests.")
    engine: EngineName = Field("adpfleet", description="The engine the servers run: adpfleet (`adpfleet serve`) "
                                                       "or vllm (`vllm serve` from vllm.image; aggregated fleets "
                                                       "only).")
    vllm: VllmEngine | None = Field(None, description=" ".join(VllmEngine.__doc__.split()))
    context: ServerRole | None = Field(None, description="Prefill servers of a disaggregated fleet (one server "
                                                         "when left out and aggregated is not set).")
    generation: ServerRole | None = Field(None, description="Decode servers of a disaggregated fleet (one server "
                                                            "when left out and aggregated is not set).")
    aggregated: ServerRole | None = Field(None, description="Servers that prefill and decode themselves, with no KV "
                                                            "hand-off, instead of context and generation "
                                                            "(immutable).")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The router in front of the servers.")
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec, description="Metrics scraping.")
    remediation: RemediationSpec = Field(default_factory=RemediationSpec, description="Stall remediation policy.")
    pod_metadata: PodMetadata = Field(default_factory=PodMetadata, description="Extra pod labels and annotations.")
    auth: AuthSpec = Field(default_factory=AuthSpec, description="The fleet's API key.")
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec,
                                              description="Who may connect (with the operator's --network-policies).")
    fault_injection: bool = Field(False, description="Servers accept POST /faults (`--fault-injection`) to freeze "
                                                     "a rank, stop KV reaping or starve a rank: tests and demos "
                                                     "only. It needs the fleet's credentials like /v1/*.")
    cel_rules: ClassVar = (
        *(_gpu_resource_not_in_template(role) for role in (*SPLIT_ROLES, AGGREGATED)),
        *_TOPOLOGY_RULES,
        CelRule("self.remediation.stallWindowSeconds >= 2 * self.monitoring.scrapeIntervalSeconds",
                "remediation.stallWindowSeconds must be at least two monitoring.scrapeIntervalSeconds "
                "(a stall is judged from at least two scrapes)",
                ".remediation.stallWindowSeconds",
                lambda s: s.remediation.stall_window_seconds >= 2 * s.monitoring.scrape_interval_seconds),
        CelRule("self.remediation.mode == 'Disabled' || self.engine != 'adpfleet' || "
                + " && ".join(f"self.remediation.stallWindowSeconds + 2 * self.monitoring.scrapeIntervalSeconds <= "
                              f"{_collective_timeout(r)}" for r in (*SPLIT_ROLES, AGGREGATED)),
                "remediation.stallWindowSeconds plus two monitoring.scrapeIntervalSeconds must not exceed "
                "engine.collectiveTimeoutSeconds of any role: a hung server exits after its collective "
                "timeout, before its stall could be detected and recorded",
                ".remediation.stallWindowSeconds", lambda s: s.remediation.mode is RemediationMode.DISABLED or
                s.engine != "adpfleet" or all(s.remediation.stall_window_seconds +
                                              2 * s.monitoring.scrape_interval_seconds
                                              <= s.role(r).engine.collective_timeout_seconds for r in s.roles())),
    )

    @model_validator(mode="before")
    @classmethod
    def _split_by_default(cls, data):
        """A fleet that does not say `aggregated` is disaggregated: one context and one generation server
        unless it says otherwise (a schema cannot default one field on another's absence)."""
        if isinstance(data, dict) and data.get("aggregated") is None:
            data = {**data, "context": data.get("context") or {}, "generation": data.get("generation") or {}}
        return data

    def roles(self) -> tuple[str, ...]:
        """The roles this fleet runs, each a spec field of that name."""
        return (AGGREGATED,) if self.aggregated is not None else SPLIT_ROLES

    def role(self, name: str) -> ServerRole:
        role = getattr(self, name)
        if role is None:
            raise ValueError(f"the fleet has no {name} role (it runs {', '.join(self.roles())})")
        return role


FLEET_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
ROOT_RULES = (  # on the whole object: `self` is the InferenceFleet; the twins check its name
    CelRule(f"size(self.metadata.name) <= {names.MAX_FLEET_NAME}",
            f"metadata.name must be at most {names.MAX_FLEET_NAME} characters (it prefixes pod names)", None,
            lambda name: len(name) <= names.MAX_FLEET_NAME),
    CelRule(f"self.metadata.name.matches('{FLEET_NAME}')",
            "metadata.name must be a DNS label starting with a letter (it names the router's Service)", None,
            lambda name: re.match(FLEET_NAME, name) is not None),
)


def fleet_name_problem(name: str) -> str | None:
    """Why `name` cannot name a fleet (the CRD's root rules, in Python), or None."""
    return next((rule.message for rule in ROOT_RULES if not rule.check(name)), None)
