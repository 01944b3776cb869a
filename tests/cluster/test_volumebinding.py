"""The scheduler's volume binding on the one node: claims must exist and be bound, or (delayed
binding) a fitting local volume is pre-bound first."""

from adpfleet.cluster.agent.volumebinding import check_claims

NODE = {"metadata": {"name": "adpfleet-node", "labels": {"kubernetes.io/hostname": "adpfleet-node"}}}
LOCAL = {"metadata": {"name": "local"}, "volumeBindingMode": "WaitForFirstConsumer"}


def pod(*claims):
    return {"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"volumes": [{"name": f"v{i}", "persistentVolumeClaim": {"claimName": c}}
                                 for i, c in enumerate(claims)]}}


def claim(name, phase="Pending", size="1Gi", storage_class="local", **spec):
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"},
            "spec": {"storageClassName": storage_class, "accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": size}}, **spec},
            "status": {"phase": phase}}


def volume(name, size="10Gi", storage_class="local", hostname="adpfleet-node", **spec):
    affinity = {"required": {"nodeSelectorTerms": [{"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [hostname]}]}]}}
    return {"metadata": {"name": name, "resourceVersion": "1", "labels": {}},
            "spec": {"storageClassName": storage_class, "accessModes": ["ReadWriteOnce"],
                     "capacity": {"storage": size}, "local": {"path": "/x"}, "nodeAffinity": affinity, **spec},
            "status": {"phase": "Available"}}


def check(p, claims, volumes, taken=None):
    return check_claims(p, {("ns", c["metadata"]["name"]): c for c in claims},
                        {v["metadata"]["name"]: v for v in volumes}, {"local": LOCAL}, NODE,
                        set() if taken is None else taken)


def test_a_missing_claim_is_named():
    assert check(pod("data"), [], []).problem == 'persistentvolumeclaim "data" not found'


def test_an_unbound_claim_of_immediate_binding_waits_for_the_binder_and_is_named():
    result = check(pod("data"), [claim("data", storage_class="manual")], [])
    assert result.problem == 'pod has unbound immediate PersistentVolumeClaims ("data")'


def test_a_bound_claim_lets_the_pod_run():
    bound = claim("data", phase="Bound", volumeName="pv-a")
    result = check(pod("data"), [bound], [volume("pv-a")])
    assert result.problem is None and not result.prebind and not result.binding


def test_a_bound_volume_pinned_to_another_node_conflicts():
    bound = claim("data", phase="Bound", volumeName="pv-a")
    assert "volume node affinity conflict" in check(pod("data"), [bound], [volume("pv-a", hostname="gpu-7")]).problem


def test_delayed_binding_prebinds_the_smallest_fitting_volume_on_this_node():
    volumes = [volume("big", "100Gi"), volume("small", "2Gi"), volume("tiny", "500Mi"),
               volume("elsewhere", "1Gi", hostname="gpu-7"), volume("other-class", "1Gi", storage_class="fast")]
    result = check(pod("data"), [claim("data")], volumes)
    assert result.problem is None
    assert [(v["metadata"]["name"], c["metadata"]["name"]) for v, c in result.prebind] == [("small", "data")]


def test_a_volume_is_offered_to_one_claim_only_and_only_when_the_whole_pod_fits():
    taken: set[str] = set()
    # The first pod's second claim is missing: its first claim must not reserve the volume.
    assert check(pod("a", "missing"), [claim("a")], [volume("only")], taken).problem
    assert taken == set()
    assert check(pod("a"), [claim("a")], [volume("only")], taken).prebind
    assert "didn't find available persistent volumes" in check(pod("b"), [claim("b")], [volume("only")], taken).problem


def test_a_claim_already_prebound_waits_for_the_binder_without_an_event():
    prebound = volume("pv-a", claimRef={"name": "data", "namespace": "ns", "uid": "uid-data"})
    prebound["status"]["phase"] = "Available"
    result = check(pod("data"), [claim("data")], [prebound])
    assert result.binding and not result.prebind and result.problem is None


def test_a_claim_being_deleted_is_named():
    going = claim("data", phase="Bound", volumeName="pv-a")
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert check(pod("data"), [going], [volume("pv-a")]).problem == 'persistentvolumeclaim "data" is being deleted'


def test_a_volume_must_offer_the_claims_access_modes_and_size():
    many = claim("data", accessModes=["ReadWriteMany"])
    assert check(pod("data"), [many], [volume("rwo")]).problem
    assert check(pod("data"), [claim("data", size="20Gi")], [volume("small", "10Gi")]).problem
