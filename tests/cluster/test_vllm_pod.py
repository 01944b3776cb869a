"""The real vLLM (PyPI's CPU build, in its own environment), in a pod whose container runs `vllm serve`
(as vLLM's images do) on the local node: it becomes Ready on its probe; the official `openai` client
completes against it on the pod's own address; its API key is enforced; a frozen engine looks the
way the operator must catch it (/health 200, work in the gauges, every progress counter flat), frozen
from the node's side by the process title, as the demo and the stall tests wedge a vLLM server; and
deleting the pod ends every process of it.

One vLLM start for the module (tens of seconds; the suite's other vLLM servers are fleets'); the
model is the tests' random Llama, mounted from the host, and vLLM's cache root is the session's
(`vllm_cache_dir`, as a fleet's `vllm.cache` renders it), so later vLLM starts skip what this one
cached. The tests run in the order written: the last deletes the pod.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
from servers import metric
from vllm_servers import ENGINE_CORE, START_TIMEOUT_S, build_model

from adpfleet.cluster import processes
from adpfleet.cluster.testing import fresh_namespace, pod_manifest, wait_for
from adpfleet.contract.env import VLLM_CACHE_ROOT_ENV
from adpfleet.operator.resource.names import VLLM_CACHE_DIR

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]

KEY = "pod-key"
CACHE_DIR = VLLM_CACHE_DIR  # where the pod mounts the session's cache directory: where the operator would
FLAT_FOR_S = 1.5  # the tiny model makes ~100 steps a second here: 1.5 s of none is no accident
MAX_TOKENS = 4000  # the tiny model's context is 4096


def vllm_pod(name: str, model_dir: str, cache_dir: str) -> dict:
    env = [{"name": k, "value": v} for k, v in (("VLLM_API_KEY", KEY), ("VLLM_CPU_KVCACHE_SPACE", "1"),
                                                 ("VLLM_CPU_OMP_THREADS_BIND", "1"), ("HF_HUB_OFFLINE", "1"),
                                                 ("VLLM_NO_USAGE_STATS", "1"), (VLLM_CACHE_ROOT_ENV, CACHE_DIR))]
    container = {"image": "vllm/vllm-openai:v0.32.0", "ports": [{"name": "http", "containerPort": 8000}],
                 "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                 "volumeMounts": [{"name": "model", "mountPath": "/models/tiny", "readOnly": True},
                                  {"name": "vllm-cache", "mountPath": CACHE_DIR}]}
    command = ["vllm", "serve", "/models/tiny", "--served-model-name", "tiny", "--host", "$(POD_IP)", "--port", "8000",
               "--dtype", "float32", "--enforce-eager"]
    return pod_manifest(name, command, env=env, container=container,
                        volumes=[{"name": "model", "hostPath": {"path": model_dir, "type": "Directory"}},
                                 {"name": "vllm-cache", "hostPath": {"path": cache_dir, "type": "Directory"}}])


@dataclass
class VllmPod:
    """The module's vLLM pod: where it serves (`url`, which servers.metric reads) and what the node
    knows it by (its uid and process group)."""
    cluster: object
    ns: str
    name: str
    url: str
    uid: str
    group: int  # the pod's process group on the node

    def client(self, api_key: str = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kwargs)

    @contextlib.contextmanager
    def frozen(self, title: str = ENGINE_CORE):
        """SIGSTOP, from the node, the pod's processes titled `title` for the block; SIGCONT after it."""
        pids = processes.signal_pod_processes(self.uid, title, signal.SIGSTOP)
        try:
            yield pids
        finally:
            processes.signal_pod_processes(self.uid, title, signal.SIGCONT)


@pytest.fixture(scope="module")
def vllm(k8s_cluster, vllm_cache_dir):
    with fresh_namespace(k8s_cluster, "vllm-pod") as ns:
        k8s_cluster.apply(vllm_pod("vllm", str(build_model()), str(vllm_cache_dir)), ns)
        pod = k8s_cluster.wait_for_pod(ns, "vllm", timeout=START_TIMEOUT_S)
        group = int(pod.status.container_statuses[0].container_id.removeprefix("adpfleet://"))
        yield VllmPod(k8s_cluster, ns, "vllm", f"http://{pod.status.pod_ip}:8000", pod.metadata.uid, group)


def test_the_openai_client_completes_with_and_without_streaming(vllm):
    client = vllm.client(timeout=60)
    completion = client.completions.create(model="tiny", prompt="the fleet server", max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="the fleet server", max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the pod"}],
                                          max_tokens=4)
    assert chat.choices[0].message.role == "assistant"


def test_a_request_without_the_api_key_is_refused_but_health_and_metrics_are_open(vllm):
    with pytest.raises(openai.AuthenticationError):
        vllm.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert httpx.get(vllm.url + "/health", timeout=10).status_code == 200
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"}' in httpx.get(vllm.url + "/metrics",
                                                                                   timeout=10).text


