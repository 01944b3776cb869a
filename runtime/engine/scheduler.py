"""Admission and batching: a capacity scheduler (guaranteed no evict) and a micro-batch scheduler.

The capacity scheduler admits waiting requests in arrival order while the KV blocks for their
prompt + max_tokens (+ the draft lookahead) fit, and stops at the first that does not
(head-of-line, as upstream: a large request is never starved by a stream of small ones behind
it). A request starts from its cached prefix: those blocks are shared and its prefill continues
from the first token not found in the prefix cache. A generation rank's requests, whose prompt KV
was pulled from a context server, are admitted by the same rule (`admit_pulled`), each placed by
the engine as soon as its blocks are reserved.
The micro-batch scheduler then fills the batch: generation requests first (one decode step
of 1 + draft tokens each), then prompt chunks, within `max_num_tokens` tokens and
`max_batch_size` requests.
Scheduling allocates the blocks the batch will write (tentatively): `revert` gives them back if
the pass does not run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.request import Request, RequestState


@dataclass
class SchedulerConfig:
    max_num_tokens: int = EngineConfig.max_num_tokens  # the engine's defaults, written once
    max_batch_size: int = EngineConfig.max_batch_size
    decode_query_len: int = 1  # 1 + draft tokens


@dataclass
class ScheduledBatch:
    context: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    generation: list[Request] = field(default_factory=list)
    decode_query_len: int = 1
    scheduled_at: float = field(default_factory=time.monotonic)  # when the pass was scheduled: its start

    @property
    def requests(self) -> list[Request]:
        return [r for r, _ in self.context] + self.generation

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.context) + len(self.generation) * self.decode_query_len

    @property
    def is_empty(self) -> bool:
        return not self.context and not self.generation


class CapacityScheduler:
    def __init__(self, kv: KVCacheManager, lookahead_tokens: int = 0):
        self.kv = kv
        self.lookahead_tokens = lookahead_tokens

    def kv_tokens(self, req: Request) -> int:
        """The KV a request can ever write: prompt + max_tokens, plus the draft positions its last
        decode query writes past its final token."""
        return req.max_total_tokens + self.lookahead_tokens

    def admit(self, waiting: list[Request]) -> list[Request]:
        """Prompts to run here, each from its cached prefix, if any."""
        return _head_of_line(waiting, self._admit_prompt)

    def admit_pulled(self, waiting: list[Request], place: Callable[[Request], object]) -> list[Request]:
        """Requests whose prompt KV arrived from a context server, each placed (`place`) as soon as its
        blocks are reserved: one that ends at its first token leaves them to the next."""
        def admit_one(req: Request) -> bool:
            if not self.kv.can_reserve(req, self.kv_tokens(req)):
                return False
            self.kv.reserve(req, self.kv_tokens(req))
            place(req)
            return True
        return _head_of_line(waiting, admit_one)

    def _admit_prompt(self, req: Request) -> bool:
        if not self.kv.admit(req, self.kv_tokens(req)):
            return False
        req.state = RequestState.CONTEXT
        return True


def _head_of_line(waiting: list[Request], admit_one) -> list[Request]:
    """The requests `admit_one` took, in arrival order, up to the first it refused: later requests
    wait behind that one, so small requests cannot overtake a large one for ever."""
    admitted = []
    for req in waiting:
        if not admit_one(req):
            break
        admitted.append(req)
    return admitted


class MicroBatchScheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config

    def select(self, running: list[Request]) -> ScheduledBatch:
        cfg = self.config
        batch = ScheduledBatch(decode_query_len=cfg.decode_query_len)
        budget = cfg.max_num_tokens
        for req in running:
            if req.state is RequestState.GENERATION and len(batch.generation) < cfg.max_batch_size \
                    and budget >= cfg.decode_query_len:
                batch.generation.append(req)
                budget -= cfg.decode_query_len
        for req in running:
            if req.state is not RequestState.CONTEXT or budget <= 0:
                continue
            if len(batch.generation) + len(batch.context) >= cfg.max_batch_size:
                break
            chunk = min(req.remaining_prompt_tokens, budget)
            batch.context.append((req, chunk))
            budget -= chunk
        return batch


class Scheduler:
    """Admission + batch selection for one rank, with the tentative KV allocation of the batch."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig):
        self.kv = kv
        self.config = config
        self.capacity = CapacityScheduler(kv, lookahead_tokens=config.decode_query_len - 1)
        self.micro = MicroBatchScheduler(config)

    def schedule(self, waiting: list[Request], running: list[Request]) -> tuple[ScheduledBatch, list[Request]]:
        """Returns the batch and the requests admitted from `waiting` (the caller moves them)."""
        admitted = self.capacity.admit(waiting)
        batch = self.micro.select(running + admitted)
        for req, chunk in batch.context:
            self.kv.grow(req, req.num_computed_tokens + chunk)
        for req in batch.generation:
            self.kv.grow(req, req.num_computed_tokens + self.config.decode_query_len)
        return batch, admitted

    def revert(self, batch: ScheduledBatch) -> None:
        """Undo the tentative allocations of a batch that did not run. Padding dummies are skipped:
        the scheduler never grew them (padding allocated them), and the padding code rolls them
        back as a whole."""
        for req in batch.requests:
            if not req.is_dummy:
                self.kv.shrink(req, req.num_computed_tokens)
