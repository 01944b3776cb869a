"""The scheduler of the one-node cluster: bind each pending pod that fits, say why when one does not.

    pending pods, highest priority first, then oldest
      → filters (scheduling.py: selector, node affinity, taints, pod count, resources)
      → volume binding (volumebinding.py: claims exist and are bound, or pre-bind a local volume)
      → Binding, a `Scheduled` event, and a `NotSupportedLocally` event per constraint that one
        node cannot honour — or `PodScheduled=False/Unschedulable` and a `FailedScheduling` event

Pods are looked at again whenever a pod, claim, volume or StorageClass changes, and every
RESCHEDULE_EVERY seconds. Every `schedulerName` is served: no other scheduler runs here.
"""

from __future__ import annotations

import asyncio
import logging

from adpfleet.cluster.agent import scheduling, volumebinding
from adpfleet.cluster.agent.events import NOT_SUPPORTED_LOCALLY, EventRecorder, now_iso
from adpfleet.cluster.agent.informer import Informer
from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi
from adpfleet.cluster.agent.node import NodeRegistration

log = logging.getLogger(__name__)
RESCHEDULE_EVERY = 5.0  # unschedulable pods are looked at again this often even without events


class Scheduler:
    def __init__(self, api: KubeApi, events: EventRecorder, node: NodeRegistration, pods: Informer):
        self.api, self.events, self.node, self.pods = api, events, node, pods
        self.claims = Informer(api, "/api/v1/persistentvolumeclaims", self._on_storage)
        self.volumes = Informer(api, "/api/v1/persistentvolumes", self._on_storage)
        self.classes = Informer(api, "/apis/storage.k8s.io/v1/storageclasses", self._on_storage)
        self._reported: dict[str, str] = {}  # uid -> the unschedulable reason last reported
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    def forget(self, uid: str) -> None:
        self._reported.pop(uid, None)

    def _on_storage(self, _kind: str, _obj: dict) -> None:
        self._wake.set()

    async def run(self) -> None:
        await asyncio.gather(self.claims.sync(), self.volumes.sync(), self.classes.sync())
        watches = [asyncio.create_task(i.run()) for i in (self.claims, self.volumes, self.classes)]
        try:
            while True:
                try:
                    await asyncio.wait_for(self._wake.wait(), RESCHEDULE_EVERY)
                except asyncio.TimeoutError:
                    pass
                self._wake.clear()
                try:
                    await self._schedule_pending()
                except Exception:  # noqa: BLE001 - one bad pass must not stop scheduling
                    log.exception("scheduling pass failed")
        finally:
            for task in watches:
                task.cancel()

    async def _schedule_pending(self) -> None:
        pods = self.pods.items
        pending = sorted((p for p in pods.values() if _wants_scheduling(p)),
                         key=lambda p: (-(p["spec"].get("priority") or 0), p["metadata"]["creationTimestamp"]))
        if not pending:
            return
        bound = [p for p in pods.values() if p["spec"].get("nodeName") == self.node.name]
        claims = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in self.claims.items.values()}
        volumes = {v["metadata"]["name"]: v for v in self.volumes.items.values()}
        classes = {c["metadata"]["name"]: c for c in self.classes.items.values()}
        taken: set[str] = set()
        for pod in pending:
            reason = scheduling.unschedulable_reason(pod, self.node.node, bound)
            check = volumebinding.ClaimCheck()
            if reason is None:
                check = volumebinding.check_claims(pod, claims, volumes, classes, self.node.node, taken)
                reason = f"0/1 nodes are available: {check.problem}." if check.problem else None
            if reason:
                if self._reported.get(pod["metadata"]["uid"]) != reason:
                    await self._report_unschedulable(pod, reason)
            elif check.prebind or check.binding:
                # The pod is bound once its claims are (their change wakes us).
                await self._prebind(check.prebind)
            elif await self._bind(pod):
                assumed = {**pod, "spec": {**pod["spec"], "nodeName": self.node.name}}
                pods[pod["metadata"]["uid"]] = assumed  # counts against capacity from now on
                bound.append(assumed)

    async def _prebind(self, prebind: list[tuple[dict, dict]]) -> None:
        for volume, claim in prebind:
            name = volume["metadata"]["name"]
            try:
                await self.api.request("PATCH", f"/api/v1/persistentvolumes/{name}", patch="merge", body={
                    "metadata": {"resourceVersion": volume["metadata"]["resourceVersion"],
                                 "annotations": {"pv.kubernetes.io/bound-by-controller": "yes"}},
                    "spec": {"claimRef": volumebinding.claim_ref(claim)}})
            except ApiError as exc:  # changed meanwhile (409): the next pass sees the new version
                log.info("pre-binding volume %s to claim %s/%s: %s", name, claim["metadata"]["namespace"],
                         claim["metadata"]["name"], exc)

    async def _bind(self, pod: dict) -> bool:
        meta = pod["metadata"]
        try:
            await self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/binding",
                                   body={"apiVersion": "v1", "kind": "Binding",
                                         "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                                                      "uid": meta["uid"]},
                                         "target": {"apiVersion": "v1", "kind": "Node", "name": self.node.name}})
        except ApiError as exc:
            if exc.status not in (404, 409):  # deleted or already bound meanwhile: nothing to do
                log.warning("binding %s/%s failed: %s", meta["namespace"], meta["name"], exc)
            return False
        self._reported.pop(meta["uid"], None)
        self.events.emit(pod, "Normal", "Scheduled",
                         f"Successfully assigned {meta['namespace']}/{meta['name']} to {self.node.name}")
        for message in scheduling.ignored_constraints(pod):
            self.events.emit(pod, "Warning", NOT_SUPPORTED_LOCALLY, message)
        return True

    async def _report_unschedulable(self, pod: dict, reason: str) -> None:
        meta = pod["metadata"]
        self._reported[meta["uid"]] = reason
        self.events.emit(pod, "Warning", "FailedScheduling", reason)
        condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": reason,
                     "lastProbeTime": None, "lastTransitionTime": now_iso()}
        try:
            await self.api.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                                   body={"status": {"conditions": [condition]}}, patch="strategic")
        except ApiError as exc:
            log.debug("marking %s/%s unschedulable failed: %s", meta["namespace"], meta["name"], exc)


def _wants_scheduling(pod: dict) -> bool:
    return (not pod["spec"].get("nodeName") and not pod["metadata"].get("deletionTimestamp")
            and not scheduling.is_terminal(pod))
