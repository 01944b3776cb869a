"""Which engine a fleet's servers run (docs/operator.md, "vLLM fleets").

`adpfleet` servers run `adpfleet serve`; `vllm` servers run the image's `vllm serve`. Everything
else about a fleet (model source, pod template, auth, probes, NetworkPolicies, PDBs, gang
scheduling, autoscaling, router) is the same for both; what differs is rendered by one module
per engine in `operator/decisions/engines/`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from adpfleet.contract.engines import ENGINES
from adpfleet.contract.env import VLLM_API_KEY_ENV  # noqa: F401 (the renderer reads it here)
from adpfleet.operator.resource.cel import CelRule, KubeModel, cel_list

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


class VllmEngine(KubeModel):
    """How the servers of a `vllm` fleet run vLLM: its image and extra `vllm serve` arguments. The
    operator sets the model path, --host, --port, --served-model-name, --data-parallel-size (adpRanks),
    --tensor-parallel-size (gpusPerServer / adpRanks), --enable-mfu-metrics and VLLM_API_KEY."""
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$",
                       description="An image whose PATH has `vllm` (e.g. vllm/vllm-openai:v0.32.0); the fleet's "
                                   "`image` (adpfleet) still runs the router and the model-fetch init container.")
    args: list[VllmArg] = Field(default_factory=list, max_length=128,
                                description="Extra `vllm serve` arguments, passed as given after the operator's "
                                            "(e.g. --max-model-len 4096, --gpu-memory-utilization 0.9); not "
                                            "the flags the operator sets: " + ", ".join(VLLM_OWNED_FLAGS) + ".")
    cel_rules: ClassVar = (
        CelRule(f"self.args.all(a, !{cel_list(VLLM_OWNED_FLAGS)}.exists(f, a == f || a.startsWith(f + '=')))",
                "vllm.args must not set " + ", ".join(VLLM_OWNED_FLAGS) + ": the operator sets them from the "
                "spec (adpRanks, gpusPerServer, auth, model)",
                ".args", lambda v: not any(owned_vllm_flag(a) for a in v.args)),
    )
