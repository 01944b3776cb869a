"""Servers over several pods (decisions/groups.py, the group pods of decisions/desired.py): one
server to every rule, created, Ready and replaced whole."""

import dataclasses

from adpfleet.operator.decisions import groups
from adpfleet.operator.decisions.desired import desired_fleet, server_template
from adpfleet.operator.decisions.observed import ServerPod, server_pod
from adpfleet.operator.decisions.rollout import CreateServer, DeleteServer, plan_role
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

from specs import fleet_manifest

FLEET = FleetRef("demo", "ns1", "uid-1")
HASH = "h"


def spec(**generation) -> FleetSpec:
    return FleetSpec.model_validate(fleet_manifest(generation={"servers": 1, "adpRanks": 2, "podsPerServer": 2,
                                                               **generation})["spec"])


def member(index, node_rank, ready=True, terminating=False, phase="Running", restarts=0):
    return ServerPod(name=f"demo-generation-{index}-{node_rank}", uid=f"uid-{index}-{node_rank}", role="generation",
                     index=index, template_hash=HASH, owner_uid="fleet", phase=phase, ready=ready,
                     terminating=terminating, unschedulable=False, problem=None, restarts=restarts,
                     node_rank=node_rank, pods_per_server=2)


def test_a_server_of_two_pods_is_two_named_pods_that_know_their_share_and_their_leader():
    pods = server_template(FLEET, spec(), "generation").pods(3)
    assert [p["metadata"]["name"] for p in pods] == ["demo-generation-3-0", "demo-generation-3-1"]
    for j, pod in enumerate(pods):
        labels = pod["metadata"]["labels"]
        assert labels[names.LABEL_INDEX] == "3" and labels[names.LABEL_NODE_RANK] == str(j)
        assert (names.LABEL_WORKER in labels) == (j > 0)  # the router discovers leaders only
        assert pod["spec"]["hostname"] == f"demo-generation-3-{j}" and pod["spec"]["subdomain"] == "demo-generation-group"
        container = pod["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--dp") + 1] == "2" and args[args.index("--nodes") + 1] == "2"
        assert args[args.index("--node-rank") + 1] == str(j)
        assert {"name": "ADPFLEET_LEADER_ADDRESS",
                "value": "demo-generation-3-0.demo-generation-group.ns1.svc"} in container["env"]
        assert server_pod(pod).node_rank == j and server_pod(pod).pods_per_server == 2


def test_a_one_pod_server_keeps_its_name_labels_and_hash():
    one = FleetSpec.model_validate(fleet_manifest()["spec"])
    template = server_template(FLEET, one, "generation")
    assert [p["metadata"]["name"] for p in template.pods(0)] == ["demo-generation-0"]
    assert names.LABEL_NODE_RANK not in template.pods(0)[0]["metadata"]["labels"]
    assert "hostname" not in template.pods(0)[0]["spec"]


def test_the_headless_service_names_the_leaders_before_they_are_ready():
    objects = desired_fleet(FLEET, spec()).objects
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "demo-generation-group")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"][names.LABEL_NODE_RANK] == "0"
    assert not any(o["metadata"]["name"] == "demo-context-group" for o in objects)  # one-pod role: none


def test_gpus_and_the_disruption_budget_count_pods():
    s = spec(adpRanks=4, gpusPerServer=4, engine={"device": "cuda"})
    pod = server_template(FLEET, s, "generation").pods(0)[0]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    budget = next(o for o in desired_fleet(FLEET, s).objects
                  if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "demo-generation")
    assert budget["spec"]["minAvailable"] == 2  # one whole server of two pods


def test_a_group_is_ready_only_when_every_pod_is():
    assert groups.servers([member(0, 0), member(0, 1)])[0].ready
    server, = groups.servers([member(0, 0), member(0, 1, ready=False)])
    assert not server.ready and server.name == "demo-generation-0-0" and len(server.members) == 2


def test_a_group_that_lost_a_pod_is_replaced_whole():
    for broken in ([member(0, 0)],                                    # the worker was deleted and is gone
                   [member(0, 0), member(0, 1, terminating=True)],   # ... is being deleted
                   [member(0, 0), member(0, 1, phase="Failed")],     # ... failed
                   [member(0, 0, restarts=1), member(0, 1)]):        # the leader restarted
        server, = groups.servers(broken)
        assert server.finished and "GroupBroken" in server.problem
        plan = plan_role("generation", 1, HASH, [server])
        assert plan.actions == (DeleteServer("generation", server.name, server.uid, plan.actions[0].why),)
    gone, = groups.servers([member(0, 0, terminating=True), member(0, 1, terminating=True)])
    assert gone.terminating
    assert plan_role("generation", 1, HASH, []).actions == (CreateServer("generation", 0, "scale up"),)


def test_a_roll_replaces_one_whole_group_at_a_time():
    old = [dataclasses.replace(m, template_hash="old") for m in (member(0, 0), member(0, 1))]
    surge = [member(1, 0, ready=False), member(1, 1)]
    plan = plan_role("generation", 1, HASH, groups.servers(old + surge))
    assert plan.actions == () and "to become ready" in plan.waiting_for
    surge = [member(1, 0), member(1, 1)]
    plan = plan_role("generation", 1, HASH, groups.servers(old + surge))
    assert [type(a) for a in plan.actions] == [DeleteServer] and plan.actions[0].name == "demo-generation-0-0"


def test_with_network_policies_the_pods_of_a_group_may_reach_each_other_on_any_port():
    from adpfleet.operator.decisions.security import OperatorIdentity, network_policies

    policies = {p["metadata"]["name"]: p for p in network_policies(FLEET, spec(), OperatorIdentity("ops", {"a": "b"}))}
    group = policies["demo-generation-group"]["spec"]
    assert group["ingress"] == [{"from": [{"podSelector": group["podSelector"]}]}]  # no port list: all of them
    assert group["podSelector"]["matchLabels"][names.LABEL_ROLE] == "generation"
    assert "demo-context-group" not in policies


def test_the_local_node_agent_answers_the_leader_address_the_pods_are_given():
    """The same names CoreDNS gives a StatefulSet's pods: the agent's /etc/hosts records for the
    role's headless Service hold the leader's address under the name every pod of the group gets."""
    from adpfleet.cluster.agent import hosts

    service = next(o for o in desired_fleet(FLEET, spec()).objects if o["kind"] == "Service"
                   and o["metadata"]["name"] == "demo-generation-group")
    pods = server_template(FLEET, spec(), "generation").pods(0)
    for j, pod in enumerate(pods):  # not Ready yet: a leader waits for its workers before turning Ready
        pod["status"] = {"podIP": f"127.0.5.{j + 1}", "phase": "Running", "conditions": []}
    records = hosts.service_records([service], pods)
    leader = next(e["value"] for e in pods[1]["spec"]["containers"][0]["env"] if e["name"] == "ADPFLEET_LEADER_ADDRESS")
    assert leader == "demo-generation-0-0.demo-generation-group.ns1.svc"
    text = hosts.hosts_file(pods[1], "127.0.5.2", records)
    assert any(line.startswith("127.0.5.1\t") and leader in line.split() for line in text.splitlines())
    assert not any(line.startswith("127.0.5.2\t") and "demo-generation-group.ns1.svc" in line.split()
                   for line in text.splitlines())  # the Service names the leader only
