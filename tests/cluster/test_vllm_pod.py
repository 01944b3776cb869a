"""A pod whose container runs `vllm serve` (as vLLM's images do) runs on the local node from the vLLM
environment: it becomes Ready on its probe, serves the official client on its own address, and
the node can freeze its engine by title, the way the demo and the stall tests wedge a vLLM server.

One vLLM start (tens of seconds); the model is the tests' random Llama, mounted from the host.
"""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
from vllm_servers import ENGINE_CORE, START_TIMEOUT_S, build_model

from adpfleet.cluster import processes
from adpfleet.cluster.testing import pod_manifest, wait_for

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]


def vllm_pod(name: str, model_dir: str) -> dict:
    env = [{"name": k, "value": v} for k, v in (("VLLM_API_KEY", "pod-key"), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                                                 ("VLLM_CPU_OMP_THREADS_BIND", "1"), ("HF_HUB_OFFLINE", "1"),
                                                 ("VLLM_NO_USAGE_STATS", "1"))]
    container = {"image": "vllm/vllm-openai:v0.32.0", "ports": [{"name": "http", "containerPort": 8000}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                 "volumeMounts": [{"name": "model", "mountPath": "/models/tiny", "readOnly": True}]}
    command = ["vllm", "serve", "/models/tiny", "--served-model-name", "tiny", "--host", "$(POD_IP)", "--port", "8000",
               "--dtype", "float32", "--enforce-eager"]
    return pod_manifest(name, command, env=env, container=container,
                        volumes=[{"name": "model", "hostPath": {"path": model_dir, "type": "Directory"}}])


def test_a_vllm_serve_pod_runs_from_the_vllm_environment_serves_and_its_engine_freezes_from_the_node(
        k8s_cluster, k8s_namespace):
    k8s_cluster.apply(vllm_pod("vllm", str(build_model())), k8s_namespace)
    pod = k8s_cluster.wait_for_pod(k8s_namespace, "vllm", timeout=START_TIMEOUT_S)
    url, uid = f"http://{pod.status.pod_ip}:8000", pod.metadata.uid
    group = int(pod.status.container_statuses[0].container_id.removeprefix("adpfleet://"))  # its process group
    client = openai.OpenAI(base_url=url + "/v1", api_key="pod-key", max_retries=0, timeout=60)
    assert client.completions.create(model="tiny", prompt="the pod", max_tokens=4).usage.completion_tokens == 4
    frozen = processes.signal_pod_processes(uid, ENGINE_CORE, signal.SIGSTOP)
    try:
        assert len(frozen) == 1 and httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        processes.signal_pod_processes(uid, ENGINE_CORE, signal.SIGCONT)
    k8s_cluster.core.delete_namespaced_pod("vllm", k8s_namespace)
    k8s_cluster.wait_for_pod_gone(k8s_namespace, "vllm", timeout=30)
    wait_for(lambda: group not in processes.live_groups(), timeout=10,
             what="every process of the vLLM pod (engine and worker included) to exit")
