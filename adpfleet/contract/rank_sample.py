"""One rank at one scrape, as the operator judges it, whatever the engine: an engine's dialect
(operator/adapters/dialects/) reads its exposition into these fields; contract/metrics.py names the
adpfleet series behind each.

None is **unknown** — the engine does not export it (vLLM has no loop or veto counters), or has not
yet (vLLM publishes an engine's queue gauges after its first step) — and is never read as 0: a rank
whose work is unknown is not judged, a signature that needs an unknown counter is not shown.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankSample:
    iterations: float | None = 0.0     # executor loop passes: an idle adpfleet loop spins, so a stop is a hang
    forward_steps: float | None = 0.0
    forward_vetoed: float | None = 0.0
    empty_batch_iterations: float | None = 0.0
    prompt_tokens: float = 0.0         # real tokens: every engine exports these two counters from start-up
    generation_tokens: float = 0.0
    requests_running: float | None = 0.0
    requests_waiting: float | None = 0.0
    kv_transfers_in_flight: float | None = 0.0
    kv_cache_blocks_used: float | None = 0.0
    kv_cache_capacity_blocks: float | None = 0.0
    kv_transfers_awaiting_pull: float | None = 0.0  # of the held blocks, those no generation server has begun to pull
    last_progress_timestamp: float | None = None
    ttft_sum: float = 0.0   # time to first token: sum and count of observations
    ttft_count: float = 0.0
    itl_sum: float = 0.0    # inter-token latency
    itl_count: float = 0.0
    # Values that any engine step changes, for an engine whose token counters lag its steps (vLLM
    # counts a prompt's tokens when its whole prefill is done, minutes later on a slow CPU); a change
    # of any is progress. Empty for adpfleet, whose token counters move with every forward.
    step_marks: tuple[float | None, ...] = ()

    @property
    def tokens(self) -> float:
        """Real tokens processed or produced (never dummies)."""
        return self.prompt_tokens + self.generation_tokens

    @property
    def work(self) -> float | None:
        """Requests running or waiting, and KV held for transfers (where the engine has them); None
        while the queue gauges are unknown."""
        if self.requests_running is None or self.requests_waiting is None:
            return None
        return self.requests_running + self.requests_waiting + (self.kv_transfers_in_flight or 0.0)

    @property
    def kv_pulled_held(self) -> float:
        """Held blocks whose pull began (under way, or done and not freed): the holder's own part."""
        if self.kv_transfers_in_flight is None:
            return 0.0
        return max(0.0, self.kv_transfers_in_flight - (self.kv_transfers_awaiting_pull or 0.0))

    def progressed_since(self, before: "RankSample") -> bool:
        """Whether the rank did real work between `before` and this sample."""
        return self.tokens > before.tokens or self.step_marks != before.step_marks
