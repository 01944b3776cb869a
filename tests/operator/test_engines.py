"""A fleet names its engine: each engine's renderer turns the same spec into its own server container,
and everything around it (credentials, NetworkPolicies, budgets, the router) follows the fleet's roles."""

import copy

import pytest

from adpfleet.model_uri import CACHE_MOUNT_PATH, PVC_MOUNT_ROOT
from adpfleet.operator.adapters.dialects import dialect_for
from adpfleet.operator.decisions import engines
from adpfleet.operator.decisions.desired import desired_fleet
from adpfleet.operator.decisions.observed import FleetObservation, ServerPod
from adpfleet.operator.decisions.security import OperatorIdentity, SecurityConfig
from adpfleet.operator.resource.engine import ENGINES
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource import names
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.stall_look import SpecCache

from specs import fleet_manifest

FLEET = FleetRef("llama", "ns1", "uid-1")
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"


def vllm_spec(model: str = "hf://org/llama@main", **aggregated) -> dict:
    spec = fleet_manifest("llama")["spec"]
    del spec["context"], spec["generation"]
    spec.update(engine="vllm", vllm={"image": VLLM_IMAGE, "args": ["--dtype", "float32", "--max-model-len", "2048"]},
                model={"uri": model}, aggregated={"servers": 2, "adpRanks": 2, **aggregated},
                auth={"apiKeySecret": {"name": "llama-key", "key": "key"}})
    return spec


def render(spec: dict, config: SecurityConfig = SecurityConfig()):
    return desired_fleet(FLEET, FleetSpec.model_validate(spec), config)


def server(spec: dict) -> dict:
    return render(spec).servers["aggregated"].pod(0)


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def router_env(spec: dict) -> dict:
    deployment = next(o for o in render(spec).objects if o["kind"] == "Deployment")
    return env_of(deployment["spec"]["template"]["spec"]["containers"][0])


def test_every_engine_the_crd_admits_has_a_renderer():
    assert set(engines.RENDERERS) == set(ENGINES)
    for module in engines.RENDERERS.values():
        assert callable(module.server_container) and callable(module.credential_env)
        assert isinstance(module.ROUTER_SENDS_INTERNAL_TOKEN, bool)


def test_a_vllm_server_runs_vllm_serve_on_the_cached_model_with_ranks_as_data_parallel_engines():
    pod = server(vllm_spec(gpusPerServer=4, engine={"device": "cuda"}))
    container = pod["spec"]["containers"][0]
    assert container["image"] == VLLM_IMAGE and container["command"] == ["vllm"]
    args = container["args"]
    assert args[:2] == ["serve", f"{CACHE_MOUNT_PATH}/hf--org--llama--main"]
    flag = {args[i]: args[i + 1] for i in range(2, len(args) - 1) if args[i].startswith("--")}
    assert flag["--host"] == "$(POD_IP)" and flag["--port"] == "8000" and flag["--served-model-name"] == "llama"
    assert flag["--data-parallel-size"] == "2" and flag["--tensor-parallel-size"] == "2"  # 4 GPUs over 2 ranks
    assert "--enable-mfu-metrics" in args
    assert args[-4:] == ["--dtype", "float32", "--max-model-len", "2048"]  # vllm.args as given, last
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # the model is fetched by adpfleet's image, as for adpfleet servers, into the cache vLLM reads, and
    # checked as vLLM will load it (an architecture adpfleet does not run is vLLM's to judge)
    fetch = pod["spec"]["initContainers"][0]
    assert fetch["image"] == "adpfleet:dev" and fetch["args"] == ["fetch-model", "hf://org/llama@main",
                                                                  "--cache-dir", CACHE_MOUNT_PATH, "--engine", "vllm"]
    assert {"name": "model-cache", "mountPath": CACHE_MOUNT_PATH, "readOnly": True} in container["volumeMounts"]
    assert pod["metadata"]["labels"]["adpfleet.io/engine"] == "vllm"
    assert pod["metadata"]["labels"]["adpfleet.io/role"] == "aggregated"


