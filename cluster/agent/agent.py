"""The node agent: register the node, adopt what a previous agent left running, then watch every
pod and hand each to the scheduler (unbound) or to its PodWorker (bound here); keep the cluster
names each pod resolves (hosts.py) current as pods and Services change.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import psutil

from adpfleet.cluster import kubeconfig, vllm_env
from adpfleet.cluster.agent import hosts, logserver
from adpfleet.cluster.agent.addresses import AddressPool
from adpfleet.cluster.agent.container import PODINIT, terminate_group
from adpfleet.cluster.agent.events import EventRecorder
from adpfleet.cluster.agent.informer import Informer
from adpfleet.cluster.agent.kubeapi import KubeApi
from adpfleet.cluster.agent.node import HOST_IP, NodeRegistration
from adpfleet.cluster.agent.pod import NodeServices, PodWorker, pod_dir_name
from adpfleet.cluster.agent.podenv import NodeContext
from adpfleet.cluster.agent.sandbox import LogSource, PodDirectory
from adpfleet.cluster.agent.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    kubeconfig: Path
    state_dir: Path
    serving_cert: Path
    serving_key: Path
    client_ca: Path
    node_name: str = "adpfleet-node"
    port: int = 10250
    gpus: int = 8
    capacity: dict[str, str] = field(default_factory=dict)  # more extended resources to advertise
    max_pods: int = 1000
    labels: dict[str, str] = field(default_factory=dict)
    status_only: bool = False
    backoff_initial: float = 10.0
    backoff_max: float = 300.0
    kubelet_version: str = "v0.0.0"
    pass_env: tuple[str, ...] = ()


def check_private_mounts() -> str | None:
    """None when pods can get private mount namespaces here, else why not."""
    proc = subprocess.run([sys.executable, "-I", "-S", PODINIT, "--check"], capture_output=True, text=True)
    return None if proc.returncode == 0 else (proc.stdout.strip() or proc.stderr.strip() or "unknown error")


def vllm_on_this_node() -> tuple[str, str]:
    """(where pods find `vllm`, "") when the vLLM environment is built, else ("", why not)."""
    try:
        return str(vllm_env.locate().bin_dir), ""
    except vllm_env.VllmUnavailable as exc:
        return "", str(exc)


class NodeAgent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.healthy = False
        self.addresses = AddressPool(str(config.state_dir))
        self.workers: dict[str, PodWorker] = {}  # pods bound here, by uid
        self._finished: OrderedDict[str, None] = OrderedDict()  # uids whose worker is done
        self.names: hosts.Records = {}
        self._dns_views: dict[str, tuple] = {}  # uid -> what of the pod its names depend on
        self._names_dirty = asyncio.Event()
        self.mount_problem = check_private_mounts()
        # At start, like the mount check, and in no thread: with an idle executor thread left in the
        # agent, its port was still held right after a SIGKILL (test_agent_restart, 2 runs of 4).
        self.vllm = vllm_on_this_node()
        self.private_mounts = self.mount_problem is None
        if not self.private_mounts:
            log.warning("private mount namespaces are unavailable (%s): volumes will not be mounted at "
                        "their mountPaths, only materialised in each pod's directory", self.mount_problem)

    # ---- start-up ----

    async def run(self) -> None:
        config = self.config
        credentials = kubeconfig.load(config.kubeconfig)
        self.api = KubeApi(credentials)
        self.events = EventRecorder(self.api, config.node_name)
        self.probe_session = aiohttp.ClientSession()
        self.node = NodeRegistration(self.api, config.node_name, labels=config.labels, gpus=config.gpus,
                                     extra_capacity=config.capacity, max_pods=config.max_pods, port=config.port,
                                     kubelet_version=config.kubelet_version)
        await self.node.register()
        server = urlparse(credentials.server)
        node_context = NodeContext(HOST_IP, server.hostname, server.port or 443, self.node.capacity,
                                   config.pass_env, *self.vllm)
        self.lent = NodeServices(
            api=self.api, events=self.events, addresses=self.addresses, context=node_context,
            probe_session=self.probe_session, state_dir=config.state_dir, backoff_initial=config.backoff_initial,
            backoff_max=config.backoff_max, status_only=config.status_only, mount_problem=self.mount_problem,
            names=lambda: self.names, done=self._worker_done)
        self.pods = Informer(self.api, "/api/v1/pods", self._on_pod)
        self.services = Informer(self.api, "/api/v1/services", self._on_service)
        self.scheduler = Scheduler(self.api, self.events, self.node, self.pods)
        tasks = [asyncio.create_task(self.node.keep_fresh())]
        ctx = logserver.tls_context(config.serving_cert, config.serving_key, config.client_ca)
        self._logserver = await logserver.serve(lambda: self.healthy, self._find_log, HOST_IP, config.port, ctx)
        await asyncio.gather(self.pods.sync(), self.services.sync())
        self._update_names()
        await self._adopt_or_clean_up()
        self.healthy = True
        log.info("node %s is ready: %d pod(s) bound here, private mounts %s", config.node_name,
                 len(self.workers), "on" if self.private_mounts else "off")
        tasks += [asyncio.create_task(c) for c in (self.scheduler.run(), self.services.run(), self._names_loop())]
        try:
            await self.pods.run()
        finally:
            for task in tasks:
                task.cancel()

    async def close(self) -> None:
        """Leave every pod running: the next agent adopts them."""
        await self._logserver.cleanup()
        await self.probe_session.close()
        await self.api.close()

    async def _adopt_or_clean_up(self) -> None:
        """Give running pod processes back to their pods; stop those whose pod is gone."""
        leaders: dict[str, dict[str, psutil.Process]] = {}
        for proc in psutil.process_iter():
            try:
                env = proc.environ()
                if env.get("ADPFLEET_CLUSTER") != str(self.config.state_dir) or os.getpgid(proc.pid) != proc.pid:
                    continue
                if proc.status() != psutil.STATUS_ZOMBIE:
                    leaders.setdefault(env["ADPFLEET_POD_UID"], {})[env["ADPFLEET_CONTAINER"]] = proc
            except (psutil.Error, ProcessLookupError, KeyError):
                continue
        bound = {uid: p for uid, p in self.pods.items.items() if p["spec"].get("nodeName") == self.config.node_name}
        orphans = [proc for uid, procs in leaders.items() if uid not in bound for proc in procs.values()]
        if orphans:
            log.info("stopping %d container process(es) whose pods were deleted while no agent ran", len(orphans))
            await asyncio.gather(*(terminate_group(p.pid, 5.0) for p in orphans))
        keep = {pod_dir_name(p) for p in bound.values()}
        pods_dir = self.config.state_dir / "pods"
        for stale in (pods_dir.iterdir() if pods_dir.exists() else []):
            if stale.name not in keep:
                PodDirectory(stale).remove()
        adopted = sum(len(v) for k, v in leaders.items() if k in bound)
        if adopted:
            log.info("adopted %d running container process(es)", adopted)
        for uid, pod in bound.items():
            self._start_worker(pod, leaders.get(uid, {}))

    # ---- pods ----

    def _on_pod(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self.scheduler.forget(uid)
        if pod["spec"].get("nodeName") == self.config.node_name:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker:
                    worker.deleted()
            elif worker:
                worker.update(pod)
            elif uid not in self._finished:
                self._start_worker(pod, {})
        view = None if kind == "DELETED" else hosts.dns_view(pod)
        if self._dns_views.get(uid) != view:
            self._dns_views[uid] = view
            if view is None:
                del self._dns_views[uid]
            self._names_dirty.set()
        self.scheduler.wake()

    def _start_worker(self, pod: dict, adopted: dict[str, psutil.Process]) -> None:
        worker = PodWorker(self.lent, pod, adopted)
        self.workers[worker.uid] = worker
        worker.update(pod)
        worker.task = asyncio.create_task(worker.run())

    def _worker_done(self, worker: PodWorker) -> None:
        self.workers.pop(worker.uid, None)
        self._finished[worker.uid] = None
        while len(self._finished) > 10000:
            self._finished.popitem(last=False)
        self.scheduler.wake()  # its resources are free again

    def _find_log(self, namespace: str, name: str, container: str, previous: bool) -> LogSource:
        worker = next((w for w in self.workers.values() if w.namespace == namespace and w.name == name), None)
        if worker is None:
            raise LookupError(f"container {container!r} of pod {namespace}/{name} is not on this node")
        return worker.log_source(container, previous)

    # ---- cluster names ----

    def _on_service(self, _kind: str, service: dict) -> None:
        if (service.get("spec") or {}).get("clusterIP") == "None":
            self._names_dirty.set()

    async def _names_loop(self) -> None:
        while True:
            await self._names_dirty.wait()
            await asyncio.sleep(0.02)  # coalesce the burst of changes one event causes
            self._names_dirty.clear()
            if self._update_names():
                for worker in list(self.workers.values()):
                    worker.refresh_hosts()

    def _update_names(self) -> bool:
        names = hosts.service_records(self.services.items.values(), self.pods.items.values())
        changed, self.names = names != self.names, names
        return changed
