"""The real vLLM behind the operator: an InferenceFleet with `engine: vllm` and one aggregated server
becomes Ready, and the official client is served through the fleet's router with the fleet's API key,
streaming and not; without the key the router refuses, and so does vLLM itself (VLLM_API_KEY reached
it). One vLLM start (DP=1, the tests' random Llama from the host's directory): minutes under load."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from vllm_servers import START_TIMEOUT_S, build_model

from adpfleet.cluster.testing import wait_for

from operator_harness import pod_ready
from specs import fleet_manifest

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]

KEY = "vllm-fleet-key"


def vllm_fleet(model_dir: str) -> dict:
    manifest = fleet_manifest("vf")
    spec = manifest["spec"]
    del spec["context"], spec["generation"]
    spec.update(engine="vllm", model={"uri": model_dir, "servedName": "tiny-llama"},
                vllm={"image": "vllm/vllm-openai:v0.32.0", "args": ["--dtype", "float32", "--enforce-eager"]},
                auth={"apiKeySecret": {"name": "vf-key", "key": "key"}},
                aggregated={"servers": 1, "adpRanks": 1, "probes": {"readinessPeriodSeconds": 1},
                            "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"},
                                    {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "1"}]})
    return manifest


def test_a_vllm_fleet_is_served_through_the_router_with_the_fleets_api_key(start_operator, fleets):
    fleets.core.create_namespaced_secret(fleets.ns, {"metadata": {"name": "vf-key"},
                                                     "data": {"key": base64.b64encode(KEY.encode()).decode()}})
    start_operator()
    fleets.apply(vllm_fleet(str(build_model())))
    fleets.wait_ready("vf", timeout=START_TIMEOUT_S + 120)  # + the model check of the init container

    (pod,) = fleets.pods("vf", "aggregated")
    assert pod_ready(pod) and pod.metadata.labels["adpfleet.io/engine"] == "vllm"
    assert pod.spec.containers[0].command == ["vllm"]
    base = wait_for(lambda: fleets.router_url("vf"), timeout=120, what="a Ready router", interval=1) + "/v1"

    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0, timeout=120)
    answer = wait_for(lambda: client.completions.create(model="tiny-llama", prompt="The fleet", max_tokens=6),
                      timeout=120, what="a completion through the router (it discovers the server)", interval=1)
    assert answer.model == "tiny-llama" and answer.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny-llama", prompt="A stream", max_tokens=5, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    assert [m.id for m in client.models.list()] == ["tiny-llama"]

    with pytest.raises(openai.AuthenticationError):  # the router checks the key
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).completions.create(
            model="tiny-llama", prompt="x", max_tokens=1)
    # and vLLM checks the same key itself: it got VLLM_API_KEY from the fleet's Secret
    server = f"http://{pod.status.pod_ip}:8000"
    assert httpx.post(server + "/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 1},
                      timeout=60).status_code == 401
    assert httpx.get(server + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
