"""The Node object: registration with capacity, a status heartbeat, and the Lease the node
lifecycle controller watches (renewed every 10 s; 40 s without renewal marks the node NotReady)."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import platform

import psutil

from adpfleet.cluster.agent.events import now_iso
from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)
LEASE_SECONDS = 40
RENEW_EVERY = 10.0
STATUS_EVERY = 60.0
HOST_IP = "127.0.0.1"


def capacity(gpus: int, max_pods: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"cpu": str(os.cpu_count() or 1),
            "memory": f"{psutil.virtual_memory().total // 1024}Ki",
            "ephemeral-storage": f"{psutil.disk_usage('/').total // 1024}Ki",
            "pods": str(max_pods),
            # Advertised only, for scheduling: pods run as processes whatever the hardware.
            "nvidia.com/gpu": str(gpus),
            **(extra or {})}


def _os_image() -> str:
    try:
        for line in open("/etc/os-release"):
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return "Linux"


class NodeRegistration:
    def __init__(self, api: KubeApi, name: str, *, labels: dict[str, str], gpus: int, max_pods: int,
                 port: int, kubelet_version: str, extra_capacity: dict[str, str] | None = None):
        self.api, self.name, self.port = api, name, port
        self.labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                       "kubernetes.io/arch": {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(),
                                                                                        platform.machine()),
                       **labels}
        self.capacity = capacity(gpus, max_pods, extra_capacity)
        self.kubelet_version = kubelet_version
        self.node: dict = {}

    async def register(self) -> dict:
        try:
            self.node = await self.api.request("POST", "/api/v1/nodes", body={
                "apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name, "labels": self.labels}})
        except ApiError as exc:
            if exc.status != 409:
                raise
            self.node = await self.api.request("PATCH", f"/api/v1/nodes/{self.name}",
                                               body={"metadata": {"labels": self.labels}}, patch="merge")
        await self.post_status()
        await self.renew_lease()
        return self.node

    def status(self) -> dict:
        now = now_iso()

        def condition(type_: str, status: str, reason: str, message: str) -> dict:
            return {"type": type_, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": self._transition(type_, status, now)}

        return {
            "capacity": self.capacity, "allocatable": self.capacity,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "no memory pressure is reported"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "no disk pressure is reported"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "no PID pressure is reported"),
                condition("Ready", "True", "KubeletReady", "the adpfleet node agent is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "", "kernelVersion": platform.release(),
                         "osImage": _os_image(), "containerRuntimeVersion": "adpfleet-node-agent://0.1.0",
                         "kubeletVersion": self.kubelet_version, "kubeProxyVersion": "",
                         "operatingSystem": "linux", "architecture": self.labels["kubernetes.io/arch"]},
        }

    def _transition(self, type_: str, status: str, now: str) -> str:
        for c in (self.node.get("status") or {}).get("conditions") or []:
            if c["type"] == type_ and c["status"] == status:
                return c.get("lastTransitionTime") or now
        return now

    async def post_status(self) -> None:
        self.node = await self.api.request("PATCH", f"/api/v1/nodes/{self.name}/status",
                                           body={"status": self.status()}, patch="merge")

    async def renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        renew = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        try:
            await self.api.request("PATCH", path, body={"spec": {"renewTime": renew, "holderIdentity": self.name}},
                                   patch="merge")
        except ApiError as exc:
            if exc.status != 404:
                raise
            await self.api.request("POST", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", body={
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": self.name, "namespace": "kube-node-lease",
                             "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": self.name,
                                                  "uid": self.node["metadata"]["uid"]}]},
                "spec": {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_SECONDS, "renewTime": renew}})

    async def keep_fresh(self) -> None:
        since_status = 0.0
        while True:
            await asyncio.sleep(RENEW_EVERY)
            since_status += RENEW_EVERY
            try:
                await self.renew_lease()
                if since_status >= STATUS_EVERY:
                    await self.post_status()
                    since_status = 0.0
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive any one failure
                log.warning("node heartbeat failed (will retry): %s", exc)
