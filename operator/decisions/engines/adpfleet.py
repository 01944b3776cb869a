"""adpfleet's own engine: `adpfleet serve` with the role's engine knobs (docs/operator.md lists the flags)."""

from __future__ import annotations

import math

from adpfleet.model_uri import CACHE_MOUNT_PATH
from adpfleet.operator.decisions import security
from adpfleet.operator.resource import names
from adpfleet.operator.resource.model_source import ModelSource
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.resource.server_role import ServerRole

ROUTER_SENDS_INTERNAL_TOKEN = True  # adpfleet servers take the fleet's internal token beside the API key

STOP_MARGIN_SECONDS = 5  # of the grace period, kept for stopping the ranks and exiting after the drain


def drain_seconds(grace_seconds: int) -> int:
    """How long a server stopped with `grace_seconds` lets in-flight requests run (`--drain-timeout`):
    the grace period less the time to stop (at most half of it), so it exits 0 before the SIGKILL."""
    return grace_seconds - min(STOP_MARGIN_SECONDS, grace_seconds // 2)


def model_args(model: ModelSource) -> list[str]:
    """`--model URI` (and the cache when the source is downloaded), for fetch-model and serve."""
    return [model.source] + (["--cache-dir", CACHE_MOUNT_PATH] if model.parsed.downloads else [])


def server_args(spec: FleetSpec, role: str) -> list[str]:
    """`adpfleet serve` arguments for a server of `role` (docs/operator.md lists them)."""
    r: ServerRole = spec.role(role)
    e = r.engine
    args = ["serve", "--role", role, "--model", *model_args(spec.model), "--dp", str(r.adp_ranks),
            "--host", "$(POD_IP)", "--port", str(names.SERVER_HTTP_PORT),
            "--device", e.device, "--dtype", e.dtype, "--kv-blocks", str(e.kv_blocks),
            "--tokens-per-block", str(e.tokens_per_block), "--max-num-tokens", str(e.max_num_tokens),
            "--max-batch-size", str(e.max_batch_size), "--max-num-active-requests", str(e.max_num_active_requests),
            "--collective-timeout", str(e.collective_timeout_seconds),
            "--drain-timeout", str(drain_seconds(r.termination_grace_period_seconds))]
    if spec.model.served_name:
        args += ["--served-model-name", spec.model.served_name]
    if not e.pad_empty_batch:
        args.append("--no-pad-empty-batch")
    if e.draft_tokens:
        args += ["--draft-tokens", str(e.draft_tokens), "--prompt-lookup-max", str(e.prompt_lookup_max),
                 "--prompt-lookup-min", str(e.prompt_lookup_min)]
    if not e.padding_reserve:
        args.append("--no-padding-reserve")
    if spec.fault_injection:
        args.append("--fault-injection")
    return args


def server_volumes(spec: FleetSpec) -> list[dict]:
    return []


def server_container(spec: FleetSpec, role: str) -> dict:
    r = spec.role(role)
    ports = [{"name": "http", "containerPort": names.SERVER_HTTP_PORT, "protocol": "TCP"}]
    if role == "context":  # context servers serve KV-cache transfers to generation servers
        ports.append({"name": "kv", "containerPort": names.SERVER_KV_PORT, "protocol": "TCP"})
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        "image": spec.image,
        "command": ["adpfleet"],
        "args": server_args(spec, role),
        "env": [{"name": names.THREADS_ENV, "value": str(r.engine.threads_per_rank)}],
        "volumeMounts": [],  # the shared ones only: scratch, shared memory, the model
        "ports": ports,
        # /health is 200 only when every rank is up: it gates startup and readiness.
        "startupProbe": {**health, "periodSeconds": 2, "timeoutSeconds": 2,
                         "failureThreshold": math.ceil(r.probes.startup_timeout_seconds / 2)},
        "readinessProbe": {**health, "periodSeconds": r.probes.readiness_period_seconds, "timeoutSeconds": 3,
                           "failureThreshold": 2},
        # Liveness asks only whether the HTTP front end answers: a dead or hung rank already makes the
        # server exit, and a stalled engine is the remediation's call (drain first, cooldowns, DryRun),
        # which a liveness kill on /health would pre-empt. /metrics, because it needs no credential.
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
    }


def credential_env(fleet: FleetRef, spec: FleetSpec) -> list[dict]:
    return security.reserved_env(fleet, spec)
