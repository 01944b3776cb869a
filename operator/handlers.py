"""The kopf layer: which watch events matter, and where they go. No decisions here.

- indexes keep every fleet's server pods, router objects, disruption budgets and InferenceFleetRoles in memory,
  keyed (namespace, fleet),
  reduced to the small records the decisions read (`decisions/observed.py`);
- event handlers wake the loop of the fleet the event belongs to;
- one daemon per fleet runs its reconcile loop (`loops.py`), another its stall watch (`stall.py`).

kopf fills the indexes before any daemon starts, so the first pass after a (re)start already sees
every existing child and repeats nothing.
"""

from __future__ import annotations

import logging

import kopf

from adpfleet.operator.decisions import observed
from adpfleet.operator.decisions.observed import FleetObservation
from adpfleet.operator.resource import names
from adpfleet.operator.resource.names import FleetRef

FLEETS = (names.GROUP, names.VERSION, names.PLURAL)
# The router's objects, the disruption budgets and the NetworkPolicies, each with its own watch:
# (kind, group, version, plural)
OWNED_KINDS = [
    ("Deployment", "apps", "v1", "deployments"),
    ("Service", "", "v1", "services"),
    ("ServiceAccount", "", "v1", "serviceaccounts"),
    ("Role", "rbac.authorization.k8s.io", "v1", "roles"),
    ("RoleBinding", "rbac.authorization.k8s.io", "v1", "rolebindings"),
    ("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
    ("PodDisruptionBudget", "policy", "v1", "poddisruptionbudgets"),
]
SERVER_POD_LABELS = {names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_ROLE: kopf.PRESENT,
                     names.LABEL_FLEET: kopf.PRESENT}
OWNED_LABELS = {names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_FLEET: kopf.PRESENT}
POD_INDEX = "fleet_server_pods"
ROLE_OBJECTS = (names.GROUP, names.VERSION, names.ROLE_PLURAL)  # each role's scale target
ROLE_INDEX = "fleet_role_objects"


def object_index_id(plural: str) -> str:
    return f"fleet_{plural}"


def observe(body, indexes: dict) -> FleetObservation:
    """A snapshot of the fleet (its live body copied now) and of its children from the indexes."""
    meta = body.get("metadata", {})
    key = (meta.get("namespace"), meta.get("name"))

    def values(index_id: str) -> tuple:
        index = indexes[index_id]
        return tuple(index[key]) if key in index else ()

    return FleetObservation(
        name=key[1], namespace=key[0], uid=meta.get("uid", ""), generation=meta.get("generation", 0),
        resource_version=meta.get("resourceVersion", ""),
        spec=_plain(body.get("spec") or {}), status=_plain(body.get("status") or {}),
        pods=values(POD_INDEX),
        objects=tuple(o for _, _, _, plural in OWNED_KINDS for o in values(object_index_id(plural))),
        role_objects=values(ROLE_INDEX))


def fleet_logger(namespace: str, name: str, uid: str) -> logging.LoggerAdapter:
    """Our own logger with the fleet as the log line's object (kopf's per-object loggers are kept
    at WARNING: they report every event handler call)."""
    ref = {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": name, "uid": uid, "namespace": namespace}
    return _MergingAdapter(logging.getLogger("adpfleet.operator.fleet"), {"k8s_ref": ref})


class _MergingAdapter(logging.LoggerAdapter):
    """A call's own `extra` fields beside the fleet's (Python 3.11's adapter replaces them)."""

    def process(self, msg, kwargs):
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return msg, kwargs


def _plain(value):
    """A deep copy of a (possibly live) kopf view as plain dicts and lists."""
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def build_registry() -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs):  # the same credentials as the reconciler's client: in-cluster, else kubeconfig
        return kopf.login_via_client(**kwargs)

    @kopf.index("pods", labels=SERVER_POD_LABELS, id=POD_INDEX, registry=registry)
    def index_server_pod(namespace, labels, body, **_):
        return {(namespace, labels[names.LABEL_FLEET]): observed.server_pod(_plain(body))}

    @kopf.on.event("pods", labels=SERVER_POD_LABELS, registry=registry)
    def wake_for_server_pod(namespace, labels, memo, **_):
        memo.loops.wake((namespace, labels[names.LABEL_FLEET]))

    for kind, group, version, plural in OWNED_KINDS:
        _register_owned_kind(registry, kind, group, version, plural)

    @kopf.index(*ROLE_OBJECTS, labels=OWNED_LABELS, id=ROLE_INDEX, registry=registry)
    def index_role_object(namespace, labels, body, **_):
        return {(namespace, labels[names.LABEL_FLEET]): observed.role_object(_plain(body))}

    @kopf.on.event(*ROLE_OBJECTS, labels=OWNED_LABELS, id="wake_for_role_objects", registry=registry)
    def wake_for_role_object(namespace, labels, memo, **_):  # kubectl scale, an HPA, the policy
        memo.loops.wake((namespace, labels[names.LABEL_FLEET]))

    @kopf.on.event(*FLEETS, registry=registry)
    def wake_for_fleet(namespace, name, memo, **_):
        memo.loops.wake((namespace, name))

    @kopf.daemon(*FLEETS, registry=registry, cancellation_backoff=10.0, cancellation_timeout=20.0)
    async def reconcile_fleet(namespace, name, uid, body, stopped, memo, **kwargs):
        await memo.loops.run((namespace, name), lambda: observe(body, kwargs), stopped,
                             fleet_logger(namespace, name, uid))

    @kopf.daemon(*FLEETS, id="watch_for_stalls", registry=registry, cancellation_timeout=10.0)
    async def watch_for_stalls(namespace, name, uid, body, stopped, memo, **kwargs):
        """Stall detection and remediation (stall.py), beside the reconcile loop."""
        await memo.stall.run((namespace, name), FleetRef(name, namespace, uid), lambda: observe(body, kwargs),
                             stopped, fleet_logger(namespace, name, uid))

    return registry


def _register_owned_kind(registry: kopf.OperatorRegistry, kind: str, group: str, version: str, plural: str) -> None:
    resource = (group, version, plural) if group else (version, plural)

    @kopf.index(*resource, labels=OWNED_LABELS, id=object_index_id(plural), registry=registry)
    def index_owned(namespace, labels, body, **_):
        return {(namespace, labels[names.LABEL_FLEET]): observed.owned_object(kind, _plain(body))}

    @kopf.on.event(*resource, labels=OWNED_LABELS, id=f"wake_for_{plural}", registry=registry)
    def wake_for_owned(namespace, labels, memo, **_):
        memo.loops.wake((namespace, labels[names.LABEL_FLEET]))