def test_a_cpu_vllm_server_gets_one_gpu_free_tensor_parallel_rank():
    args = server(vllm_spec())["spec"]["containers"][0]["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "1"


@pytest.mark.parametrize("uri, path", [("pvc://models/llama-3", f"{PVC_MOUNT_ROOT}/models/llama-3"),
                                       ("/opt/models/llama", "/opt/models/llama"),
                                       ("file:///opt/models/llama", "/opt/models/llama")])
def test_vllm_serves_the_directory_the_model_source_names(uri, path):
    assert server(vllm_spec(model=uri))["spec"]["containers"][0]["args"][1] == path


def test_the_fleets_api_key_is_vllms_own_and_the_router_forwards_the_clients_key():
    container = server(vllm_spec())["spec"]["containers"][0]
    key = {"secretKeyRef": {"name": "llama-key", "key": "key"}}
    env = env_of(container)
    assert env["VLLM_API_KEY"] == key
    assert "--api-key" not in container["args"]  # a flag would show the key in `ps`
    assert not {"ADPFLEET_INTERNAL_TOKEN", "ADPFLEET_API_KEY"} & set(env)  # vLLM reads neither
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    # vLLM checks one key: the router must send the client's (the fleet's), not the internal token
    routed = router_env(vllm_spec())
    assert routed["ADPFLEET_API_KEY"] == key and "ADPFLEET_INTERNAL_TOKEN" not in routed
    adpfleet_fleet = {**fleet_manifest("llama")["spec"], "auth": {"apiKeySecret": dict(key["secretKeyRef"])}}
    assert "ADPFLEET_INTERNAL_TOKEN" in router_env(adpfleet_fleet)


def test_the_role_env_comes_after_the_engines_and_cannot_override_the_key():
    spec = vllm_spec(env=[{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}])
    names = [e["name"] for e in server(spec)["spec"]["containers"][0]["env"]]
    assert names.index("VLLM_NO_USAGE_STATS") < names.index("VLLM_CPU_KVCACHE_SPACE") < names.index("VLLM_API_KEY")


@pytest.mark.parametrize("cache, volume", [
    ({"hostPath": {"path": "/var/lib/vllm-cache"}}, {"hostPath": {"path": "/var/lib/vllm-cache", "type": "Directory"}}),
    ({"persistentVolumeClaim": {"claimName": "vllm-cache"}}, {"persistentVolumeClaim": {"claimName": "vllm-cache"}})])
def test_a_vllm_cache_is_every_server_pods_vllm_cache_root(cache, volume):
    spec = vllm_spec()
    spec["vllm"]["cache"] = cache
    template = render(spec).servers["aggregated"]
    for pod in (template.pod(0), template.pod(1)):  # every server (a vLLM server is one pod)
        container = pod["spec"]["containers"][0]
        assert env_of(container)["VLLM_CACHE_ROOT"] == names.VLLM_CACHE_DIR
        assert {"name": "vllm-cache", "mountPath": names.VLLM_CACHE_DIR} in container["volumeMounts"]
        assert {"name": "vllm-cache", **volume} in pod["spec"]["volumes"]
        assert not any(m["name"] == "vllm-cache" for m in pod["spec"]["initContainers"][0]["volumeMounts"])
    # a cache changes the pods: setting (or moving) it rolls the servers onto it
    assert template.template_hash != render(vllm_spec()).servers["aggregated"].template_hash


def test_without_a_vllm_cache_the_cache_root_stays_in_the_pods_scratch():
    pod = server(vllm_spec())
    container = pod["spec"]["containers"][0]
    assert "VLLM_CACHE_ROOT" not in env_of(container) and env_of(container)["HOME"] == names.SCRATCH_DIR
    assert names.VLLM_CACHE_DIR not in {m["mountPath"] for m in container["volumeMounts"]}
    assert "vllm-cache" not in {v["name"] for v in pod["spec"]["volumes"]}


def test_vllm_probes_ask_vllms_health_with_a_startup_budget_from_the_role():
    container = server(vllm_spec(probes={"startupTimeoutSeconds": 900}))["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] == 900
    assert [p["name"] for p in container["ports"]] == ["http"]


def test_a_pod_template_and_gang_scheduling_apply_to_vllm_servers_as_to_adpfleet_ones():
    spec = vllm_spec(podTemplate={"spec": {"priorityClassName": "inference-high", "containers": [
        {"name": "server", "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}]}]}},
        gangScheduling={"provider": "Volcano"})
    pod = server(spec)
    assert pod["spec"]["priorityClassName"] == "inference-high" and pod["spec"]["schedulerName"] == "volcano"
    assert env_of(pod["spec"]["containers"][0])["NCCL_IB_HCA"] == "mlx5"


def test_an_aggregated_adpfleet_fleet_runs_adpfleet_serve_as_aggregated_servers_without_kv_ports():
    spec = fleet_manifest("llama")["spec"]
    aggregated = spec.pop("context")
    del spec["generation"]
    spec["aggregated"] = {**aggregated, "servers": 3}
    desired = render(spec, SecurityConfig(network_policies=OperatorIdentity("adpfleet-system")))
    assert list(desired.servers) == ["aggregated"] and desired.replicas == {"aggregated": 3}
    pod = desired.servers["aggregated"].pod(2)
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "llama-aggregated-2"
    assert container["command"] + container["args"][:3] == ["adpfleet", "serve", "--role", "aggregated"]
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert "ADPFLEET_INTERNAL_TOKEN" in env_of(container)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in desired.objects]
    assert ("PodDisruptionBudget", "llama-aggregated") in kinds
    assert ("NetworkPolicy", "llama-servers") in kinds and ("NetworkPolicy", "llama-kv") not in kinds


def test_a_spec_without_roles_is_the_disaggregated_default():
    spec = fleet_manifest("llama")["spec"]
    del spec["context"], spec["generation"]
    fleet = FleetSpec.model_validate(spec)
    assert fleet.roles() == ("context", "generation") and fleet.context.servers == 1
    with pytest.raises(ValueError, match="no aggregated role"):
        fleet.role("aggregated")


def pod(name: str, role: str) -> ServerPod:
    return ServerPod(name=name, uid=name, role=role, index=0, template_hash="h", owner_uid="uid-1", phase="Running",
                     ready=True, terminating=False, unschedulable=False, problem=None, ip="127.0.0.9")


def observation(spec: dict, role: str) -> FleetObservation:
    return FleetObservation("llama", "ns1", "uid-1", 1, "1", copy.deepcopy(spec), {},
                            (pod(f"llama-{role}-0", role),), ())


def test_stall_detection_judges_vllm_servers_in_vllms_dialect():
    vllm_look = SpecCache().look(observation(vllm_spec(), "aggregated"))
    assert [p.name for p in vllm_look.judged] == ["llama-aggregated-0"]
    assert vllm_look.dialect is dialect_for("vllm") and not vllm_look.dialect.lockstep
    spec = fleet_manifest("llama")["spec"]
    spec["aggregated"] = spec.pop("context")
    del spec["generation"]
    adpfleet_look = SpecCache().look(observation(spec, "aggregated"))
    assert [p.name for p in adpfleet_look.judged] == ["llama-aggregated-0"]  # adpfleet's aggregated ones are
