"""The agent binds a pod only when it fits, and says why when it does not."""

from adpfleet.cluster.agent.addresses import AddressPool
from adpfleet.cluster.agent.scheduling import ignored_constraints, unschedulable_reason

NODE = {"metadata": {"labels": {"kubernetes.io/hostname": "adpfleet-node", "gpu": "h100"}},
        "spec": {},
        "status": {"allocatable": {"cpu": "2", "memory": "8Gi", "pods": "10", "nvidia.com/gpu": "4"}}}


def pod(requests=None, limits=None, **spec):
    return {"metadata": {"name": "p"}, "status": {},
            "spec": {"containers": [{"name": "c", "resources": {"requests": requests or {}, "limits": limits or {}}}],
                     **spec}}


def test_a_pod_that_fits_is_schedulable():
    assert unschedulable_reason(pod({"cpu": "1"}, {"nvidia.com/gpu": "2"}), NODE, []) is None


def test_gpus_already_requested_by_bound_pods_are_not_available_again():
    bound = [pod(limits={"nvidia.com/gpu": "3"})]
    reason = unschedulable_reason(pod(limits={"nvidia.com/gpu": "2"}), NODE, bound)
    assert reason == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


def test_finished_pods_hold_no_resources():
    done = pod(limits={"nvidia.com/gpu": "4"})
    done["status"]["phase"] = "Succeeded"
    assert unschedulable_reason(pod(limits={"nvidia.com/gpu": "4"}), NODE, [done]) is None


def test_node_selector_and_required_affinity_must_match_the_node_labels():
    assert unschedulable_reason(pod(nodeSelector={"gpu": "h100"}), NODE, []) is None
    assert "node affinity/selector" in unschedulable_reason(pod(nodeSelector={"gpu": "a100"}), NODE, [])
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]}}}
    assert "node affinity/selector" in unschedulable_reason(pod(affinity=affinity), NODE, [])


def test_user_taints_need_a_toleration_but_lifecycle_taints_do_not_block():
    tainted = {**NODE, "spec": {"taints": [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"},
                                           {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}}
    assert "untolerated taint {dedicated: llm}" in unschedulable_reason(pod(), tainted, [])
    tolerations = [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}]
    assert unschedulable_reason(pod(tolerations=tolerations), tainted, []) is None


def test_every_pod_gets_its_own_loopback_address_and_keeps_it():
    pool = AddressPool()
    a, b = pool.allocate("a"), pool.allocate("b")
    assert a != b and a.startswith("127.") and not a.startswith("127.0.0.")
    assert pool.allocate("a") == a
    pool.release("a")
    assert pool.allocate("c", preferred=a) == a  # an adopted pod keeps the address it had


def test_two_clusters_on_one_machine_hand_out_different_pod_addresses():
    from adpfleet.cluster.agent.addresses import AddressPool

    a, b = AddressPool("/tmp/cluster-a"), AddressPool("/home/u/.local/state/adpfleet/cluster")
    assert a.allocate("pod-1") != b.allocate("pod-1")
    assert AddressPool("/tmp/cluster-a").allocate("x") == AddressPool("/tmp/cluster-a").allocate("y")  # stable


def test_node_affinity_match_fields_select_the_node_by_name_and_an_empty_term_matches_nothing():
    node = {**NODE, "metadata": {**NODE["metadata"], "name": "adpfleet-node"}}

    def affinity(*terms):
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}
    by_name = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["adpfleet-node"]}]}
    other_name = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}
    assert unschedulable_reason(pod(affinity=affinity(by_name)), node, []) is None
    assert "node affinity/selector" in unschedulable_reason(pod(affinity=affinity(other_name)), node, [])
    assert "node affinity/selector" in unschedulable_reason(pod(affinity=affinity({})), node, [])
    either = affinity(other_name, {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]})
    assert unschedulable_reason(pod(affinity=either), node, []) is None


def test_what_one_node_cannot_honour_is_named_not_refused():
    spec = {"schedulerName": "volcano", "topologySpreadConstraints": [{"maxSkew": 1}],
            "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{}]}}}
    p = pod(**spec)
    assert unschedulable_reason(p, NODE, []) is None
    ignored = ignored_constraints(p)
    assert any('schedulerName "volcano"' in m for m in ignored)
    assert any("podAntiAffinity" in m for m in ignored)
    assert any("topologySpreadConstraints" in m for m in ignored)
    assert ignored_constraints(pod()) == []
