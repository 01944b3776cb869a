"""Desired objects are a pure function of the spec."""

from adpfleet.operator.decisions.desired import desired_fleet, router_objects, server_template
from adpfleet.operator.decisions.observed import ServerPod
from adpfleet.operator.decisions.rollout import plan_role
from adpfleet.operator.resource import names
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.resource.models import FleetSpec

from specs import fleet_manifest

FLEET = FleetRef("demo", "ns1", "uid-1")


def spec(**overrides) -> FleetSpec:
    return FleetSpec.model_validate(fleet_manifest(**overrides)["spec"])


def test_server_pod_has_stable_name_labels_owner_and_the_runtime_command():
    pod = server_template(FLEET, spec(), "context").pod(0)
    meta = pod["metadata"]
    assert meta["name"] == "demo-context-0" and meta["namespace"] == "ns1"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "adpfleet", "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "context-server", "app.kubernetes.io/managed-by": "adpfleet-operator",
        "adpfleet.io/fleet": "demo", "adpfleet.io/role": "context", "adpfleet.io/index": "0",
        "adpfleet.io/engine": "adpfleet"}
    assert meta["ownerReferences"] == [{"apiVersion": "adpfleet.io/v1alpha1", "kind": "InferenceFleet",
                                        "name": "demo", "uid": "uid-1", "controller": True,
                                        "blockOwnerDeletion": True}]
    container = pod["spec"]["containers"][0]
    argv = container["command"] + container["args"]
    assert argv[:10] == ["adpfleet", "serve", "--role", "context", "--model", "tiny", "--dp", "1", "--host", "$(POD_IP)"]
    assert argv[argv.index("--kv-blocks") + 1] == "64"
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "kv": 8001}


def test_a_server_drains_within_its_grace_period_and_keeps_time_to_stop():
    def drain(grace):
        pod = server_template(FLEET, spec(context={"terminationGracePeriodSeconds": grace}), "context").pod(0)
        args = pod["spec"]["containers"][0]["args"]
        assert pod["spec"]["terminationGracePeriodSeconds"] == grace
        return int(args[args.index("--drain-timeout") + 1])
    assert (drain(30), drain(120), drain(5), drain(1), drain(0)) == (25, 115, 3, 1, 0)


def test_generation_servers_expose_no_kv_port():
    container = server_template(FLEET, spec(), "generation").pod(1)["spec"]["containers"][0]
    assert [p["name"] for p in container["ports"]] == ["http"]


def test_probes_use_the_runtime_endpoints():
    container = server_template(FLEET, spec(), "context").pod(0)["spec"]["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["periodSeconds"] == 1  # from probes.readinessPeriodSeconds
    assert container["livenessProbe"]["httpGet"]["path"] == "/metrics"  # open: needs no credential
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600


def test_pods_run_unprivileged_with_a_read_only_root():
    pod = server_template(FLEET, spec(), "context").pod(0)["spec"]
    container = pod["containers"][0]
    # the images' `adpfleet` user (docker/*.Dockerfile); the "restricted" Pod Security Standard
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                      "fsGroup": 10001, "seccompProfile": {"type": "RuntimeDefault"}}
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/var/tmp", "/dev/shm"}
    assert pod["automountServiceAccountToken"] is False


def test_gpus_resources_and_scheduling_are_passed_through():
    s = spec(generation={"servers": 1, "adpRanks": 2, "gpusPerServer": 4, "engine": {"device": "cuda"},
                         "resources": {"requests": {"cpu": "4", "memory": "16Gi", "ephemeralStorage": "1Gi"},
                                       "limits": {"memory": "32Gi"}},
                         "nodeSelector": {"gpu": "h100"},
                         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]})
    pod = server_template(FLEET, s, "generation").pod(0)["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "1Gi", "nvidia.com/gpu": "4"},
                         "limits": {"memory": "32Gi", "nvidia.com/gpu": "4"}}
    assert pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    args = pod["containers"][0]["args"]
    assert args[args.index("--device") + 1] == "cuda"


def test_the_specs_env_reaches_the_server_container():
    s = spec(generation={"servers": 1, "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "EMPTY"}]})
    env = server_template(FLEET, s, "generation").pod(0)["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] in ("NCCL_DEBUG", "EMPTY")] == [{"name": "NCCL_DEBUG", "value": "INFO"},
                                                                         {"name": "EMPTY", "value": ""}]
    other = server_template(FLEET, s, "context").pod(0)["spec"]["containers"][0]["env"]
    assert not any(e["name"] == "NCCL_DEBUG" for e in other)


def test_token_secret_becomes_hf_token_env_of_the_download_only():
    s = spec(model={"uri": "hf://meta/llama", "tokenSecretRef": {"name": "hf", "key": "tok"}})
    pod = server_template(FLEET, s, "context").pod(0)["spec"]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}}}
    assert token in pod["initContainers"][0]["env"]
    assert token not in pod["containers"][0]["env"]  # the server reads files; the cache is complete


def test_template_hash_changes_with_server_settings_but_not_with_server_count():
    base = server_template(FLEET, spec(), "context").template_hash
    more = spec(context={"servers": 5, "adpRanks": 1, "engine": {"kvBlocks": 64},
                         "probes": {"readinessPeriodSeconds": 1}})
    assert server_template(FLEET, more, "context").template_hash == base
    bigger_kv = spec(context={"servers": 1, "adpRanks": 1, "engine": {"kvBlocks": 65},
                              "probes": {"readinessPeriodSeconds": 1}})
    assert server_template(FLEET, bigger_kv, "context").template_hash != base
    assert server_template(FLEET, spec(image="adpfleet:2"), "context").template_hash != base
    # a setting of the other role does not roll this one
    other = spec(generation={"servers": 1, "adpRanks": 2})
    assert server_template(FLEET, other, "context").template_hash == base


