"""Running `adpfleet operator` as a real process against the session's control plane, and reading
what it did: its fleets, their pods, its /metrics, and (through the counting proxy) every API
request it made."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kubernetes import client, watch
from prometheus_client.parser import text_string_to_metric_families

from adpfleet.cluster.apiproxy import CountingProxy
from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import LocalCluster, wait_for
from adpfleet.operator.resource import names

ADPFLEET = Path(sys.executable).with_name("adpfleet")


class OperatorProcess:
    """`adpfleet operator` in a subprocess whose every API request goes through `proxy` (a
    CountingProxy, or anything else that writes a kubeconfig: partition.Relay). `name` tells the
    files (and the Lease identities) of several operators in one directory apart."""

    def __init__(self, proxy: CountingProxy, workdir: Path, scope: list[str], *, resync_seconds: float = 300,
                 extra_args: tuple[str, ...] = (), name: str = "operator",
                 extra_env: dict[str, str] | None = None):
        self.proxy = proxy
        self.name = name
        self.kubeconfig = proxy.write_kubeconfig(workdir / f"{name}.kubeconfig")
        self.scope = scope
        self.resync_seconds = resync_seconds
        self.extra_args = extra_args
        self.extra_env = dict(extra_env or {})
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.runs = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}-{self.runs}.log"

    def start(self) -> "OperatorProcess":
        self.runs += 1
        self.port = free_port()
        argv = [str(ADPFLEET), "operator", *self.scope, "--http-host", "127.0.0.1", "--http-port", str(self.port),
                "--resync-seconds", str(self.resync_seconds), *self.extra_args]
        env = {"KUBECONFIG": str(self.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(self.workdir),
               "POD_NAME": self.name, **self.extra_env}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        wait_for(lambda: self._get("/readyz")[0] == 200, timeout=60, what=f"the operator to be ready "
                 f"(log: {self.log_path})")
        return self

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, as Kubernetes does; the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._log.close()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye, no Lease handed back."""
        self.proc.kill()
        self.proc.wait()
        self._log.close()

    def role(self) -> str | None:
        """'leader' or 'standby' (leader election), None when it does not answer."""
        code, body = self._get("/readyz")
        return json.loads(body).get("role") if code == 200 else None

    def log(self) -> str:
        return "".join(p.read_text() for p in sorted(self.workdir.glob(f"{self.name}-*.log")))

    def _get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def healthz(self) -> tuple[int, dict]:
        code, body = self._get("/healthz")
        return code, json.loads(body) if code else {}

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, frozenset(labels.items())): value}"""
        code, text = self._get("/metrics")
        assert code == 200, text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def metric(self, name: str, *, since: dict[tuple, float] | None = None, **labels) -> float:
        """The sum of the samples of `name` with these labels; with `since` (an earlier `metrics()`),
        what they grew by since then (a shared operator's counters count other tests' work too)."""
        def total(samples: dict[tuple, float]) -> float:
            return sum(v for (n, ls), v in samples.items()
                       if n == name and all(dict(ls).get(k) == v2 for k, v2 in labels.items()))
        return total(self.metrics()) - (total(since) if since is not None else 0)


# ---- fleets ----

class Fleets:
    def __init__(self, cluster: LocalCluster, namespace: str):
        self.cluster = cluster
        self.ns = namespace
        self.custom = client.CustomObjectsApi(cluster.api_client)
        self.core = cluster.core

    def apply(self, manifest: dict) -> None:
        self.cluster.apply(manifest, namespace=self.ns)

    def patch_spec(self, name: str, spec_patch: dict) -> int:
        """Merge-patch the spec; the fleet's new generation."""
        body = self.custom.patch_namespaced_custom_object(names.GROUP, names.VERSION, self.ns, names.PLURAL, name,
                                                          {"spec": spec_patch})
        return body["metadata"]["generation"]

    def get(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, self.ns, names.PLURAL, name)

    def condition(self, name: str, type_: str) -> dict:
        return next((c for c in self.get(name).get("status", {}).get("conditions", []) if c["type"] == type_), {})

    def wait_ready(self, name: str, timeout: float = 60) -> dict:
        """Until Ready=True with every server Ready (AllServersReady) for the fleet's current
        generation; the fleet."""
        def ready():
            fleet = self.get(name)
            status = fleet.get("status", {})
            cond = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), {})
            return fleet if (cond.get("status") == "True" and cond.get("reason") == "AllServersReady"
                             and status.get("observedGeneration") == fleet["metadata"]["generation"]) else None
        return wait_for(ready, timeout=timeout, what=f"fleet {self.ns}/{name} to be Ready",
                        interval=0.25)

    def pods(self, fleet: str, role: str | None = None) -> list:
        selector = f"{names.LABEL_FLEET}={fleet}," + (f"{names.LABEL_ROLE}={role}" if role else names.LABEL_ROLE)
        return sorted(self.core.list_namespaced_pod(self.ns, label_selector=selector).items,
                      key=lambda p: p.metadata.name)

    def live_pods(self, fleet: str, role: str | None = None) -> list:
        return [p for p in self.pods(fleet, role) if p.metadata.deletion_timestamp is None]

    def router_url(self, fleet: str) -> str:
        """The base URL of one of the fleet's Ready routers (a pod IP: the test runs on the node)."""
        pods = self.core.list_namespaced_pod(self.ns, label_selector=",".join(
            f"{k}={v}" for k, v in names.router_selector(fleet).items())).items
        ready = [p for p in pods if pod_ready(p) and p.metadata.deletion_timestamp is None]
        assert ready, f"no Ready router pod of {fleet}"
        return f"http://{ready[0].status.pod_ip}:{names.ROUTER_HTTP_PORT}"

    def events(self, reason: str | None = None) -> list:
        items = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.kind={names.KIND}").items
        return [e for e in items if reason is None or e.reason == reason]

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, self.ns, names.PLURAL, name)

    def drop_finalizers(self) -> None:
        """Fleets left behind with no operator to finish them would hold their namespace in
        Terminating forever."""
        for fleet in self.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, self.ns,
                                                               names.PLURAL)["items"]:
            self.custom.patch_namespaced_custom_object(names.GROUP, names.VERSION, self.ns, names.PLURAL,
                                                       fleet["metadata"]["name"], {"metadata": {"finalizers": None}})

    def owned_objects(self, fleet: str) -> list[tuple[str, str]]:
        """(kind, name) of everything labelled as this fleet's (pods included)."""
        selector = f"{names.LABEL_FLEET}={fleet}"
        apps, rbac = client.AppsV1Api(self.cluster.api_client), client.RbacAuthorizationV1Api(self.cluster.api_client)
        found = []
        for kind, lister in (("Pod", self.core.list_namespaced_pod), ("Service", self.core.list_namespaced_service),
                             ("ServiceAccount", self.core.list_namespaced_service_account),
                             ("Deployment", apps.list_namespaced_deployment),
                             ("ReplicaSet", apps.list_namespaced_replica_set),
                             ("Role", rbac.list_namespaced_role), ("RoleBinding", rbac.list_namespaced_role_binding)):
            found += [(kind, o.metadata.name) for o in lister(self.ns, label_selector=selector).items]
        return found

    def resource_versions(self, fleet: str) -> dict[tuple[str, str], str]:
        """resourceVersion of the fleet and of its operator-made children (not of pods, whose status
        the node agent writes)."""
        rbac = client.RbacAuthorizationV1Api(self.cluster.api_client)
        selector = f"{names.LABEL_FLEET}={fleet}"
        out = {("InferenceFleet", fleet): self.get(fleet)["metadata"]["resourceVersion"]}
        for kind, lister in (("Service", self.core.list_namespaced_service),
                             ("ServiceAccount", self.core.list_namespaced_service_account),
                             ("Role", rbac.list_namespaced_role), ("RoleBinding", rbac.list_namespaced_role_binding)):
            for o in lister(self.ns, label_selector=selector).items:
                out[(kind, o.metadata.name)] = o.metadata.resource_version
        return out


