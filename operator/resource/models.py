"""The InferenceFleet resource as pydantic models: the single source of truth.

The CRD's OpenAPI schema is generated from these classes (`crd.py`): field descriptions, defaults,
bounds and enums come from the `Field`s, and every cross-field rule is written once as a `CelRule`
that carries both its CEL text (enforced by the API server at apply time) and the same check in
Python (enforced by `model_validate`, so the operator and the unit tests apply identical rules).

YAML names are camelCase (`adpRanks`); Python names are snake_case (`adp_ranks`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from adpfleet.model_uri import ModelURI, ModelURIError, parse_model_uri
from adpfleet.operator.resource import names, pod_schema, quantity
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


def cel_checked(*rules: CelRule) -> tuple:
    """Annotated metadata putting CEL rules on a scalar field (`self` is its value) and running
    their Python twins on it: `Annotated[str, *cel_checked(rule, ...)]`."""
    def validate(value):
        for rule in rules:
            if not rule.check(value):
                raise ValueError(rule.message)
        return value
    return (Field(json_schema_extra={"x-kubernetes-validations": [r.to_schema() for r in rules]}),
            AfterValidator(validate))


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
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The object's name.")


# ---- the model source: a URI (adpfleet/model_uri.py) and what fetching it needs ----

@dataclass(frozen=True)
class URIRule:
    """One part of the model-source URI grammar as RE2 regular expressions, for the API server:
    where the URI matches `applies`, it must match every `require` and none of `forbid` (CEL's
    `matches` searches, as `re.search` does). The Python twin is `parse_model_uri` itself: the rule
    fails when parsing fails at this `part`. tests/operator/test_models.py keeps the expressions and
    the parser in agreement over a catalogue of URIs."""
    part: str
    message: str
    applies: str | None
    require: tuple[str, ...] = ()
    forbid: tuple[str, ...] = ()

    def cel(self) -> str:
        def matches(rx: str) -> str:
            assert "'" not in rx
            return "self.matches('" + rx.replace("\\", "\\\\") + "')"
        terms = " && ".join([matches(r) for r in self.require] + [f"!{matches(r)}" for r in self.forbid])
        return f"!{matches(self.applies)} || ({terms})" if self.applies else terms

    def holds(self, text: str) -> bool:
        """What the API server's CEL rule says about `text` (the regular expressions, in Python)."""
        if self.applies and not re.search(self.applies, text):
            return True
        return all(re.search(r, text) for r in self.require) and not any(re.search(r, text) for r in self.forbid)

    def check(self, text: str) -> bool:
        """The Python twin: the parser does not refuse `text` for this part."""
        if self.applies and not re.search(self.applies, text):
            return True
        try:
            parse_model_uri(text)
        except ModelURIError as e:
            return e.part != self.part
        return True

    def cel_rule(self) -> CelRule:
        return CelRule(self.cel(), self.message, None, self.check)


_HF_NAME = "[A-Za-z0-9]([A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_DNS_LABEL = "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
URI_RULES = (
    URIRule("the URI", "must not contain whitespace or control characters", None, forbid=(r"[\x00-\x20]",)),
    URIRule("scheme", "the scheme must be hf://, s3://, pvc:// or file:// (or give a model directory or a built-in "
                      "name: tiny, tiny-dense)",
            "^[A-Za-z][A-Za-z0-9+.-]*://", require=("^(hf|s3|pvc|file)://",)),
    URIRule("repo", "hf:// needs a repository, hf://ORG/REPO[@REVISION]: letters, digits, '-', '_' and '.', at most "
                    "96 each, no '--' or '..'",
            "^hf://", require=(f"^hf://{_HF_NAME}(/{_HF_NAME})?(@|$)",), forbid=("^hf://[^@]*(--|[.][.])",)),
    URIRule("revision", "the revision after '@' must be a branch, tag or commit",
            "^hf://[^@]*@", require=("^hf://[^@]*@[A-Za-z0-9._][A-Za-z0-9._/-]{0,254}$",),
            forbid=("^hf://[^@]*@.*[.][.]", "/$")),
    URIRule("bucket", "s3:// needs a bucket name, s3://BUCKET[/PREFIX]: 3-63 lowercase letters, digits, dots and "
                      "hyphens",
            "^s3://", require=("^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/|$)",), forbid=("^s3://[^/]*[.][.]",)),
    URIRule("prefix", "the S3 prefix must not contain '.' or '..' segments",
            "^s3://", forbid=("^s3://[^/]*/(.*/)?[.][.]?(/|$)",)),
    URIRule("claim", "pvc:// needs a PersistentVolumeClaim name, pvc://CLAIM[/PATH]: a lowercase DNS subdomain "
                     "(letters, digits, '-' and '.')",
            "^pvc://", require=(f"^pvc://{_DNS_LABEL}([.]{_DNS_LABEL})*(/|$)", "^pvc://[^/]{1,253}(/|$)")),
    URIRule("path", "the path inside the claim must not contain '.' or '..' segments",
            "^pvc://", forbid=("^pvc://[^/]*/(.*/)?[.][.]?(/|$)",)),
    URIRule("path", "file:// needs an absolute path (file:///DIR)", "^file://", require=("^file:///",)),
)
ModelURIText = Annotated[str, Field(min_length=1, max_length=512), *cel_checked(*(r.cel_rule() for r in URI_RULES))]
_SOURCE = "(has(self.uri) ? self.uri : (has(self.name) ? self.name : ''))"  # CEL: the URI, whichever field has it


