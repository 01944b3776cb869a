"""Tests against the real local control plane: a pytest plugin (loaded by tests/conftest.py).

Fixtures:
    k8s_cluster    one control plane + node agent for the whole session (`LocalCluster`), checked
                   before each test module that uses it: a component an earlier test killed is
                   brought back, or the module fails with that component's log
    k8s_namespace  a fresh namespace per test (its default service account exists), deleted after
                   (`fresh_namespace(cluster, label)`: the same for a wider scope, e.g. a module's)
    vllm_cache_dir one vLLM cache root on the node for the session's vLLM servers (a fleet's
                   `vllm.cache.hostPath`): the first start fills it, the later ones skip that work

Helpers on `LocalCluster`: `apply` (kubectl apply of YAML text, dicts or files), `kubectl`,
`core` (the official client's CoreV1Api), `wait_for_pod`, `pod_ready`, `pod_events`; and
`wait_for`, the one way tests wait: poll with a deadline, and say what never happened.

The binaries come from tools/k8s/build.sh (built on first use, minutes); when they cannot be built
the fixture fails. A skipped Kubernetes test would be no evidence of anything.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import pytest
import yaml

from adpfleet.cluster import processes
from adpfleet.cluster.binaries import BinariesUnavailable
from adpfleet.cluster.controlplane import ClusterError, ControlPlane, UpReport

T = TypeVar("T")

# Tests want to see restarts in seconds, not the kubelet's 10 s → 5 min back-off; and extended
# resources beyond GPUs (an RDMA device plugin's, hugepages) to schedule pods that request them.
TEST_AGENT_ARGS = ["--backoff-initial=1", "--backoff-max=8", "--capacity=rdma/ib=8", "--capacity=hugepages-2Mi=1Gi"]


class WaitTimeout(AssertionError):
    pass


class ClusterRepaired(UserWarning):
    """A test module found the session cluster broken (a test before it killed a component) and the
    fixture brought it back: the warning names what was restarted, so the culprit can be found."""


def wait_for(check: Callable[[], T], *, timeout: float, what: str, interval: float = 0.1) -> T:
    """Call `check` until it returns something truthy; return that. Exceptions count as "not yet"
    (the last one is reported) so a check may simply read an object that does not exist yet."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            result = check()
            if result:
                return result
            last = result
        except Exception as exc:  # noqa: BLE001 - reported below
            last = exc
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}")
        time.sleep(interval)


def pod_ready(pod) -> bool:
    conditions = (pod.status and pod.status.conditions) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def pod_manifest(name: str, command: list[str], *, env: list[dict] | None = None, container: dict | None = None,
                 metadata: dict | None = None, **spec) -> dict:
    """A one-container pod whose POD_IP, POD_NAME and POD_NAMESPACE come from the downward API."""
    downward = [{"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                for var, path in (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"),
                                  ("POD_NAMESPACE", "metadata.namespace"))]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **(metadata or {})},
            "spec": {"terminationGracePeriodSeconds": 5, **spec,
                     "containers": [{"name": "main", "image": "ignored", "command": command,
                                     "env": downward + (env or []), **(container or {})}]}}


def http_server_pod(name: str, port: int = 8080, *, probe_period: int = 1, **kwargs) -> dict:
    """A trivial HTTP server on the pod's own address, Ready when it answers."""
    container = {"ports": [{"name": "http", "containerPort": port}],
                 "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": probe_period},
                 **kwargs.pop("container", {})}
    return pod_manifest(name, ["python3", "-m", "http.server", "--bind", "$(POD_IP)", str(port)],
                        container=container, **kwargs)


