"""What an operator that died midway left, taken up by the next: once per operator, the actions
recorded as Pending are finished (only pods older than the decision are deleted, so nothing is done
twice) and the ones too old to finish fail; every tick, servers an action left drained although it
ended Recovered are undrained."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Coroutine

from adpfleet.operator.decisions.history import left_drained, pending, rfc3339
from adpfleet.operator.remediator import ActingFleet, Remediator
from adpfleet.operator.resource.names import FleetKey
from adpfleet.operator.resource.vocabulary import Outcome
from adpfleet.operator.stall_look import Look

ABANDONED = "abandoned: the operator restarted and the action is too old to finish"


@dataclass
class LeftOver:
    resumed: bool = False  # the Pending records were taken up (once per operator)

    async def finish(self, key: FleetKey, fleet: ActingFleet, look: Look, now: float, remediator: Remediator,
                     spawn: Callable[[Coroutine], None]) -> None:
        history = fleet.share.history(look.obs)
        if not self.resumed:
            self.resumed = True
            to_finish, too_old = pending(history, look.spec, now)
            for record in too_old:
                fleet.share.note(record.ended(Outcome.FAILED, ABANDONED))
            for record in to_finish:
                fleet.logger.info("resuming %s of %s recorded at %s", record.action.value, ", ".join(record.targets),
                                  rfc3339(record.time))
                batch = max(1, look.spec.remediation.max_concurrent_per_role)
                spawn(remediator.execute(key, fleet, record, look.spec, batch, persisted=True, stalled_sample=None))
        by_name = {p.name: p for p in look.pods}
        for name in left_drained(history, [p.view for p in look.pods], now):
            await remediator.api.set_drain(fleet.ref.namespace, name, by_name[name].uid, False)
