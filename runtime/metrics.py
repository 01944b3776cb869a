"""Per-rank counters and their Prometheus rendering (the names are listed in docs/adp.md).

Each rank keeps a plain `RankStats`; the server renders the latest snapshot of every live rank at
scrape time, so a series exists (at 0) from start-up, is never counted twice, and disappears
with the rank that owned it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Latency buckets in seconds (vLLM's scale, from a few ms on a GPU to a minute on a loaded CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class LatencyHistogram:
    """Observations per bucket (not cumulative), their sum and count; rendered as a Prometheus histogram."""
    buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    sum: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1
                break
        self.sum += seconds
        self.count += 1


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
    time_to_first_token: LatencyHistogram = field(default_factory=LatencyHistogram)
    inter_token_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
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
    ("prefix_cache_queries", "adpfleet_prefix_cache_queries_total",
     "Prompt tokens of admitted requests looked up in the prefix cache (0 with --no-prefix-cache)."),
    ("prefix_cache_hits", "adpfleet_prefix_cache_hits_total",
     "Of those, tokens found there: their prefill was skipped."),
]
_GAUGES = [
    ("requests_running", "adpfleet_requests_running", "Requests admitted (context or generation)."),
    ("requests_waiting", "adpfleet_requests_waiting", "Requests waiting for KV cache or for a rank."),
    ("kv_cache_blocks_used", "adpfleet_kv_cache_blocks_used", "KV cache blocks in use."),
    ("kv_cache_capacity_blocks", "adpfleet_kv_cache_capacity_blocks", "KV cache blocks in the pool."),
    ("prefix_cache_blocks", "adpfleet_prefix_cache_blocks",
     "KV cache blocks in the prefix cache, referenced or not (the unreferenced ones count as free)."),
    ("kv_transfers_in_flight", "adpfleet_kv_transfers_in_flight", "KV blocks held for or awaiting transfer."),
    ("kv_transfers_awaiting_pull", "adpfleet_kv_transfers_awaiting_pull",
     "Of those, blocks no generation server is pulling or has pulled yet."),
    ("last_progress_timestamp", "adpfleet_last_progress_timestamp_seconds",
     "Wall time of the last pass that produced real tokens."),
]


_HISTOGRAMS = [
    ("time_to_first_token", "adpfleet_time_to_first_token_seconds",
     "Seconds from a request's arrival on the rank to its first token (on a generation server: to the first "
     "token handed over by the context server, KV pull included)."),
    ("inter_token_latency", "adpfleet_inter_token_latency_seconds", "Seconds between two tokens of a request."),
]


def render(role: str, ranks: list[tuple[int, RankStats]], node_rank: int | None = None) -> str:
    """Prometheus text exposition of the given ranks' stats. A server over several pods labels its
    series with the pod's `node_rank` too (0 the leader), so a dashboard names the pod of a rank."""
    lines: list[str] = []
    pod = (("node_rank", node_rank),) if node_rank is not None else ()

    def family(name: str, kind: str, help_: str, samples):
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {float(value)!r}")

    for attr, name, help_ in _COUNTERS:
        family(name, "counter", help_, [((("role", role), ("rank", r), *pod), getattr(s, attr)) for r, s in ranks])
    family("adpfleet_padding_dummies_total", "counter", "Padding dummies by phase and outcome.",
           [((("role", role), ("rank", r), *pod, ("phase", p), ("outcome", o)), n)
            for r, s in ranks for (p, o), n in sorted(s.padding_dummies.items())])
    family("adpfleet_requests_finished_total", "counter", "Completed requests by finish reason.",
           [((("role", role), ("rank", r), *pod, ("finish_reason", k)), n)
            for r, s in ranks for k, n in sorted(s.requests_finished.items())])
    for attr, name, help_ in _GAUGES:
        family(name, "gauge", help_, [((("role", role), ("rank", r), *pod), getattr(s, attr)) for r, s in ranks])
    for attr, name, help_ in _HISTOGRAMS:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} histogram")
        for r, s in ranks:
            h: LatencyHistogram = getattr(s, attr)
            base = ",".join(f'{k}="{v}"' for k, v in (("role", role), ("rank", r), *pod))
            cumulative = 0
            for bound, n in zip(LATENCY_BUCKETS, h.buckets):
                cumulative += n
                lines.append(f'{name}_bucket{{{base},le="{bound}"}} {float(cumulative)!r}')
            lines.append(f'{name}_bucket{{{base},le="+Inf"}} {float(h.count)!r}')
            lines.append(f"{name}_sum{{{base}}} {float(h.sum)!r}")
            lines.append(f"{name}_count{{{base}}} {float(h.count)!r}")
    return "\n".join(lines) + "\n"
