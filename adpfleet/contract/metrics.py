"""The per-rank metrics: the families an adpfleet server exports (docs/adp.md lists them) and
`RankSample`, one rank at one scrape as the operator reads it, whatever the engine.

A family's `field` is the runtime's `RankStats` attribute that counts it; `read` is the `RankSample`
field the operator's adpfleet dialect reads it into (None: the operator does not read it), and
`required` says the operator refuses a rank without it. A new metric is its family line and its
sample field here, the counter in the runtime, and the rule that reads it.
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
    Family("request_queue_time", "adpfleet_request_queue_time_seconds",
           "Seconds from a request's arrival on the rank to the first pass that ran its prompt (as vLLM's "
           "request_queue_time_seconds; only requests whose prompt the rank computes)."),
    Family("request_prefill_time", "adpfleet_request_prefill_time_seconds",
           "Seconds from the first pass that ran a request's prompt to its first token: with the queue time, "
           "its time to first token (as vLLM's request_prefill_time_seconds)."),
    Family("pass_imbalance", "adpfleet_pass_imbalance",
           "Per pass that ran on ADP ranks, max over mean of the ranks' scheduled tokens (padding dummies "
           "included): the lockstep imbalance (at most the number of ranks; not observed on one rank)."),
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
# Imbalance buckets (max/mean, 1 to the number of ranks), 1.25 the ADP dispatcher's bound (docs/adp.md).
IMBALANCE_BUCKETS = (1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 8.0)


@dataclass
class Histogram:
    """Observations per bucket (not cumulative), their sum and count; rendered as a Prometheus histogram
    with `bounds` as its `le` (latencies in seconds unless told)."""
    bounds: list[float] = field(default_factory=lambda: list(LATENCY_BUCKETS))
    buckets: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.bounds = list(self.bounds)
        self.buckets = self.buckets or [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.buckets[i] += 1
                break
        self.sum += value
        self.count += 1


def read_fields() -> dict[str, str]:
    """Series name -> RankSample field, for every family the operator reads."""
    scalars = {f.name: f.read for f in (*COUNTERS, *GAUGES) if f.read}
    histograms = {f"{f.name}_{part}": f"{f.read}_{part}" for f in HISTOGRAMS if f.read for part in ("sum", "count")}
    return {**scalars, **histograms}


REQUIRED = frozenset(f.name for f in (*COUNTERS, *GAUGES) if f.required)


@dataclass(frozen=True)
class RankSample:
    """One rank at one scrape, as the operator judges it, whatever the engine: an engine's dialect
    (operator/adapters/dialects/) reads its exposition into these fields (`Family.read` above names
    adpfleet's series behind each). None is **unknown** — the engine does not export it (vLLM has no
    loop or veto counters), or has not yet (vLLM publishes an engine's queue gauges after its first
    step) — and is never read as 0: a rank whose work is unknown is not judged, and a signature that
    needs an unknown counter is not shown."""
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
