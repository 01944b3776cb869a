"""A fleet's credentials and NetworkPolicies as desired objects (docs/security.md): who gets which
secret, from which Secret, and which pods may reach which port."""

import base64

import pytest
from pydantic import ValidationError

from adpfleet.cli import build_parser
from adpfleet.operator.decisions import security
from adpfleet.operator.decisions.desired import desired_fleet, router_objects, server_template
from adpfleet.operator.decisions.engines.adpfleet import server_args
from adpfleet.operator.decisions.security import OperatorIdentity, SecurityConfig
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

from specs import fleet_manifest

FLEET = FleetRef("demo", "ns1", "uid-1")
OPERATOR = OperatorIdentity("adpfleet-system", {"app.kubernetes.io/name": "adpfleet",
                                                "app.kubernetes.io/component": "operator"})
TOKEN_ENV = {"name": "ADPFLEET_INTERNAL_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": "demo-internal-token", "key": "token"}}}


def spec(**overrides) -> FleetSpec:
    return FleetSpec.model_validate(fleet_manifest(**overrides)["spec"])


def env_of(container: dict) -> dict:
    return {e["name"]: e for e in container["env"]}


def router_container(s: FleetSpec) -> dict:
    deployment = next(o for o in router_objects(FLEET, s) if o["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]


# ---- secrets ----

def test_every_server_and_the_router_get_the_internal_token_from_the_fleets_secret():
    s = spec()
    for role in names.ROLES:
        assert env_of(server_template(FLEET, s, role).pod(0)["spec"]["containers"][0])["ADPFLEET_INTERNAL_TOKEN"] \
            == TOKEN_ENV
    assert env_of(router_container(s))["ADPFLEET_INTERNAL_TOKEN"] == TOKEN_ENV


def test_the_api_key_comes_from_the_named_secret_through_secret_key_ref_only_when_named():
    s = spec(auth={"apiKeySecret": {"name": "fleet-api", "key": "key"}})
    want = {"name": "ADPFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "fleet-api", "key": "key"}}}
    assert env_of(router_container(s))["ADPFLEET_API_KEY"] == want
    assert env_of(server_template(FLEET, s, "context").pod(0)["spec"]["containers"][0])["ADPFLEET_API_KEY"] == want
    assert "ADPFLEET_API_KEY" not in env_of(router_container(spec()))
    # no secret value is ever in a pod template: only references
    assert "value" not in want and all("value" not in e for e in router_container(s)["env"]
                                       if e["name"] in (security.API_KEY_ENV, security.INTERNAL_TOKEN_ENV))


def test_the_internal_token_secret_is_random_owned_by_the_fleet_and_named_for_it():
    a, b = security.internal_token_secret(FLEET), security.internal_token_secret(FLEET)
    assert a["metadata"]["name"] == "demo-internal-token" and a["metadata"]["namespace"] == "ns1"
    assert a["metadata"]["ownerReferences"] == [FLEET.owner_reference()]
    token = base64.b64decode(a["data"]["token"]).decode()
    assert len(token) >= 32 and a["data"] != b["data"]
    assert security.internal_token_secret(FLEET, "t")["data"]["token"] == base64.b64encode(b"t").decode()


@pytest.mark.parametrize("name", ["ADPFLEET_FAULT_INJECTION", "ADPFLEET_API_KEY", "ADPFLEET_INTERNAL_TOKEN"])
def test_a_fleets_env_may_not_set_the_credentials_or_fault_injection(name):
    with pytest.raises(ValidationError, match="env must not set .*spec.faultInjection"):
        spec(generation={"env": [{"name": name, "value": "1"}]})


def test_fault_injection_only_from_the_fleet_field():
    assert "--fault-injection" not in server_args(spec(), "context")
    on = spec(faultInjection=True)
    assert all("--fault-injection" in server_args(on, role) for role in names.ROLES)
    assert "--fault-injection" not in router_container(on)["args"]
    assert build_parser().parse_args(server_args(on, "context")).fault_injection


# What a pod template's envFrom brings, as the kubelet (the node agent) resolves it: every reserved
# name from an unprefixed ConfigMap, and fault injection again through a prefix.
HOSTILE_ENV_FROM = [{"configMapRef": {"name": "hostile"}}, {"configMapRef": {"name": "prefixed"}, "prefix": "ADPFLEET_"}]
HOSTILE_OBJECTS = {
    ("ConfigMap", "hostile"): {"data": {"ADPFLEET_FAULT_INJECTION": "1", "ADPFLEET_INTERNAL_TOKEN": "guessed",
                                        "ADPFLEET_API_KEY": "guessed", "LOG_LEVEL": "debug"}},
    ("ConfigMap", "prefixed"): {"data": {"FAULT_INJECTION": "1"}},
    ("Secret", "demo-internal-token"): {"data": {"token": base64.b64encode(b"internal").decode()}},
    ("Secret", "fleet-api"): {"data": {"key": base64.b64encode(b"api").decode()}},
}


def resolved_env(container: dict) -> dict[str, str]:
    import asyncio

    from adpfleet.cluster.agent import podenv
    pod = {"metadata": {"name": "demo-context-0", "namespace": "ns1", "uid": "u"}, "spec": {"containers": [container]}}
    node = podenv.NodeContext(host_ip="127.0.0.1", apiserver_host="127.0.0.1", apiserver_port=6443, allocatable={})

    async def fetch(kind, name):
        return HOSTILE_OBJECTS.get((kind, name))
    return asyncio.run(podenv.container_env(pod, container, "127.0.1.7", node, fetch, {}))


@pytest.mark.parametrize("fault_injection", [False, True])
def test_envfrom_cannot_set_fault_injection_or_the_credentials_because_env_pins_them(fault_injection):
    """Admission cannot see a ConfigMap's keys, so the operator sets every reserved name in `env`,
    which wins over `envFrom` (as the kubelet resolves it here)."""
    from adpfleet.contract.env import FAULT_INJECTION_ENV
    template = {"spec": {"containers": [{"name": "server", "envFrom": HOSTILE_ENV_FROM}]}}
    s = spec(faultInjection=fault_injection, auth={"apiKeySecret": {"name": "fleet-api", "key": "key"}},
             context={"podTemplate": template}, router={"podTemplate": {
                 "spec": {"containers": [{"name": "router", "envFrom": HOSTILE_ENV_FROM}]}}})
    for container in (server_template(FLEET, s, "context").pod(0)["spec"]["containers"][0], router_container(s)):
        assert container["envFrom"] == HOSTILE_ENV_FROM  # the template's envFrom is kept
        env = resolved_env(container)
        assert env[FAULT_INJECTION_ENV] == ("1" if fault_injection else "0"), container["name"]
        assert (env["ADPFLEET_INTERNAL_TOKEN"], env["ADPFLEET_API_KEY"]) == ("internal", "api"), container["name"]
        assert env["LOG_LEVEL"] == "debug"  # the rest of the ConfigMap arrives


def test_engine_speculation_and_padding_reserve_reach_the_command_line():
    s = spec(context={"engine": {"draftTokens": 4, "promptLookupMax": 5, "promptLookupMin": 2,
                                 "paddingReserve": False}})
    args = build_parser().parse_args([a.replace("$(POD_IP)", "0.0.0.0") for a in server_args(s, "context")])
    assert (args.draft_tokens, args.prompt_lookup_max, args.prompt_lookup_min, args.padding_reserve) == (4, 5, 2, False)
    with pytest.raises(ValidationError, match="promptLookupMin must not exceed promptLookupMax"):
        spec(context={"engine": {"promptLookupMin": 4, "promptLookupMax": 3}})
    with pytest.raises(ValidationError, match="maxNumTokens must fit one decode query"):
        spec(context={"engine": {"draftTokens": 8, "maxNumTokens": 8}})


def test_the_kubelet_message_of_a_missing_secret_names_the_field_that_references_it():
    from adpfleet.operator.decisions.conditions import pod_problems
    from adpfleet.operator.decisions.observed import ServerPod
    s = spec(auth={"apiKeySecret": {"name": "fleet-api"}}, model={"name": "tiny", "tokenSecretRef": {"name": "hf"}})
    fields = security.secret_fields("demo", s)

    def problem(message):
        pod = ServerPod(name="demo-context-0", uid="u", role="context", index=0, template_hash="h", owner_uid="uid-1",
                        phase="Pending", ready=False, terminating=False, unschedulable=False, problem=message)
        return pod_problems([pod], fields)[0]

    missing = problem('CreateContainerConfigError: secret "fleet-api" not found')
    assert missing.reason == "SecretNotFound" and missing.message.endswith("(spec.auth.apiKeySecret)")
    key = problem("CreateContainerConfigError: couldn't find key token in Secret ns1/hf")
    assert key.reason == "SecretNotFound" and key.message.endswith("(spec.model.tokenSecretRef)")
    assert problem("CreateContainerConfigError: configmap \"x\" not found").reason == "ServersFailing"
    assert problem("CrashLoopBackOff: back-off").reason == "ServersFailing"


# ---- NetworkPolicies ----

def policies(s: FleetSpec) -> dict[str, dict]:
    objects = desired_fleet(FLEET, s, SecurityConfig(network_policies=OPERATOR)).objects
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}


def test_no_network_policies_unless_the_operator_is_told_to():
    assert not [o for o in desired_fleet(FLEET, spec()).objects if o["kind"] == "NetworkPolicy"]


def test_server_http_only_from_the_fleets_router_the_operator_and_the_monitoring_namespaces():
    p = policies(spec(networkPolicy={"monitoringNamespaces": ["monitoring"]}))["demo-servers"]
    assert p["metadata"]["ownerReferences"] == [FLEET.owner_reference()]
    selector = p["spec"]["podSelector"]
    assert selector["matchLabels"] == {"adpfleet.io/fleet": "demo", "app.kubernetes.io/managed-by": "adpfleet-operator"}
    assert selector["matchExpressions"] == [{"key": "adpfleet.io/role", "operator": "Exists"}]
    assert p["spec"]["policyTypes"] == ["Ingress"]
    [rule] = p["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": names.router_selector("demo")}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "adpfleet-system"}},
         "podSelector": {"matchLabels": OPERATOR.pod_labels}},  # one peer: both must match
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
    ]


