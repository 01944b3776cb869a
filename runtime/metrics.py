"""Per-rank counters (the families and their names: adpfleet/contract/metrics.py, listed in docs/adp.md).

Each rank keeps a plain `RankStats`; the server renders the latest snapshot of every live rank at
scrape time (`render`, the contract's one writer of the exposition), so a series exists (at 0) from
start-up, is never counted twice, and disappears with the rank that owned it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from adpfleet.contract.exposition import render
from adpfleet.contract.metrics import FINISH_REASONS, IMBALANCE_BUCKETS, PADDING_OUTCOMES, PADDING_PHASES, Histogram

__all__ = ["RankStats", "render"]


@dataclass
class RankStats:
    """One rank's counters: an attribute per family `field` of the contract, and a few internal ones."""
    iterations: int = 0
    forward_steps: int = 0
    forward_vetoed: int = 0
    empty_batch_iterations: int = 0
    padding_dummies: dict[tuple[str, str], int] = field(
        default_factory=lambda: {(p, o): 0 for p in PADDING_PHASES for o in PADDING_OUTCOMES})
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    requests_running: int = 0
    requests_waiting: int = 0
    kv_cache_blocks_used: int = 0
    kv_cache_capacity_blocks: int = 0
    prefix_cache_blocks: int = 0
    kv_transfers_in_flight: int = 0
    kv_transfers_awaiting_pull: int = 0
    last_progress_timestamp: float = field(default_factory=time.time)
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    request_queue_time: Histogram = field(default_factory=Histogram)
    request_prefill_time: Histogram = field(default_factory=Histogram)
    pass_imbalance: Histogram = field(default_factory=lambda: Histogram(IMBALANCE_BUCKETS))
    # internal (benchmarks), not exported
    requests_fetched: int = 0
    collective_calls: int = 0
    control_collective_calls: int = 0
    busy_passes: int = 0  # passes while the fleet had work
    busy_pass_seconds: float = 0.0
