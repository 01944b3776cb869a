"""Kubernetes discovery against the real local control plane: pods become servers when Ready,
and stop getting new work within a couple of seconds of a drain annotation or deletion."""

import concurrent.futures
import sys
import threading
import time

import httpx
import openai
import pytest

from adpfleet.cluster.testing import http_server_pod, pod_manifest, wait_for
from adpfleet.runtime.router.discovery import KubeDiscovery
from adpfleet.runtime.router.pool import Endpoint
from router_harness import HERE, RouterProcess

pytestmark = pytest.mark.k8s
FLEET = "adpfleet.io/fleet=f1"


class Seen:
    """The endpoint sets discovery published, with the time each arrived."""

    def __init__(self):
        self.sets: list[tuple[float, set[Endpoint]]] = []
        self.lock = threading.Lock()

    def __call__(self, endpoints):
        with self.lock:
            self.sets.append((time.monotonic(), set(endpoints)))

    @property
    def current(self) -> set[Endpoint]:
        with self.lock:
            return self.sets[-1][1] if self.sets else set()

    def wait(self, check, what, timeout=10):
        return wait_for(lambda: check(self.current), timeout=timeout, what=what)


def labelled(manifest, role=None, fleet="f1"):
    labels = {"adpfleet.io/fleet": fleet, **({"adpfleet.io/role": role} if role else {})}
    manifest["metadata"]["labels"] = labels
    return manifest


@pytest.fixture
def discovery(k8s_cluster, k8s_namespace):
    seen = Seen()
    d = KubeDiscovery(k8s_namespace, f"{FLEET},adpfleet.io/role", 8080, seen, api_client=k8s_cluster.api_client,
                      watch_timeout_s=5).start()
    try:
        wait_for(d.synced.is_set, timeout=10, what="the first list")
        yield seen
    finally:
        d.stop()


def test_ready_role_pods_of_the_fleet_are_servers_and_drain_or_delete_removes_them_fast(
        k8s_cluster, k8s_namespace, discovery):
    core = k8s_cluster.core
    k8s_cluster.apply([labelled(http_server_pod("gen-a"), "generation"), labelled(http_server_pod("ctx-a"), "context"),
                       labelled(http_server_pod("no-role")),                        # e.g. the router's own pod
                       labelled(http_server_pod("other-fleet"), "generation", fleet="f2")], k8s_namespace)
    ips = {name: k8s_cluster.wait_for_pod(k8s_namespace, name).status.pod_ip for name in ("gen-a", "ctx-a")}
    gen, ctx = Endpoint("generation", f"http://{ips['gen-a']}:8080"), Endpoint("context", f"http://{ips['ctx-a']}:8080")
    discovery.wait(lambda eps: eps == {gen, ctx}, "the two ready servers of the fleet")

    t0 = time.monotonic()
    core.patch_namespaced_pod("gen-a", k8s_namespace, {"metadata": {"annotations": {"adpfleet.io/drain": "true"}}})
    discovery.wait(lambda eps: eps == {ctx}, "the drained pod to leave", timeout=2)
    assert time.monotonic() - t0 < 2

    core.patch_namespaced_pod("gen-a", k8s_namespace, {"metadata": {"annotations": {"adpfleet.io/drain": None}}})
    discovery.wait(lambda eps: eps == {gen, ctx}, "the undrained pod to return")

    t0 = time.monotonic()
    core.delete_namespaced_pod("ctx-a", k8s_namespace)  # 5 s grace: gone from the pool at once, not after it
    discovery.wait(lambda eps: eps == {gen}, "the deleted pod to leave", timeout=2)
    assert time.monotonic() - t0 < 2


