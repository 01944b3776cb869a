"""PersistentVolumeClaims on the local node: bound by the real kube-controller-manager's
PersistentVolume binder (or pre-bound by the agent's scheduler for WaitForFirstConsumer classes),
mounted from the volume's hostPath or local directory, read-only when asked."""

import pytest

from adpfleet.cluster.testing import pod_manifest, wait_for

pytestmark = pytest.mark.k8s


def volume(name: str, path, storage_class: str, *, source: str = "hostPath", size: str = "1Gi") -> dict:
    # Retain: the controller manager's hostPath deleter would remove a /tmp directory.
    spec = {"capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
            "persistentVolumeReclaimPolicy": "Retain"}
    if source == "hostPath":
        spec["hostPath"] = {"path": str(path), "type": "Directory"}
    else:
        spec["local"] = {"path": str(path)}
        spec["nodeAffinity"] = {"required": {"nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["adpfleet-node"]}]}]}}
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": spec}


def claim(name: str, storage_class: str, size: str = "100Mi") -> dict:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": storage_class,
                     "resources": {"requests": {"storage": size}}}}


@pytest.fixture
def cluster_scoped(k8s_cluster):
    """Cluster-scoped objects a test creates (PersistentVolumes, StorageClasses), deleted after it."""
    created: list[tuple[str, str]] = []
    yield created
    for kind, name in created:
        k8s_cluster.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found", check=False)


def phase(cluster, ns: str, kind: str, name: str) -> str:
    return cluster.get_json(kind, name, "-n", ns).get("status", {}).get("phase")


def test_a_claim_bound_by_the_controller_manager_is_mounted_read_write_or_read_only(
        k8s_cluster, k8s_namespace, cluster_scoped, tmp_path):
    ns = k8s_namespace
    (tmp_path / "weights.txt").write_text("tiny weights")
    cluster_scoped.append(("persistentvolume", f"{ns}-weights"))
    k8s_cluster.apply(volume(f"{ns}-weights", tmp_path, "manual"))
    k8s_cluster.apply(claim("weights", "manual"), ns)
    script = ("cat /models/rw/weights.txt; echo; echo written > /models/rw/out.txt; "
              "touch /models/ro/x 2>/dev/null || echo ro-volume; touch /models/ro-mount/x 2>/dev/null || echo ro-mount; "
              "exec sleep 3600")
    k8s_cluster.apply(pod_manifest(
        "reader", ["sh", "-c", script],
        volumes=[{"name": "rw", "persistentVolumeClaim": {"claimName": "weights"}},
                 {"name": "ro", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}],
        container={"volumeMounts": [{"name": "rw", "mountPath": "/models/rw"},
                                    {"name": "ro", "mountPath": "/models/ro"},
                                    {"name": "rw", "mountPath": "/models/ro-mount", "readOnly": True}]}), ns)
    k8s_cluster.wait_for_pod(ns, "reader", timeout=30)
    assert phase(k8s_cluster, ns, "pvc", "weights") == "Bound"
    out = wait_for(lambda: (t := k8s_cluster.kubectl("logs", "reader", "-n", ns).stdout).count("\n") >= 3 and t,
                   timeout=10, what="three lines")
    assert out.splitlines() == ["tiny weights", "ro-volume", "ro-mount"]
    assert (tmp_path / "out.txt").read_text() == "written\n"  # the volume is the host directory itself


def test_a_missing_claim_keeps_the_pod_pending_with_an_event_naming_it_until_it_is_bound(
        k8s_cluster, k8s_namespace, cluster_scoped, tmp_path):
    ns = k8s_namespace
    k8s_cluster.apply(pod_manifest("waiter", ["sleep", "3600"],
                                   volumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "late"}}]), ns)
    k8s_cluster.wait_for_pod(ns, "waiter", lambda p: any(
        c.type == "PodScheduled" and c.reason == "Unschedulable" for c in p.status.conditions or []),
        what="PodScheduled=False/Unschedulable")
    assert ("Warning", "FailedScheduling", '0/1 nodes are available: persistentvolumeclaim "late" not found.') \
        in k8s_cluster.pod_events(ns, "waiter")

    cluster_scoped.append(("persistentvolume", f"{ns}-late"))
    k8s_cluster.apply(claim("late", "manual"), ns)  # the claim first: the binder's next pass binds it
    k8s_cluster.apply(volume(f"{ns}-late", tmp_path, "manual"))
    k8s_cluster.wait_for_pod(ns, "waiter", timeout=30)
    assert phase(k8s_cluster, ns, "pvc", "late") == "Bound"


def test_a_wait_for_first_consumer_claim_is_bound_to_a_local_volume_when_its_pod_is_scheduled(
        k8s_cluster, k8s_namespace, cluster_scoped, tmp_path):
    ns = k8s_namespace
    storage_class = f"{ns}-local"
    cluster_scoped += [("storageclass", storage_class), ("persistentvolume", f"{ns}-local-big"),
                       ("persistentvolume", f"{ns}-local-fit")]
    (tmp_path / "big").mkdir()
    (tmp_path / "fit").mkdir()
    (tmp_path / "fit" / "config.json").write_text("{}")
    k8s_cluster.apply([{"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
                        "metadata": {"name": storage_class}, "provisioner": "kubernetes.io/no-provisioner",
                        "volumeBindingMode": "WaitForFirstConsumer"},
                       volume(f"{ns}-local-big", tmp_path / "big", storage_class, source="local", size="10Gi"),
                       volume(f"{ns}-local-fit", tmp_path / "fit", storage_class, source="local", size="1Gi")])
    k8s_cluster.apply(claim("cache", storage_class), ns)
    k8s_cluster.apply(pod_manifest("consumer", ["sh", "-c", "ls /cache; exec sleep 3600"],
                                   volumes=[{"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}}],
                                   container={"volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}), ns)
    k8s_cluster.wait_for_pod(ns, "consumer", timeout=30)
    bound = k8s_cluster.get_json("pvc", "cache", "-n", ns)
    assert bound["status"]["phase"] == "Bound" and bound["spec"]["volumeName"] == f"{ns}-local-fit"  # the smallest
    assert k8s_cluster.kubectl("logs", "consumer", "-n", ns).stdout.split() == ["config.json"]
