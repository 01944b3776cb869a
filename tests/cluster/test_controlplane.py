"""The local control plane is a real Kubernetes API: versioned, RBAC-enforcing, with the
controller manager's garbage collection and workload controllers running."""

import datetime as dt
import json
import ssl
import urllib.error
import urllib.request

import pytest

from adpfleet.cluster.binaries import kubernetes_version
from adpfleet.cluster.testing import http_server_pod, wait_for

pytestmark = pytest.mark.k8s


def test_kubectl_with_the_written_kubeconfig_sees_the_pinned_version_and_a_ready_node(k8s_cluster):
    version = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == f"v{kubernetes_version()}"
    assert version["clientVersion"]["gitVersion"] == f"v{kubernetes_version()}"
    nodes = k8s_cluster.kubectl("get", "nodes", "--no-headers").stdout.split()
    assert nodes[:2] == ["adpfleet-node", "Ready"]


def test_cluster_up_again_changes_nothing(k8s_cluster):
    before = k8s_cluster.plane.state["components"]
    report = k8s_cluster.plane.up()
    assert report.started == [] and report.notes == []
    assert k8s_cluster.plane.state["components"] == before


def test_the_node_advertises_gpus_and_keeps_its_lease_fresh(k8s_cluster):
    node = k8s_cluster.core.read_node("adpfleet-node")
    assert node.status.capacity["nvidia.com/gpu"] == "8"
    assert node.status.node_info.kubelet_version == f"v{kubernetes_version()}"
    from kubernetes import client
    lease = client.CoordinationV1Api(k8s_cluster.api_client).read_namespaced_lease("adpfleet-node", "kube-node-lease")
    age = dt.datetime.now(dt.timezone.utc) - lease.spec.renew_time
    assert age < dt.timedelta(seconds=30)


def _get_with_token(cluster, token: str, path: str) -> int:
    ctx = ssl.create_default_context(cafile=str(cluster.plane.pki.ca.cert))
    request = urllib.request.Request(cluster.report.server + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, context=ctx, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_rbac_denies_a_service_account_until_a_role_binding_allows_it(k8s_cluster, k8s_namespace):
    from kubernetes import client
    ns = k8s_namespace
    k8s_cluster.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}}, ns)
    token = k8s_cluster.core.create_namespaced_service_account_token(
        "nobody", ns, client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[])))
    pods = f"/api/v1/namespaces/{ns}/pods"
    assert _get_with_token(k8s_cluster, token.status.token, pods) == 403

    k8s_cluster.apply([
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "pod-reader"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "nobody-reads"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
         "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": ns}]}], ns)
    wait_for(lambda: _get_with_token(k8s_cluster, token.status.token, pods) == 200, timeout=10,
             what="the role binding to take effect")
    assert _get_with_token(k8s_cluster, token.status.token, f"/api/v1/namespaces/{ns}/secrets") == 403


def test_deleting_an_owner_garbage_collects_its_dependents(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    k8s_cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, ns)
    owner = k8s_cluster.core.read_namespaced_config_map("owner", ns)
    k8s_cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "dependent", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                                  "uid": owner.metadata.uid}]}}, ns)
    k8s_cluster.core.delete_namespaced_config_map("owner", ns)
    wait_for(lambda: "dependent" not in [c.metadata.name for c in k8s_cluster.core.list_namespaced_config_map(ns).items],
             timeout=30, what="the garbage collector to delete the dependent ConfigMap")


def test_a_deployment_rolls_out_ready_pods_through_the_controller_manager_and_the_agent(k8s_cluster, k8s_namespace):
    pod = http_server_pod("unused")
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
                  "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                           "template": {"metadata": {"labels": {"app": "web"}}, "spec": pod["spec"]}}}
    k8s_cluster.apply(deployment, k8s_namespace)
    wait_for(lambda: k8s_cluster.get_json("deployment", "web", "-n", k8s_namespace)["status"].get("availableReplicas") == 2,
             timeout=60, what="2 available replicas")
    k8s_cluster.kubectl("delete", "deployment", "web", "-n", k8s_namespace, "--wait=false")
    wait_for(lambda: not k8s_cluster.core.list_namespaced_pod(k8s_namespace).items, timeout=60,
             what="the deployment's pods to be garbage-collected")