def test_a_frozen_engine_core_answers_health_with_work_and_no_progress(vllm):
    generated = _progress(vllm)[0]
    with vllm.frozen(ENGINE_CORE) as frozen, _long_stream(vllm) as ended:
        assert len(frozen) == 1  # the one engine of a DP=1 server, found by its title
        settled = _begun_in_pulses(vllm, frozen, generated)
        assert settled[0] - generated < MAX_TOKENS  # still running when it froze
        time.sleep(FLAT_FOR_S)  # flatness is a claim about time: it needs some to pass
        assert _progress(vllm) == settled
        assert httpx.get(vllm.url + "/health", timeout=5).status_code == 200
        # work as the operator's vLLM dialect counts it (running + waiting)
        work = {g: metric(vllm, f"vllm:num_requests_{g}", engine="0") for g in ("running", "waiting")}
        assert sum(work.values()) == 1, (work, ended)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: _progress(vllm)[0] > settled[0], timeout=30, what="tokens after the thaw")


def _begun_in_pulses(vllm: VllmPod, frozen: list[int], generated: float, pulse_s: float = 0.1,
                     timeout: float = 60) -> tuple[float, float]:
    """Let the frozen engine run `pulse_s` at a time until its counters show tokens past `generated`;
    its settled progress then, frozen again.

    The engine runs ahead of its stream (the request's 4,000 tokens in ~7 s on a quiet machine): a
    freeze timed by the stream's first chunk came after the whole request, three tries in a row, on a
    loaded CI host. Sent to a frozen engine and let run in pulses, the request has made at most a
    pulse's tokens when the engine stops, if the pulse ends on time. So a pulse is timed by a shell
    at real-time priority where allowed: the pod is a session of its own, and with the kernel's
    autogroup a busy engine starved this session's processes (a 0.1 s sleep here took 9.4 s beside
    three spinning ones, as long as the engine took to run the whole request: one pulse at normal
    priority did so in 2 of 3 tries, and twice in CI; at SCHED_FIFO 0 of 3)."""
    deadline = time.monotonic() + timeout
    pids = " ".join(map(str, frozen))
    while (settled := _settled_progress(vllm))[0] == generated:
        assert time.monotonic() < deadline, f"the engine, let run {pulse_s:g} s at a time, began no request"
        subprocess.run(["sh", "-c", f"kill -CONT {pids}; sleep {pulse_s}; kill -STOP {pids}"], check=True, timeout=30,
                       preexec_fn=_real_time)
    return settled


def _real_time() -> None:
    """SCHED_FIFO for this process, where allowed (root, CAP_SYS_NICE): no CFS task can delay it."""
    with contextlib.suppress(PermissionError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))


@contextlib.contextmanager
def _long_stream(vllm: VllmPod):
    """A MAX_TOKENS streaming request, sent and read by a thread for the block (nothing waits for its
    chunks: the engine may be frozen) and closed after it; yields how its stream ended, once it has."""
    streams: list = []
    ended: list = []

    def send_and_read() -> None:
        read = 0
        try:
            stream = vllm.client(timeout=120).completions.create(
                model="tiny", prompt="the engine", max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True})
            streams.append(stream)
            for _ in stream:
                read += 1
            ended.append(f"ended after {read} chunks")
        except (httpx.HTTPError, openai.APIError) as e:
            ended.append(f"{type(e).__name__} after {read} chunks: {e}")

    reader = threading.Thread(target=send_and_read, daemon=True)
    reader.start()
    try:
        yield ended
    finally:
        for stream in streams:
            stream.close()
        reader.join(30)


def test_deleting_the_pod_ends_every_process_of_it(vllm):
    vllm.cluster.core.delete_namespaced_pod(vllm.name, vllm.ns)
    vllm.cluster.wait_for_pod_gone(vllm.ns, vllm.name, timeout=30)
    wait_for(lambda: vllm.group not in processes.live_groups(), timeout=10,
             what="every process of the vLLM pod (engine and worker included) to exit")


def _progress(server: VllmPod) -> tuple[float, float]:
    """(generation tokens, engine steps) of engine 0."""
    return (metric(server, "vllm:generation_tokens_total", engine="0"),
            metric(server, "vllm:iteration_tokens_total_count", engine="0"))


def _settled_progress(server: VllmPod) -> tuple[float, float]:
    """Progress once two scrapes half a second apart agree: what the engine sent before it froze
    has reached the API server's counters."""
    seen = [_progress(server)]

    def agrees() -> bool:
        time.sleep(0.5)
        seen.append(_progress(server))
        return seen[-1] == seen[-2]
    wait_for(agrees, timeout=10, what="the counters to settle after the freeze")
    return seen[-1]