@dataclass
class LocalCluster:
    plane: ControlPlane
    report: UpReport

    @property
    def kubeconfig(self) -> Path:
        return self.plane.kubeconfig

    @property
    def kubectl_path(self) -> Path:
        return self.report.binaries.kubectl

    @property
    def api_client(self):
        if not hasattr(self, "_api_client"):
            from kubernetes import config
            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    @property
    def core(self):
        from kubernetes import client
        return client.CoreV1Api(self.api_client)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", *args], input=input,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def apply(self, manifest: str | dict | list | Path, namespace: str | None = None) -> None:
        """kubectl apply (server-side) of YAML text, a dict, a list of dicts, or a file."""
        if isinstance(manifest, Path):
            manifest = manifest.read_text()
        if isinstance(manifest, dict):
            manifest = [manifest]
        if isinstance(manifest, list):
            manifest = yaml.safe_dump_all(manifest)
        args = ["apply", "--server-side", "--field-manager=adpfleet-tests", "-f", "-"]
        self.kubectl(*args, *([f"--namespace={namespace}"] if namespace else []), input=manifest)

    def get_json(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def wait_for_pod(self, namespace: str, name: str, check: Callable = pod_ready, *, timeout: float = 30,
                     what: str | None = None):
        """Wait until `check(pod)` holds (default: Ready); returns the pod (a V1Pod)."""
        def attempt():
            pod = self.core.read_namespaced_pod(name, namespace)
            return pod if check(pod) else None
        return wait_for(attempt, timeout=timeout, what=what or f"pod {namespace}/{name} to be {check.__name__}")

    def pod_events(self, namespace: str, name: str) -> list[tuple[str, str, str]]:
        """(type, reason, message) of the Events about one pod, oldest first."""
        items = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        items.sort(key=lambda e: (e.first_timestamp or e.event_time or e.metadata.creation_timestamp))
        return [(e.type, e.reason, e.message) for e in items]

    def ensure_healthy(self) -> list[str]:
        """Bring back any component that is not running (`up` keeps what is healthy and restarts what
        died) and return what was done; fail loudly, with the component's log, if it cannot."""
        try:
            if all(s.healthy for s in self.plane.status()):
                return []
            return self.plane.up().notes
        except (ClusterError, BinariesUnavailable) as exc:
            pytest.fail(f"the local cluster in {self.plane.dir} is broken and could not be repaired: "
                        f"{exc}{self._logs_of_unhealthy(unless_in=str(exc))}", pytrace=False)

    def _logs_of_unhealthy(self, unless_in: str) -> str:
        with contextlib.suppress(ClusterError):
            return "".join(f"\n{s.name}: {s.detail}. The end of {s.log}:\n{processes.log_tail(s.log)}"
                           for s in self.plane.status() if not s.healthy and str(s.log) not in unless_in)
        return ""

    def wait_for_pod_gone(self, namespace: str, name: str, *, timeout: float = 30) -> None:
        from kubernetes.client.exceptions import ApiException

        def gone() -> bool:
            try:
                self.core.read_namespaced_pod(name, namespace)
                return False
            except ApiException as exc:
                return exc.status == 404
        wait_for(gone, timeout=timeout, what=f"pod {namespace}/{name} to be deleted")


def start_cluster(state_dir: Path, agent_args: list[str] | None = None) -> LocalCluster:
    plane = ControlPlane(state_dir, agent_args=TEST_AGENT_ARGS if agent_args is None else agent_args)
    try:
        report = plane.up()
    except Exception:
        plane.down()
        raise
    return LocalCluster(plane, report)


_SESSION_CLUSTER = pytest.StashKey[LocalCluster]()


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config):
    cluster = start_cluster(tmp_path_factory.mktemp("k8s"))
    pytestconfig.stash[_SESSION_CLUSTER] = cluster
    yield cluster
    del pytestconfig.stash[_SESSION_CLUSTER]
    # `down` removes the state directory; pytest keeps its last few base directories, logs included.
    shutil.copytree(cluster.plane.logs, tmp_path_factory.getbasetemp() / "k8s-logs", dirs_exist_ok=True)
    cluster.plane.down()


@pytest.fixture(scope="session")
def vllm_cache_dir(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Path:
    """The directory every vLLM server of the session has as its cache root, as a fleet's
    `vllm.cache` gives its restarted servers (docs/operator.md, "vLLM fleets"): vLLM writes it
    atomically, so servers starting together share it safely. Under pytest-xdist, one for all the
    workers (their base directories share a parent)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if hasattr(pytestconfig, "workerinput") else base) / "vllm-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="module", autouse=True)
def _k8s_cluster_healthy_for_each_module(request: pytest.FixtureRequest):
    """A test that kills a component of the shared cluster must not leave the modules after it to
    time out: before a module that uses the (already started) session cluster, check it and repair it."""
    cluster = request.config.stash.get(_SESSION_CLUSTER, None)
    module_items = (item for item in request.session.items if getattr(item, "module", None) is request.module)
    if cluster is None or not any("k8s_cluster" in item.fixturenames for item in module_items):
        return
    for note in cluster.ensure_healthy():
        warnings.warn(ClusterRepaired(f"before {request.module.__name__}: {note}"), stacklevel=1)


@contextlib.contextmanager
def fresh_namespace(cluster: LocalCluster, label: str):
    """A new namespace named after `label` (its default service account exists), deleted on exit."""
    from kubernetes import client

    base = re.sub(r"[^a-z0-9-]+", "-", label.lower()).strip("-")[:48].strip("-")
    name = f"{base}-{secrets.token_hex(3)}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # Pods are refused until the controller manager has created the namespace's default account.
    wait_for(lambda: cluster.core.read_namespaced_service_account("default", name), timeout=30,
             what=f"the default service account in {name}")
    yield name
    cluster.core.delete_namespace(name)  # finishes in the background: the next test need not wait


@pytest.fixture
def k8s_namespace(k8s_cluster: LocalCluster, request: pytest.FixtureRequest):
    with fresh_namespace(k8s_cluster, request.node.name) as name:
        yield name
