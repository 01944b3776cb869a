"""Which engine a fleet's servers run (docs/operator.md, "vLLM fleets").

`adpfleet` servers run `adpfleet serve`; `vllm` servers run the image's `vllm serve`. Everything
else about a fleet (model source, pod template, auth, probes, NetworkPolicies, PDBs, gang
scheduling, autoscaling, router) is the same for both; what differs is rendered by one module
per engine in `operator/decisions/engines/`.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from adpfleet.contract.engines import ENGINES
from adpfleet.contract.env import VLLM_API_KEY_ENV  # noqa: F401 (the renderer reads it here)
from adpfleet.operator.resource import names
from adpfleet.operator.resource.cel import CelRule, KubeModel, cel_list
from adpfleet.operator.resource.kube_types import DNS_SUBDOMAIN

EngineName = Literal[ENGINES]


LABEL_ENGINE = "adpfleet.io/engine"  # on server pods: which engine runs there (which dialect reads its metrics)

# The flags of `vllm serve` the operator sets from the spec; `vllm.args` may not repeat them (a second
# --port would win over the operator's and the Service, probes and router would miss the server).
VLLM_OWNED_FLAGS = ("--host", "--port", "--api-key", "--data-parallel-size", "-dp", "--tensor-parallel-size",
                    "-tp", "--served-model-name", "--model", "--data-parallel-size-local", "--data-parallel-rank",
                    "--data-parallel-address", "--data-parallel-rpc-port", "--headless", "--enable-mfu-metrics")


def owned_vllm_flag(arg: str) -> str | None:
    """The operator's flag `arg` sets (`--port` or `--port=8000`), or None."""
    return next((f for f in VLLM_OWNED_FLAGS if arg == f or arg.startswith(f + "=")), None)


VllmArg = Annotated[str, Field(min_length=1, max_length=4096)]


BACKSTEP = r"(^|/)[.]{2}(/|$)"  # a '..' segment: Kubernetes refuses it in a hostPath


class HostPathDirectory(KubeModel):
    """A directory on the node (a hostPath volume)."""
    path: str = Field(min_length=2, max_length=4096, pattern=r"^/\S*$",
                      description="An absolute path on the node. The directory must exist (a node without it "
                                  "leaves the pod unstarted with a FailedMount event) and be writable by the "
                                  "pods' user, uid 10001.")
    cel_rules: ClassVar = (
        CelRule(f"!self.path.matches('{BACKSTEP}')", "hostPath.path must not contain '..' segments", ".path",
                lambda h: not re.search(BACKSTEP, h.path)),
    )


class ClaimReference(KubeModel):
    """A PersistentVolumeClaim in the fleet's namespace."""
    claim_name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                            description="The claim's name (ReadWriteMany when the servers run on several nodes).")


class VllmCache(KubeModel):
    """A volume for vLLM's cache root (VLLM_CACHE_ROOT) that outlives the pods, so a restarted or
    rescheduled server reuses what an earlier start wrote there (its model inspection, torch.compile
    and other start-up caches) instead of redoing it. Set exactly one of hostPath and
    persistentVolumeClaim."""
    host_path: HostPathDirectory | None = Field(None, description="A directory on each node (servers on one node "
                                                                  "share it; a server on a new node starts cold).")
    persistent_volume_claim: ClaimReference | None = Field(
        None, description="A claim every server of the fleet mounts (ReadWriteMany when they run on several nodes).")
    cel_rules: ClassVar = (
        CelRule("has(self.hostPath) != has(self.persistentVolumeClaim)",
                "vllm.cache needs exactly one of hostPath and persistentVolumeClaim", ".hostPath",
                lambda c: (c.host_path is None) != (c.persistent_volume_claim is None)),
    )


class VllmEngine(KubeModel):
    """How the servers of a `vllm` fleet run vLLM: its image and extra `vllm serve` arguments. The
    operator sets the model path, --host, --port, --served-model-name, --data-parallel-size (adpRanks),
    --tensor-parallel-size (gpusPerServer / adpRanks), --enable-mfu-metrics, VLLM_API_KEY and, with a
    cache, VLLM_CACHE_ROOT."""
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$",
                       description="An image whose PATH has `vllm` (e.g. vllm/vllm-openai:v0.32.0); the fleet's "
                                   "`image` (adpfleet) still runs the router and the model-fetch init container.")
    args: list[VllmArg] = Field(default_factory=list, max_length=128,
                                description="Extra `vllm serve` arguments, passed as given after the operator's "
                                            "(e.g. --max-model-len 4096, --gpu-memory-utilization 0.9); not "
                                            "the flags the operator sets: " + ", ".join(VLLM_OWNED_FLAGS) + ".")
    cache: VllmCache | None = Field(None, description=" ".join(VllmCache.__doc__.split()) + " Mounted at "
                                    + names.VLLM_CACHE_DIR + " in every server pod; unset: the cache is in the "
                                    "pod's scratch emptyDir and every start is cold.")
    cel_rules: ClassVar = (
        CelRule(f"self.args.all(a, !{cel_list(VLLM_OWNED_FLAGS)}.exists(f, a == f || a.startsWith(f + '=')))",
                "vllm.args must not set " + ", ".join(VLLM_OWNED_FLAGS) + ": the operator sets them from the "
                "spec (adpRanks, gpusPerServer, auth, model)",
                ".args", lambda v: not any(owned_vllm_flag(a) for a in v.args)),
    )
