"""Every request the operator makes to the Kubernetes API (kopf's own watches aside), in one
place, counted and timed: the reconciler's, remediation's (drain, delete with a grace period) and
the webhook's (its token Secret). The only Secrets written are the fleets' internal tokens (created
once, never read back); the only one read is the webhook's own token.

The official client is synchronous; each call runs in a worker thread so the event loop (kopf's
watches, the other fleets, the probes) never waits on the network. Results the callers can treat
as done are folded in here: creating what already exists (the watch had not delivered it yet) and
deleting what is already gone or was replaced (uid precondition) are not errors.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from adpfleet.operator.resource import names
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.telemetry import OperatorMetrics

log = logging.getLogger("adpfleet.operator.kube")

REQUEST_TIMEOUT = (5, 30)  # connect, read: a hung request must not hang a fleet's loop forever
EVENT_MESSAGE_LIMIT = 1024  # characters of an Event's message (events.k8s.io refuses longer ones)
CONNECTION_POOL = 16        # concurrent requests to the API server (the worker threads of main.py)


@dataclass(frozen=True)
class ApiResult:
    """What one request came to: `ok` also for the codes the caller treats as done."""
    ok: bool
    code: int = 200
    message: str = ""
    body: dict | None = None


def load_api_client() -> client.ApiClient:
    """In-cluster credentials when running in a pod, else the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
        configuration = client.Configuration.get_default_copy()
    except config.ConfigException:
        configuration = client.Configuration()
        config.load_kube_config(client_configuration=configuration)
    configuration.connection_pool_maxsize = CONNECTION_POOL
    return client.ApiClient(configuration)


