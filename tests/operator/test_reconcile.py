"""The operator against the real API server, with pods the node agent reports Ready without running
them (status-only), so that many reconcile steps take seconds. Real servers: test_end_to_end.py.

Every operator here is a real `adpfleet operator` process whose requests all pass through a
counting proxy: write counts are measured from the outside, not taken from the operator's word.
The tests that need no process of their own share the module's operator (`module_operator`), each
with a namespace of its own; those that stop it, count its requests or give it flags start one.
"""

import re
import time

import pytest
from kubernetes import client

from adpfleet.cluster.apiproxy import CountingProxy
from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names

from operator_harness import PodTimeline, pod_ready
from specs import fleet_manifest

pytestmark = pytest.mark.k8s


def role(servers, **extra):
    return {"servers": servers, "adpRanks": 1, "engine": {"kvBlocks": 64}, **extra}


def names_of(pods):
    return [p.metadata.name for p in pods]


def test_fleet_gets_its_servers_router_rbac_status_and_events(module_operator, fleets):
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(2), generation=role(1)))
    fleet = fleets.wait_ready("demo")

    assert names_of(fleets.pods("demo", "context")) == ["demo-context-0", "demo-context-1"]
    assert names_of(fleets.pods("demo", "generation")) == ["demo-generation-0"]
    pod = fleets.pods("demo", "generation")[0]
    assert pod.metadata.labels[names.LABEL_INDEX] == "0" and pod.metadata.labels[names.LABEL_ROLE] == "generation"
    assert pod.metadata.labels["app.kubernetes.io/managed-by"] == "adpfleet-operator"
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.uid, owner.controller) == ("InferenceFleet", "demo",
                                                                      fleet["metadata"]["uid"], True)
    assert pod.spec.containers[0].command + pod.spec.containers[0].args[:3] == ["adpfleet", "serve", "--role",
                                                                                "generation"]
    kinds = set(fleets.owned_objects("demo"))
    assert {("Deployment", "demo-router"), ("Service", "demo-router"), ("ServiceAccount", "demo-router"),
            ("Role", "demo-router"), ("RoleBinding", "demo-router")} <= kinds

    status = fleet["status"]
    assert status["observedGeneration"] == 1 and status["readyRoles"] == "3/3"
    assert status["context"] == {"desired": 2, "current": 2, "updated": 2, "ready": 2, "servers": "2/2"}
    assert status["router"] == {"desired": 1, "ready": 1}
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["reason"] == "AllServersReady"
    assert conditions["Progressing"]["status"] == "False" and conditions["Degraded"]["status"] == "False"
    assert all(c["observedGeneration"] == 1 and c["lastTransitionTime"] for c in conditions.values())
    wait_for(lambda: fleets.events("FleetReady"), timeout=10, what="the FleetReady Event (written after the status)")
    created = fleets.events("CreatedServer")
    assert len(created) == 1  # one Event per kind of change, naming each server
    assert all(name in created[0].message for name in ("demo-context-0", "demo-context-1", "demo-generation-0"))

    row = printed_row(fleets, "demo")
    assert list(row) == ["NAME", "READY", "ROLES READY", "STALLED", "REMEDIATING", "DEGRADED", "MODEL", "OBSERVED",
                         "DELETING", "AGE"], row
    assert list(row.values())[:9] == ["demo", "True", "3/3", "False", "False", "False", "Available", "1", ""], row


def printed_row(fleets, name: str) -> dict[str, str]:
    """`kubectl get ifleet NAME` as {column: cell}; an empty cell is "" (columns are cut where the
    header's are: a column name may have a space, a cell may be empty)."""
    header, line = fleets.cluster.kubectl("get", names.SHORT_NAMES[0], name, f"--namespace={fleets.ns}").stdout \
        .rstrip("\n").split("\n")
    columns = list(re.finditer(r"\S+(?: \S+)*", header))
    ends = [c.start() for c in columns[1:]] + [None]
    return {c.group(): line[c.start():end].strip() for c, end in zip(columns, ends)}


