"""The per-rank metric families of an adpfleet server (docs/adp.md lists them): each
family's name, help, the field that holds it and whether the operator reads it.

A family's `field` is the runtime's `RankStats` attribute that counts it; `read` is the `RankSample`
field the operator's adpfleet dialect reads it into (None: the operator does not read it), and
`required` says the operator refuses a rank without it. A new metric is one line here, the counter
in the runtime, and the rule that reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE_LABEL = "role"
RANK_LABEL = "rank"
NODE_RANK_LABEL = "node_rank"  # a server over several pods: the pod's place in it (0 the leader)


@dataclass(frozen=True)
class Family:
    field: str
    name: str
    help: str
    read: str | None = None
    required: bool = False


COUNTERS = (
    Family("iterations", "adpfleet_iterations_total", "Executor loop passes.", "iterations", True),
    Family("forward_steps", "adpfleet_forward_steps_total", "Passes in which the forward ran.", "forward_steps", True),
    Family("forward_vetoed", "adpfleet_forward_vetoed_total", "Passes vetoed by the can_queue vote.",
           "forward_vetoed", True),
    Family("empty_batch_iterations", "adpfleet_empty_batch_iterations_total",
           "Passes where this rank's batch was empty after scheduling while the fleet had work.",
           "empty_batch_iterations", True),
    Family("prompt_tokens", "adpfleet_prompt_tokens_total", "Real prompt tokens processed (never dummies).",
           "prompt_tokens", True),
    Family("generation_tokens", "adpfleet_generation_tokens_total", "Real tokens generated (never dummies).",
           "generation_tokens", True),
    Family("spec_decode_draft_tokens", "adpfleet_spec_decode_draft_tokens_total",
           "Draft tokens verified by decode steps (speculative decoding; 0 without --draft-tokens)."),
    Family("spec_decode_accepted_tokens", "adpfleet_spec_decode_accepted_tokens_total",
           "Draft tokens the verification accepted (each saves one decode step)."),
    Family("prefix_cache_queries", "adpfleet_prefix_cache_queries_total",
           "Prompt tokens of admitted requests looked up in the prefix cache (0 with --no-prefix-cache)."),
    Family("prefix_cache_hits", "adpfleet_prefix_cache_hits_total",
           "Of those, tokens found there: their prefill was skipped."),
)
GAUGES = (
    Family("requests_running", "adpfleet_requests_running", "Requests admitted (context or generation).",
           "requests_running", True),
    Family("requests_waiting", "adpfleet_requests_waiting", "Requests waiting for KV cache or for a rank.",
           "requests_waiting", True),
    Family("kv_cache_blocks_used", "adpfleet_kv_cache_blocks_used", "KV cache blocks in use.",
           "kv_cache_blocks_used"),
    Family("kv_cache_capacity_blocks", "adpfleet_kv_cache_capacity_blocks", "KV cache blocks in the pool.",
           "kv_cache_capacity_blocks"),
    Family("prefix_cache_blocks", "adpfleet_prefix_cache_blocks",
           "KV cache blocks in the prefix cache, referenced or not (the unreferenced ones count as free)."),
    Family("kv_transfers_in_flight", "adpfleet_kv_transfers_in_flight", "KV blocks held for or awaiting transfer.",
           "kv_transfers_in_flight", True),
    Family("kv_transfers_awaiting_pull", "adpfleet_kv_transfers_awaiting_pull",
           "Of those, blocks no generation server is pulling or has pulled yet.", "kv_transfers_awaiting_pull"),
    Family("last_progress_timestamp", "adpfleet_last_progress_timestamp_seconds",
           "Wall time of the last pass that produced real tokens.", "last_progress_timestamp"),
)
# Histograms: the operator reads only their sums and counts (means over an interval), as `<read>_sum`
# and `<read>_count`, never the buckets.
HISTOGRAMS = (
    Family("time_to_first_token", "adpfleet_time_to_first_token_seconds",
           "Seconds from a request's arrival on the rank to its first token (on a generation server: to the first "
           "token handed over by the context server, KV pull included).", "ttft"),
    Family("inter_token_latency", "adpfleet_inter_token_latency_seconds", "Seconds between two tokens of a request.",
           "itl"),
)


@dataclass(frozen=True)
class LabeledFamily:
    """A counter with labels beyond role and rank: `field` is a dict keyed by their values."""
    field: str
    name: str
    help: str
    labels: tuple[str, ...]


PADDING_PHASES = ("pre_schedule", "post_schedule")
PADDING_OUTCOMES = ("committed", "rolled_back", "unaffordable", "failed")
FINISH_REASONS = ("stop", "length", "abort", "error")
PADDING_DUMMIES = LabeledFamily("padding_dummies", "adpfleet_padding_dummies_total",
                                "Padding dummies by phase and outcome.", ("phase", "outcome"))
REQUESTS_FINISHED = LabeledFamily("requests_finished", "adpfleet_requests_finished_total",
                                  "Completed requests by finish reason.", ("finish_reason",))
LABELED_COUNTERS = (PADDING_DUMMIES, REQUESTS_FINISHED)

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


def read_fields() -> dict[str, str]:
    """Series name -> RankSample field, for every family the operator reads."""
    scalars = {f.name: f.read for f in (*COUNTERS, *GAUGES) if f.read}
    histograms = {f"{f.name}_{part}": f"{f.read}_{part}" for f in HISTOGRAMS for part in ("sum", "count")}
    return {**scalars, **histograms}


REQUIRED = frozenset(f.name for f in (*COUNTERS, *GAUGES) if f.required)