class ModelCache(KubeModel):
    """Where hf:// and s3:// models are downloaded before a server starts: an emptyDir of each pod, or
    a PersistentVolumeClaim the fleet's servers share (downloaded once, kept across restarts)."""
    size_limit: Quantity | None = Field(None, description="Size limit of each pod's emptyDir cache, e.g. '50Gi' (a "
                                                          "download that does not fit fails with DiskFull).")
    claim_name: str | None = Field(None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                                   description="A PersistentVolumeClaim in the fleet's namespace used as the cache by "
                                               "every server of the fleet instead of an emptyDir (ReadWriteMany when "
                                               "servers run on several nodes).")
    cel_rules: ClassVar = (
        CelRule("!has(self.sizeLimit) || !has(self.claimName)",
                "sizeLimit is the emptyDir's; a claim's size is its own (set one of sizeLimit and claimName)",
                ".sizeLimit", lambda c: c.size_limit is None or c.claim_name is None),
    )


class ModelSource(KubeModel):
    """What the servers load, and what fetching it needs (docs/operator.md, Model sources)."""
    uri: ModelURIText | None = Field(None, description="The model: hf://ORG/REPO[@REVISION] (Hugging Face Hub), "
                                                       "s3://BUCKET/PREFIX, pvc://CLAIM/PATH (mounted read-only), a "
                                                       "model directory inside the image, or a built-in name ('tiny', "
                                                       "'tiny-dense'). hf:// and s3:// are downloaded by an init "
                                                       "container into the cache before the server starts.")
    name: ModelURIText | None = Field(None, description="The older spelling of uri (set one of them).")
    served_name: str | None = Field(None, min_length=1, max_length=256, pattern=r"^\S+$",
                                    description="Model id the OpenAI API reports and accepts; default: the "
                                                "repository's name (else the last segment of the path).")
    endpoint: str | None = Field(None, max_length=1024, pattern=r"^https?://[^\s/?#]+(/\S*)?$",
                                 description="Where the source is served from: a Hugging Face Hub mirror for hf:// "
                                             "(HF_ENDPOINT), an S3-compatible store such as MinIO or Ceph for s3:// "
                                             "(AWS_ENDPOINT_URL).")
    token_secret_ref: SecretKeyRef | None = Field(None, description="Secret key given to the download as HF_TOKEN "
                                                                    "(gated or private Hugging Face repositories).")
    credentials_secret_ref: LocalObjectReference | None = Field(
        None, description="s3://: a Secret with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and, if "
                          "present, AWS_SESSION_TOKEN and AWS_REGION), given to the download as those variables.")
    cache: ModelCache = Field(default_factory=ModelCache, description="Where downloads land.")
    cel_rules: ClassVar = (
        CelRule("has(self.uri) != has(self.name)", "set exactly one of uri and name (name is the older spelling of "
                                                   "uri)", ".uri", lambda m: (m.uri is None) != (m.name is None)),
        CelRule(f"!has(self.endpoint) || {_SOURCE}.startsWith('hf://') || {_SOURCE}.startsWith('s3://')",
                "endpoint is for hf:// and s3:// sources", ".endpoint",
                lambda m: m.endpoint is None or m.source.startswith(("hf://", "s3://"))),
        CelRule(f"!has(self.credentialsSecretRef) || {_SOURCE}.startsWith('s3://')",
                "credentialsSecretRef is for s3:// sources (hf:// takes tokenSecretRef)", ".credentialsSecretRef",
                lambda m: m.credentials_secret_ref is None or m.source.startswith("s3://")),
    )

    @property
    def source(self) -> str:
        """The model URI, from whichever of uri and name is set."""
        return self.uri or self.name or ""

    @property
    def parsed(self) -> ModelURI:
        return parse_model_uri(self.source)


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


RESERVED_ENV = names.RESERVED_ENV  # the credentials and fault injection: not from a fleet's env
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


# ---- pod templates: a part of a pod laid over the operator's (docs/operator.md, "Pod templates") ----

