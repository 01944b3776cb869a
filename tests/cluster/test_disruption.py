"""What a real cluster's pods may carry runs here too, and what one node cannot honour is said in an
Event; the Eviction API and the disruption controller protect PodDisruptionBudgets as on any cluster."""

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from adpfleet.cluster.testing import pod_manifest, pod_ready, wait_for

pytestmark = pytest.mark.k8s


def evict(cluster, ns: str, name: str) -> int:
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ns))
    try:
        cluster.core.create_namespaced_pod_eviction(name, ns, body)
        return 201
    except ApiException as exc:
        return exc.status


def budget(cluster, ns: str, name: str):
    return client.PolicyV1Api(cluster.api_client).read_namespaced_pod_disruption_budget(name, ns).status


def test_an_eviction_is_refused_while_it_would_break_the_disruption_budget(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "servers"},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": {"role": "server"}}}}
    pods = [pod_manifest(n, ["sleep", "3600"], metadata={"labels": {"role": "server"}}, terminationGracePeriodSeconds=2)
            for n in ("server-0", "server-1")]
    k8s_cluster.apply([pdb, *pods], ns)
    for name in ("server-0", "server-1"):
        k8s_cluster.wait_for_pod(ns, name)
    wait_for(lambda: budget(k8s_cluster, ns, "servers").disruptions_allowed == 1, timeout=30,
             what="the disruption controller to allow one disruption")

    assert evict(k8s_cluster, ns, "server-0") == 201
    k8s_cluster.wait_for_pod_gone(ns, "server-0")
    wait_for(lambda: budget(k8s_cluster, ns, "servers").disruptions_allowed == 0, timeout=30,
             what="the budget to be used up")
    assert evict(k8s_cluster, ns, "server-1") == 429  # TooManyRequests: it would violate the budget
    assert pod_ready(k8s_cluster.core.read_namespaced_pod("server-1", ns))


def test_a_pod_with_a_real_clusters_scheduling_and_runtime_fields_runs_and_says_what_is_ignored(
        k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    priority, runtime = f"{ns}-serving", f"{ns}-nvidia"
    k8s_cluster.apply([
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": priority}, "value": 1000},
        {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": runtime}, "handler": "nvidia"}])
    try:
        labels = {"app.kubernetes.io/component": "generation"}
        on_this_node = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                              "values": ["adpfleet-node"]}]}
        spread = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule",
                   "labelSelector": {"matchLabels": labels}}]
        anti = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": labels}}]}
        sidecar = {"name": "log-shipper", "image": "ignored", "command": ["sleep", "3600"],
                   "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}
        pod = pod_manifest(
            "everything", ["sleep", "3600"], metadata={"labels": labels}, priorityClassName=priority,
            schedulerName="volcano", runtimeClassName=runtime, topologySpreadConstraints=spread,
            affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [on_this_node]}}, "podAntiAffinity": anti},
            volumes=[{"name": "scratch", "emptyDir": {}},
                     {"name": "fast", "csi": {"driver": "fast.csi.example.com", "volumeAttributes": {"size": "1Gi"}}}],
            container={"resources": {"limits": {"rdma/ib": "1", "nvidia.com/gpu": "1"}},
                       "volumeMounts": [{"name": "fast", "mountPath": "/fast"}]})
        pod["spec"]["containers"].append(sidecar)
        k8s_cluster.apply(pod, ns)
        ready = k8s_cluster.wait_for_pod(ns, "everything", timeout=30)
        assert ready.spec.priority == 1000 and ready.spec.node_name == "adpfleet-node"
        assert [c.name for c in ready.status.container_statuses] == ["log-shipper", "main"]
        expected = ('schedulerName "volcano"', "podAntiAffinity", "topologySpreadConstraints",
                    f'runtimeClassName "{runtime}"', "volume 'fast': csi volumes")

        def all_said() -> bool:
            said = [m for _, reason, m in k8s_cluster.pod_events(ns, "everything") if reason == "NotSupportedLocally"]
            missing = [words for words in expected if not any(words in m for m in said)]
            assert not missing, f"no event about {missing} among {said}"  # reported if it never holds
            return True
        wait_for(all_said, timeout=10, what="a NotSupportedLocally event about each ignored field")
    finally:
        k8s_cluster.kubectl("delete", "priorityclass", priority, "--ignore-not-found", check=False)
        k8s_cluster.kubectl("delete", "runtimeclass", runtime, "--ignore-not-found", check=False)
