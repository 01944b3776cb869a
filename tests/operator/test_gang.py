"""Gang scheduling (decisions/gang.py, spec.<role>.gangScheduling): what a server's PodGroup says,
what its pods carry, and how a reconcile pass creates, deletes and waits for PodGroups (against the
fake API of test_reconciler.py; the real API server's view is test_gang_k8s.py)."""

import dataclasses
from decimal import Decimal
from pathlib import Path

import yaml

from adpfleet.operator.decisions import gang
from adpfleet.operator.decisions.desired import desired_fleet, server_template
from adpfleet.operator.decisions.observed import server_pod
from adpfleet.operator.reconciler import FleetMemory
from adpfleet.operator.resource import names, pod_schema
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

from specs import fleet_manifest
from test_reconciler import FakeApi, observation, reconcile, servers_only

FLEET = FleetRef("demo", "ns1", "uid-1")
CRDS = {d["spec"]["group"]: d for d in yaml.safe_load_all(
    (Path(__file__).parent / "fixtures" / "podgroup-crds.yaml").read_text())}


def spec(gang_scheduling=None, **generation) -> FleetSpec:
    role = {"servers": 1, "adpRanks": 2, "podsPerServer": 2, **generation}
    if gang_scheduling is not None:
        role["gangScheduling"] = gang_scheduling
    return FleetSpec.model_validate(fleet_manifest(generation=role)["spec"])


