"""Attention-DP padding: the only place dummies are made, kept, rolled back and torn down.

Under ADP every rank must take part in every forward. Two paddings keep that possible.

Pre-schedule padding (step 2, before `schedule()`; the fleet has work): a rank with no active
real request gets one *context* dummy of one token, so it has something to schedule. Rules:
  - no-op unless ADP is on, and when the rank has an active real request;
  - never a second dummy while the singleton dummy is live;
  - padding allocates the dummy's KV itself (the scheduler only batches it): a dummy is never
    admitted, never counts against `max_num_active_requests`, never waits behind a request.

Post-schedule padding (step 4, right after `schedule()`; the TensorRT-LLM fix): a rank that has
active requests but whose scheduled batch is empty — typically its only request does not fit
the free KV cache — would veto the forward on every rank, forever. It appends a *generation*
dummy (a decode query of 1 + draft tokens, not a context chunk: the rank is empty because it is
short of KV). Rules:
  - rank-local: it adds no collective (a collective on only the empty ranks would desynchronise
    the fleet);
  - no-op unless ADP and post-schedule padding are on, unless the batch is empty, when the rank
    has no active real request (pre-schedule padding covers an idle rank), and while the
    singleton dummy is live;
  - not a no-op at `max_num_active_requests`: the dummy is not a request the rank admitted.
    (Upstream skips a rank at the cap to protect an assertion this design does not have; with
    that skip, a context rank at the cap whose KV is held for transfers votes 0 forever.)

Both paddings:
  - affordable by construction: under ADP, admission keeps one decode query's blocks free for
    the dummy (`KVCacheManager.padding_reserve_blocks`; `--no-padding-reserve` turns it off), so
    held transfers can never take the last block;
  - never raise: if the KV cache cannot afford the dummy (`unaffordable`) or the allocation fails
    (`failed`) they log once, count, and add nothing — a rank-local exception here would strand
    the peers in the next collective;
  - a dummy never outlives its pass: after a vetoed pass it is rolled back (`rolled_back`),
    after a forward it is torn down (`committed`); either way its KV is freed and it leaves the
    active list, so the singleton cannot leak;
  - the scheduler's rollback of tentative allocations skips dummies (the scheduler never grew
    them), see `Scheduler.revert`;
  - dummies never count as progress, never produce responses, and are excluded from balancing
    and request statistics (see `Request.is_dummy`).
Every dummy is counted once in `adpfleet_padding_dummies_total{phase,outcome}`.
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
        if adp and engine.config.padding_reserve:  # admission never takes the dummy's blocks
            engine.kv.padding_reserve_blocks = engine.kv.blocks_for(engine.config.decode_query_len)
        self.dummy: Request | None = None
        self._warned: set[tuple[str, str]] = set()

    # -- step 2, before schedule() -------------------------------------------------------------
    def pre_schedule_pad(self) -> None:
        e = self.engine
        if (not self.adp
                or e.num_active_real
                or self.dummy is not None):
            return
        self._allocate(Request(DUMMY_REQUEST_ID, [0], SamplingParams(max_tokens=1, ignore_eos=True),
                               state=RequestState.CONTEXT, dummy_phase="pre_schedule"), num_tokens=1)

    # -- step 4, right after schedule() ----------------------------------------------------------
    def post_schedule_pad(self, batch: ScheduledBatch) -> None:
        e = self.engine
        if (not self.adp
                or not self.pad_empty_batch
                or not batch.is_empty
                or not e.num_active_real
                or self.dummy is not None):
            return
        dummy = Request(DUMMY_REQUEST_ID, [0], SamplingParams(max_tokens=1, ignore_eos=True),
                        state=RequestState.GENERATION, dummy_phase="post_schedule")
        if self._allocate(dummy, num_tokens=batch.decode_query_len):
            batch.generation.append(dummy)

    def _allocate(self, dummy: Request, num_tokens: int) -> bool:
        """Give the dummy its KV and make it the live singleton; never raises."""
        kv, phase = self.engine.kv, dummy.dummy_phase
        try:
            if kv.blocks_for(num_tokens) > kv.available_for(dummy):
                self._count(phase, "unaffordable")
                self._warn_once(phase, "unaffordable", "the KV cache cannot afford the dummy; this rank "
                                "votes 0 and the pass is vetoed on every rank")
                return False
            kv.grow(dummy, num_tokens)
        except Exception as exc:  # never propagate: the peers are about to enter the vote
            kv.free(dummy)
            self._count(phase, "failed")
            self._warn_once(phase, "failed", f"allocating the dummy failed: {exc!r}")
            return False
        self.dummy = dummy
        self.engine.active.append(dummy)
        return True

    # -- step 6, after the forward or the veto ---------------------------------------------------
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

    def _count(self, phase: str, outcome: str) -> None:
        self.engine.stats.padding_dummies[(phase, outcome)] += 1

    def _warn_once(self, phase: str, outcome: str, message: str) -> None:
        if (phase, outcome) not in self._warned:
            self._warned.add((phase, outcome))
            log.warning("%s padding: %s (logged once; counted in adpfleet_padding_dummies_total)",
                        phase.replace("_", "-"), message)
