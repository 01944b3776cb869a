"""Attention-DP padding: the only place dummies are made, kept, rolled back and torn down.

Under ADP every rank must take part in every forward. Two paddings keep that possible:

Pre-schedule padding (before `schedule()`): a rank with no active request while the fleet has
work gets one *context* dummy of one token, so it has something to schedule.

Post-schedule padding (right after `schedule()`, the TensorRT-LLM fix): a rank that has active
requests but whose scheduled batch is empty — typically its only request does not fit the free
KV cache — would veto the forward on every rank, forever. It appends a *generation* dummy
(1 + draft tokens of KV, not a context chunk: the rank is empty because it is short of KV).
Its rules:
  - rank-local: it adds no collective (a collective on only the empty ranks would desynchronise
    the fleet);
  - no-op unless ADP is on, unless the batch is empty, when the rank has no active request
    (pre-schedule padding covers an idle rank), at `max_num_active_requests`, while the singleton
    dummy is live, and while the fill gate deliberately holds forwards;
  - affordable by construction: admission keeps the dummy's blocks in reserve under ADP, so
    held transfers cannot take them;
  - never raises: if the KV cache still cannot afford the dummy (`unaffordable`) or the allocation
    fails (`failed`) it logs once, counts, and leaves the batch empty — a rank-local exception
    here would strand the peers in the next collective;
  - a dummy on a rank whose vote still fails is rolled back (KV freed, removed from the active
    list), so the singleton cannot leak; a dummy in a batch that ran is torn down after it;
  - the scheduler's rollback of tentative allocations skips it (it was never grown by the
    scheduler), see `Scheduler.revert`;
  - dummies never count as progress, never produce responses, and are excluded from balancing
    and request statistics (see `Request.is_dummy`).
"""

from __future__ import annotations

import logging

from adpfleet.runtime.engine.request import Request, RequestState
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

DUMMY_REQUEST_ID = "adp-dummy"  # the singleton: at most one dummy is live on a rank


class Padding:
    def __init__(self, engine, adp: bool, pad_empty_batch: bool = True):
        self.engine = engine
        self.adp = adp
        self.pad_empty_batch = pad_empty_batch
        if adp and pad_empty_batch:  # keep the dummy affordable: admission never takes these blocks
            engine.kv.padding_reserve_blocks = engine.kv.blocks_for(engine.config.decode_query_len)
        self.dummy: Request | None = None
        self._warned: set[str] = set()

    def _count(self, phase: str, outcome: str) -> None:
        self.engine.stats.padding_dummies[(phase, outcome)] += 1

    def _warn_once(self, outcome: str, message: str) -> None:
        if outcome not in self._warned:
            self._warned.add(outcome)
            log.warning("%s (logged once; counted in adpfleet_padding_dummies_total)", message)

    # -- before schedule() -----------------------------------------------------------------------
    def pre_schedule_pad(self, fleet_has_work: bool, gate_held: bool = False) -> None:
        e = self.engine
        if not self.adp or gate_held or not fleet_has_work or self.dummy is not None or e.num_active_real:
            return
        dummy = Request(DUMMY_REQUEST_ID, [0], SamplingParams(max_tokens=1, ignore_eos=True),
                        dummy_phase="pre_schedule")
        self.dummy = dummy
        e.active.append(dummy)  # scheduled like any request; admitted if one block is free

    # -- right after schedule() ------------------------------------------------------------------
    def post_schedule_pad(self, batch: ScheduledBatch, gate_held: bool = False) -> None:
        e = self.engine
        if (not self.adp or not self.pad_empty_batch or gate_held or not batch.is_empty
                or not e.num_active_real or e.num_active_real >= e.config.max_num_active_requests
                or self.dummy is not None):
            return
        qlen = batch.decode_query_len
        dummy = Request(DUMMY_REQUEST_ID, [0], SamplingParams(max_tokens=1, ignore_eos=True),
                        state=RequestState.GENERATION, dummy_phase="post_schedule")
        dummy.output_token_ids = [0] * (qlen - 1)  # position 0.. of the decode query
        try:
            if e.kv.blocks_for(qlen) > e.kv.available_for(dummy):
                self._count("post_schedule", "unaffordable")
                self._warn_once("unaffordable", "post-schedule padding: the KV cache cannot afford a "
                                "generation dummy; this pass stays empty and is vetoed")
                return
            e.kv.grow(dummy, qlen)
        except Exception as exc:  # never propagate: the peers are about to enter the vote
            e.kv.free(dummy)
            self._count("post_schedule", "failed")
            self._warn_once("failed", f"post-schedule padding: allocating the dummy failed: {exc!r}")
            return
        self.dummy = dummy
        e.active.append(dummy)
        batch.generation.append(dummy)

    # -- after the vote ------------------------------------------------------------------------
    def finish_pass(self, ran: bool) -> None:
        """Tear the dummy down after a forward that ran (`committed`), or roll it back after a
        vetoed pass (`rolled_back`): either way it does not outlive the pass."""
        dummy, self.dummy = self.dummy, None
        if dummy is None:
            return
        if dummy in self.engine.active:
            self.engine.active.remove(dummy)
        self.engine.kv.free(dummy)
        self._count(dummy.dummy_phase, "committed" if ran else "rolled_back")