@contextlib.contextmanager
def operators(api_proxy: CountingProxy, namespace: str, fleets: Fleets, workdir: Path, failed: Callable[[], bool]):
    """start(scope=None, **kwargs): operators watching `namespace` (or `scope`). On exit the
    namespace's fleets are deleted while they still run (they own the finalizer), then they are
    stopped; the last one's log is printed when `failed()`."""
    started: list[OperatorProcess] = []

    def start(scope: list[str] | None = None, **kwargs) -> OperatorProcess:
        op = OperatorProcess(api_proxy, workdir, scope or ["--namespace", namespace], **kwargs).start()
        started.append(op)
        return op

    try:
        yield start  # a failure in the caller's block (a fleet never Ready) is raised here: clean up all the same
    finally:
        show = failed()
        try:
            if show:
                print_pod_logs(fleets)  # the servers' and routers' side of the failure, while their pods are there
            delete_fleets(fleets, any(op.running() for op in started))
        finally:
            for op in started:
                op.stop()
            fleets.drop_finalizers()
            if started and show:
                print_log(started[-1])


def delete_fleets(fleets: Fleets, operator_running: bool) -> None:
    """Deletes the namespace's fleets; while an operator runs (it owns their finalizer), until they are gone."""
    for fleet in fleets.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, fleets.ns,
                                                             names.PLURAL)["items"]:
        fleets.delete(fleet["metadata"]["name"])
    if operator_running:
        wait_for(lambda: not fleets.custom.list_namespaced_custom_object(
            names.GROUP, names.VERSION, fleets.ns, names.PLURAL)["items"], timeout=60,
            what="the test's fleets to be deleted")


