"""The ADP executor loop of one rank, in the order of docs/adp.md:

  1. fetch new requests, and learn in one all-gather whether the fleet has work (and whether
     some rank asked it to stop); an idle fleet goes straight to 7
  2. pre-schedule padding
  3. schedule() (and draft, with speculative decoding)
  4. post-schedule padding
  5. the can_queue vote: one all-gather of every rank's batch size and token count (their
     max/mean, the pass's lockstep imbalance, is observed when the forward runs)
  6. if every rank has a batch: forward (padded to the largest token count), sample and verify,
     advance request states, respond, free; otherwise roll back the tentative allocations.
     Either way the dummy goes (torn down or rolled back)
  7. on every pass — ran, vetoed or idle: release held KV that was pulled or whose lease expired,
     refresh the stats that are shipped with the responses.

Collectives per pass: the fetch all-gather and the vote (plus the model's own when the forward
runs). Padding adds none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import Request, RequestOutput
from adpfleet.runtime.engine.scheduler import ScheduledBatch
from adpfleet.runtime.executor.padding import Padding


@dataclass
class PassResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    fleet_has_work: bool = False
    ran: bool = False
    stop: bool = False  # some rank asked the fleet to stop


class ADPExecutor:
    def __init__(self, engine: LLMEngine, comm, pad_empty_batch: bool = True):
        self.engine = engine
        self.comm = comm
        self.adp = comm.world_size > 1
        self.padding = Padding(engine, self.adp, pad_empty_batch)

    def step(self, new_requests: list[Request] = (), stop: bool = False, emit=None) -> PassResult:
        """One pass. `emit(outputs)`, when given, gets the outputs the fetch produced (the first
        tokens of requests whose pulled KV was placed) at once, before this pass's forward."""
        e, stats = self.engine, self.engine.stats
        result = PassResult()
        # 1. fetch
        e.pending.extend(new_requests)
        result.outputs = e.fetch()
        if emit is not None and result.outputs:
            emit(result.outputs)
            result.outputs = []
        fleet = self.comm.all_gather_ints([e.num_active_real + len(e.pending), int(stop)])
        result.fleet_has_work = any(row[0] for row in fleet)
        result.stop = any(row[1] for row in fleet)
        stats.iterations += 1
        if result.fleet_has_work:
            # 2. pre-schedule padding
            self.padding.pre_schedule_pad()
            # 3. schedule
            batch = e.schedule_batch()
            if batch.is_empty:
                stats.empty_batch_iterations += 1
            # 4. post-schedule padding
            self.padding.post_schedule_pad(batch)
            # 5. the can_queue vote (+ the token count every rank pads its forward to)
            can_queue, pad_to = self._vote(batch)
            # 6.
            if can_queue:
                logits = e.runner.forward(batch, pad_to)
                stats.forward_steps += 1
                result.outputs += e.update(batch, e.runner.sample(batch, logits))
                result.ran = True
            else:
                e.scheduler.revert(batch)
            self.padding.finish_pass(ran=can_queue)
        # 7. on every pass
        e.release_held_kv()
        e.refresh_gauges()
        return result

    def _vote(self, batch: ScheduledBatch) -> tuple[bool, int | None]:
        if not self.adp:
            return not batch.is_empty, None
        votes = self.comm.all_gather_ints([len(batch.requests), batch.num_tokens])
        can_queue = all(size > 0 for size, _ in votes)
        tokens = [t for _, t in votes]
        if can_queue and sum(tokens) > 0:  # every rank observes the same pass: the forward costs the largest share
            self.engine.stats.pass_imbalance.observe(max(tokens) * len(tokens) / sum(tokens))
        elif any(size > 0 for size, _ in votes):
            self.engine.stats.forward_vetoed += 1
        return can_queue, max(tokens)