def test_kv_ports_only_from_the_fleets_generation_servers_one_per_context_rank():
    p = policies(spec(context={"adpRanks": 4}))["demo-kv"]
    assert p["spec"]["podSelector"]["matchLabels"]["adpfleet.io/role"] == "context"
    [rule] = p["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8001, "endPort": 8004, "protocol": "TCP"}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "adpfleet.io/fleet": "demo", "app.kubernetes.io/managed-by": "adpfleet-operator", "adpfleet.io/role": "generation"}}}]
    assert policies(spec())["demo-kv"]["spec"]["ingress"][0]["ports"] == [{"port": 8001, "protocol": "TCP"}]


def test_the_router_port_is_open_unless_clients_are_named():
    open_ = policies(spec())["demo-router"]
    assert open_["spec"]["podSelector"] == {"matchLabels": names.router_selector("demo")}
    assert open_["spec"]["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]  # no `from`: anyone
    named = policies(spec(networkPolicy={"clientNamespaces": ["apps"], "clientCidrs": ["10.0.0.0/8"]}))["demo-router"]
    assert named["spec"]["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}},
        {"ipBlock": {"cidr": "10.0.0.0/8"}}]


def test_without_a_router_the_named_clients_reach_the_servers_instead():
    p = policies(spec(router={"enabled": False}, networkPolicy={"clientNamespaces": ["apps"]}))
    assert "demo-router" not in p
    peers = p["demo-servers"]["spec"]["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}} in peers
    assert not any("podSelector" in peer and "namespaceSelector" not in peer for peer in peers)  # no router pods
    anyone = policies(spec(router={"enabled": False}))["demo-servers"]["spec"]["ingress"]
    assert anyone == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]


def test_network_policy_fields_are_checked():
    for bad in ({"clientNamespaces": ["Not_A_Namespace"]}, {"clientCidrs": ["10.0.0.0"]},
                {"monitoringNamespaces": ["-x"]}):
        with pytest.raises(ValidationError):
            spec(networkPolicy=bad)


def test_the_operator_flags_become_its_security_config(monkeypatch):
    from adpfleet.operator.main import security_config
    parser = build_parser()
    monkeypatch.setenv("POD_NAMESPACE", "adpfleet-system")
    config = security_config(parser.parse_args(["operator", "--network-policies", "--require-api-key",
                                                "--operator-pod-labels", "a=b,c=d"]))
    assert config == SecurityConfig(OperatorIdentity("adpfleet-system", {"a": "b", "c": "d"}), True)
    assert security_config(parser.parse_args(["operator"])) == SecurityConfig()
    with pytest.raises(ValueError, match="--operator-pod-labels"):
        security_config(parser.parse_args(["operator", "--network-policies"]))
    with pytest.raises(ValueError, match="K=V"):
        security_config(parser.parse_args(["operator", "--network-policies", "--operator-pod-labels", "a"]))


def test_the_env_names_are_the_ones_the_runtime_reads():
    """The operator cannot import the runtime (its image has no torch); the names must still agree."""
    from adpfleet.operator.resource.names import RESERVED_ENV
    from adpfleet.runtime.serving import auth
    from adpfleet.contract.env import FAULT_INJECTION_ENV
    assert (security.API_KEY_ENV, security.INTERNAL_TOKEN_ENV, security.FAULT_INJECTION_ENV) == (
        auth.API_KEY_ENV, auth.INTERNAL_TOKEN_ENV, FAULT_INJECTION_ENV)
    assert set(RESERVED_ENV) == {auth.API_KEY_ENV, auth.INTERNAL_TOKEN_ENV, FAULT_INJECTION_ENV, "VLLM_API_KEY"}