def test_kubectl_get_shows_a_fleet_no_operator_watches_and_one_being_deleted(start_operator, fleets):
    def row(name):
        return printed_row(fleets, name)

    fleets.apply(fleet_manifest("unwatched", status_only=True))
    assert row("unwatched")["OBSERVED"] == "" and row("unwatched")["READY"] == ""
    op = start_operator()
    fleets.wait_ready("unwatched")
    assert row("unwatched")["OBSERVED"] == "1"
    op.stop()  # the fleet keeps the operator's finalizer: deleting it waits for an operator
    fleets.cluster.kubectl("delete", names.SHORT_NAMES[0], "unwatched", f"--namespace={fleets.ns}", "--wait=false")
    wait_for(lambda: row("unwatched")["DELETING"] != "", timeout=10, what="the DELETING column")


def test_the_router_role_reads_pods_in_its_namespace_and_nothing_else(module_operator, fleets, k8s_cluster):
    fleets.apply(fleet_manifest("demo", status_only=True))
    fleets.wait_ready("demo")
    sa = f"system:serviceaccount:{fleets.ns}:demo-router"

    def can(verb, resource, namespace=fleets.ns):
        return k8s_cluster.kubectl("auth", "can-i", verb, resource, f"--as={sa}", f"--namespace={namespace}",
                                   check=False).stdout.strip()
    assert [can(v, "pods") for v in ("get", "list", "watch")] == ["yes"] * 3
    assert can("delete", "pods") == "no" and can("create", "pods") == "no"
    assert can("get", "secrets") == "no" and can("list", "pods", "default") == "no"


def test_each_role_scales_up_and_down(module_operator, fleets):
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(1), generation=role(1)))
    fleets.wait_ready("demo")
    ready_since = fleets.condition("demo", "Ready")["lastTransitionTime"]

    fleets.patch_spec("demo", {"context": {"servers": 3}, "generation": {"servers": 2}})
    fleets.wait_ready("demo")
    # the existing servers kept serving: the fleet never stopped being Ready, and said nothing else
    assert fleets.condition("demo", "Ready")["lastTransitionTime"] == ready_since
    assert fleets.events("FleetNotReady") == [] and len(fleets.events("FleetReady")) == 1
    assert names_of(fleets.live_pods("demo", "context")) == ["demo-context-0", "demo-context-1", "demo-context-2"]
    assert names_of(fleets.live_pods("demo", "generation")) == ["demo-generation-0", "demo-generation-1"]

    fleets.patch_spec("demo", {"context": {"servers": 1}, "generation": {"servers": 1}})
    fleets.wait_ready("demo")
    wait_for(lambda: names_of(fleets.pods("demo")) == ["demo-context-0", "demo-generation-0"], timeout=30,
             what="the scaled-down pods to be gone")
    counts = ("desired", "current", "updated", "ready", "servers")  # (and the role's lastScale, now it scaled)
    wait_for(lambda: {k: fleets.get("demo")["status"]["context"].get(k) for k in counts} == {
        "desired": 1, "current": 1, "updated": 1, "ready": 1, "servers": "1/1"}, timeout=10, what="the counts")
    # a pass writes its Events after the status: the counts above can be read before the last of them
    wait_for(lambda: all(name in " ".join(e.message for e in fleets.events("DeletedServer"))
                         for name in ("demo-context-1", "demo-context-2", "demo-generation-1")), timeout=10,
             what="a DeletedServer Event naming each scaled-down server")


