"""Where the servers are: a static list of URLs, or the fleet's pods watched in Kubernetes.

Kubernetes discovery (the operator starts the router this way): pods matching a label selector in
one namespace; a pod is a server when it has an IP, its Ready condition is True, it is not being
deleted, it carries the role label, and it is not marked for drain. A list, then a watch from
the list's resourceVersion; any error (410 Gone included) means list again, so a drained or
deleted pod leaves the router's pool as soon as the API server reports it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable

from adpfleet.runtime.router.pool import ROLES, Endpoint, normalize_url

log = logging.getLogger("adpfleet.router.discovery")

ROLE_LABEL = "adpfleet.io/role"
DRAIN_ANNOTATION = "adpfleet.io/drain"


def static_endpoints(context: Iterable[str] = (), generation: Iterable[str] = (),
                     aggregated: Iterable[str] = ()) -> list[Endpoint]:
    return [Endpoint(role, normalize_url(url))
            for role, urls in (("context", context), ("generation", generation), ("aggregated", aggregated))
            for url in urls]


def endpoint_from_pod(pod: dict, port: int) -> Endpoint | None:
    """The server a pod (the API's JSON form) offers for new work, or None."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return None
    if str((meta.get("annotations") or {}).get(DRAIN_ANNOTATION, "")).lower() == "true":
        return None
    role = (meta.get("labels") or {}).get(ROLE_LABEL)
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    if role not in ROLES or not ip or not ready:
        return None
    return Endpoint(role, f"http://{f'[{ip}]' if ':' in ip else ip}:{port}")


class PodSet:
    """Watch events folded into the current set of endpoints (pure)."""

    def __init__(self, port: int):
        self.port = port
        self._by_pod: dict[str, Endpoint] = {}

    def replace(self, pods: Iterable[dict]) -> bool:
        before = self.endpoints()
        self._by_pod = {}
        for pod in pods:
            self.apply("ADDED", pod)
        return self.endpoints() != before

    def apply(self, event_type: str, pod: dict) -> bool:
        """ADDED / MODIFIED / DELETED of one pod; True when the endpoint set changed."""
        meta = pod.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        old = self._by_pod.get(key)
        new = None if event_type == "DELETED" else endpoint_from_pod(pod, self.port)
        if new is None:
            self._by_pod.pop(key, None)
        else:
            self._by_pod[key] = new
        return old != new

    def endpoints(self) -> list[Endpoint]:
        return sorted(set(self._by_pod.values()))


def _api_client():
    """An explicit KUBECONFIG wins; else the pod's service account; else ~/.kube/config."""
    from kubernetes import client, config

    if os.environ.get("KUBECONFIG"):
        return config.new_client_from_config()
    try:
        config.load_incluster_config()
        return client.ApiClient()
    except config.ConfigException:
        return config.new_client_from_config()


class Relist(Exception):
    pass


class KubeDiscovery:
    """List + watch of the fleet's pods on a daemon thread; `on_change(endpoints)` is called on
    that thread with the full set after every change."""

    def __init__(self, namespace: str, selector: str, port: int, on_change: Callable[[list[Endpoint]], None], *,
                 api_client=None, core_api=None, watch_timeout_s: int = 60, retry_s: float = 1.0):
        self.namespace, self.selector = namespace, selector
        self.pods = PodSet(port)
        self.on_change = on_change
        self.watch_timeout_s, self.retry_s = watch_timeout_s, retry_s
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._resp = None
        self._api_client, self.core = api_client, core_api
        self._thread = threading.Thread(target=self._run, name="kube-discovery", daemon=True)

    def start(self) -> "KubeDiscovery":
        if self.core is None:
            from kubernetes import client
            self.core = client.CoreV1Api(self._api_client or _api_client())
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        resp = self._resp
        if resp is not None:
            try:
                resp.close()
            except Exception:  # noqa: BLE001 - closing from another thread may race the reader
                pass
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._list()
                while not self._stop.is_set():
                    version = self._watch(version)
            except Exception as e:  # noqa: BLE001 - any failure: list again after a pause
                if self._stop.is_set():
                    return
                log.warning("pod watch in %s (%s) failed, listing again: %s", self.namespace, self.selector, e)
                self._stop.wait(self.retry_s)

    def _list(self) -> str:
        resp = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector,
                                             _preload_content=False, _request_timeout=30)
        body = json.loads(resp.data)
        if self.pods.replace(body.get("items") or []) or not self.synced.is_set():
            self._publish()
        self.synced.set()
        return body["metadata"]["resourceVersion"]

    def _watch(self, version: str) -> str:
        from kubernetes.watch.watch import iter_resp_lines

        resp = self._resp = self.core.list_namespaced_pod(
            self.namespace, label_selector=self.selector, watch=True, resource_version=version,
            allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s, _preload_content=False,
            _request_timeout=(10, self.watch_timeout_s + 10))
        try:
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                kind, obj = event["type"], event["object"]
                if kind == "ERROR":  # 410 Gone: our version is too old
                    raise Relist(f"watch error {obj.get('code')}: {obj.get('message')}")
                version = obj["metadata"]["resourceVersion"]
                if kind != "BOOKMARK" and self.pods.apply(kind, obj):
                    self._publish()
        finally:
            self._resp = None
            resp.release_conn()
        return version

    def _publish(self) -> None:
        endpoints = self.pods.endpoints()
        log.info("servers: %s", ", ".join(f"{ep.role} {ep.url}" for ep in endpoints) or "none")
        self.on_change(endpoints)
