"""A request's whole state lives here: tokens, progress through its prompt, its KV blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adpfleet.runtime.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the front end and the router build requests' prompts without torch
    import torch


class RequestState(enum.Enum):
    WAITING = "waiting"  # active on this rank, but not admitted: its KV does not fit yet
    CONTEXT = "context"  # admitted, prompt being processed chunk by chunk
    GENERATION = "generation"  # decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    reserved_blocks: int = 0  # blocks promised at admission (guaranteed no evict)
    # prefix cache: the chained hashes of its full blocks (computed once, as far as needed), and
    # how many leading blocks of its table were offered to the cache (found there or entered)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    finish_reason: str | None = None
    output_text: str = ""
    dummy_phase: str | None = None  # padding dummies: "pre_schedule" / "post_schedule"
    # speculative decoding: the drafts the next decode step verifies, and the prompt-lookup index
    draft_token_ids: list[int] = field(default_factory=list)
    prompt_lookup: object = None
    # generation role: where the prompt's KV is held (context server) and, once pulled, the KV
    remote_kv: tuple[str, str] | None = None  # (endpoint, handle)
    first_token_id: int | None = None
    last_token_time: float | None = None  # monotonic time of the newest token: time to first token, inter-token latency
    first_scheduled_time: float | None = None  # monotonic start of the first pass that ran its prompt
    kv_payload: object = None
    error: str | None = None  # set when something failed for this request alone; the engine fails it
    data_parallel_rank: int | None = None  # the ADP rank the router named (X-Data-Parallel-Rank), as vLLM's
    # a torch.Generator, made on the first draw; typed loosely because the node link reads this class's
    # hints (typing.get_type_hints) in processes that never import torch here
    _generator: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def remaining_prompt_tokens(self) -> int:
        return max(0, len(self.prompt_token_ids) - self.num_computed_tokens)

    @property
    def is_dummy(self) -> bool:
        """Padding: never progress, never responded to, never in balancing or statistics."""
        return self.dummy_phase is not None

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def generator(self) -> torch.Generator | None:
        if self.params.seed is None:
            return None
        if self._generator is None:
            import torch

            self._generator = torch.Generator().manual_seed(self.params.seed)
        return self._generator


@dataclass
class RequestOutput:
    """What a rank says of one request after a pass (torch-free: the server process, which never
    imports torch, receives it)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None  # with finish_reason "error"
    rank: int = 0  # the rank that produced it (set by the rank group)