def test_a_spec_change_rolls_servers_one_at_a_time_never_leaving_a_role_without_a_ready_server(module_operator, fleets):
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(3), generation=role(1)))
    fleets.wait_ready("demo")
    before = {p.metadata.uid for p in fleets.pods("demo")}
    old_hash = fleets.pods("demo", "context")[0].metadata.annotations[names.ANNOTATION_TEMPLATE_HASH]

    with PodTimeline(fleets.cluster, fleets.ns, "demo") as timeline:
        generation = fleets.patch_spec("demo", {"context": {"engine": {"kvBlocks": 96}},
                                                "generation": {"engine": {"kvBlocks": 96}}})
        fleets.wait_ready("demo")
        wait_for(lambda: all(p.metadata.annotations[names.ANNOTATION_TEMPLATE_HASH] != old_hash
                             for p in fleets.pods("demo", "context")) and len(fleets.pods("demo")) == 4,
                 timeout=60, what="every server to run the new spec")

    assert fleets.get("demo")["status"]["observedGeneration"] == generation
    for role_name, desired in (("context", 3), ("generation", 1)):
        samples = timeline.samples[role_name]
        assert min(s.ready for s in samples) >= 1, f"{role_name} dropped to zero ready servers"
        assert max(s.live for s in samples) <= desired + 1, f"{role_name} had more than one extra server"
    pods = fleets.pods("demo")
    assert not {p.metadata.uid for p in pods} & before
    new_ones = [n for n, uid in timeline.created if uid not in before]
    assert len(new_ones) == 4  # each server replaced exactly once
    assert all(p.spec.containers[0].args[p.spec.containers[0].args.index("--kv-blocks") + 1] == "96" for p in pods)
    # Ready means the fleet serves, which it did all along: the roll is over when Progressing says so
    wait_for(lambda: fleets.condition("demo", "Progressing")["status"] == "False", timeout=30,
             what="Progressing False after the roll")
    assert fleets.condition("demo", "Progressing")["observedGeneration"] == generation


def test_a_server_deleted_by_hand_is_recreated_under_its_name(module_operator, fleets):
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(2), generation=role(1)))
    fleets.wait_ready("demo")
    victim = fleets.pods("demo", "context")[1]
    fleets.core.delete_namespaced_pod(victim.metadata.name, fleets.ns)

    def recreated():
        pods = {p.metadata.name: p for p in fleets.live_pods("demo", "context")}
        pod = pods.get(victim.metadata.name)
        return pod is not None and pod.metadata.uid != victim.metadata.uid and pod_ready(pod)
    wait_for(recreated, timeout=30, what=f"{victim.metadata.name} to be recreated and Ready")
    assert names_of(fleets.live_pods("demo", "context")) == ["demo-context-0", "demo-context-1"]
    fleets.wait_ready("demo")


def test_at_rest_a_fleet_costs_zero_writes_and_its_objects_do_not_change(start_operator, fleets, api_proxy):
    """Several resync periods (every one a full reconcile pass from the watch caches) with nothing
    changed: the counting proxy sees no write, and no resourceVersion moves."""
    op = start_operator(resync_seconds=1)
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(2), generation=role(2)))
    fleets.wait_ready("demo")
    wait_for(lambda: fleets.condition("demo", "Progressing").get("status") == "False", timeout=30,
             what="the fleet to settle")
    time.sleep(2)  # let the last status write and its own watch event pass (this is the point of the test)
    versions = fleets.resource_versions("demo")
    passes_before = op.metric("adpfleet_operator_reconciles_total")
    start = time.monotonic()

    wait_for(lambda: op.metric("adpfleet_operator_reconciles_total") >= passes_before + 5, timeout=30,
             what="five more reconcile passes")
    window = api_proxy.since(start)
    assert CountingProxy.writes(window) == [], [(r.verb, r.path) for r in CountingProxy.writes(window)]
    assert [r for r in window if r.verb not in ("watch",)] == [], "a pass at rest should read from the caches"
    assert fleets.resource_versions("demo") == versions


def test_an_operator_restart_changes_nothing(start_operator, fleets, api_proxy):
    op = start_operator()
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(2), generation=role(1)))
    fleets.wait_ready("demo")
    time.sleep(1)
    uids = {p.metadata.uid for p in fleets.pods("demo")}
    versions = fleets.resource_versions("demo")
    assert op.stop() == 0

    start = time.monotonic()
    op2 = start_operator()
    wait_for(lambda: op2.metric("adpfleet_operator_reconciles_total") >= 1, timeout=30, what="a first pass")
    time.sleep(2)
    assert CountingProxy.writes(api_proxy.since(start)) == []
    assert {p.metadata.uid for p in fleets.pods("demo")} == uids
    assert fleets.resource_versions("demo") == versions


