"""The local control plane: etcd, kube-apiserver, kube-controller-manager and the node agent,
each a process in its own group, all bound to 127.0.0.1, all state in one directory.

    <state>/state.json     ports and the process record of each component
    <state>/kubeconfig     the admin kubeconfig handed to the user (certificates embedded)
    <state>/logs/*.log     one log per component
    <state>/pki/           CA, serving and client certificates, service-account key pair
    <state>/etcd/          etcd's data
    <state>/agent/         the node agent's pod directories (volumes, logs, working directories)

`up` is idempotent: it keeps what is healthy, restarts what died (saying so) and fails with the
reason when something cannot start. `down` stops everything (pod processes included) and removes
the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from adpfleet.cluster import kubeconfig, processes
from adpfleet.cluster.binaries import Binaries, ensure_binaries, kubernetes_version
from adpfleet.cluster.pki import PKI, CertPair

HOST = "127.0.0.1"
NODE_NAME = "adpfleet-node"
POD_MARKER_ENV = "ADPFLEET_CLUSTER"  # set in every pod process to the agent's state directory
# 2: a component's record is its pid, start ticks and command line (processes.ProcessRecord).
# 1 recorded psutil's create_time (wall clock): read by migrating its records (_migrate_v1_records).
STATE_VERSION = 2
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# Cloud and node-IPAM controllers have nothing to do on one loopback node. Pod addresses are
# loopback addresses, which the API server refuses in Endpoints and EndpointSlices: their controllers
# would only retry and warn about every Service, so they do not run (the node agent answers
# headless Service names through each pod's /etc/hosts instead).
CONTROLLERS = ",".join(["*", "-node-ipam-controller", "-cloud-node-lifecycle-controller", "-node-route-controller",
                        "-service-lb-controller", "-endpoints-controller", "-endpointslice-controller",
                        "-endpointslice-mirroring-controller"])
# How often the PersistentVolume binder looks again at unbound claims (upstream: 15 s). It binds a
# claim the moment it sees it, but a claim created just before its volume waits for this pass.
PV_BINDER_SYNC_PERIOD = "2s"
# Client certificates: file stem -> (user, group). system:masters bypasses RBAC, which the node
# agent (binding, status, tokens for every pod) and the admin need; the controller manager gets
# its own identity, which the default RBAC policy already authorises.
CLIENTS = {
    "admin": ("adpfleet-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "node-agent": (f"system:node:{NODE_NAME}", "system:masters"),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
}


class ClusterError(RuntimeError):
    """Something the user must fix; the message says what and how."""


def default_state_dir() -> Path:
    if "ADPFLEET_CLUSTER_DIR" in os.environ:
        return Path(os.environ["ADPFLEET_CLUSTER_DIR"])
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "adpfleet" / "cluster"


@dataclass
class ComponentStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    detail: str
    log: Path


@dataclass
class UpReport:
    kubeconfig: Path
    server: str
    state_dir: Path
    binaries: Binaries
    started: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    apiserver_ready_s: float | None = None


@dataclass
class _Component:
    name: str
    argv: Callable[[], list[str]]
    health: Callable[[], str | None]  # None when healthy, else what is not yet right
    timeout: float
    port_keys: tuple[str, ...] = ()


class ControlPlane:
    def __init__(self, state_dir: Path | None = None, *, apiserver_port: int = 0,
                 agent_args: list[str] | None = None):
        """`agent_args`: extra node-agent arguments; None keeps those of the running cluster."""
        self.dir = (state_dir or default_state_dir()).resolve()
        self.requested_apiserver_port = apiserver_port
        self.requested_agent_args = agent_args
        self.pki = PKI(self.dir / "pki")
        self.kubeconfig = self.dir / "kubeconfig"
        self.state_file = self.dir / "state.json"
        self.logs = self.dir / "logs"
        self.agent_dir = self.dir / "agent"
        self.state: dict = {}
        self.binaries: Binaries | None = None
        self.components = [
            _Component("etcd", self._etcd_argv, self._etcd_health, 30, ("etcd", "etcd_peer")),
            _Component("kube-apiserver", self._apiserver_argv, self._apiserver_health, 90, ("apiserver",)),
            _Component("kube-controller-manager", self._kcm_argv, self._kcm_health, 60, ("controller_manager",)),
            _Component("node-agent", self._agent_argv, self._agent_health, 60, ("agent",)),
        ]

    # ---- the three commands ----

    def up(self) -> UpReport:
        with self._locked():
            self.binaries = ensure_binaries()
            self._load_state(for_up=True)
            self.pki.ensure(CLIENTS)
            self.pki.issue_server(self.pki.client("node-agent-serving"), NODE_NAME, [HOST])
            self._assign_ports()
            self._write_kubeconfigs()
            report = UpReport(self.kubeconfig, self.server, self.dir, self.binaries)
            self._apply_agent_args(report)
            for component in self.components:
                self._ensure_running(component, report)
            return report

    def down(self) -> list[str]:
        """Stop every process of this cluster and remove its state directory. Returns what it did."""
        done: list[str] = []
        if not self.dir.exists():
            return [f"no local cluster at {self.dir}; nothing to do", *_clusters_elsewhere()]
        with self._locked():
            with contextlib.suppress(ClusterError):
                self._load_state(for_up=False)
            records = self.state.get("components", {})
            for component in reversed(self.components):
                done += self._stop_component(component.name, records.get(component.name))
                if component.name == "node-agent":
                    done += self._stop_pods()  # after the agent, which would restart them
            done += self._stop_strays()
            done += self._remove_mountpoints()
        shutil.rmtree(self.dir, ignore_errors=True)
        done.append(f"removed {self.dir}")
        return done

    def status(self) -> list[ComponentStatus]:
        self._load_state(for_up=False)
        records = self.state.get("components", {})
        result = []
        for component in self.components:
            record = _record(records.get(component.name))
            running = bool(record and record.alive())
            problem = component.health() if running else "not running"
            result.append(ComponentStatus(component.name, record.pid if record else None, running,
                                          running and problem is None, problem or "healthy",
                                          self._log(component.name)))
        return result

    # ---- state ----

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.state['ports']['apiserver']}"

    @contextlib.contextmanager
    def _locked(self):
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ClusterError(f"another `adpfleet cluster` command is working on {self.dir}; "
                                   "wait for it to finish") from None
            yield

    def _load_state(self, *, for_up: bool) -> None:
        if not self.state_file.exists():
            self.state = {}
            if not self.dir.exists() and not for_up:
                raise ClusterError(f"no local cluster at {self.dir}; start one with `adpfleet cluster up`"
                                   + "".join(f"\n{line}" for line in _clusters_elsewhere()))
            return
        try:
            self.state = json.loads(self.state_file.read_text())
        except (OSError, ValueError) as exc:
            raise ClusterError(f"the state file {self.state_file} is unreadable ({exc}); "
                               "remove the stale cluster with `adpfleet cluster down`, then `up` again") from None
        if self.state.get("version") == 1:
            self._migrate_v1_records()
        if for_up and self.state.get("version") != STATE_VERSION:
            raise ClusterError(f"{self.dir} was written by another adpfleet version (state version "
                               f"{self.state.get('version')}, expected {STATE_VERSION}); "
                               "run `adpfleet cluster down` first")
        wanted = self.binaries.directory.name if (for_up and self.binaries) else None
        if wanted and self.state.get("binaries") not in (None, wanted):
            raise ClusterError(f"{self.dir} belongs to a cluster built from {self.state['binaries']}, "
                               f"but this checkout pins {wanted}; run `adpfleet cluster down` first")

    def _migrate_v1_records(self) -> None:
        """Version 1 identified a component by pid and a wall-clock start time that a clock step
        moves, so that time proves nothing. A record is kept (rewritten) only when the process at
        its pid is, by its command line, this cluster's component of that name; any other is dropped,
        and the component counts as not running (`up` starts it, or names who holds its port)."""
        records = self.state.get("components", {})
        for name, raw in list(records.items()):
            with contextlib.suppress(ProcessLookupError):
                record = processes.ProcessRecord.of(raw["pid"])
                if self._component_of(record.cmdline) == name:
                    records[name] = record.to_json()
                    continue
            del records[name]
        self.state["version"] = STATE_VERSION

    def _component_of(self, argv: tuple[str, ...] | list[str]) -> str | None:
        """Which of this cluster's components a command line runs, if any: the program, and flags
        that name this state directory."""
        if not argv or str(self.dir) + "/" not in " ".join(argv):
            return None
        if Path(argv[0]).name in {"etcd", "kube-apiserver", "kube-controller-manager"}:
            return Path(argv[0]).name
        return "node-agent" if "adpfleet.cluster.agent" in argv else None

    def _save_state(self) -> None:
        self.state["version"] = STATE_VERSION
        self.state["binaries"] = self.binaries.directory.name
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        tmp.replace(self.state_file)

    def _assign_ports(self) -> None:
        ports = self.state.setdefault("ports", {})
        wanted = self.requested_apiserver_port
        if wanted and ports.get("apiserver") not in (None, wanted):
            raise ClusterError(f"the cluster in {self.dir} already uses apiserver port {ports['apiserver']}, "
                               f"not {wanted}; run `adpfleet cluster down` to change it")
        if wanted:
            ports["apiserver"] = wanted
        for key in ("etcd", "etcd_peer", "apiserver", "controller_manager", "agent"):
            ports.setdefault(key, processes.free_port(HOST))
        self._save_state()

    def _apply_agent_args(self, report: UpReport) -> None:
        """New agent arguments restart the agent (pods keep running; the new agent adopts them)."""
        wanted = self.requested_agent_args
        if wanted is None or wanted == self.state.get("agent_args", []):
            return
        record = _record(self.state.get("components", {}).get("node-agent"))
        if record and record.alive():
            processes.stop_group(record.pid, grace=10)
            report.notes.append(f"restarting the node agent with arguments {wanted} "
                                f"(was {self.state.get('agent_args', [])}); pods keep running")
            del self.state["components"]["node-agent"]
        self.state["agent_args"] = list(wanted)
        self._save_state()

    def _write_kubeconfigs(self) -> None:
        kubeconfig.write(self.kubeconfig, self.server, self.pki.ca.cert, self.pki.client("admin"), embed=True)
        for stem in ("controller-manager", "node-agent"):
            kubeconfig.write(self.dir / f"{stem}.kubeconfig", self.server, self.pki.ca.cert,
                             self.pki.client(stem), embed=False)

    def _log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    # ---- starting ----

    def _ensure_running(self, component: _Component, report: UpReport) -> None:
        records = self.state.setdefault("components", {})
        record = _record(records.get(component.name))
        if record and record.alive():
            self._wait_healthy(component, record, report)
            return
        if record:
            report.notes.append(f"{component.name} (pid {record.pid}) was not running; restarted it. "
                                f"Its log {self._log(component.name)} ended with:\n"
                                f"{processes.log_tail(self._log(component.name), 5)}")
        for key in component.port_keys:
            port = self.state["ports"][key]
            owner = processes.port_owner(HOST, port)
            if owner:
                raise ClusterError(
                    f"cannot start {component.name}: port {HOST}:{port} ({key}) is in use by {owner}. "
                    f"Stop that process, or run `adpfleet cluster down` and `up` again to pick new ports.")
        started = time.monotonic()
        record = processes.spawn(component.argv(), self._log(component.name))
        records[component.name] = record.to_json()
        self._save_state()
        report.started.append(component.name)
        self._wait_healthy(component, record, report)
        if component.name == "kube-apiserver":
            report.apiserver_ready_s = time.monotonic() - started

    def _wait_healthy(self, component: _Component, record: processes.ProcessRecord, report: UpReport) -> None:
        deadline = time.monotonic() + component.timeout
        while (problem := component.health()) is not None:
            if not record.alive():
                raise ClusterError(
                    f"{component.name} exited during start-up. The end of {self._log(component.name)}:\n"
                    f"{processes.log_tail(self._log(component.name))}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{component.name} (pid {record.pid}) is not healthy after {component.timeout:.0f} s: "
                    f"{problem}. The end of {self._log(component.name)}:\n"
                    f"{processes.log_tail(self._log(component.name))}")
            time.sleep(0.1)

    # ---- stopping ----

    def _stop_component(self, name: str, raw: dict | None) -> list[str]:
        record = _record(raw)
        if record and record.alive():
            processes.stop_group(record.pid, grace=10)
            return [f"stopped {name} (pid {record.pid})"]
        return []

    def _stop_pods(self) -> list[str]:
        pods = processes.processes_with_env(POD_MARKER_ENV, str(self.agent_dir))
        groups = {pgid for p in pods if (pgid := _pgid_or_none(p.pid))}
        processes.stop_groups(groups, grace=5)
        return [f"stopped {len(groups)} pod container(s)"] if groups else []

    def _stop_strays(self) -> list[str]:
        """Components whose record was lost (a corrupt state.json): their flags name the directory."""
        done = []
        for proc in processes.psutil.process_iter(["pid", "cmdline"]):
            argv = proc.info["cmdline"] or []
            if self._component_of(argv) and proc.pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    processes.stop_group(os.getpgid(proc.pid), grace=5)
                    done.append(f"stopped stray pid {proc.pid} ({' '.join(argv)[:80]})")
        return done

    def _remove_mountpoints(self) -> list[str]:
        """The files and empty directories the agent created on the host as pod mount points (see docs)."""
        listing = self.agent_dir / "created-mountpoints"
        if not listing.exists():
            return []
        if _other_clusters_running(str(self.agent_dir)):
            return [f"kept the mount points in {listing}: another local cluster's pods may use them"]
        removed = 0
        for path in sorted(set(listing.read_text().split("\n")) - {""}, key=len, reverse=True):
            with contextlib.suppress(OSError):
                # A file mount point (e.g. /dev/termination-log) is ours whatever a host process wrote
                # into it; a directory may have received someone's data: only an empty one goes.
                if os.path.isfile(path) and not os.path.islink(path):
                    os.unlink(path)
                else:
                    os.rmdir(path)
                removed += 1
        return [f"removed {removed} mount points"] if removed else []

    # ---- the components ----

    def _etcd_argv(self) -> list[str]:
        p = self.state["ports"]
        client, peer = f"http://{HOST}:{p['etcd']}", f"http://{HOST}:{p['etcd_peer']}"
        return [str(self.binaries.etcd), "--name=adpfleet", f"--data-dir={self.dir}/etcd",
                f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=adpfleet={peer}",
                # A development cluster: fsync dominates etcd latency and a power cut may lose it.
                "--unsafe-no-fsync=true", "--log-level=warn"]

    def _etcd_health(self) -> str | None:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.state['ports']['etcd']}/health", timeout=2) as r:
                body = json.loads(r.read())
            return None if body.get("health") == "true" else f"/health says {body}"
        except (OSError, ValueError) as exc:
            return f"/health unreachable ({exc})"

    def _apiserver_argv(self) -> list[str]:
        p, pki = self.state["ports"], self.pki
        kubelet_client = pki.client("apiserver-kubelet-client")
        return [str(self.binaries.kube_apiserver),
                f"--etcd-servers=http://{HOST}:{p['etcd']}",
                f"--bind-address={HOST}", f"--advertise-address={HOST}", f"--secure-port={p['apiserver']}",
                f"--tls-cert-file={pki.apiserver.cert}", f"--tls-private-key-file={pki.apiserver.key}",
                f"--client-ca-file={pki.ca.cert}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--authorization-mode=RBAC",
                # `kubectl logs` reaches the node agent's log endpoint like a kubelet's.
                f"--kubelet-client-certificate={kubelet_client.cert}",
                f"--kubelet-client-key={kubelet_client.key}",
                f"--kubelet-certificate-authority={pki.ca.cert}",
                "--kubelet-preferred-address-types=InternalIP",
                "--allow-privileged=true",
                # No kube-proxy: the `kubernetes` Service needs no endpoints (and loopback ones
                # would be rejected); pods get KUBERNETES_SERVICE_HOST=127.0.0.1 instead.
                "--endpoint-reconciler-type=none",
                "--profiling=false"]

    def _https_ok(self, url: str, *, verify: bool = True, client: CertPair | None = None) -> str | None:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        if not verify:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if client:
            ctx.load_cert_chain(str(client.cert), str(client.key))
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                return None if r.status == 200 else f"{url} answered {r.status}"
        except urllib.error.HTTPError as exc:
            return f"{url} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except OSError as exc:
            return f"{url} unreachable ({exc})"

    def _apiserver_health(self) -> str | None:
        return self._https_ok(f"{self.server}/readyz", client=self.pki.client("admin"))

    def _kcm_argv(self) -> list[str]:
        p, pki, kc = self.state["ports"], self.pki, self.dir / "controller-manager.kubeconfig"
        return [str(self.binaries.kube_controller_manager),
                f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
                f"--bind-address={HOST}", f"--secure-port={p['controller_manager']}",
                f"--cert-dir={self.dir}/controller-manager",
                "--leader-elect=false", "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca.cert}",
                f"--cluster-signing-cert-file={pki.ca.cert}", f"--cluster-signing-key-file={pki.ca.key}",
                f"--controllers={CONTROLLERS}", f"--pvclaimbinder-sync-period={PV_BINDER_SYNC_PERIOD}"]

    def _kcm_health(self) -> str | None:
        port = self.state["ports"]["controller_manager"]
        problem = self._https_ok(f"https://{HOST}:{port}/healthz", verify=False)  # self-signed serving cert
        # Pods are refused until the default service account exists: wait for it, so that
        # `kubectl run` works the moment `up` returns.
        return problem or self._https_ok(f"{self.server}/api/v1/namespaces/default/serviceaccounts/default",
                                         client=self.pki.client("admin"))

    def _agent_argv(self) -> list[str]:
        serving = self.pki.client("node-agent-serving")
        return [sys.executable, "-m", "adpfleet.cluster.agent",
                f"--kubeconfig={self.dir / 'node-agent.kubeconfig'}", f"--state-dir={self.agent_dir}",
                f"--node-name={NODE_NAME}", f"--port={self.state['ports']['agent']}",
                f"--serving-cert={serving.cert}", f"--serving-key={serving.key}",
                f"--client-ca={self.pki.ca.cert}", f"--kubelet-version=v{kubernetes_version()}",
                *self.state.get("agent_args", [])]

    def _agent_health(self) -> str | None:
        return self._https_ok(f"https://{HOST}:{self.state['ports']['agent']}/healthz",
                              client=self.pki.client("apiserver-kubelet-client"))


def running_clusters() -> list[Path]:
    """The state directories of the local clusters whose node agent runs on this machine (found by
    the agent's `--state-dir=<cluster>/agent`), so that a command aimed at the wrong directory can
    say where they are."""
    found = set()
    for proc in processes.psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if "adpfleet.cluster.agent" in argv:
            found |= {Path(a.removeprefix("--state-dir=")).parent for a in argv if a.startswith("--state-dir=")}
    return sorted(found)


def _clusters_elsewhere() -> list[str]:
    return [f"  a local cluster runs in {d}: `adpfleet cluster status --state-dir {shlex.quote(str(d))}`"
            for d in running_clusters()]


def _record(raw: dict | None) -> processes.ProcessRecord | None:
    return processes.ProcessRecord.from_json(raw) if raw else None


def _pgid_or_none(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _other_clusters_running(own: str) -> bool:
    for proc in processes.psutil.process_iter():
        with contextlib.suppress(processes.psutil.Error):
            value = proc.environ().get(POD_MARKER_ENV)
            if value and value != own:
                return True
    return False