def require_crd(api_client: client.ApiClient) -> None:
    """Refuse to start without the InferenceFleet API: kopf would otherwise run and serve nothing,
    and not notice the CRD arriving later. Discovery needs no permission beyond being signed in."""
    groups = client.ApisApi(api_client).get_api_versions(_request_timeout=REQUEST_TIMEOUT).groups or []
    versions = {v.version for g in groups if g.name == names.GROUP for v in g.versions}
    if names.VERSION not in versions:
        raise ValueError(f"the API server does not serve {names.API_VERSION} ({names.KIND}): install the CRD "
                         f"first, e.g. `adpfleet crds | kubectl apply --server-side -f -` (the Helm chart "
                         f"installs it from its crds/ directory)")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    """A MicroTime (a Lease's acquireTime and renewTime)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")




class KubeApi:
    """The operator's requests; each returns an `ApiResult` and never raises."""

    def __init__(self, api_client: client.ApiClient, metrics: OperatorMetrics):
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.metrics = metrics

    async def _call(self, verb: str, resource: str, fn, *args, ok_codes: tuple[int, ...] = (), **kwargs) -> ApiResult:
        start = time.monotonic()
        try:
            result = await asyncio.to_thread(fn, *args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
            code, outcome = 200, ApiResult(True, 200, body=result)
        except ApiException as exc:
            code = exc.status or 0
            outcome = ApiResult(code in ok_codes, code, _api_message(exc))
        except Exception as exc:  # noqa: BLE001 - connection errors, timeouts: reported, retried later
            code = 0
            outcome = ApiResult(False, 0, f"{type(exc).__name__}: {exc}")
        self.metrics.api_requests.labels(verb, resource, str(code)).inc()
        self.metrics.api_seconds.labels(verb).observe(time.monotonic() - start)
        return outcome

    # ---- server pods ----

    async def create_pod(self, manifest: dict) -> ApiResult:
        ns = manifest["metadata"]["namespace"]
        return await self._call("create", "pods", self.core.create_namespaced_pod, ns, manifest,
                                field_manager=names.MANAGER, ok_codes=(409,))

    async def delete_pod(self, namespace: str, name: str, uid: str, grace_seconds: int | None = None) -> ApiResult:
        """Delete that pod (uid precondition: a replacement of the same name is left alone), with its
        own termination grace period unless `grace_seconds` says otherwise."""
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid),
                                      grace_period_seconds=grace_seconds)
        return await self._call("delete", "pods", self.core.delete_namespaced_pod, name, namespace, body=body,
                                ok_codes=(404, 409))

    async def set_drain(self, namespace: str, name: str, uid: str, drain: bool) -> ApiResult:
        """Set (or remove) the drain annotation the router reads; metadata.uid in the patch is a
        precondition, so a replacement with the same name is left alone."""
        body = {"metadata": {"uid": uid, "annotations": {names.ANNOTATION_DRAIN: "true" if drain else None}}}
        return await self._call("patch", "pods", self.core.patch_namespaced_pod, name, namespace, body,
                                ok_codes=(404,))

    async def set_leaving(self, namespace: str, name: str, uid: str, since: str | None) -> ApiResult:
        """Start (`since`: the time, RFC 3339) or cancel (None) a scale-down's drain of a server: the
        drain annotation the router reads and the scale-down annotation the reconcile reads, in one
        patch with metadata.uid as a precondition."""
        annotations = {names.ANNOTATION_DRAIN: "true" if since else None, names.ANNOTATION_SCALE_DOWN: since}
        body = {"metadata": {"uid": uid, "annotations": annotations}}
        return await self._call("patch", "pods", self.core.patch_namespaced_pod, name, namespace, body,
                                ok_codes=(404,))

    # ---- InferenceFleetRoles: each role's scale target ----

    async def create_role_object(self, manifest: dict) -> ApiResult:
        meta = manifest["metadata"]
        return await self._call("create", "inferencefleetroles", self.custom.create_namespaced_custom_object,
                                names.GROUP, names.VERSION, meta["namespace"], names.ROLE_PLURAL, manifest,
                                field_manager=names.MANAGER, ok_codes=(409,))

    async def patch_role_object(self, namespace: str, name: str, body: dict) -> ApiResult:
        """A merge patch of an InferenceFleetRole (its replicas and the operator's annotations);
        metadata.uid in `body` makes a replacement of the same name refuse it."""
        return await self._call("patch", "inferencefleetroles", self.custom.patch_namespaced_custom_object,
                                names.GROUP, names.VERSION, namespace, names.ROLE_PLURAL, name, body,
                                field_manager=names.MANAGER, _content_type="application/merge-patch+json")

    async def patch_role_status(self, namespace: str, name: str, status: dict) -> ApiResult:
        return await self._call("patch", "inferencefleetroles/status",
                                self.custom.patch_namespaced_custom_object_status, names.GROUP, names.VERSION,
                                namespace, names.ROLE_PLURAL, name, {"status": status},
                                field_manager=names.MANAGER, _content_type="application/merge-patch+json")

    # ---- the router's objects and the budgets: server-side apply, so fields we stop setting are removed ----

    _APPLY = {
        "ServiceAccount": ("serviceaccounts", "core", "patch_namespaced_service_account",
                           "delete_namespaced_service_account"),
        "Service": ("services", "core", "patch_namespaced_service", "delete_namespaced_service"),
        "Deployment": ("deployments", "apps", "patch_namespaced_deployment", "delete_namespaced_deployment"),
        "Role": ("roles", "rbac", "patch_namespaced_role", "delete_namespaced_role"),
        "RoleBinding": ("rolebindings", "rbac", "patch_namespaced_role_binding", "delete_namespaced_role_binding"),
        "NetworkPolicy": ("networkpolicies", "networking", "patch_namespaced_network_policy",
                          "delete_namespaced_network_policy"),
        "PodDisruptionBudget": ("poddisruptionbudgets", "policy", "patch_namespaced_pod_disruption_budget",
                                "delete_namespaced_pod_disruption_budget"),
    }

    async def apply(self, manifest: dict) -> ApiResult:
        resource, api, patch, _ = self._APPLY[manifest["kind"]]
        meta = manifest["metadata"]
        return await self._call("patch", resource, getattr(getattr(self, api), patch), meta["name"],
                                meta["namespace"], manifest, field_manager=names.MANAGER, force=True,
                                _content_type="application/apply-patch+yaml")

    async def delete_object(self, kind: str, namespace: str, name: str, uid: str) -> ApiResult:
        resource, api, _, delete = self._APPLY[kind]
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid),
                                      propagation_policy="Background")
        return await self._call("delete", resource, getattr(getattr(self, api), delete), name, namespace,
                                body=body, ok_codes=(404, 409))

    # ---- another project's custom resources (gang scheduling's PodGroups): the API may be missing ----

    async def api_served(self, group: str, version: str, plural: str) -> ApiResult:
        """Whether the API server serves `plural` in `group`/`version` (discovery, which every
        signed-in client may read): ok, or code 404 when that API is not installed."""
        out = await self._call("get", "discovery", self.custom.get_api_resources, group, version, ok_codes=(404,))
        if not out.ok or out.code == 404:
            return ApiResult(False, out.code or 0, out.message)
        served = {r.name for r in (getattr(out.body, "resources", None) or [])}
        return ApiResult(True) if plural in served else ApiResult(False, 404, f"{group}/{version} has no {plural}")

    async def apply_custom(self, group: str, version: str, plural: str, manifest: dict) -> ApiResult:
        """Server-side apply of a namespaced custom object (created when missing)."""
        meta = manifest["metadata"]
        return await self._call("patch", f"{plural}.{group}", self.custom.patch_namespaced_custom_object, group,
                                version, meta["namespace"], plural, meta["name"], manifest,
                                field_manager=names.MANAGER, force=True,
                                _content_type="application/apply-patch+yaml")

    async def delete_custom(self, group: str, version: str, plural: str, namespace: str, name: str) -> ApiResult:
        """Delete a namespaced custom object; already gone is done."""
        return await self._call("delete", f"{plural}.{group}", self.custom.delete_namespaced_custom_object, group,
                                version, namespace, plural, name, ok_codes=(404,))

    # ---- leader election (a coordination.k8s.io Lease) ----

    def _plain(self, out: ApiResult) -> dict | None:
        return self.api_client.sanitize_for_serialization(out.body) if out.ok and out.body is not None else None

    async def read_lease(self, namespace: str, name: str) -> tuple[ApiResult, dict | None]:
        """The Lease as a plain object (None when there is none yet)."""
        out = await self._call("get", "leases", self.coordination.read_namespaced_lease, name, namespace,
                               ok_codes=(404,))
        return out, self._plain(out)

    async def create_lease(self, namespace: str, name: str, spec: dict) -> tuple[ApiResult, dict | None]:
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": namespace, "labels": {names.LABEL_MANAGED_BY: names.MANAGER}},
                "spec": spec}
        out = await self._call("create", "leases", self.coordination.create_namespaced_lease, namespace, body,
                               field_manager=names.MANAGER)
        return out, self._plain(out)

    async def replace_lease(self, namespace: str, name: str, spec: dict,
                            resource_version: str) -> tuple[ApiResult, dict | None]:
        """Write the Lease as it was at `resource_version` (409 when it changed since)."""
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": name, "namespace": namespace, "resourceVersion": resource_version,
                             "labels": {names.LABEL_MANAGED_BY: names.MANAGER}},
                "spec": spec}
        out = await self._call("update", "leases", self.coordination.replace_namespaced_lease, name, namespace, body,
                               field_manager=names.MANAGER)
        return out, self._plain(out)

    # ---- the fleet ----

    async def patch_fleet_status(self, namespace: str, name: str, status: dict) -> ApiResult:
        return await self._call("patch", f"{names.PLURAL}/status", self.custom.patch_namespaced_custom_object_status,
                                names.GROUP, names.VERSION, namespace, names.PLURAL, name, {"status": status},
                                field_manager=names.MANAGER, _content_type="application/merge-patch+json")

    async def record_event(self, fleet: FleetRef, type_: str, reason: str, message: str) -> ApiResult:
        """A core/v1 Event on the fleet (what `kubectl describe ifleet` shows)."""
        now = now_rfc3339()
        event = {
            "metadata": {"name": f"{fleet.name}.{secrets.token_hex(8)}", "namespace": fleet.namespace},
            "involvedObject": {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": fleet.name,
                               "namespace": fleet.namespace, "uid": fleet.uid},
            "type": type_, "reason": reason, "message": message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": names.MANAGER}, "reportingComponent": names.MANAGER,
            "reportingInstance": names.MANAGER,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        return await self._call("create", "events", self.core.create_namespaced_event, fleet.namespace, event)

    async def create_secret(self, manifest: dict) -> ApiResult:
        """Create a Secret; one that already exists is left as it is (and is not read)."""
        return await self._call("create", "secrets", self.core.create_namespaced_secret,
                                manifest["metadata"]["namespace"], manifest, field_manager=names.MANAGER,
                                ok_codes=(409,))

    async def container_log(self, namespace: str, pod: str, container: str, tail_lines: int) -> str | None:
        """The last lines of a running container's log (a download's progress); None when unreadable."""
        out = await self._call("get", "pods/log", self.core.read_namespaced_pod_log, pod, namespace,
                               container=container, tail_lines=tail_lines)
        return out.body if out.ok and isinstance(out.body, str) else None

    async def claim_exists(self, namespace: str, name: str) -> ApiResult:
        """Whether a PersistentVolumeClaim exists: ok, or code 404 (a claim being deleted still exists)."""
        return await self._call("get", "persistentvolumeclaims", self.core.read_namespaced_persistent_volume_claim,
                                name, namespace, ok_codes=(404,))

    async def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One value of a Secret, stripped; None when the Secret or the key is missing or unreadable."""
        out = await self._call("get", "secrets", self.core.read_namespaced_secret, name, namespace, ok_codes=(404,))
        if not out.ok or out.body is None:
            return None
        data = out.body.data or {}
        if key in data:
            return base64.b64decode(data[key]).decode().strip()
        return ((out.body.string_data or {}).get(key) or "").strip() or None


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body).get("message") or exc.reason
    except Exception:  # noqa: BLE001 - not a Status object
        return f"{exc.status} {exc.reason}"