PodSpecPart = Annotated[dict[str, Any], WithJsonSchema(pod_schema.structural())]
OPERATOR_RESOURCES = ("cpu", "memory", "ephemeral-storage")  # the role's `resources` sets these


def _cel_list(values) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _entries(template: "PodTemplate", field: str) -> list[dict]:
    return [c for c in (template.spec.get(field) or []) if isinstance(c, dict)]


def _main(template: "PodTemplate") -> list[dict]:
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
        return lambda t: all(check(c) for c in _main(t))

    def mounts_rule(field: str) -> CelRule:
        return CelRule(
            f"!has(self.spec.{field}) || self.spec.{field}.all(c, !has(c.volumeMounts) || c.volumeMounts.all(m, "
            f"m.name in {_cel_list(owns.volumes)} || (has(self.spec.volumes) && "
            f"self.spec.volumes.exists(v, v.name == m.name))))",
            f"{field}: every volumeMount names a volume of the template (or {', '.join(owns.volumes)})",
            f".spec.{field}", lambda t: _mounts_resolve(t, field))

    return (
        CelRule(of_main + " && ".join(f"!has(c.{f})" for f in owned_fields) + ")",
                f"containers[name={main}] may set only {', '.join(may_set)}: its command, args, image, ports, "
                f"probes and lifecycle are set by the operator",
                ".spec.containers", main_has(lambda c: not set(c) & set(owned_fields))),
        CelRule(of_main + f"!has(c.env) || c.env.all(e, !(e.name in {_cel_list(owns.env)})))",
                f"containers[name={main}].env: {', '.join(owns.env)} are set by the operator",
                ".spec.containers", main_has(lambda c: not {e.get("name") for e in c.get("env") or []} & set(owns.env))),
        CelRule(of_main + f"!has(c.volumeMounts) || c.volumeMounts.all(m, !(m.mountPath in "
                f"{_cel_list(owns.mount_paths)})))",
                f"containers[name={main}].volumeMounts: {', '.join(owns.mount_paths)} are mounted by the operator",
                ".spec.containers",
                main_has(lambda c: not {m.get("mountPath") for m in c.get("volumeMounts") or []} & set(owns.mount_paths))),
        CelRule(of_main + "!has(c.resources) || ("
                + " && ".join(f"(!has(c.resources.{side}) || !c.resources.{side}.exists(k, k in "
                              f"{_cel_list(OPERATOR_RESOURCES)}))" for side in ("requests", "limits")) + "))",
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
        CelRule(f"!has(self.spec.volumes) || self.spec.volumes.all(v, !(v.name in {_cel_list(owns.volumes)}))",
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
        CelRule("self.env.all(e, !(e.name in " + str(list(RESERVED_ENV)).replace("'", '"') + "))",
                "env must not set " + ", ".join(RESERVED_ENV) + ": the operator sets the credentials from "
                "spec.auth and its own token Secret, and fault injection only from spec.faultInjection",
                ".env", lambda r: not {e.name for e in r.env} & set(RESERVED_ENV)),
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
    names_in_template = {e.get("name") for c in _main(role.pod_template) for e in c.get("env") or []}
    return not names_in_template & {e.name for e in role.env}


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


NAMESPACE_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CIDR = r"^[0-9a-fA-F:.]+/[0-9]{1,3}$"


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
        template = spec.role(role).pod_template
        return template is None or not any(spec.gpu_resource_name in ((c.get("resources") or {}).get(side) or {})
                                           for c in _main(template) for side in ("requests", "limits"))
    sides = " && ".join(f"(!has(c.resources.{side}) || !(self.gpuResourceName in c.resources.{side}))"
                        for side in ("requests", "limits"))
    return CelRule(f"!has(self.{role}.podTemplate) || !has(self.{role}.podTemplate.spec.containers) || "
                   f"self.{role}.podTemplate.spec.containers.all(c, c.name != '{names.SERVER_CONTAINER}' || "
                   f"!has(c.resources) || ({sides}))",
                   f"{role}.podTemplate: the GPU resource (gpuResourceName) is requested by gpusPerServer, not by "
                   f"the server container's resources", f".{role}.podTemplate.spec.containers", check)


class FleetSpec(KubeModel):
    """A disaggregated ADP inference fleet: context servers, generation servers and a router."""
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
    context: ServerRole = Field(default_factory=ServerRole, description="Prefill servers.")
    generation: ServerRole = Field(default_factory=ServerRole, description="Decode servers.")
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
        *(_gpu_resource_not_in_template(role) for role in names.ROLES),
        CelRule("self.remediation.stallWindowSeconds >= 2 * self.monitoring.scrapeIntervalSeconds",
                "remediation.stallWindowSeconds must be at least two monitoring.scrapeIntervalSeconds "
                "(a stall is judged from at least two scrapes)",
                ".remediation.stallWindowSeconds",
                lambda s: s.remediation.stall_window_seconds >= 2 * s.monitoring.scrape_interval_seconds),
        CelRule("self.remediation.mode == 'Disabled' || self.remediation.stallWindowSeconds + "
                "2 * self.monitoring.scrapeIntervalSeconds <= self.context.engine.collectiveTimeoutSeconds && "
                "self.remediation.stallWindowSeconds + 2 * self.monitoring.scrapeIntervalSeconds <= "
                "self.generation.engine.collectiveTimeoutSeconds",
                "remediation.stallWindowSeconds plus two monitoring.scrapeIntervalSeconds must not exceed "
                "engine.collectiveTimeoutSeconds of either role: a hung server exits after its collective "
                "timeout, before its stall could be detected and recorded",
                ".remediation.stallWindowSeconds", lambda s: s.remediation.mode is RemediationMode.DISABLED or all(
                    s.remediation.stall_window_seconds + 2 * s.monitoring.scrape_interval_seconds
                    <= s.role(r).engine.collective_timeout_seconds for r in names.ROLES)),
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
    status: Literal["True", "False", "Unknown"] = Field(description="Whether the condition holds.")
    reason: str = Field(min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
                        description="CamelCase, machine-readable.")
    message: str = Field("", max_length=32_768, description="For people.")
    last_transition_time: Timestamp = Field(description="When status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="The generation this condition was set for.")


class ScaleRecord(KubeModel):
    """A change of a role's desired server count: who made it and why."""
    time: Timestamp = Field(description="When the desired count changed.")
    role: Literal["context", "generation"] = Field(description="The role scaled.")
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
    desired: int = Field(0, ge=0, description="spec router replicas (0 when the router is disabled).")
    ready: int = Field(0, ge=0, description="Router pods that are Ready.")


RECORD_MESSAGE_LIMIT = 1024  # characters of a remediation record's message (the verdict and its evidence)
HISTORY_LIMIT = 20           # records in status.recentRemediations (newest first)


class RemediationRecord(KubeModel):
    """One remediation, newest first in recentRemediations."""
    time: Timestamp = Field(description="When the remediation was decided.")
    role: Literal["context", "generation"] = Field(description="The stalled server's role.")
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


ModelPhase = Literal["Pending", "Downloading", "Available", "Unavailable"]


class ModelStatus(KubeModel):
    """The fleet's model as its servers last showed it."""
    source: str = Field(max_length=512, description="spec.model.uri (or name).")
    phase: ModelPhase = Field(description="Downloading: a server waits for its download. Unavailable: the model "
                                          "cannot be had (reason; the Degraded condition says why). Available: "
                                          "every server that started has it. Pending: no server has got that far.")
    reason: str | None = Field(None, max_length=128, description="Unavailable: why (docs/engine.md's failure "
                                                                 "reasons, or ClaimNotFound).")
    revision: str | None = Field(None, max_length=512, description="Available, hf://: the commit the servers "
                                 "fetched the model at (several, comma-separated, if their caches differ).")
    bytes_done: int | None = Field(None, ge=0, description="Downloading: bytes on disk, summed over the servers "
                                                          "downloading (where their log has said).")
    bytes_total: int | None = Field(None, ge=0, description="Downloading: bytes those downloads fetch in all.")
    progress: str | None = Field(None, max_length=64, description="Downloading: bytes done of total, for people.")


class FleetStatus(KubeModel):
    """What the operator last observed and did."""
    observed_generation: int | None = Field(None, ge=0, description="The generation the status describes.")
    conditions: list[Condition] = Field(default_factory=list, max_length=16,
                                        json_schema_extra={"x-kubernetes-list-type": "map",
                                                           "x-kubernetes-list-map-keys": ["type"]},
                                        description="Ready (the fleet serves: every role has a Ready server, "
                                                    "and the router), Progressing, Degraded, Stalled, "
                                                    "Remediating (docs/operator.md, docs/remediation.md).")
    context: RoleStatus | None = Field(None, description="Context server counts.")
    generation: RoleStatus | None = Field(None, description="Generation server counts.")
    router: RouterStatus | None = Field(None, description="Router pod counts.")
    ready_roles: str | None = Field(None, max_length=16, description="'<roles with every server ready>/<roles>', "
                                                                     "the router counting as a role.")
    recent_remediations: list[RemediationRecord] = Field(default_factory=list, max_length=HISTORY_LIMIT,
                                                         description="The last remediations, newest first.")
    last_scale: ScaleRecord | None = Field(None, description="The newest of the roles' lastScale.")
    model: ModelStatus | None = Field(None, description="The model source and whether the servers have it.")


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