def print_pod_logs(fleets: Fleets, lines: int = 40) -> None:
    """The end of each container's log, for each pod of the namespace (as `kubectl logs --tail`)."""
    for pod in fleets.core.list_namespaced_pod(fleets.ns).items:
        for container in pod.spec.containers:
            try:
                text = fleets.core.read_namespaced_pod_log(pod.metadata.name, fleets.ns, container=container.name,
                                                           tail_lines=lines)
            except client.ApiException as e:
                text = f"(unreadable: {e.status} {e.reason})"
            print(f"---- {pod.metadata.name}/{container.name} (last {lines} lines) ----\n{text}")


def print_log(op: OperatorProcess) -> None:
    print(f"---- operator log ({op.log_path.parent}) ----\n{op.log()[-20000:]}")


def pod_ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


# ---- watching a roll ----

@dataclass(frozen=True)
class PodState:
    """One pod as an event left it: enough to tell which server (and which pod of it) it is, what
    it was built from, and whether it is Ready or being deleted."""
    name: str
    uid: str
    index: str       # the server's slot (adpfleet.io/index)
    node_rank: int   # its place in a server over several pods (0: the leader, or a one-pod server)
    template_hash: str
    ready: bool
    deleting: bool


@dataclass
class RoleSample:
    time: float
    live: int        # pods not being deleted
    ready: int       # of those, Ready
    names: tuple
    pods: tuple[PodState, ...] = ()  # every pod of the role, the ones being deleted included


