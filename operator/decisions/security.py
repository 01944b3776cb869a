"""A fleet's credentials and network isolation, as plain manifests (docs/security.md).

- The **internal token**: a Secret per fleet, `<fleet>-internal-token`, that the operator creates
  once with a random value (owned by the fleet, so it goes with it). The router and every server
  get it as `ADPFLEET_INTERNAL_TOKEN` through `secretKeyRef`; the operator never reads it back.
- The **API key**: the Secret key `spec.auth.apiKeySecret` names, given to the router and the
  servers as `ADPFLEET_API_KEY` through `secretKeyRef`. The kubelet resolves both: a missing Secret
  or key keeps the container in CreateContainerConfigError, which the fleet's status reports.
- **Fault injection** (`ADPFLEET_FAULT_INJECTION`) is always set, from spec.faultInjection, so that
  no envFrom source can turn it on.
- **NetworkPolicies** (with the operator's `--network-policies`): the servers' HTTP port only from
  the fleet's router pods, the operator's pods and the monitoring namespaces; the context servers'
  KV ports only from the fleet's generation servers; the router's port from `spec.networkPolicy`'s
  clients (anyone when none are named).
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass, field

from adpfleet.contract.env import API_KEY_ENV, FAULT_INJECTION_ENV, INTERNAL_TOKEN_ENV
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

INTERNAL_TOKEN_KEY = "token"
NAMESPACE_LABEL = "kubernetes.io/metadata.name"  # set by the API server on every namespace


@dataclass(frozen=True)
class OperatorIdentity:
    """How NetworkPolicies recognise the operator's own pods (it scrapes every server's /metrics)."""
    namespace: str
    pod_labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SecurityConfig:
    """The operator's own security settings (its command line), applied to every fleet."""
    network_policies: OperatorIdentity | None = None  # None: no NetworkPolicies
    require_api_key: bool = False


def internal_token_secret_name(fleet: str) -> str:
    return f"{fleet}-internal-token"


def internal_token_secret(fleet: FleetRef, token: str | None = None) -> dict:
    """The fleet's internal token Secret, with a fresh random token unless one is given."""
    token = token if token is not None else secrets.token_urlsafe(32)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": internal_token_secret_name(fleet.name), "namespace": fleet.namespace,
                         "labels": names.common_labels(fleet.name, "internal-token"),
                         "ownerReferences": [fleet.owner_reference()]},  # deleted with the fleet
            "data": {INTERNAL_TOKEN_KEY: base64.b64encode(token.encode()).decode()}}


def api_key_env(spec: FleetSpec, env_name: str = API_KEY_ENV) -> list[dict]:
    """`env_name` from the Secret key spec.auth.apiKeySecret names (nothing without one)."""
    ref = spec.auth.api_key_secret
    if ref is None:
        return []
    return [{"name": env_name, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]


def reserved_env(fleet: FleetRef, spec: FleetSpec, internal_token: bool = True) -> list[dict]:
    """The reserved names (names.RESERVED_ENV) of a router or server container: the fleet's secrets,
    and fault injection pinned to spec.faultInjection. `env` wins over `envFrom`, so a ConfigMap or
    Secret that a pod template's envFrom names (admission cannot see its keys) cannot set them.
    Without spec.auth.apiKeySecret there is no value to pin the API key to: one from envFrom can only
    make the container ask for a key (docs/security.md). `internal_token` False: a router whose
    servers check only the API key (vLLM) is given no internal token, so it forwards the client's key."""
    env = [{"name": INTERNAL_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": internal_token_secret_name(fleet.name), "key": INTERNAL_TOKEN_KEY}}}] if internal_token else []
    env += api_key_env(spec)
    return env + [{"name": FAULT_INJECTION_ENV, "value": "1" if spec.fault_injection else "0"}]


def with_credentials(pod_spec: dict, container: str, env: list[dict]) -> dict:
    """`pod_spec` with the credentials `env` (and the other reserved names) in the environment of its
    main `container` (not in a pod template's other containers)."""
    return {**pod_spec, "containers": [{**c, "env": list(c.get("env", [])) + env} if c.get("name") == container else c
                                       for c in pod_spec["containers"]]}


def secret_fields(fleet: str, spec: FleetSpec) -> dict[str, str]:
    """Secret name -> what names it (to say where a Secret a pod cannot find comes from)."""
    out = {internal_token_secret_name(fleet): "the fleet's internal token, created by the operator"}
    if spec.model.token_secret_ref:
        out[spec.model.token_secret_ref.name] = "spec.model.tokenSecretRef"
    if spec.model.credentials_secret_ref:
        out[spec.model.credentials_secret_ref.name] = "spec.model.credentialsSecretRef"
    if spec.auth.api_key_secret:
        out[spec.auth.api_key_secret.name] = "spec.auth.apiKeySecret"
    return out


# ---- NetworkPolicies ----

def _role_pods(fleet: str, role: str | None) -> dict:
    labels = {names.LABEL_FLEET: fleet, names.LABEL_MANAGED_BY: names.MANAGER}
    if role:
        return {"matchLabels": {**labels, names.LABEL_ROLE: role}}
    return {"matchLabels": labels, "matchExpressions": [{"key": names.LABEL_ROLE, "operator": "Exists"}]}


def _namespace(name: str) -> dict:
    return {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: name}}}


def _client_peers(spec: FleetSpec) -> list[dict]:
    """The peers `spec.networkPolicy` names as clients; [] means anyone."""
    np = spec.network_policy
    return [_namespace(ns) for ns in np.client_namespaces] + [{"ipBlock": {"cidr": c}} for c in np.client_cidrs]


def _policy(fleet: FleetRef, suffix: str, pod_selector: dict, ingress: list[dict]) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{fleet.name}-{suffix}", "namespace": fleet.namespace,
                         "labels": names.common_labels(fleet.name, "network-policy"),
                         "ownerReferences": [fleet.owner_reference()]},
            "spec": {"podSelector": pod_selector, "policyTypes": ["Ingress"], "ingress": ingress}}