def test_deleting_the_fleet_removes_everything_it_created(module_operator, fleets):
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(2), generation=role(1)))
    fleets.wait_ready("demo")
    assert len(fleets.owned_objects("demo")) >= 8
    fleets.delete("demo")
    wait_for(lambda: fleets.owned_objects("demo") == [], timeout=60, what="every object of the fleet to be deleted")
    wait_for(lambda: not fleets.custom.list_namespaced_custom_object(
        names.GROUP, names.VERSION, fleets.ns, names.PLURAL)["items"], timeout=30, what="the fleet to be gone")


def test_a_missing_api_key_secret_degrades_the_fleet_naming_it_and_the_operator_never_reads_secrets(
        start_operator, fleets, k8s_cluster, api_proxy):
    """The kubelet (here the node agent) resolves secretKeyRef: the pods wait in
    CreateContainerConfigError, which becomes Degraded/SecretNotFound and an Event. The operator
    creates the fleet's internal token and its NetworkPolicies and reads no Secret."""
    op = start_operator(extra_args=("--network-policies", "--operator-pod-labels", "app=adpfleet-operator"),
                        extra_env={"POD_NAMESPACE": "adpfleet-system"})
    start = time.monotonic()
    fleets.apply(fleet_manifest("demo", auth={"apiKeySecret": {"name": "api", "key": "key"}}))  # real pods
    wait_for(lambda: fleets.condition("demo", "Degraded").get("reason") == "SecretNotFound", timeout=60,
             what="Degraded/SecretNotFound")
    degraded = fleets.condition("demo", "Degraded")
    assert degraded["status"] == "True" and "spec.auth.apiKeySecret" in degraded["message"], degraded
    assert '"api"' in degraded["message"] or "/api" in degraded["message"], degraded
    event = wait_for(lambda: fleets.events("SecretNotFound"), timeout=30, what="the Event")[0]
    assert event.type == "Warning" and "spec.auth.apiKeySecret" in event.message
    assert fleets.condition("demo", "Ready")["status"] == "False"
    assert op.running() and op.healthz()[0] == 200

    # what the operator made: the token Secret (owned, random) and the policies, accepted by the API server
    fleet_uid = fleets.get("demo")["metadata"]["uid"]
    token = k8s_cluster.core.read_namespaced_secret("demo-internal-token", fleets.ns)
    assert token.metadata.owner_references[0].uid == fleet_uid and len(token.data["token"]) >= 40
    policies = {p.metadata.name: p for p in client.NetworkingV1Api(k8s_cluster.api_client)
                .list_namespaced_network_policy(fleets.ns).items}
    assert set(policies) == {"demo-servers", "demo-kv", "demo-router"}
    assert all(p.metadata.owner_references[0].uid == fleet_uid for p in policies.values())
    assert policies["demo-kv"].spec.ingress[0].ports[0].port == names.SERVER_KV_PORT
    # the operator's requests (through the counting proxy): one Secret created, none read
    secret_requests = [r for r in api_proxy.since(start) if "/secrets" in r.path]
    assert secret_requests and all(r.method == "POST" for r in secret_requests), secret_requests

    k8s_cluster.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api"},
                       "stringData": {"key": "x"}}, namespace=fleets.ns)
    # the node agent retries the container: it starts, and the problem is gone (no Secret watch needed)
    wait_for(lambda: fleets.condition("demo", "Degraded").get("status") == "False", timeout=60,
             what="Degraded=False once the Secret exists")
    wait_for(lambda: fleets.events("Recovered"), timeout=10, what="the Recovered Event (recorded after the status)")