@dataclass
class PodTimeline:
    """Every pod event of a fleet, as (per role) live/ready counts after each event."""
    cluster: LocalCluster
    namespace: str
    fleet: str
    samples: dict[str, list[RoleSample]] = field(default_factory=dict)
    created: list[tuple[str, str]] = field(default_factory=list)  # (name, uid) in order of appearance
    phases: dict[str, str] = field(default_factory=dict)  # uid -> the last phase seen (a deleted pod's final one)
    deleting: dict[str, float] = field(default_factory=dict)  # uid -> when its deletion was first seen
    ready_at: dict[str, float] = field(default_factory=dict)  # uid -> when it was first seen Ready
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "PodTimeline":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready_to_go = threading.Event()
        self._thread.start()
        self._ready_to_go.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        pods: dict[str, object] = {}
        selector = f"{names.LABEL_FLEET}={self.fleet},{names.LABEL_ROLE}"
        core = client.CoreV1Api(self.cluster.api_client)
        version = self._relist(core, selector, pods)
        self._ready_to_go.set()
        w = watch.Watch()
        while not self._stop.is_set():
            try:
                # the server ends each watch after a second; a read that hangs past 15 s is cut here
                for event in w.stream(core.list_namespaced_pod, self.namespace, label_selector=selector,
                                      resource_version=version, timeout_seconds=1, _request_timeout=15):
                    version = event["object"].metadata.resource_version
                    self._seen(event["type"], event["object"], pods)
                    if self._stop.is_set():
                        break
            except Exception as e:  # noqa: BLE001 - a watch cut or hung (under load, a restart): list again
                print(f"PodTimeline: the watch ended ({e!r}); listing again", flush=True)
                time.sleep(0.2)
                version = self._relist(core, selector, pods)

    def _relist(self, core, selector: str, pods: dict) -> str:
        """Every pod of the fleet as the API server lists it now (also after a watch was cut: a pod
        gone meanwhile keeps the last phase seen); the list's resource version, to watch from."""
        while True:
            try:
                listed = core.list_namespaced_pod(self.namespace, label_selector=selector)
                break
            except Exception as e:  # noqa: BLE001
                if self._stop.wait(0.5):
                    raise
                print(f"PodTimeline: listing failed ({e!r}); again", flush=True)
        for gone in pods.keys() - {p.metadata.uid for p in listed.items}:
            pods.pop(gone)
        for p in listed.items:
            self._seen("ADDED", p, pods, record=False)
        self._record(pods)  # one sample for the whole list: a partial one would count pods missing
        return listed.metadata.resource_version

    def _seen(self, kind: str, pod, pods: dict, record: bool = True) -> None:
        self.phases[pod.metadata.uid] = pod.status.phase
        if pod.metadata.deletion_timestamp is not None:
            self.deleting.setdefault(pod.metadata.uid, time.monotonic())
        if pod_ready(pod):
            self.ready_at.setdefault(pod.metadata.uid, time.monotonic())
        if kind == "DELETED":
            pods.pop(pod.metadata.uid, None)
        else:
            if pod.metadata.uid not in pods and (pod.metadata.name, pod.metadata.uid) not in self.created:
                self.created.append((pod.metadata.name, pod.metadata.uid))
            pods[pod.metadata.uid] = pod
        if record:
            self._record(pods)

    def _record(self, pods: dict) -> None:
        now = time.monotonic()
        by_role: dict[str, list] = {}
        for p in pods.values():
            by_role.setdefault(p.metadata.labels[names.LABEL_ROLE], []).append(p)
        for role, items in by_role.items():
            live = [p for p in items if p.metadata.deletion_timestamp is None]
            self.samples.setdefault(role, []).append(RoleSample(
                now, len(live), sum(pod_ready(p) for p in live), tuple(sorted(p.metadata.name for p in live)),
                tuple(sorted((_pod_state(p) for p in items), key=lambda s: s.name))))


def _pod_state(pod) -> PodState:
    labels, annotations = pod.metadata.labels or {}, pod.metadata.annotations or {}
    return PodState(pod.metadata.name, pod.metadata.uid, labels.get(names.LABEL_INDEX, ""),
                    int(labels.get(names.LABEL_NODE_RANK, "0")), annotations.get(names.ANNOTATION_TEMPLATE_HASH, ""),
                    pod_ready(pod), pod.metadata.deletion_timestamp is not None)
