"""Per-rank counters and their Prometheus rendering (names: DESIGN.md §3.3).

Each rank keeps a plain `RankStats`; the server renders the latest snapshot of every live rank at
scrape time, so a series exists (at 0) from start-up, is never counted twice, and disappears
with the rank that owned it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PADDING_PHASES = ("pre_schedule", "post_schedule")
PADDING_OUTCOMES = ("committed", "rolled_back", "unaffordable", "failed")
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class RankStats:
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
    requests_finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    requests_running: int = 0
    requests_waiting: int = 0
    kv_cache_blocks_used: int = 0
    kv_cache_blocks_total: int = 0
    kv_transfers_in_flight: int = 0
    last_progress_timestamp: float = field(default_factory=time.time)
    # internal (benchmarks), not exported
    requests_fetched: int = 0
    collective_calls: int = 0
    control_collective_calls: int = 0
    busy_passes: int = 0  # passes while the fleet had work
    busy_pass_seconds: float = 0.0


_COUNTERS = [
    ("iterations", "adpfleet_iterations_total", "Executor loop passes."),
    ("forward_steps", "adpfleet_forward_steps_total", "Passes in which the forward ran."),
    ("forward_vetoed", "adpfleet_forward_vetoed_total", "Passes vetoed by the can_queue vote."),
    ("empty_batch_iterations", "adpfleet_empty_batch_iterations_total",
     "Passes where this rank's batch was empty after scheduling while the fleet had work."),
    ("prompt_tokens", "adpfleet_prompt_tokens_total", "Real prompt tokens processed (never dummies)."),
    ("generation_tokens", "adpfleet_generation_tokens_total", "Real tokens generated (never dummies)."),
    ("spec_decode_draft_tokens", "adpfleet_spec_decode_draft_tokens_total",
     "Draft tokens verified by decode steps (speculative decoding; 0 without --draft-tokens)."),
    ("spec_decode_accepted_tokens", "adpfleet_spec_decode_accepted_tokens_total",
     "Draft tokens the verification accepted (each saves one decode step)."),
]
_GAUGES = [
    ("requests_running", "adpfleet_requests_running", "Requests admitted (context or generation)."),
    ("requests_waiting", "adpfleet_requests_waiting", "Requests waiting for KV cache or for a rank."),
    ("kv_cache_blocks_used", "adpfleet_kv_cache_blocks_used", "KV cache blocks in use."),
    ("kv_cache_blocks_total", "adpfleet_kv_cache_blocks_total", "KV cache blocks in the pool."),
    ("kv_transfers_in_flight", "adpfleet_kv_transfers_in_flight", "KV blocks held for or awaiting transfer."),
    ("last_progress_timestamp", "adpfleet_last_progress_timestamp_seconds",
     "Wall time of the last pass that produced real tokens."),
]


def render(role: str, ranks: list[tuple[int, RankStats]]) -> str:
    """Prometheus text exposition of the given ranks' stats."""
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {float(value)!r}")

    for attr, name, help_ in _COUNTERS:
        family(name, "counter", help_, [((("role", role), ("rank", r)), getattr(s, attr)) for r, s in ranks])
    family("adpfleet_padding_dummies_total", "counter", "Padding dummies by phase and outcome.",
           [((("role", role), ("rank", r), ("phase", p), ("outcome", o)), n)
            for r, s in ranks for (p, o), n in sorted(s.padding_dummies.items())])
    family("adpfleet_requests_finished_total", "counter", "Completed requests by finish reason.",
           [((("role", role), ("rank", r), ("finish_reason", k)), n)
            for r, s in ranks for k, n in sorted(s.requests_finished.items())])
    for attr, name, help_ in _GAUGES:
        family(name, "gauge", help_, [((("role", role), ("rank", r)), getattr(s, attr)) for r, s in ranks])
    return "\n".join(lines) + "\n"
