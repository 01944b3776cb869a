"""vLLM's exposition (`vllm serve`'s /metrics; measured on vLLM 0.32, tests/fixtures/vllm/): every
`vllm:` series carries `engine="<DP rank>"` and `model_name`; each engine is read as one rank.

    work      num_requests_running + num_requests_waiting (gauges)
    progress  real tokens: prompt_tokens_total (counted when a prompt's whole prefill is done),
              generation_tokens_total; and engine steps, which move while a long prompt is still
              being prefilled: iteration_tokens_total_count (a step that produced output),
              estimated_flops_per_gpu_total (every step, with --enable-mfu-metrics), a change of
              kv_cache_usage_perc (blocks allocated by a prefill chunk or freed)
    KV        kv_cache_usage_perc x cache_config_info's num_gpu_blocks
    latency   time_to_first_token_seconds, inter_token_latency_seconds (sums and counts)

An engine's gauges appear only after its first step (DP>1: not at start-up): until then its work is
unknown, never 0, and it is not judged. vLLM has no loop, veto or KV-transfer counters, so a vLLM
server can show only the `hung` signature: work, and no step for the stall window.
"""

from __future__ import annotations

from adpfleet.contract.metrics import RankSample
from adpfleet.operator.adapters.dialects.exposition import SampleReader, ScrapeError, integer_label, label, per_rank

ENGINE = "vllm"
# DP engines of a dense model step on their own (a frozen engine does not stop its peer): each
# engine is judged alone, or one engine's progress would hide its peer's hang.
LOCKSTEP = False
ENGINE_LABEL = "engine"
CACHE_INFO = "vllm:cache_config_info"  # value 1; its num_gpu_blocks label is the engine's KV capacity

_FIELDS = {
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:iteration_tokens_total_count": "steps",
    "vllm:estimated_flops_per_gpu_total": "flops",
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
}
# counters every engine exports from start-up (at 0): an engine without them is not a vLLM engine
REQUIRED = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:iteration_tokens_total_count")
# not exported by vLLM at all: unknown, whatever the engine does
_NOT_EXPORTED = dict.fromkeys(("iterations", "forward_steps", "forward_vetoed", "empty_batch_iterations",
                               "kv_transfers_in_flight", "kv_transfers_awaiting_pull"))
_READER = SampleReader((*_FIELDS, CACHE_INFO))


def parse(text: str) -> dict[int, RankSample]:
    """Per-engine samples from a vLLM server's Prometheus text; `ScrapeError` for a text that is not
    one (garbage, no `vllm:` series, an engine without its token and step counters)."""
    samples = list(_READER(text))
    capacity = _capacity(s for s in samples if s[0] == CACHE_INFO)
    values = per_rank((s for s in samples if s[0] != CACHE_INFO), ENGINE_LABEL, _FIELDS)
    if not values:
        raise ScrapeError("no vllm: series with an engine label: not a vLLM server")
    for engine, fields in values.items():
        missing = [name for name in REQUIRED if _FIELDS[name] not in fields]
        if missing:
            raise ScrapeError(f"engine {engine} lacks {', '.join(missing)}")
    return {engine: _sample(fields, capacity.get(engine, capacity.get(None)))
            for engine, fields in sorted(values.items())}


def _capacity(infos) -> dict[int | None, float]:
    """KV blocks per engine from cache_config_info (None: a series without an engine label, for all)."""
    out: dict[int | None, float] = {}
    for _, labels, _ in infos:
        blocks = label(labels, "num_gpu_blocks")
        if blocks is not None and blocks.isdigit():
            out[integer_label(labels, ENGINE_LABEL)] = float(blocks)
    return out


def _sample(fields: dict[str, float], capacity: float | None) -> RankSample:
    usage = fields.pop("kv_usage", None)
    steps, flops = fields.pop("steps"), fields.pop("flops", None)
    return RankSample(**_NOT_EXPORTED, **{"requests_running": None, "requests_waiting": None, **fields},
                      kv_cache_blocks_used=usage * capacity if usage is not None and capacity else None,
                      kv_cache_capacity_blocks=capacity, step_marks=(steps, flops, usage))