def schema_problems(manifest: dict) -> list[str]:
    """What the provider's PodGroup CRD (the fixture) refuses in `manifest`."""
    crd = CRDS[manifest["apiVersion"].split("/")[0]]
    return pod_schema.problems(manifest, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")


# ---- what is rendered ----

def test_a_volcano_server_gets_a_podgroup_of_all_its_pods_with_their_summed_requests():
    s = spec({"provider": "Volcano", "queue": "inference"}, gpusPerServer=8, adpRanks=8,
             engine={"device": "cuda"}, resources={"requests": {"cpu": "3500m", "memory": "48Gi"}},
             podTemplate={"spec": {"priorityClassName": "inference-high"}})
    template = server_template(FLEET, s, "generation")
    group = template.pod_group(3)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["kind"] == "PodGroup"
    assert group["metadata"]["name"] == "demo-generation-3" and group["metadata"]["namespace"] == "ns1"
    assert group["metadata"]["ownerReferences"] == [FLEET.owner_reference()]  # removed with the fleet
    assert group["spec"] == {"minMember": 2, "queue": "inference", "priorityClassName": "inference-high",
                             "minResources": {"cpu": "7", "memory": "96Gi", "nvidia.com/gpu": "8"}}
    assert schema_problems(group) == []
    for pod in template.pods(3):
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo-generation-3"
        assert server_pod(pod).pod_group == gang.PodGroupRef("Volcano", "demo-generation-3")


def test_a_coscheduling_server_gets_a_podgroup_with_its_timeout_and_its_pods_the_group_label():
    s = spec({"provider": "Coscheduling", "schedulerName": "gang-scheduler", "scheduleTimeoutSeconds": 120})
    template = server_template(FLEET, s, "generation")
    group = template.pod_group(0)
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1"
    assert group["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 120}
    assert schema_problems(group) == []
    for pod in template.pods(0):
        assert pod["spec"]["schedulerName"] == "gang-scheduler"
        assert pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo-generation-0"
        assert "scheduling.k8s.io/group-name" not in pod["metadata"]["annotations"]
    assert server_template(FLEET, spec({"provider": "Coscheduling"}), "generation").pods(0)[0]["spec"][
        "schedulerName"] == "scheduler-plugins-scheduler"


def test_one_pod_servers_of_a_gang_scheduled_role_get_a_podgroup_of_one():
    s = spec({"provider": "Volcano"}, podsPerServer=1, adpRanks=1)
    template = server_template(FLEET, s, "generation")
    assert template.pod_group(1)["spec"]["minMember"] == 1
    assert template.pods(1)[0]["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo-generation-1"


def test_without_gang_scheduling_nothing_changes_the_pods_or_their_hash():
    plain, gang_on = server_template(FLEET, spec(), "generation"), server_template(
        FLEET, spec({"provider": "Volcano"}), "generation")
    assert plain.pod_group(0) is None and "schedulerName" not in plain.pods(0)[0]["spec"]
    assert server_pod(plain.pods(0)[0]).pod_group is None
    assert plain.template_hash != gang_on.template_hash  # turning it on rolls the servers into PodGroups
    # so does a change of the PodGroups' settings: the next groups get the new settings
    queued = server_template(FLEET, spec({"provider": "Volcano", "queue": "q"}), "generation")
    assert queued.template_hash != gang_on.template_hash
    # the other role is untouched
    assert desired_fleet(FLEET, spec()).servers["context"].template_hash == \
        desired_fleet(FLEET, spec({"provider": "Volcano"})).servers["context"].template_hash


def test_a_group_label_naming_another_group_is_not_the_operators():
    pod = server_template(FLEET, spec(), "generation").pods(0)[0]
    pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] = "the-users-own"
    assert server_pod(pod).pod_group is None  # never deleted with the server


def test_quantities_are_written_as_kubernetes_writes_them():
    assert gang.format_quantity("cpu", Decimal("1.25")) == "1250m"
    assert gang.format_quantity("memory", Decimal(3 * 2**29)) == "1536Mi"
    assert gang.format_quantity("nvidia.com/gpu", Decimal(1024)) == "1024"


# ---- a reconcile pass ----

class GangApi(FakeApi):
    """The fake API with PodGroups: `served` lists the API groups discovery shows."""

    def __init__(self, served=("scheduling.volcano.sh", "scheduling.x-k8s.io"), **kwargs):
        super().__init__(**kwargs)
        self.served = set(served)
        self.pod_groups = []

    async def api_served(self, group, version, plural):
        self.calls.append(("api_served", group))
        from adpfleet.operator.adapters.kube import ApiResult
        return ApiResult(True) if group in self.served else ApiResult(False, 404, "not found")

    async def apply_custom(self, group, version, plural, manifest):
        self.pod_groups.append(manifest)
        return self._out("apply_custom", group, manifest["metadata"]["name"])

    async def delete_custom(self, group, version, plural, namespace, name):
        return self._out("delete_custom", group, name)


def gang_fleet(provider="Volcano") -> dict:
    m = servers_only()
    m["spec"]["generation"].update({"adpRanks": 2, "podsPerServer": 2, "gangScheduling": {"provider": provider}})
    return m


def test_a_servers_podgroup_is_applied_before_its_pods():
    api = GangApi()
    reconcile(api, observation(gang_fleet()))
    calls = [c[:2] if c[0] != "apply_custom" else c for c in api.calls if c[0] in ("create_pod", "apply_custom")]
    assert calls == [("create_pod", "f-context-0"), ("apply_custom", "scheduling.volcano.sh", "f-generation-0"),
                     ("create_pod", "f-generation-0-0"), ("create_pod", "f-generation-0-1")]
    assert api.pod_groups[0]["spec"]["minMember"] == 2
    assert {c["type"]: c for c in api.last_status["conditions"]}["Degraded"]["status"] == "False"


def test_a_podgroup_the_api_server_refuses_leaves_the_server_uncreated_and_says_why():
    api = GangApi(fail={"apply_custom"})
    reconcile(api, observation(gang_fleet()))
    assert not [c for c in api.calls if c[0] == "create_pod" and c[1].startswith("f-generation")]
    degraded = {c["type"]: c for c in api.last_status["conditions"]}["Degraded"]
    assert degraded["reason"] == "CreateServerFailed"
    assert "PodGroup f-generation-0 (scheduling.volcano.sh/v1beta1): boom" in degraded["message"]


def test_without_the_podgroup_api_the_role_waits_degraded_naming_the_api_and_the_field():
    api = GangApi(served=())
    result = reconcile(api, observation(gang_fleet("Coscheduling")))
    created = [c[1] for c in api.calls if c[0] == "create_pod"]
    assert created == ["f-context-0"]  # the other role is not held
    assert not [c for c in api.calls if c[0] == "apply_custom"]
    conditions = {c["type"]: c for c in api.last_status["conditions"]}
    degraded = conditions["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "PodGroupAPIMissing"
    assert "spec.generation.gangScheduling" in degraded["message"]
    assert "podgroups.scheduling.x-k8s.io" in degraded["message"] and "scheduler-plugins" in degraded["message"]
    assert ("event", "Warning", "PodGroupAPIMissing") in api.calls
    assert "waiting for the scheduling.x-k8s.io/v1alpha1 PodGroup API" in conditions["Progressing"]["message"]
    assert result.requeue_after == 30.0  # looked at again: installing the CRD has no watch here

    # once it is installed, the next pass creates the server and the condition clears
    api = GangApi()
    reconcile(api, observation(gang_fleet("Coscheduling")))
    assert ("apply_custom", "scheduling.x-k8s.io", "f-generation-0") in api.calls


def test_the_api_is_looked_up_only_when_a_gang_scheduled_role_creates_servers():
    api = GangApi()
    reconcile(api, observation())  # no gang scheduling
    assert not [c for c in api.calls if c[0] == "api_served"]


def test_a_deleted_server_takes_its_podgroup_with_it():
    m = gang_fleet()
    m["spec"]["generation"]["servers"] = 1
    spec_ = FleetSpec.model_validate(m["spec"])
    template = desired_fleet(FleetRef("f", "ns", "fleet-uid"), spec_).servers["generation"]
    pods = []
    for index in (0, 1):  # two servers where one is wanted: the second goes (not Ready: at once)
        for body in template.pods(index):
            body["metadata"]["uid"] = f"u-{body['metadata']['name']}"
            body["metadata"]["ownerReferences"][0]["uid"] = "fleet-uid"
            body["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": str(index == 0)}]}
            pods.append(server_pod(body))
    context = server_template(FleetRef("f", "ns", "fleet-uid"), spec_, "context").pods(0)[0]
    context["metadata"]["uid"] = "u-ctx"
    context["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    pods.append(dataclasses.replace(server_pod(context), owner_uid="fleet-uid"))
    api = GangApi()
    reconcile(api, observation(m, pods=pods), FleetMemory())
    deleted = [c for c in api.calls if c[0] in ("delete_pod", "delete_custom")]
    assert deleted == [("delete_pod", "f-generation-1-0"), ("delete_pod", "f-generation-1-1"),
                       ("delete_custom", "scheduling.volcano.sh", "f-generation-1")]



def test_the_charts_volcano_example_renders_podgroups_its_crd_accepts():
    path = Path(__file__).resolve().parents[2] / "charts" / "adpfleet" / "examples" / "multinode-gang-volcano.yaml"
    example = FleetSpec.model_validate(yaml.safe_load(path.read_text())["spec"])
    group = server_template(FLEET, example, "generation").pod_group(1)
    assert group["spec"] == {"minMember": 2, "queue": "inference",
                             "minResources": {"cpu": "32", "memory": "400Gi", "nvidia.com/gpu": "8"}}
    assert schema_problems(group) == []
