"""What the scheduler reserves for a pod: one formula for the operator's PodGroups and the local node."""

from decimal import Decimal

from adpfleet.contract.pod_requests import pod_requests


def container(cpu, **extra):
    return {"name": f"c{cpu}", "resources": {"requests": {"cpu": str(cpu)}}, **extra}


def test_limits_stand_for_missing_requests_sidecars_add_and_the_largest_init_container_is_a_floor():
    pod_spec = {
        "containers": [{"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "2", "memory": "1Gi"}}},
                       {"resources": {"requests": {"cpu": "250m"}}}],
        "initContainers": [{"restartPolicy": "Always", "resources": {"requests": {"memory": "512Mi"}}},
                           {"resources": {"requests": {"cpu": "4", "memory": "256Mi"}}}],
    }
    assert pod_requests(pod_spec) == {"cpu": Decimal(4), "memory": Decimal(3 * 2**29)}


def test_sidecars_hold_their_requests_beside_the_containers_and_during_later_init_containers():
    spec = {"containers": [container(1)],
            "initContainers": [container(2, restartPolicy="Always"), container(3)]}
    # Containers + sidecar = 3; the second init container runs beside the sidecar: 2 + 3 = 5.
    assert pod_requests(spec)["cpu"] == 5
    spec["initContainers"][1] = container(0.5)
    assert pod_requests(spec)["cpu"] == 3


def test_the_pods_overhead_is_reserved_on_top_as_kubernetes_counts_it():
    spec = {"containers": [container(1)], "overhead": {"cpu": "250m", "memory": "64Mi"}}
    assert pod_requests(spec) == {"cpu": Decimal("1.25"), "memory": Decimal(64 * 2**20)}