def network_policies(fleet: FleetRef, spec: FleetSpec, operator: OperatorIdentity) -> list[dict]:
    """The fleet's NetworkPolicies (Ingress only: what the fleet's pods connect to is left alone)."""
    http = [{"port": names.SERVER_HTTP_PORT, "protocol": "TCP"}]
    operator_pods = {**_namespace(operator.namespace), "podSelector": {"matchLabels": dict(operator.pod_labels)}}
    monitoring = [_namespace(ns) for ns in spec.network_policy.monitoring_namespaces]
    if spec.router.enabled:
        router_pods = {"podSelector": {"matchLabels": names.router_selector(fleet.name)}}
        server_rule = {"ports": http, "from": [router_pods, operator_pods] + monitoring}
    elif _client_peers(spec):  # no router: the clients call the servers themselves
        server_rule = {"ports": http, "from": [operator_pods] + monitoring + _client_peers(spec)}
    else:  # no router and no clients named: anyone (a rule without `from`); the API key is the gate
        server_rule = {"ports": http}
    # a context server's rank r serves its KV on SERVER_KV_PORT + r
    policies = [_policy(fleet, "servers", _role_pods(fleet.name, None), [server_rule])]
    if spec.context is not None:  # a disaggregated fleet: KV moves from context to generation servers
        kv_ports = {"port": names.SERVER_KV_PORT, "protocol": "TCP"}
        if spec.context.adp_ranks > 1:
            kv_ports["endPort"] = names.SERVER_KV_PORT + spec.context.adp_ranks - 1
        generation = {"podSelector": _role_pods(fleet.name, "generation")}
        policies.append(_policy(fleet, "kv", _role_pods(fleet.name, "context"),
                                [{"ports": [kv_ports], "from": [generation]}]))
    for role in spec.roles():
        if spec.role(role).pods_per_server > 1:
            # the pods of a server over several pods join each other: the group link, the rendezvous
            # store and the collectives' own connections (gloo and NCCL pick their ports at start)
            peers = _role_pods(fleet.name, role)
            peers["matchExpressions"] = [{"key": names.LABEL_NODE_RANK, "operator": "Exists"}]
            policies.append(_policy(fleet, f"{role}-group", peers, [{"from": [{"podSelector": peers}]}]))
    if spec.router.enabled:
        clients = _client_peers(spec)
        rule = {"ports": [{"port": names.ROUTER_HTTP_PORT, "protocol": "TCP"}], **({"from": clients} if clients else {})}
        policies.append(_policy(fleet, "router", {"matchLabels": names.router_selector(fleet.name)}, [rule]))
    return policies
