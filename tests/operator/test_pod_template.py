"""Pod templates: what a role's (or the router's) template does to the pods the operator builds,
and which names in a pod are the operator's (the CRD refuses templates that touch them)."""

import copy

from adpfleet.operator.decisions.desired import router_objects, server_template
from adpfleet.operator.resource import names, pod_schema
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

from specs import GPU_TEMPLATE, fleet_manifest, gpu_role
from test_engines import server as vllm_server
from test_engines import vllm_spec

FLEET = FleetRef("demo", "ns1", "uid-1")


def spec(**overrides) -> FleetSpec:
    return FleetSpec.model_validate(fleet_manifest(**overrides)["spec"])


def role_with(template: dict, **extra) -> dict:
    return {"servers": 1, "adpRanks": 1, "engine": {"kvBlocks": 64}, "podTemplate": template, **extra}


def server_pod(template: dict | None, role: str = "context") -> dict:
    roles = {role: role_with(template)} if template is not None else {}
    return server_template(FLEET, spec(**roles), role).pod(0)


def gpu_server_pod(template: dict) -> dict:
    return server_template(FLEET, spec(context=gpu_role(template)), "context").pod(0)


def router_deployment(template: dict) -> dict:
    objects = router_objects(FLEET, spec(router={"podTemplate": template}))
    return next(o for o in objects if o["kind"] == "Deployment")


def test_scheduling_fields_are_the_templates():
    pod = gpu_server_pod(GPU_TEMPLATE)
    for field in ("affinity", "topologySpreadConstraints", "priorityClassName", "schedulerName", "runtimeClassName"):
        assert pod["spec"][field] == GPU_TEMPLATE["spec"][field], field


def test_the_server_container_is_amended_and_stays_first_and_sidecars_follow():
    plain = gpu_server_pod({})["spec"]["containers"][0]
    pod = gpu_server_pod(GPU_TEMPLATE)
    server, *sidecars = pod["spec"]["containers"]
    assert server["name"] == names.SERVER_CONTAINER and [c["name"] for c in sidecars] == ["log-shipper"]
    assert sidecars[0] == GPU_TEMPLATE["spec"]["containers"][1]
    # what the operator owns is untouched
    for field in ("image", "command", "args", "ports", "startupProbe", "readinessProbe", "livenessProbe"):
        assert server[field] == plain[field], field
    # env after the operator's (so $(POD_IP) may be used), mounts after the operator's
    assert server["env"][:len(plain["env"])] == plain["env"]
    assert server["env"][len(plain["env"]):] == [{"name": "NCCL_IB_HCA", "value": "mlx5"}]
    assert server["envFrom"] == [{"configMapRef": {"name": "nccl-tuning"}}]
    assert server["volumeMounts"] == plain["volumeMounts"] + [{"name": "models", "mountPath": "/models"}]
    # extended resources beside the role's CPU and memory; GPUs still from gpusPerServer
    assert server["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "1", "rdma/ib": "1",
                                             "hugepages-2Mi": "1Gi"}
    # securityContext: the template's keys over the operator's
    assert server["securityContext"]["capabilities"] == {"add": ["IPC_LOCK"]}
    assert server["securityContext"]["readOnlyRootFilesystem"] is True


def test_volumes_and_init_containers_come_after_the_operators():
    pod = gpu_server_pod(GPU_TEMPLATE)
    assert [v["name"] for v in pod["spec"]["volumes"]] == [names.SCRATCH_VOLUME, names.SHM_VOLUME, "models"]
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["warm-cache"]


def test_template_metadata_is_added_to_the_fleets_and_wins_a_key_both_set():
    manifest = fleet_manifest(podMetadata={"labels": {"team": "a"}, "annotations": {"a": "1", "b": "1"}},
                              generation=role_with({"metadata": {"labels": {"team": "b", "tier": "gpu"},
                                                                 "annotations": {"a": "2"}}}))
    pod = server_template(FLEET, FleetSpec.model_validate(manifest["spec"]), "generation").pod(0)
    assert pod["metadata"]["labels"]["team"] == "b" and pod["metadata"]["labels"]["tier"] == "gpu"
    assert pod["metadata"]["annotations"]["a"] == "2" and pod["metadata"]["annotations"]["b"] == "1"
    assert pod["metadata"]["labels"][names.LABEL_ROLE] == "generation"


def test_pod_security_context_keys_of_the_template_win_the_rest_stay():
    pod = server_pod({"spec": {"securityContext": {"supplementalGroups": [44], "fsGroup": 2000}}})
    context = pod["spec"]["securityContext"]
    assert context["supplementalGroups"] == [44] and context["fsGroup"] == 2000
    assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}


