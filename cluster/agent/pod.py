"""One pod bound to this node, from binding to the removal of its API object.

    address, /etc/hosts → volumes → init containers, one after another (a sidecar — an init
    container with `restartPolicy: Always` — starts, and the next one follows once it has started)
    → containers, side by side ... once every container has finished for good, the sidecars stop
    ... until the pod is deleted: stop the containers, then the sidecars in reverse order, within
    the grace period; report the final status; delete the API object (grace 0, uid precondition);
    remove the pod directory.

Status is written by one loop: anything that changes marks the pod dirty, the loop rebuilds the
whole status and patches it only when it differs from the last one written.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp
import psutil

from adpfleet.cluster.agent import hosts, podenv
from adpfleet.cluster.agent import volumes as volumes_mod
from adpfleet.cluster.agent.addresses import AddressPool
from adpfleet.cluster.agent.container import ContainerRunner, terminate_group
from adpfleet.cluster.agent.events import NOT_SUPPORTED_LOCALLY, EventRecorder, now_iso
from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi, retrying
from adpfleet.cluster.agent.node import HOST_IP
from adpfleet.cluster.agent.podenv import ContainerConfigError
from adpfleet.cluster.agent.sandbox import Emit, Launch, LogSource, PodDirectory, PodSandbox

log = logging.getLogger(__name__)
STATUS_ONLY_ANNOTATION = "adpfleet.io/node-agent"  # value "status-only": report Running/Ready, run nothing
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MIN_SIDECAR_GRACE = 2.0  # the kubelet's minimum grace, for sidecars stopped after a slow container


def pod_dir_name(pod: dict) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}_{meta['name']}_{meta['uid']}"


@dataclass
class NodeServices:
    """What the node agent lends each pod; a PodWorker never sees the agent itself."""
    api: KubeApi
    events: EventRecorder
    addresses: AddressPool
    context: podenv.NodeContext
    probe_session: aiohttp.ClientSession
    state_dir: Path                 # the agent's: pods/<pod dir>/, created-mountpoints
    backoff_initial: float
    backoff_max: float
    status_only: bool               # the agent's --status-only: every pod is status-only
    mount_problem: str | None       # why private mount namespaces are unavailable (None: they work)
    names: Callable[[], hosts.Records]  # the cluster names pods resolve (each pod's /etc/hosts)
    done: Callable[["PodWorker"], None]  # the worker has finished: its pod object is gone

    @property
    def private_mounts(self) -> bool:
        return self.mount_problem is None


class PodWorker:
    def __init__(self, node: NodeServices, pod: dict, adopted: dict[str, psutil.Process]):
        self.node, self.pod = node, pod
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        self.uid, self.name, self.namespace = meta["uid"], meta["name"], meta["namespace"]
        self.events = node.events
        self.dir = PodDirectory(node.state_dir / "pods" / pod_dir_name(pod))
        self.sandbox = PodSandbox(
            namespace=self.namespace, name=self.name, uid=self.uid, dir=self.dir,
            restart_policy=spec.get("restartPolicy", "Always"),
            grace_period=float(spec.get("terminationGracePeriodSeconds", 30)),
            backoff_initial=node.backoff_initial, backoff_max=node.backoff_max,
            private_mounts=node.private_mounts, probe_session=node.probe_session,
            prepare=self._prepare, changed=self.changed, event=self._container_events,
            ip=status.get("podIP") or "")
        self.status_only = (node.status_only
                            or (meta.get("annotations") or {}).get(STATUS_ONLY_ANNOTATION) == "status-only")
        self.start_time = status.get("startTime") or now_iso()
        self.adopted = adopted
        previous = {s["name"]: s for s in (status.get("containerStatuses") or [])
                    + (status.get("initContainerStatuses") or [])}
        self.init_runners = [ContainerRunner(self.sandbox, c, init=True, previous=previous.get(c["name"]))
                             for c in spec.get("initContainers") or []]
        self.runners = [ContainerRunner(self.sandbox, c, init=False, previous=previous.get(c["name"]))
                        for c in spec["containers"]]
        self.sidecars = [r for r in self.init_runners if r.sidecar]
        for runner in self.runners if self.init_runners else []:
            if runner.state == {"waiting": {"reason": "ContainerCreating"}}:
                runner.state = {"waiting": {"reason": "PodInitializing"}}
        self.volumes = volumes_mod.PodVolumes()
        self.ready_to_start = any(c["type"] == "PodReadyToStartContainers" and c["status"] == "True"
                                  for c in status.get("conditions") or [])
        self._conditions: dict[str, dict] = {c["type"]: c for c in status.get("conditions") or []
                                             if c["type"] in _CONDITION_ORDER}
        self._dirty = asyncio.Event()
        self._deleting = asyncio.Event()
        self._gone = False              # the API object no longer exists
        self._tasks: list[tuple[asyncio.Task, ContainerRunner]] = []  # one per container started
        self._token_refresher: asyncio.Task | None = None
        self._last_status: dict | None = None
        self._mount_warning_sent = False
        self._hosts_managed = False     # the pod has its own /etc/hosts, which refresh_hosts keeps current
        self._hosts_text: str | None = None  # what it holds now

    # ---- called by the agent ----

    def update(self, pod: dict) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self._deleting.set()

    def deleted(self) -> None:
        """The API object is gone (force deletion): stop everything now."""
        self._gone = True
        self._deleting.set()

    def changed(self) -> None:
        self._dirty.set()

    def all_runners(self) -> list[ContainerRunner]:
        return self.init_runners + self.runners

    def log_source(self, container: str, previous: bool) -> LogSource:
        """For `kubectl logs`; LookupError saying what is missing."""
        runner = next((r for r in self.all_runners() if r.name == container), None)
        if runner is None:
            raise LookupError(f"pod {self.namespace}/{self.name} has no container {container!r}")
        source = runner.log_source(previous)
        if source is None:
            raise LookupError(f"no {'previous ' if previous else ''}log for container {container!r} "
                              f"in pod {self.namespace}/{self.name}")
        return source

    @property
    def ip(self) -> str:
        return self.sandbox.ip

    def refresh_hosts(self) -> None:
        """Rewrite the pod's /etc/hosts if the cluster names it should hold have changed."""
        if not self._hosts_managed:
            return  # not set up yet (_bring_up writes it first), or the pod does without
        text = hosts.hosts_file(self.pod, self.ip, self.node.names())
        if text != self._hosts_text:
            hosts.rewrite_in_place(self.dir.hosts, text)
            self._hosts_text = text

    def _container_events(self, container: str) -> Emit:
        return lambda type_, reason, message: self.events.emit(self.pod, type_, reason, message, container)

    # ---- the pod's life ----

    async def run(self) -> None:
        status_loop = asyncio.create_task(self._status_loop())
        live = asyncio.create_task(self._live())
        self.changed()
        await self._deleting.wait()
        live.cancel()
        await asyncio.gather(live, return_exceptions=True)
        await self._stop_containers()
        await self._flush_status()
        status_loop.cancel()
        await self._remove()

    async def _live(self) -> None:
        try:
            await self._bring_up()
        except Exception:  # noqa: BLE001 - logged; deletion still stops whatever did start
            log.exception("%s/%s: starting the pod failed", self.namespace, self.name)

    async def _bring_up(self) -> None:
        self.sandbox.ip = self.node.addresses.allocate(self.uid, self.sandbox.ip or None)
        self.changed()
        if self.status_only:
            self.ready_to_start = True
            self.changed()
            return
        self.dir.path.mkdir(parents=True, exist_ok=True)
        self._hosts_managed = self.node.private_mounts and not self.pod["spec"].get("hostNetwork")
        self.refresh_hosts()
        runtime_class = self.pod["spec"].get("runtimeClassName")
        if runtime_class:
            self.events.emit(self.pod, "Warning", NOT_SUPPORTED_LOCALLY,
                             f'runtimeClassName "{runtime_class}" is ignored: containers run as plain processes '
                             "on the local node")
        await self._set_up_volumes()
        self.ready_to_start = True
        self.changed()
        if self.volumes.tokens:
            self._token_refresher = asyncio.create_task(self._refresh_tokens())
        for runner in self.init_runners:
            if not await self._initialize(runner):
                return  # it failed for good (the pod has failed), or the pod is being deleted
        main = [self._start_runner(runner) for runner in self.runners]
        if self.sidecars:
            await asyncio.wait(main)
            await self._stop_sidecars(self.sandbox.grace_period)  # the pod is done: so are its sidecars

    async def _initialize(self, runner: ContainerRunner) -> bool:
        """Run one init container until it has completed (a sidecar: until it has started)."""
        task = self._start_runner(runner)
        started = asyncio.ensure_future(runner.has_started.wait())
        # asyncio.wait, not wait_for: cancelling us (deletion) must not cancel the runner.
        await asyncio.wait([task, started] if runner.sidecar else [task], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        return runner.initialized

    def _start_runner(self, runner: ContainerRunner) -> asyncio.Task:
        task = asyncio.create_task(runner.run(self.adopted.pop(runner.name, None)))
        self._tasks.append((task, runner))
        return task

    async def _stop_sidecars(self, grace: float) -> None:
        """In reverse order of their start, like the kubelet."""
        for runner in reversed(self.sidecars):
            runner.stop(grace)
            await asyncio.gather(*(t for t, r in self._tasks if r is runner), return_exceptions=True)

    async def _set_up_volumes(self) -> None:
        delay = 1.0
        while True:
            try:
                self.volumes = await volumes_mod.materialise(self.pod, self.dir.path, self.node.api, self.fetch,
                                                             self.ip, self.node.context)
                for message in self.volumes.substituted:
                    self.events.emit(self.pod, "Warning", NOT_SUPPORTED_LOCALLY, message)
                return
            except Exception as exc:  # noqa: BLE001 - any failure here is retried, like the kubelet does
                self.events.emit(self.pod, "Warning", "FailedMount", f"MountVolume.SetUp failed: {exc}")
            await asyncio.sleep(delay)  # e.g. the namespace's kube-root-ca.crt is not published yet
            delay = min(delay * 2, 10.0)

    async def _refresh_tokens(self) -> None:
        while True:
            token = min(self.volumes.tokens, key=lambda t: t.refresh_at)
            await asyncio.sleep(max(1.0, token.refresh_at - time.time()))
            try:
                await volumes_mod.refresh_token(self.node.api, self.pod, token)
            except Exception as exc:  # noqa: BLE001 - the current token is still valid for a while
                log.warning("%s/%s: %s; retrying in 10 s", self.namespace, self.name, exc)
                token.refresh_at = time.time() + 10

    async def _stop_containers(self) -> None:
        meta = self.pod["metadata"]
        grace = float(meta.get("deletionGracePeriodSeconds", self.sandbox.grace_period))
        if self._gone:
            grace = min(grace, 2.0)  # force-deleted: the kubelet's minimum grace
        if any(r.pid and not r.finished.is_set() for r in self.all_runners()):
            self.events.emit(self.pod, "Normal", "Killing", f"Stopping pod (grace period {grace:g}s)")
        deadline = time.monotonic() + grace
        for runner in self.all_runners():
            if not runner.sidecar:
                runner.stop(grace)
        await asyncio.gather(*(t for t, r in self._tasks if not r.sidecar), return_exceptions=True)
        await self._stop_sidecars(max(deadline - time.monotonic(), MIN_SIDECAR_GRACE))
        if self._token_refresher:
            self._token_refresher.cancel()
        await asyncio.gather(*(t for t, _ in self._tasks), return_exceptions=True)
        # Processes a previous agent started whose container never got to run here.
        await asyncio.gather(*(terminate_group(p.pid, grace) for p in self.adopted.values()))

    async def _remove(self) -> None:
        if not self._gone:
            path = f"/api/v1/namespaces/{self.namespace}/pods/{self.name}"
            body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid}}
            try:
                await retrying(f"deleting {path}", lambda: self.node.api.request("DELETE", path, body=body),
                               retry_conflicts=False)
            except ApiError as exc:
                if exc.status not in (404, 409):  # gone, or another pod of that name: not ours to delete
                    log.warning("%s/%s: deleting the pod object failed: %s", self.namespace, self.name, exc)
            except Exception as exc:  # noqa: BLE001 - the next agent start finalises it
                log.warning("%s/%s: deleting the pod object failed: %s", self.namespace, self.name, exc)
        self.dir.remove()
        self.node.addresses.release(self.uid)
        self.node.done(self)

    # ---- what containers ask of their pod ----

    async def _prepare(self, container: dict) -> Launch:
        """Everything one run of `container` needs, read now (ConfigMaps and Secrets may have changed)."""
        markers = {"ADPFLEET_CLUSTER": str(self.node.state_dir), "ADPFLEET_POD_UID": self.uid,
                   "ADPFLEET_CONTAINER": container["name"]}
        env = await podenv.container_env(self.pod, container, self.ip, self.node.context, self.fetch, markers,
                                         str(self._tmpdir(container["name"])))
        argv = podenv.command_line(container, env)
        mounts = self._mounts_for(container)
        cwd = Path(container.get("workingDir") or self.dir.work)
        self._ensure_directory(cwd)
        hostname = None
        if self.node.private_mounts:
            mounts += self._pod_mounts(container)
            hostname = hosts.pod_hostname(self.pod)
            if self.pod["spec"].get("setHostnameAsFQDN") and hosts.pod_fqdn(self.pod):
                hostname = hosts.pod_fqdn(self.pod)
        return Launch(argv=argv, env=env, cwd=cwd, mounts=mounts, hostname=hostname)

    def _tmpdir(self, container: str) -> Path:
        """The container's TMPDIR: its directory in the pod's, by its short link."""
        target, link = self.dir.tmp(container), self.dir.tmp_link(container)
        target.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(target)
        return link

    def _pod_mounts(self, container: dict) -> list[dict]:
        """What the kubelet mounts into every container: the pod's /etc/hosts (unless it uses the
        host's network) and a fresh file at its terminationMessagePath."""
        mounts = []
        if not self.pod["spec"].get("hostNetwork"):
            mounts.append({"source": str(self.dir.hosts), "target": "/etc/hosts", "readOnly": False})
        message = self.dir.termination_log(container["name"])
        message.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        message.write_bytes(b"")
        target = container.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH
        self._ensure_host_path(Path(target), is_file=True)
        mounts.append({"source": str(message), "target": target, "readOnly": False})
        return mounts

    async def fetch(self, kind: str, name: str) -> dict | None:
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        try:
            return await self.node.api.get(f"/api/v1/namespaces/{self.namespace}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise ContainerConfigError(f"reading {kind} {name}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - connection trouble: the container start is retried
            raise ContainerConfigError(f"reading {kind} {name}: {exc!r}") from None

    def _ensure_directory(self, path: Path) -> None:
        if self.dir.path in path.parents or path == self.dir.path:
            path.mkdir(parents=True, exist_ok=True)
        else:
            self._ensure_host_path(path, is_file=False)

    def _ensure_host_path(self, path: Path, *, is_file: bool) -> None:
        volumes_mod.ensure_host_path(path, is_file=is_file, ledger=self.node.state_dir / "created-mountpoints")

    def _mounts_for(self, container: dict) -> list[dict]:
        mounts = []
        for vm in container.get("volumeMounts") or []:
            source = self.volumes.paths.get(vm["name"])
            if source is None:
                raise ContainerConfigError(f"volumeMount {vm['name']!r}: the pod has no such volume")
            if vm.get("subPath"):
                source = source / vm["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)  # like the kubelet: a missing subPath becomes a directory
            read_only = bool(vm.get("readOnly")) or self.volumes.read_only(vm["name"])
            mounts.append({"source": str(source), "target": vm["mountPath"], "readOnly": read_only})
        if mounts and not self.node.private_mounts:
            if not self._mount_warning_sent:
                self._mount_warning_sent = True
                self.events.emit(self.pod, "Warning", "VolumesNotMounted",
                                 f"private mount namespaces are unavailable ({self.node.mount_problem}); "
                                 f"volumes are only in {self.dir.path / 'volumes'}", container["name"])
            return []
        for m in mounts:
            self._ensure_host_path(Path(m["target"]), is_file=Path(m["source"]).is_file())
        return mounts

    # ---- status ----

    async def _status_loop(self) -> None:
        while True:
            await self._dirty.wait()
            await asyncio.sleep(0.02)  # coalesce the burst of changes one event causes
            self._dirty.clear()
            try:
                await self._write_status()
            except ApiError as exc:
                if exc.status == 404:
                    self._gone = True
                    self._deleting.set()
                    return
                await self._retry_status_later(exc)
            except Exception as exc:  # noqa: BLE001 - connection trouble: the next attempt may work
                await self._retry_status_later(exc)

    async def _retry_status_later(self, exc: Exception) -> None:
        log.warning("%s/%s: status update failed (retrying in 1 s): %s", self.namespace, self.name, exc)
        await asyncio.sleep(1)
        self._dirty.set()

    async def _flush_status(self) -> None:
        if self._gone:
            return
        try:
            await self._write_status()
        except (ApiError, OSError):
            pass

    async def _write_status(self) -> None:
        status = copy.deepcopy(self.status())
        if status == self._last_status:
            return
        await self.node.api.request("PATCH", f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                                     body={"status": status}, patch="merge")
        self._last_status = status

    def status(self) -> dict:
        # Like the kubelet: containers sorted by name, init containers in their order.
        containers = sorted((self._container_status(r) for r in self.runners), key=lambda c: c["name"])
        init = [self._container_status(r) for r in self.init_runners]
        phase = self._phase()
        not_init = [r.name for r in self.init_runners if not r.initialized]
        initialized = not not_init
        unready = [r.name for r in self.sidecars + self.runners if not (self.status_only or r.ready)]
        gates = [g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []]
        # Conditions other controllers own (readiness gates, DisruptionTarget) are passed through.
        external = [c for c in (self.pod.get("status") or {}).get("conditions") or []
                    if c["type"] not in _CONDITION_ORDER]
        gates_open = all(any(c["type"] == g and c["status"] == "True" for c in external) for g in gates)
        done = phase in ("Succeeded", "Failed")
        self._condition("PodScheduled", True)
        self._condition("PodReadyToStartContainers", self.ready_to_start)
        self._condition("Initialized", initialized, "ContainersNotInitialized",
                        f"containers with incomplete status: [{' '.join(not_init)}]")
        self._condition("ContainersReady", not unready and not done,
                        "PodCompleted" if done else "ContainersNotReady",
                        "" if done else f"containers with unready status: [{' '.join(unready)}]")
        ready_reason = "PodCompleted" if done else ("ContainersNotReady" if unready else "ReadinessGatesNotReady")
        self._condition("Ready", not unready and not done and gates_open, ready_reason,
                        "" if done else f"containers with unready status: [{' '.join(unready)}]")
        status = {"phase": phase, "hostIP": HOST_IP, "hostIPs": [{"ip": HOST_IP}],
                  "startTime": self.start_time,
                  "conditions": sorted(self._conditions.values(), key=lambda c: _CONDITION_ORDER[c["type"]]) + external,
                  "containerStatuses": containers}
        if init:
            status["initContainerStatuses"] = init
        if self.ip:
            status["podIP"], status["podIPs"] = self.ip, [{"ip": self.ip}]
        return status

    def _container_status(self, runner: ContainerRunner) -> dict:
        if not self.status_only:
            return runner.status()
        return {"name": runner.name, "image": runner.spec.get("image", ""), "imageID": "", "ready": True,
                "started": True, "restartCount": 0, "state": {"running": {"startedAt": self.start_time}},
                "lastState": {}}

    def _phase(self) -> str:
        if self.status_only:
            return "Running" if self.ip else "Pending"
        if any(r.finished.is_set() and r.exit_code not in (0, None) for r in self.init_runners if not r.sidecar):
            return "Failed"
        if not all(r.initialized for r in self.init_runners):
            return "Pending"
        if all(r.finished.is_set() for r in self.runners):
            return "Succeeded" if all(r.exit_code == 0 for r in self.runners) else "Failed"
        return "Running" if any(r.ever_started for r in self.runners) else "Pending"

    def _condition(self, type_: str, ok: bool, reason: str = "", message: str = "") -> None:
        status = "True" if ok else "False"
        old = self._conditions.get(type_)
        if old and old["status"] == status and (ok or old.get("reason", "") == reason):
            if not ok and old.get("message", "") != message:
                old["message"] = message
            return
        condition = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": now_iso()}
        if not ok:
            condition.update(reason=reason, message=message)
        self._conditions[type_] = condition


_CONDITION_ORDER = {"PodReadyToStartContainers": 0, "Initialized": 1, "Ready": 2, "ContainersReady": 3,
                    "PodScheduled": 4}