def test_a_pod_that_is_not_ready_is_no_server_until_it_is(k8s_cluster, k8s_namespace, discovery, tmp_path):
    flag = tmp_path / "ready"  # the readiness probe passes once the test creates this file
    slow = labelled(http_server_pod("slow", container={"readinessProbe": {
        "exec": {"command": ["test", "-e", str(flag)]}, "periodSeconds": 1}}), "generation")
    k8s_cluster.apply(slow, k8s_namespace)
    slow_ip = k8s_cluster.wait_for_pod(k8s_namespace, "slow", lambda p: p.status.pod_ip, what="an IP").status.pod_ip
    # Watch events arrive in order: once a later pod shows up, the running-but-unready pod was seen and skipped.
    k8s_cluster.apply(labelled(http_server_pod("marker"), "context"), k8s_namespace)
    marker_ip = k8s_cluster.wait_for_pod(k8s_namespace, "marker").status.pod_ip
    marker = Endpoint("context", f"http://{marker_ip}:8080")
    discovery.wait(lambda eps: eps == {marker}, "only the ready pod")
    flag.touch()
    discovery.wait(lambda eps: eps == {marker, Endpoint("generation", f"http://{slow_ip}:8080")}, "the pod to be ready")


def fake_pod(name, role):
    command = [sys.executable, str(HERE / "fake_server.py"), "--role", role, "--host", "$(POD_IP)", "--port", "8000"]
    return labelled(pod_manifest(name, command, container={
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1}}), role)


def test_the_router_serves_through_discovered_pods_and_stops_using_a_drained_one(k8s_cluster, k8s_namespace, tmp_path):
    k8s_cluster.apply([fake_pod("ctx", "context"), fake_pod("gen-a", "generation"), fake_pod("gen-b", "generation")],
                      k8s_namespace)
    ips = {n: k8s_cluster.wait_for_pod(k8s_namespace, n).status.pod_ip for n in ("ctx", "gen-a", "gen-b")}
    router = RouterProcess(tmp_path, "--kube-namespace", k8s_namespace, "--kube-selector", f"{FLEET},adpfleet.io/role",
                           "--server-port", "8000", env={"KUBECONFIG": str(k8s_cluster.kubeconfig)})
    try:
        router.wait_healthy(30)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        for _ in range(4):
            assert client.completions.create(model="fake", prompt="k8s", max_tokens=3).usage.completion_tokens == 3

        def received(name):
            return len(httpx.get(f"http://{ips[name]}:8000/fake/state", trust_env=False).json()["received"])
        assert received("gen-a") == 2 and received("gen-b") == 2  # least loaded, ties round robin

        k8s_cluster.core.patch_namespaced_pod("gen-a", k8s_namespace,
                                              {"metadata": {"annotations": {"adpfleet.io/drain": "true"}}})
        wait_for(lambda: httpx.get(router.url + "/health").json()["servers"]["generation"] == 1, timeout=2,
                 what="the router to drop the drained pod")
        for _ in range(4):
            client.completions.create(model="fake", prompt="k8s", max_tokens=3)
        assert received("gen-a") == 2 and received("gen-b") == 6

        k8s_cluster.core.delete_namespaced_pod("gen-b", k8s_namespace)
        wait_for(lambda: httpx.get(router.url + "/health").status_code == 503, timeout=2,
                 what="the router to be unhealthy without a usable generation server")
        # every generation server drained or gone: a request waits in the router's queue...
        waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
            client.completions.create, model="fake", prompt="k8s", max_tokens=3)
        wait_for(lambda: router.metric("adpfleet_router_queue_waiting") == 1, timeout=10, what="the request waiting")
        assert not waiting.done()
        # ...and completes as soon as discovery reports a server it may use
        k8s_cluster.core.patch_namespaced_pod("gen-a", k8s_namespace,
                                              {"metadata": {"annotations": {"adpfleet.io/drain": "false"}}})
        assert waiting.result(timeout=10).usage.completion_tokens == 3
        assert received("gen-a") == 3
        assert router.metric("adpfleet_router_queued_total", outcome="placed") == 1
    finally:
        router.stop()

