"""The stall loop's Events about one fleet, rate limited: the same reason about the same server at
most once per `EVENT_REPEAT_SECONDS`, unless forced (a stall beginning, an action taken or ended,
a server unreachable for a window: each said once by its room).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Protocol

from adpfleet.operator.adapters.kube import KubeApi
from adpfleet.operator.resource.names import FleetRef

EVENT_REPEAT_SECONDS = 60.0  # the same skip of the same server is reported at most this often


class Say(Protocol):
    """An Event about the fleet (and a log line), unless the same one was said too recently."""

    def __call__(self, type_: str, reason: str, message: str, server: str, force: bool = False) -> Awaitable[None]:
        ...


@dataclass
class FleetEvents:
    ref: FleetRef
    logger: logging.Logger
    last: dict[tuple[str, str], float] = field(default_factory=dict)  # (server, reason) -> when last said

    async def say(self, api: KubeApi, type_: str, reason: str, message: str, server: str,
                  force: bool = False) -> None:
        now = time.monotonic()
        last = self.last.get((server, reason))
        if not force and last is not None and now - last < EVENT_REPEAT_SECONDS:
            return
        self.last[(server, reason)] = now
        self.logger.info("%s: %s", reason, message)
        await api.record_event(self.ref, type_, reason, message)
