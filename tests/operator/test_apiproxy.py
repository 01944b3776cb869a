"""The counting proxy the operator tests measure with (cluster/apiproxy.py)."""

import threading
import time

import pytest
from kubernetes import client, config

from adpfleet.cluster.apiproxy import CountingProxy, verb_of


@pytest.mark.parametrize("method,path,query,verb", [
    ("GET", "/api/v1/namespaces/ns/pods", "", "list"),
    ("GET", "/api/v1/namespaces/ns/pods", "watch=true&resourceVersion=5", "watch"),
    ("GET", "/api/v1/namespaces/ns/pods/p", "", "get"),
    ("GET", "/apis/apps/v1/deployments", "", "list"),
    ("POST", "/api/v1/namespaces/ns/pods", "", "create"),
    ("PATCH", "/apis/adpfleet.io/v1alpha1/namespaces/ns/inferencefleets/f/status", "", "patch"),
    ("PUT", "/apis/apps/v1/namespaces/ns/deployments/d", "", "update"),
    ("DELETE", "/api/v1/namespaces/ns/pods/p", "", "delete"),
    ("DELETE", "/api/v1/namespaces/ns/pods", "", "deletecollection"),
])
def test_verbs_are_named_as_the_api_server_names_them(method, path, query, verb):
    assert verb_of(method, path, query) == verb


@pytest.mark.k8s
def test_requests_through_the_proxy_are_forwarded_and_counted(k8s_cluster, k8s_namespace, api_proxy, tmp_path):
    core = client.CoreV1Api(config.new_client_from_config(str(api_proxy.write_kubeconfig(tmp_path / "kc"))))
    start = time.monotonic()
    core.create_namespaced_config_map(k8s_namespace, {"metadata": {"name": "c"}, "data": {"a": "1"}})
    assert core.read_namespaced_config_map("c", k8s_namespace).data == {"a": "1"}
    seen = [(r.verb, r.resource, r.status) for r in api_proxy.since(start)]
    assert seen == [("create", "configmaps", 201), ("get", "configmaps", 200)]
    assert [r.verb for r in CountingProxy.writes(api_proxy.since(start))] == ["create"]


@pytest.mark.k8s
def test_held_writes_wait_until_released(k8s_cluster, k8s_namespace, api_proxy, tmp_path):
    core = client.CoreV1Api(config.new_client_from_config(str(api_proxy.write_kubeconfig(tmp_path / "kc"))))
    done = threading.Event()
    with api_proxy.writes_held():
        threading.Thread(target=lambda: (core.create_namespaced_config_map(
            k8s_namespace, {"metadata": {"name": "held"}}), done.set()), daemon=True).start()
        assert not done.wait(1.0)
        core.list_namespaced_config_map(k8s_namespace)  # reads still pass
    assert done.wait(10)
