"""Pods reach each other by the names a real cluster gives them: `<hostname>.<subdomain>` under a
headless Service, fully qualified or short, answered through each pod's own /etc/hosts."""

import pytest

from adpfleet.cluster.testing import http_server_pod, pod_manifest, wait_for

pytestmark = pytest.mark.k8s

# Resolves and fetches the worker's page by two of its names, printing one line per change.
PROBE = """
import os, socket, time, urllib.request
ns = os.environ["POD_NAMESPACE"]
print("hostname", socket.gethostname(), socket.getfqdn(), flush=True)
last = None
while True:
    seen = []
    for name in ("worker-0.grp", f"worker-0.grp.{ns}.svc.cluster.local"):
        try:
            ip = socket.gethostbyname(name)
            status = urllib.request.urlopen(f"http://{name}:8080/", timeout=2).status
            seen.append(f"{ip}:{status}")
        except OSError as exc:
            seen.append(type(exc).__name__)
    if seen != last:
        print("worker", " ".join(seen), flush=True)
        last = seen
    time.sleep(0.1)
"""


def group_pod(manifest: dict, hostname: str) -> dict:
    manifest["metadata"]["labels"] = {"app": "grp"}
    manifest["spec"].update(hostname=hostname, subdomain="grp")
    return manifest


def test_pods_of_a_headless_service_resolve_each_other_and_follow_a_recreated_pod(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "grp"},
               "spec": {"clusterIP": "None", "selector": {"app": "grp"}, "publishNotReadyAddresses": True,
                        "ports": [{"name": "http", "port": 8080}]}}
    worker = group_pod(http_server_pod("worker", terminationGracePeriodSeconds=2), "worker-0")
    leader = group_pod(pod_manifest("leader", ["python3", "-c", PROBE]), "leader-0")
    k8s_cluster.apply([service, worker, leader], ns)
    first_ip = k8s_cluster.wait_for_pod(ns, "worker").status.pod_ip
    log = lambda: k8s_cluster.kubectl("logs", "leader", "-n", ns).stdout  # noqa: E731
    wait_for(lambda: f"worker {first_ip}:200 {first_ip}:200" in log(), timeout=20, what="the worker by both names")
    assert log().splitlines()[0] == f"hostname leader-0 leader-0.grp.{ns}.svc.cluster.local"

    k8s_cluster.core.delete_namespaced_pod("worker", ns)
    wait_for(lambda: log().splitlines()[-1] == "worker gaierror gaierror", timeout=20,
             what="the deleted worker's names to go")
    k8s_cluster.wait_for_pod_gone(ns, "worker")
    k8s_cluster.apply(group_pod(http_server_pod("worker", terminationGracePeriodSeconds=2), "worker-0"), ns)
    second_ip = k8s_cluster.wait_for_pod(ns, "worker").status.pod_ip
    assert second_ip != first_ip
    wait_for(lambda: log().splitlines()[-1] == f"worker {second_ip}:200 {second_ip}:200", timeout=20,
             what="the recreated worker at its new address")
