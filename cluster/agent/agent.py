"""The node agent's main loop: register the node, adopt what a previous agent left running,
then watch every pod and hand each to the scheduler (unbound) or to its PodWorker (bound here).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import psutil

from adpfleet.cluster import kubeconfig
from adpfleet.cluster.agent import logserver, scheduling
from adpfleet.cluster.agent.addresses import AddressPool
from adpfleet.cluster.agent.container import PODINIT, terminate_group
from adpfleet.cluster.agent.events import EventRecorder, now_iso
from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi
from adpfleet.cluster.agent.node import HOST_IP, NodeRegistration
from adpfleet.cluster.agent.pod import NodeServices, PodWorker, pod_dir_name
from adpfleet.cluster.agent.podenv import NodeContext
from adpfleet.cluster.agent.sandbox import LogSource

log = logging.getLogger(__name__)
RESCHEDULE_EVERY = 5.0  # unschedulable pods are looked at again this often even without events


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


class NodeAgent:
    def __init__(self, config: AgentConfig):
        self.config = config
        self.healthy = False
        self.addresses = AddressPool(str(config.state_dir))
        self.pods: dict[str, dict] = {}          # every pod in the cluster, by uid
        self.workers: dict[str, PodWorker] = {}  # pods bound here, by uid
        self._finished: OrderedDict[str, None] = OrderedDict()  # uids whose worker is done
        self._reported_unschedulable: dict[str, str] = {}
        self._wake_scheduler = asyncio.Event()
        self.mount_problem = check_private_mounts()
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
                                     max_pods=config.max_pods, port=config.port,
                                     kubelet_version=config.kubelet_version)
        await self.node.register()
        server = urlparse(credentials.server)
        node_context = NodeContext(HOST_IP, server.hostname, server.port or 443, self.node.capacity,
                                   config.pass_env)
        self.services = NodeServices(
            api=self.api, events=self.events, addresses=self.addresses, context=node_context,
            probe_session=self.probe_session, state_dir=config.state_dir, backoff_initial=config.backoff_initial,
            backoff_max=config.backoff_max, status_only=config.status_only, mount_problem=self.mount_problem,
            done=self._worker_done)
        tasks = [asyncio.create_task(self.node.keep_fresh())]
        ctx = logserver.tls_context(config.serving_cert, config.serving_key, config.client_ca)
        self._logserver = await logserver.serve(lambda: self.healthy, self._find_log, HOST_IP, config.port, ctx)
        resource_version = await self._list()
        await self._adopt_or_clean_up()
        self.healthy = True
        log.info("node %s is ready: %d pod(s) bound here, private mounts %s", config.node_name,
                 len(self.workers), "on" if self.private_mounts else "off")
        tasks.append(asyncio.create_task(self._schedule_loop()))
        try:
            await self._watch_forever(resource_version)
        finally:
            for task in tasks:
                task.cancel()

    async def close(self) -> None:
        """Leave every pod running: the next agent adopts them."""
        await self._logserver.cleanup()
        await self.probe_session.close()
        await self.api.close()

    async def _list(self) -> str:
        answer = await self.api.get("/api/v1/pods")
        self.pods = {p["metadata"]["uid"]: p for p in answer["items"]}
        return answer["metadata"]["resourceVersion"]

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
        bound = {uid: p for uid, p in self.pods.items() if p["spec"].get("nodeName") == self.config.node_name}
        orphans = [proc for uid, procs in leaders.items() if uid not in bound for proc in procs.values()]
        if orphans:
            log.info("stopping %d container process(es) whose pods were deleted while no agent ran", len(orphans))
            await asyncio.gather(*(terminate_group(p.pid, 5.0) for p in orphans))
        keep = {pod_dir_name(p) for p in bound.values()}
        pods_dir = self.config.state_dir / "pods"
        for stale in (pods_dir.iterdir() if pods_dir.exists() else []):
            if stale.name not in keep:
                shutil.rmtree(stale, ignore_errors=True)
        adopted = sum(len(v) for k, v in leaders.items() if k in bound)
        if adopted:
            log.info("adopted %d running container process(es)", adopted)
        for uid, pod in bound.items():
            self._start_worker(pod, leaders.get(uid, {}))

    # ---- watching ----

    async def _watch_forever(self, resource_version: str) -> None:
        while True:
            try:
                async for event in self.api.watch("/api/v1/pods", resource_version):
                    pod = event["object"]
                    resource_version = pod["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._on_pod(event["type"], pod)
            except ApiError as exc:
                if exc.status != 410:
                    log.warning("pod watch failed: %s; watching again", exc)
                    await asyncio.sleep(1)
                    continue
                resource_version = await self._relist()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("pod watch interrupted: %s; watching again", exc)
                await asyncio.sleep(1)

    async def _relist(self) -> str:
        """The watch fell too far behind: list again and replay the difference as events."""
        before = self.pods
        resource_version = await self._list()
        after, self.pods = self.pods, before
        for uid, pod in before.items():
            if uid not in after:
                self._on_pod("DELETED", pod)
        for pod in after.values():
            self._on_pod("MODIFIED", pod)
        return resource_version

    def _on_pod(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self.pods.pop(uid, None)
            self._reported_unschedulable.pop(uid, None)
        else:
            self.pods[uid] = pod
        if pod["spec"].get("nodeName") == self.config.node_name:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker:
                    worker.deleted()
            elif worker:
                worker.update(pod)
            elif uid not in self._finished:
                self._start_worker(pod, {})
        self._wake_scheduler.set()

    def _start_worker(self, pod: dict, adopted: dict[str, psutil.Process]) -> None:
        worker = PodWorker(self.services, pod, adopted)
        self.workers[worker.uid] = worker
        worker.update(pod)
        worker.task = asyncio.create_task(worker.run())

    def _worker_done(self, worker: PodWorker) -> None:
        self.workers.pop(worker.uid, None)
        self._finished[worker.uid] = None
        while len(self._finished) > 10000:
            self._finished.popitem(last=False)
        self._wake_scheduler.set()  # its resources are free again

    def _find_log(self, namespace: str, name: str, container: str, previous: bool) -> LogSource:
        worker = next((w for w in self.workers.values() if w.namespace == namespace and w.name == name), None)
        if worker is None:
            raise LookupError(f"container {container!r} of pod {namespace}/{name} is not on this node")
        return worker.log_source(container, previous)

    # ---- scheduling ----

    async def _schedule_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake_scheduler.wait(), RESCHEDULE_EVERY)
            except asyncio.TimeoutError:
                pass
            self._wake_scheduler.clear()
            try:
                await self._schedule_pending()
            except Exception:  # noqa: BLE001 - one bad pass must not stop scheduling
                log.exception("scheduling pass failed")

    async def _schedule_pending(self) -> None:
        pending = sorted((p for p in self.pods.values() if _wants_scheduling(p)),
                         key=lambda p: p["metadata"]["creationTimestamp"])
        if not pending:
            return
        bound = [p for p in self.pods.values() if p["spec"].get("nodeName") == self.config.node_name]
        for pod in pending:
            reason = scheduling.unschedulable_reason(pod, self.node.node, bound)
            if reason is None and await self._bind(pod):
                assumed = {**pod, "spec": {**pod["spec"], "nodeName": self.config.node_name}}
                self.pods[pod["metadata"]["uid"]] = assumed  # counts against capacity from now on
                bound.append(assumed)
            elif reason and self._reported_unschedulable.get(pod["metadata"]["uid"]) != reason:
                await self._report_unschedulable(pod, reason)

    async def _bind(self, pod: dict) -> bool:
        meta = pod["metadata"]
        try:
            await self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                                   body={"apiVersion": "v1", "kind": "Binding",
                                         "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                                                      "uid": meta["uid"]},
                                         "target": {"apiVersion": "v1", "kind": "Node",
                                                    "name": self.config.node_name}})
        except ApiError as exc:
            if exc.status not in (404, 409):  # deleted or already bound meanwhile: nothing to do
                log.warning("binding %s/%s failed: %s", meta["namespace"], meta["name"], exc)
            return False
        self._reported_unschedulable.pop(meta["uid"], None)
        self.events.emit(pod, "Normal", "Scheduled",
                         f"Successfully assigned {meta['namespace']}/{meta['name']} to {self.config.node_name}")
        return True

    async def _report_unschedulable(self, pod: dict, reason: str) -> None:
        meta = pod["metadata"]
        self._reported_unschedulable[meta["uid"]] = reason
        self.events.emit(pod, "Warning", "FailedScheduling", reason)
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": reason,
                     "lastProbeTime": None, "lastTransitionTime": now_iso()}
        try:
            await self.api.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                                   body={"status": {"conditions": [condition]}}, patch="strategic")
        except ApiError as exc:
            log.debug("marking %s/%s unschedulable failed: %s", meta["namespace"], meta["name"], exc)


def _wants_scheduling(pod: dict) -> bool:
    spec = pod["spec"]
    return (not spec.get("nodeName") and spec.get("schedulerName", "default-scheduler") == "default-scheduler"
            and not pod["metadata"].get("deletionTimestamp") and not scheduling.is_terminal(pod))