def test_pod_metadata_is_added_but_cannot_override_the_operators_labels():
    s = spec(podMetadata={"labels": {"team": "a"}, "annotations": {"prometheus.io/scrape": "true"}})
    meta = server_template(FLEET, s, "context").pod(0)["metadata"]
    assert meta["labels"]["team"] == "a" and meta["labels"]["adpfleet.io/role"] == "context"
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert names.ANNOTATION_TEMPLATE_HASH in meta["annotations"]


def test_a_pod_metadata_change_changes_the_template_hash_so_the_servers_roll():
    base = server_template(FLEET, spec(), "context").template_hash
    labelled = server_template(FLEET, spec(podMetadata={"labels": {"team": "a"}}), "context").template_hash
    annotated = server_template(FLEET, spec(podMetadata={"annotations": {"a": "b"}}), "context").template_hash
    assert len({base, labelled, annotated}) == 3
    running = ServerPod(name="demo-context-0", uid="u", role="context", index=0, template_hash=base,
                        owner_uid="uid-1", phase="Running", ready=True, terminating=False, unschedulable=False,
                        problem=None)
    assert plan_role("context", 1, labelled, [running]).phase == "RollingUpdate"


def test_router_runs_kubernetes_discovery_with_read_only_pod_access_in_its_namespace():
    objects = {o["kind"]: o for o in router_objects(FLEET, spec())}
    assert list(objects) == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"]
    assert objects["Role"]["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = objects["RoleBinding"]
    assert binding["roleRef"]["name"] == "demo-router"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router", "namespace": "ns1"}]
    pod = objects["Deployment"]["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "demo-router"
    args = pod["spec"]["containers"][0]["args"]
    assert args[:5] == ["router", "--host", "$(POD_IP)", "--port", "8000"]
    assert args[args.index("--kube-selector") + 1] == "adpfleet.io/fleet=demo,adpfleet.io/role,!adpfleet.io/worker"
    assert args[args.index("--kube-namespace") + 1] == "$(POD_NAMESPACE)"
    assert args[args.index("--queue-size") + 1] == "256" and args[args.index("--queue-timeout") + 1] == "60"
    # Ready while it listens: with no Ready server it holds requests, so it must keep getting them
    assert pod["spec"]["containers"][0]["readinessProbe"]["tcpSocket"] == {"port": "http"}
    assert "adpfleet.io/role" not in pod["metadata"]["labels"]  # the router never discovers itself
    assert objects["Service"]["spec"]["selector"] == objects["Deployment"]["spec"]["selector"]["matchLabels"]
    for obj in objects.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert names.ANNOTATION_TEMPLATE_HASH in obj["metadata"]["annotations"]


def test_the_router_queue_comes_from_the_fleet():
    args = router_objects(FLEET, spec(router={"queueSize": 0, "queueTimeoutSeconds": 5}))[3]["spec"]["template"][
        "spec"]["containers"][0]["args"]
    assert args[args.index("--queue-size") + 1] == "0" and args[args.index("--queue-timeout") + 1] == "5"


def test_router_can_be_left_out():
    assert router_objects(FLEET, spec(router={"enabled": False})) == []


def test_desired_fleet_is_deterministic():
    assert desired_fleet(FLEET, spec()) == desired_fleet(FLEET, spec())


# ---- disruption budgets ----

def budgets(**overrides) -> dict:
    from adpfleet.operator.decisions.desired import disruption_budgets
    return {b["metadata"]["name"]: b for b in disruption_budgets(FLEET, spec(**overrides))}


def test_each_role_and_the_router_get_a_budget_that_never_lets_a_drain_take_the_last_ready_pod():
    found = budgets(context={"servers": 3}, generation={"servers": 1}, router={"replicas": 2})
    assert set(found) == {"demo-context", "demo-generation", "demo-router"}
    assert {n: b["spec"]["minAvailable"] for n, b in found.items()} == \
        {"demo-context": 2, "demo-generation": 1, "demo-router": 1}  # maxUnavailable 1, and never 0
    assert found["demo-context"]["spec"]["selector"] == {"matchLabels": {"adpfleet.io/fleet": "demo",
                                                                         "adpfleet.io/role": "context"}}
    assert found["demo-router"]["spec"]["selector"] == {"matchLabels": names.router_selector("demo")}
    assert all(b["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow" for b in found.values())
    assert all(b["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for b in found.values())


def test_a_budget_follows_the_roles_size_and_its_max_unavailable_and_can_be_disabled():
    found = budgets(context={"servers": 4, "disruptionBudget": {"maxUnavailable": 2}},
                    generation={"servers": 2, "disruptionBudget": {"enabled": False}}, router={"enabled": False})
    assert set(found) == {"demo-context"} and found["demo-context"]["spec"]["minAvailable"] == 2
    zero = budgets(context={"servers": 3, "disruptionBudget": {"maxUnavailable": 0}})
    assert zero["demo-context"]["spec"]["minAvailable"] == 3
    before = budgets(context={"servers": 3})["demo-context"]["metadata"]["annotations"]
    after = budgets(context={"servers": 4})["demo-context"]["metadata"]["annotations"]
    assert before[names.ANNOTATION_TEMPLATE_HASH] != after[names.ANNOTATION_TEMPLATE_HASH]  # re-applied on scale
