"""List, then watch, one kind of object for ever: a local cache by uid and a callback per change.

Like client-go's informer, minus the resync: `sync()` lists once (the cache is then complete);
`run()` watches from there, and when the watch falls too far behind (410 Gone) lists again and
replays the difference as ADDED/MODIFIED/DELETED.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import aiohttp

from adpfleet.cluster.agent.kubeapi import ApiError, KubeApi

log = logging.getLogger(__name__)
Handler = Callable[[str, dict], None]  # (ADDED | MODIFIED | DELETED, object)


class Informer:
    def __init__(self, api: KubeApi, path: str, on_change: Handler):
        self.api, self.path, self.on_change = api, path, on_change
        self.items: dict[str, dict] = {}
        self._version = ""

    @property
    def what(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    async def sync(self) -> None:
        """List everything (no callbacks): afterwards `items` is complete."""
        answer = await self.api.get(self.path)
        self.items = {o["metadata"]["uid"]: o for o in answer["items"]}
        self._version = answer["metadata"]["resourceVersion"]

    async def run(self) -> None:
        if not self._version:
            await self.sync()
        while True:
            try:
                async for event in self.api.watch(self.path, self._version):
                    obj = event["object"]
                    self._version = obj["metadata"]["resourceVersion"]
                    if event["type"] != "BOOKMARK":
                        self._apply(event["type"], obj)
            except ApiError as exc:
                if exc.status != 410:
                    log.warning("%s watch failed: %s; watching again", self.what, exc)
                    await asyncio.sleep(1)
                    continue
                await self._relist()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                log.warning("%s watch interrupted: %s; watching again", self.what, exc)
                await asyncio.sleep(1)

    def _apply(self, kind: str, obj: dict) -> None:
        uid = obj["metadata"]["uid"]
        if kind == "DELETED":
            self.items.pop(uid, None)
        else:
            self.items[uid] = obj
        self.on_change(kind, obj)

    async def _relist(self) -> None:
        """The watch fell too far behind: list again and replay the difference as events."""
        before = self.items
        await self.sync()
        after, self.items = self.items, before
        for uid, obj in before.items():
            if uid not in after:
                self._apply("DELETED", obj)
        for obj in after.values():
            self._apply("MODIFIED", obj)
