"""Gang scheduling on the local cluster (docs/operator.md, "Gang scheduling"): the API server is
given cut-down copies of Volcano's and the Coscheduling plugin's PodGroup CRDs
(fixtures/podgroup-crds.yaml), so it validates the PodGroups the operator makes as a real
cluster's would; neither scheduler runs (the node agent places every pod, whatever its
schedulerName). Without the CRDs the fleet says which API is missing and creates nothing of that
role; once they are installed the same fleet reconciles, each server with its PodGroup owned by
the fleet; a scale-down takes its server's PodGroup, deleting the fleet takes the rest.

Status-only pods (the node agent reports them Ready without starting a process): what is checked is
the objects, not servers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from adpfleet.cluster.testing import wait_for
from adpfleet.operator.decisions import gang

from specs import fleet_manifest

pytestmark = pytest.mark.k8s

CRDS = Path(__file__).parent / "fixtures" / "podgroup-crds.yaml"
CRD_NAMES = [f"{api.resource}" for api in gang.APIS.values()]
ROLE = {"engine": {"kvBlocks": 64}, "probes": {"readinessPeriodSeconds": 1}}


def served(k8s_cluster, api: gang.PodGroupAPI) -> bool:
    try:
        resources = client.CustomObjectsApi(k8s_cluster.api_client).get_api_resources(api.group, api.version)
    except client.exceptions.ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return any(r.name == gang.POD_GROUP_PLURAL for r in resources.resources)


@pytest.fixture
def no_podgroup_crds(k8s_cluster):
    """The cluster without the PodGroup CRDs now, and again after the test (they are cluster-wide)."""
    def remove():
        k8s_cluster.kubectl("delete", "crd", *CRD_NAMES, "--ignore-not-found", "--wait=true")
        wait_for(lambda: not any(served(k8s_cluster, api) for api in gang.APIS.values()), timeout=60,
                 what="the PodGroup APIs to be gone from discovery")
    remove()
    yield
    remove()


def pod_groups(fleets, api: gang.PodGroupAPI) -> dict[str, dict]:
    items = fleets.custom.list_namespaced_custom_object(api.group, api.version, fleets.ns,
                                                        gang.POD_GROUP_PLURAL)["items"]
    return {o["metadata"]["name"]: o for o in items if o["metadata"].get("deletionTimestamp") is None}


def test_podgroups_are_made_validated_owned_and_deleted_with_their_servers_and_a_missing_api_is_named(
        start_operator, fleets, k8s_cluster, no_podgroup_crds):
    start_operator()
    generation = {**ROLE, "servers": 2, "adpRanks": 2, "podsPerServer": 2,
                  "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                  "gangScheduling": {"provider": "Volcano", "queue": "inference"}}
    context = {**ROLE, "servers": 1, "adpRanks": 1,
               "gangScheduling": {"provider": "Coscheduling", "scheduleTimeoutSeconds": 60}}
    fleets.apply(fleet_manifest("gang", status_only=True, context=context, generation=generation))

    # No PodGroup API: Degraded naming the field and the API, an Event, and no server of either role.
    degraded = wait_for(lambda: (c := fleets.condition("gang", "Degraded")).get("reason") == "PodGroupAPIMissing"
                        and c, timeout=60, what="Degraded/PodGroupAPIMissing")
    assert degraded["status"] == "True"
    assert "spec.context.gangScheduling" in degraded["message"] or \
        "spec.generation.gangScheduling" in degraded["message"], degraded
    assert "podgroups.scheduling." in degraded["message"], degraded
    event = wait_for(lambda: fleets.events("PodGroupAPIMissing"), timeout=30, what="the Event")[0]
    assert event.type == "Warning" and "podgroups.scheduling." in event.message
    assert fleets.pods("gang") == []

    # Installed later (looked at again within 30 s): the fleet reconciles with every server in its PodGroup.
    k8s_cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    wait_for(lambda: all(served(k8s_cluster, api) for api in gang.APIS.values()), timeout=60,
             what="the PodGroup APIs to be served")
    fleets.wait_ready("gang", timeout=90)
    assert fleets.condition("gang", "Degraded")["status"] == "False"
    uid = fleets.get("gang")["metadata"]["uid"]

    volcano = pod_groups(fleets, gang.VOLCANO)
    assert sorted(volcano) == ["gang-generation-0", "gang-generation-1"]
    for name, group in volcano.items():
        owner, = group["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["kind"] == "InferenceFleet" and owner["controller"] is True
        assert group["spec"]["minMember"] == 2 and group["spec"]["queue"] == "inference"
        assert group["spec"]["minResources"] == {"cpu": "200m", "memory": "128Mi"}
    coscheduling = pod_groups(fleets, gang.COSCHEDULING)
    assert list(coscheduling) == ["gang-context-0"]
    assert coscheduling["gang-context-0"]["spec"] == {"minMember": 1, "scheduleTimeoutSeconds": 60}
    assert coscheduling["gang-context-0"]["metadata"]["ownerReferences"][0]["uid"] == uid

    for pod in fleets.live_pods("gang", "generation"):
        server = pod.metadata.name.rsplit("-", 1)[0]  # gang-generation-<i>-<j> -> gang-generation-<i>
        assert pod.spec.scheduler_name == "volcano"
        assert pod.metadata.annotations["scheduling.k8s.io/group-name"] == server
    context_pod, = fleets.live_pods("gang", "context")
    assert context_pod.spec.scheduler_name == "scheduler-plugins-scheduler"
    assert context_pod.metadata.labels["scheduling.x-k8s.io/pod-group"] == "gang-context-0"
    # the node agent placed it in the named scheduler's stead, and says so
    wait_for(lambda: any("scheduler-plugins-scheduler" in message for _, _, message in
                         k8s_cluster.pod_events(fleets.ns, "gang-context-0")),
             timeout=30, what="the node agent's Event about the schedulerName")

    # A scale-down takes its server's PodGroup with its pods.
    fleets.patch_spec("gang", {"generation": {"servers": 1}})
    wait_for(lambda: list(pod_groups(fleets, gang.VOLCANO)) == ["gang-generation-0"], timeout=60,
             what="the removed server's PodGroup to be deleted")

    # Deleting the fleet takes the rest (the garbage collector, through the ownerReference).
    fleets.delete("gang")
    wait_for(lambda: not pod_groups(fleets, gang.VOLCANO) and not pod_groups(fleets, gang.COSCHEDULING),
             timeout=120, what="the fleet's PodGroups to be deleted with it", interval=1)