def test_the_security_objects_of_every_kind_of_fleet_are_accepted_by_the_api_server(k8s_cluster, k8s_namespace):
    """NetworkPolicies (ports, port ranges, peers) and the token Secret as rendered, created with
    server-side dry-run: the API server validates them. (The local cluster does not enforce them.)"""
    from adpfleet.operator.decisions import security
    from adpfleet.operator.decisions.desired import desired_fleet
    from adpfleet.operator.resource.models import FleetSpec
    from adpfleet.operator.resource.names import FleetRef

    net = client.NetworkingV1Api(k8s_cluster.api_client)
    fleet = FleetRef("demo", k8s_namespace, "0b7c1f4e-0000-4000-8000-000000000000")
    config = security.SecurityConfig(security.OperatorIdentity("adpfleet-system", {"app": "op"}))
    variants = [{}, {"context": {"adpRanks": 8}, "networkPolicy": {
                    "clientNamespaces": ["apps"], "clientCidrs": ["10.0.0.0/8", "fd00::/8"],
                    "monitoringNamespaces": ["monitoring"]}},
                {"router": {"enabled": False}, "networkPolicy": {"clientCidrs": ["192.168.0.0/16"]}},
                {"router": {"enabled": False}}]
    checked = 0
    for variant in variants:
        spec = FleetSpec.model_validate(fleet_manifest("demo", **variant)["spec"])
        for policy in (o for o in desired_fleet(fleet, spec, config).objects if o["kind"] == "NetworkPolicy"):
            net.create_namespaced_network_policy(k8s_namespace, policy, dry_run="All")
            checked += 1
    assert checked == 3 + 3 + 2 + 2
    k8s_cluster.core.create_namespaced_secret(k8s_namespace, security.internal_token_secret(fleet), dry_run="All")
    # and a policy the API server refuses is refused (the dry run checks something)
    broken = security.network_policies(fleet, FleetSpec.model_validate(fleet_manifest("demo")["spec"]),
                                       config.network_policies)[1]
    broken["spec"]["ingress"][0]["ports"][0]["endPort"] = names.SERVER_KV_PORT - 1
    with pytest.raises(client.exceptions.ApiException) as refused:
        net.create_namespaced_network_policy(k8s_namespace, broken, dry_run="All")
    assert refused.value.status == 422 and "endPort" in refused.value.body


def test_a_server_that_cannot_be_scheduled_is_reported(module_operator, fleets):
    fleets.apply(fleet_manifest("demo", status_only=True, context=role(1, nodeSelector={"no-such": "node"})))
    wait_for(lambda: fleets.condition("demo", "Degraded").get("reason") == "ServersUnschedulable", timeout=30,
             what="Degraded/ServersUnschedulable")
    assert "demo-context-0: Unschedulable" in fleets.condition("demo", "Degraded")["message"]
    assert fleets.condition("demo", "Progressing")["status"] == "True"


def test_an_aggregated_fleet_runs_one_role_with_its_scale_target_budget_and_status(module_operator, fleets):
    manifest = fleet_manifest("agg", status_only=True, aggregated=role(2))
    del manifest["spec"]["context"], manifest["spec"]["generation"]
    fleets.apply(manifest)
    fleet = fleets.wait_ready("agg")

    assert names_of(fleets.pods("agg")) == ["agg-aggregated-0", "agg-aggregated-1"]
    assert fleet["status"]["aggregated"]["servers"] == "2/2" and "context" not in fleet["status"]
    assert fleet["status"]["readyRoles"] == "2/2"  # the role and the router
    budgets = client.PolicyV1Api(fleets.cluster.api_client).list_namespaced_pod_disruption_budget(fleets.ns).items
    assert sorted(b.metadata.name for b in budgets) == ["agg-aggregated", "agg-router"]
    role_objects = fleets.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, fleets.ns,
                                                               names.ROLE_PLURAL)["items"]
    assert [(o["metadata"]["name"], o["spec"]["role"]) for o in role_objects] == [("agg-aggregated", "aggregated")]

    fleets.patch_spec("agg", {"aggregated": {"servers": 1}})
    wait_for(lambda: names_of(fleets.pods("agg")) == ["agg-aggregated-0"], timeout=60,
             what="the aggregated role to scale down to one server")
