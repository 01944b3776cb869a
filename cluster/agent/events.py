"""Pod events (what `kubectl describe pod` shows), aggregated like the kubelet's: a repeat of the
same reason and message on the same pod bumps the count of the existing event."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
from collections import OrderedDict

from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)
COMPONENT = "adpfleet-node-agent"
# The reason of the Warning events that say what of a pod the local cluster ignores or does in
# its own way (runtimeClassName, pod affinity, spread constraints, another schedulerName, ...).
NOT_SUPPORTED_LOCALLY = "NotSupportedLocally"


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    def __init__(self, api: KubeApi, node_name: str, remembered: int = 2000):
        self.api, self.node_name = api, node_name
        self._seen: OrderedDict[tuple, tuple[str, int]] = OrderedDict()
        self._remembered = remembered
        self._tasks: set[asyncio.Task] = set()

    def emit(self, pod: dict, type_: str, reason: str, message: str, container: str | None = None) -> None:
        """Record in the background: an event must never hold up the pod it describes."""
        level = logging.WARNING if type_ == "Warning" else logging.INFO
        meta = pod["metadata"]
        log.log(level, "%s/%s: %s: %s", meta["namespace"], meta["name"], reason, message)
        task = asyncio.get_running_loop().create_task(self._record(pod, type_, reason, message, container))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _record(self, pod: dict, type_: str, reason: str, message: str, container: str | None) -> None:
        meta = pod["metadata"]
        key = (meta["uid"], reason, message)
        try:
            if key in self._seen:
                name, count = self._seen[key]
                self._seen[key] = (name, count + 1)
                await self.api.request("PATCH", f"/api/v1/namespaces/{meta['namespace']}/events/{name}",
                                       body={"count": count + 1, "lastTimestamp": now_iso()}, patch="merge")
                return
            name = f"{meta['name']}.{secrets.token_hex(8)}"
            involved = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"],
                        "name": meta["name"], "uid": meta["uid"]}
            if container:
                involved["fieldPath"] = f"spec.containers{{{container}}}"
            await self.api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/events", body={
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": name, "namespace": meta["namespace"]},
                "involvedObject": involved, "type": type_, "reason": reason, "message": message,
                "source": {"component": COMPONENT, "host": self.node_name},
                "reportingComponent": COMPONENT, "reportingInstance": self.node_name,
                "firstTimestamp": now_iso(), "lastTimestamp": now_iso(), "count": 1})
            self._seen[key] = (name, 1)
            while len(self._seen) > self._remembered:
                self._seen.popitem(last=False)
        except (ApiError, OSError) as exc:
            # The namespace may be terminating; an event is never worth failing for.
            self._seen.pop(key, None)
            log.debug("event %s for %s/%s not recorded: %s", reason, meta["namespace"], meta["name"], exc)
