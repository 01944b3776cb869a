"""The stall controller's share of its fleet's status: the latest plan and the remediation records
this operator made, which of them the API server holds, and what was last published to the
reconcile pass, the status's one writer (docs/remediation.md).

An action starts only once its Pending record is in the API server (`until_stored`), so an operator
restarted mid-action finds it there instead of acting twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from adpfleet.operator.adapters.kube import now_rfc3339
from adpfleet.operator.decisions import stall_status
from adpfleet.operator.decisions.detection import StallVerdict
from adpfleet.operator.decisions.history import Remediation, history_from_status, with_records
from adpfleet.operator.decisions.observed import FleetObservation
from adpfleet.operator.decisions.remediation import Plan

STORED_WAKE_SECONDS = 2.0  # while a record waits to be stored, the reconcile loop is woken again this often


@dataclass
class StatusShare:
    plan: Plan = field(default_factory=Plan)
    records: dict[tuple, Remediation] = field(default_factory=dict)  # made here, not yet seen in the cached status
    persisted: set[tuple] = field(default_factory=set)  # (record key, outcome) known to be in the API server
    persisted_changed: asyncio.Event = field(default_factory=asyncio.Event)
    published: object = None  # what the reconcile pass was last woken for

    def note(self, record: Remediation) -> None:
        self.records[record.key()] = record

    def drop(self, record: Remediation) -> None:
        self.records.pop(record.key(), None)

    def history(self, obs: FleetObservation) -> list[Remediation]:
        """The stored history with this operator's records the cache has not shown yet."""
        stored = history_from_status(obs.status)
        stored_keys = {(r.key(), r.outcome) for r in stored}
        for k, r in list(self.records.items()):  # the cache has caught up: no need to remember it
            if (k, r.outcome) in stored_keys:
                self.persisted.add((k, r.outcome))
                del self.records[k]
        return with_records(stored, self.records.values())

    def overlay(self, obs: FleetObservation, status: dict, stalls: list[StallVerdict], *, ended: str | None,
                settling: bool) -> dict:
        """`status` (computed by the reconcile pass) with this share laid over it; `stalls`: the
        ongoing episodes' verdicts, `ended`: why the last one ended."""
        return stall_status.overlay(status, obs.status, stalls, self.plan, self.history(obs), now_rfc3339(),
                                    generation=obs.generation, ended=ended, settling=settling)

    def changed(self, overlaid: dict) -> bool:
        """Whether this share, as laid over an empty status, differs from what was last published."""
        view = (tuple((c["type"], c["status"], c["reason"], c["message"]) for c in overlaid["conditions"]),
                repr(overlaid.get("recentRemediations")), stall_status.degraded_problem(self.plan))
        if view == self.published:
            return False
        self.published = view
        return True

    def stored(self, status: dict) -> None:
        """The reconcile pass wrote `status` (or found it already stored)."""
        for entry in status.get("recentRemediations") or []:
            record = Remediation.from_status(entry)
            if record is not None:
                self.persisted.add((record.key(), record.outcome))
        self.persisted_changed.set()

    async def until_stored(self, record: Remediation, timeout: float, wake: Callable[[], None]) -> bool:
        """Until the record is in the API server (the reconcile pass writes it, woken meanwhile), or `timeout`."""
        want = (record.key(), record.outcome)
        deadline = time.monotonic() + timeout
        while want not in self.persisted:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.persisted_changed.clear()
            wake()
            try:
                await asyncio.wait_for(self.persisted_changed.wait(), timeout=min(left, STORED_WAKE_SECONDS))
            except asyncio.TimeoutError:
                pass
        return True
