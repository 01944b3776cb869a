"""vLLM: `vllm serve <model directory>` from the fleet's `vllm.image` (docs/operator.md, "vLLM fleets").

ADP ranks are vLLM's data-parallel engines (`--data-parallel-size`), each driving
gpusPerServer / adpRanks GPUs (`--tensor-parallel-size`); the model is the directory the fetch-model
init container checked or filled (a download in the cache, a claim's path, a directory in the image);
the fleet's API key is vLLM's own (`VLLM_API_KEY`, not `--api-key`: a flag shows in `ps`); `vllm.cache`,
when set, is mounted as vLLM's cache root (`VLLM_CACHE_ROOT`) so that a restarted server skips the
start-up work an earlier one cached. The role's `engine` knobs are adpfleet's and do not apply:
vLLM's own flags go in `vllm.args`.
"""

from __future__ import annotations

import math

from adpfleet.contract.env import VLLM_CACHE_ROOT_ENV
from adpfleet.model_uri import CACHE_MOUNT_PATH, PVC_MOUNT_ROOT
from adpfleet.operator.decisions import security
from adpfleet.operator.resource import names
from adpfleet.operator.resource.engine import VLLM_API_KEY_ENV
from adpfleet.operator.resource.model_source import ModelSource
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

ROUTER_SENDS_INTERNAL_TOKEN = False  # vLLM checks one key, the fleet's: the router forwards the client's

# vLLM reports usage to its stats server unless told not to; the model is a local directory, so the
# hub is never needed (a server that tried would hang on a cluster without egress).
QUIET_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def model_path(model: ModelSource) -> str:
    """The directory vLLM serves: where fetch-model left (or checked) the weights."""
    uri = model.parsed
    if uri.downloads:
        return uri.cache_dir(CACHE_MOUNT_PATH)
    return uri.local_dir(pvc_root=PVC_MOUNT_ROOT)


def tensor_parallel_size(gpus_per_server: int, adp_ranks: int) -> int:
    """GPUs of one data-parallel engine: each rank drives whole GPUs (the CRD keeps the division exact)."""
    return max(1, gpus_per_server // adp_ranks)


def server_args(spec: FleetSpec, role: str) -> list[str]:
    """`vllm serve` arguments: the operator's, then `vllm.args` as given (the CRD refuses the owned flags)."""
    r = spec.role(role)
    served = spec.model.served_name or spec.model.parsed.served_name
    return ["serve", model_path(spec.model), "--host", "$(POD_IP)", "--port", str(names.SERVER_HTTP_PORT),
            "--served-model-name", served, "--data-parallel-size", str(r.adp_ranks),
            "--tensor-parallel-size", str(tensor_parallel_size(r.gpus_per_server, r.adp_ranks)),
            # vLLM's only per-step counter (estimated_flops_per_gpu_total): it advances during a long
            # chunked prefill too, so stall detection can tell a slow step from a hung engine
            "--enable-mfu-metrics", *spec.vllm.args]


def server_volumes(spec: FleetSpec) -> list[dict]:
    """vllm.cache's volume (none when unset: vLLM's cache root is then under HOME, the pod's scratch)."""
    cache = spec.vllm.cache
    if cache is None:
        return []
    if cache.host_path is not None:
        # Directory, not DirectoryOrCreate: a directory the kubelet made is root's, and uid 10001 could not write it
        return [{"name": names.VLLM_CACHE_VOLUME, "hostPath": {"path": cache.host_path.path, "type": "Directory"}}]
    return [{"name": names.VLLM_CACHE_VOLUME,
             "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim.claim_name}}]


def cache_env(spec: FleetSpec) -> dict[str, str]:
    return {VLLM_CACHE_ROOT_ENV: names.VLLM_CACHE_DIR} if spec.vllm.cache else {}


def cache_mounts(spec: FleetSpec) -> list[dict]:
    return [{"name": names.VLLM_CACHE_VOLUME, "mountPath": names.VLLM_CACHE_DIR}] if spec.vllm.cache else []


def server_container(spec: FleetSpec, role: str) -> dict:
    r = spec.role(role)
    health = {"httpGet": {"path": "/health", "port": "http"}}  # open: vLLM asks no key for it
    return {
        "image": spec.vllm.image,
        "command": ["vllm"],
        "args": server_args(spec, role),
        "env": [{"name": k, "value": v} for k, v in {**QUIET_ENV, **cache_env(spec)}.items()],
        "volumeMounts": cache_mounts(spec),
        "ports": [{"name": "http", "containerPort": names.SERVER_HTTP_PORT, "protocol": "TCP"}],
        # /health answers once the engines are up (it stays 200 while an engine hangs: that is the
        # stall detection's to see, not a probe's)
        "startupProbe": {**health, "periodSeconds": 2, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(r.probes.startup_timeout_seconds / 2)},
        "readinessProbe": {**health, "periodSeconds": r.probes.readiness_period_seconds, "timeoutSeconds": 5,
                           "failureThreshold": 2},
        "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3},
    }


def credential_env(fleet: FleetRef, spec: FleetSpec) -> list[dict]:
    return security.api_key_env(spec, VLLM_API_KEY_ENV)