def test_with_sidecars_kubectl_defaults_to_the_main_container():
    assert gpu_server_pod(GPU_TEMPLATE)["metadata"]["annotations"][names.DEFAULT_CONTAINER_ANNOTATION] == "server"
    plain = server_pod({"spec": {"priorityClassName": "high"}})
    assert names.DEFAULT_CONTAINER_ANNOTATION not in plain["metadata"]["annotations"]


def test_a_template_change_rolls_only_that_role():
    before = {r: server_template(FLEET, spec(), r).template_hash for r in names.ROLES}
    after_spec = spec(context=role_with({"spec": {"priorityClassName": "high"}}))
    after = {r: server_template(FLEET, after_spec, r).template_hash for r in names.ROLES}
    assert after["context"] != before["context"] and after["generation"] == before["generation"]


def test_no_template_and_an_empty_one_build_the_same_pod():
    without = {k: v for k, v in role_with({}).items() if k != "podTemplate"}
    for empty in ({}, {"metadata": {}, "spec": {}}):  # adding an empty template rolls nothing
        assert server_template(FLEET, spec(context=without), "context").pod(0) == server_pod(empty)


def test_the_router_template_amends_the_router_container_and_rolls_the_deployment():
    template = {"metadata": {"labels": {"zone": "a"}},
                "spec": {"priorityClassName": "router-high",
                         "containers": [{"name": "router", "env": [{"name": "LOG_LEVEL", "value": "debug"}]},
                                        {"name": "envoy", "image": "envoy:1"}]}}
    deployment = router_deployment(template)
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["zone"] == "a"
    assert pod["spec"]["priorityClassName"] == "router-high"
    assert [c["name"] for c in pod["spec"]["containers"]] == ["router", "envoy"]
    assert pod["spec"]["containers"][0]["env"][-1] == {"name": "LOG_LEVEL", "value": "debug"}
    plain = next(o for o in router_objects(FLEET, spec()) if o["kind"] == "Deployment")
    assert deployment["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH] != \
        plain["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH]


def test_the_operators_names_are_exactly_what_it_puts_in_the_pods():
    """The lists the CRD's rules refuse (names.SERVER_OWNS, ROUTER_OWNS) are what the pods carry: a
    new operator env var, volume or mount without its entry there fails here."""
    full = spec(model={"uri": "hf://acme/tiny", "tokenSecretRef": {"name": "hf"}}, auth={"apiKeySecret": {"name": "api"}})
    pod = server_template(FLEET, full, "context").pod(0)["spec"]
    server = pod["containers"][0]
    assert server["name"] == names.SERVER_OWNS.container
    # every engine's credential is owned, whichever engine a fleet runs (vLLM's key: VLLM_API_KEY)
    vllm = vllm_server(vllm_spec())["spec"]["containers"][0]
    credentials = {e["name"] for e in vllm["env"]} & set(names.RESERVED_ENV)
    assert {e["name"] for e in server["env"]} | credentials == set(names.SERVER_OWNS.env)
    # the model's volumes: the download cache (hf://) and a pvc:// claim (mounted at a path per claim)
    claim_pod = server_template(FLEET, spec(model={"uri": "pvc://store/tiny"}), "context").pod(0)["spec"]
    # and vllm.cache's volume, mounted as vLLM's cache root
    cached = vllm_spec()
    cached["vllm"]["cache"] = {"hostPath": {"path": "/var/cache/vllm"}}
    cached_pod = vllm_server(cached)["spec"]
    assert {v["name"] for v in pod["volumes"] + claim_pod["volumes"] + cached_pod["volumes"]} == \
        set(names.SERVER_OWNS.volumes)
    assert {m["mountPath"] for m in server["volumeMounts"] + cached_pod["containers"][0]["volumeMounts"]} == \
        set(names.SERVER_OWNS.mount_paths)
    router_pod = next(o for o in router_objects(FLEET, full) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    router = router_pod["containers"][0]
    assert router["name"] == names.ROUTER_OWNS.container
    assert {e["name"] for e in router["env"]} == set(names.ROUTER_OWNS.env)
    assert {v["name"] for v in router_pod["volumes"]} == set(names.ROUTER_OWNS.volumes)
    assert {m["mountPath"] for m in router["volumeMounts"]} == set(names.ROUTER_OWNS.mount_paths)


def test_the_fields_the_server_container_may_not_set_include_everything_the_operator_sets():
    owned = set(pod_schema.owned_container_fields())
    server = server_pod(None)["spec"]["containers"][0]
    set_by_operator = set(server) - set(pod_schema.MAIN_CONTAINER_FIELDS)
    assert set_by_operator <= owned, set_by_operator - owned
    assert {"command", "args", "image", "ports", "lifecycle", "livenessProbe"} <= owned


def test_the_template_does_not_change_what_it_was_given():
    template = copy.deepcopy(GPU_TEMPLATE)
    gpu_server_pod(template)
    assert template == GPU_TEMPLATE
