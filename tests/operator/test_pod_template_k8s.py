"""Pod templates on the local cluster: a fleet whose roles ask for node affinity, a topology spread,
a priority class, a sidecar, an init container and an extra volume mounted into the
server (and tolerations and a node selector, the role's own fields) reconciles, and the pods the API server stored carry exactly what was asked, beside what
the operator owns; every role and the router get their PodDisruptionBudget.

Status-only pods (the node agent reports them Running and Ready without starting a process): what
is checked is what the API server and the scheduler made of the operator's pods, not a server.
"""

from __future__ import annotations

import copy

import pytest

from adpfleet.operator.resource import names

from specs import GPU_TEMPLATE, fleet_manifest

pytestmark = pytest.mark.k8s

PRIORITY_CLASS = "adpfleet-test-inference"
TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]  # the role's own fields

def local_template() -> dict:
    """specs.GPU_TEMPLATE less what one CPU node cannot give (another scheduler, a runtime class,
    RDMA and hugepages, a ConfigMap), with the priority class the test creates."""
    template = copy.deepcopy(GPU_TEMPLATE)
    spec = template["spec"]
    del spec["schedulerName"], spec["runtimeClassName"]
    spec["priorityClassName"] = PRIORITY_CLASS
    for key in ("envFrom", "resources", "securityContext"):
        del spec["containers"][0][key]
    return template


TEMPLATE = local_template()


@pytest.fixture
def priority_class(k8s_cluster):
    from kubernetes import client
    scheduling = client.SchedulingV1Api(k8s_cluster.api_client)
    scheduling.create_priority_class({"metadata": {"name": PRIORITY_CLASS}, "value": 1000})
    yield 1000
    scheduling.delete_priority_class(PRIORITY_CLASS)


def subset(asked, got) -> bool:
    """`asked` is in `got`: every key of a dict with the same value (the API server adds defaults,
    such as a toleration's or a mount's), every item of a list in order among `got`'s."""
    if isinstance(asked, dict):
        return isinstance(got, dict) and all(k in got and subset(v, got[k]) for k, v in asked.items())
    if isinstance(asked, list):
        return isinstance(got, list) and all(any(subset(a, g) for g in got) for a in asked)
    return asked == got


def test_a_fleet_with_a_pod_template_reconciles_and_its_pods_carry_exactly_what_was_asked(
        start_operator, fleets, k8s_cluster, priority_class):
    start_operator()
    role = {"servers": 1, "adpRanks": 1, "engine": {"kvBlocks": 64}, "probes": {"readinessPeriodSeconds": 1},
            "tolerations": TOLERATIONS, "nodeSelector": {"kubernetes.io/os": "linux"},
            "podTemplate": copy.deepcopy(TEMPLATE)}
    fleets.apply(fleet_manifest("tpl", status_only=True, context=role, generation=copy.deepcopy(role)))
    fleets.wait_ready("tpl", timeout=120)

    for pod in fleets.live_pods("tpl"):
        body = k8s_cluster.api_client.sanitize_for_serialization(pod)
        spec, meta = body["spec"], body["metadata"]
        where = meta["name"]
        # what was asked, as asked
        for field in ("affinity", "topologySpreadConstraints"):
            assert subset(TEMPLATE["spec"][field], spec.get(field)), (where, field, spec.get(field))
        assert subset(TOLERATIONS, spec["tolerations"]) and spec["nodeSelector"] == {"kubernetes.io/os": "linux"}
        assert spec["priorityClassName"] == PRIORITY_CLASS and spec["priority"] == priority_class, where
        assert {"name": "models", "emptyDir": {}} in spec["volumes"], where
        assert [c["name"] for c in spec["containers"]] == [names.SERVER_CONTAINER, "log-shipper"], where
        assert subset(TEMPLATE["spec"]["containers"][1], spec["containers"][1]), where
        assert [c["name"] for c in spec.get("initContainers", [])][-1] == "warm-cache", where
        assert meta["labels"]["team"] == "inference" and meta["annotations"]["example.com/owner"] == "ml-platform"
        server = spec["containers"][0]
        assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in server["env"], where
        assert subset([{"name": "models", "mountPath": "/models"}], server["volumeMounts"]), where
        # ... beside what the operator owns: its labels, its command, ports and probes
        assert meta["labels"][names.LABEL_FLEET] == "tpl" and names.LABEL_ROLE in meta["labels"], where
        assert server["command"] == ["adpfleet"] and server["args"][0] == "serve", where
        assert {p["containerPort"] for p in server["ports"]} >= {names.SERVER_HTTP_PORT}, where
        assert server["readinessProbe"] and server["startupProbe"], where
        # and the scheduler placed it (the affinity matched the node)
        assert spec.get("nodeName"), where

    from kubernetes import client
    policy = client.PolicyV1Api(k8s_cluster.api_client)
    budgets = {b.metadata.name: b for b in policy.list_namespaced_pod_disruption_budget(fleets.ns).items}
    for role_name in ("context", "generation"):
        owned = [b for b in budgets.values() if (b.spec.selector.match_labels or {}).get(names.LABEL_ROLE) == role_name
                 and (b.spec.selector.match_labels or {}).get(names.LABEL_FLEET) == "tpl"]
        assert len(owned) == 1 and owned[0].spec.min_available == 1, (role_name, sorted(budgets))
