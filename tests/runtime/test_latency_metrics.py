"""Time to first token and inter-token latency: observed per rank by the engine, exported as
Prometheus histograms (promtool accepts them), read by the operator's parser as sums and counts."""

import shutil
import subprocess

from adpfleet.contract.metrics import LATENCY_BUCKETS, Histogram
from adpfleet.operator.adapters.dialects import ADPFLEET
from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.metrics import RankStats, render
from adpfleet.runtime.model.loader import load_model


def test_each_request_observes_one_time_to_first_token_and_a_latency_per_further_token():
    engine = LLMEngine(EngineConfig(model="tiny-dense", kv_blocks=64, tokens_per_block=4, max_num_tokens=64),
                       model=load_model("tiny-dense"))
    engine.generate(["one", "two", "three"], SamplingParams(max_tokens=5, ignore_eos=True))
    s = engine.stats
    assert s.time_to_first_token.count == 3 and s.inter_token_latency.count == 3 * 4
    assert s.time_to_first_token.sum > 0 and sum(s.time_to_first_token.buckets) == 3


def test_time_to_first_token_splits_into_the_queue_before_the_first_pass_and_the_prefill_after_it():
    # a KV pool that holds one request at a time: the second waits, unscheduled, for the first to end
    engine = LLMEngine(EngineConfig(model="tiny-dense", kv_blocks=6, tokens_per_block=4, max_num_tokens=64),
                       model=load_model("tiny-dense"))
    first, second = engine.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(max_tokens=12, ignore_eos=True))
    s = engine.stats
    assert s.request_queue_time.count == s.request_prefill_time.count == s.time_to_first_token.count == 2
    assert abs(s.request_queue_time.sum + s.request_prefill_time.sum - s.time_to_first_token.sum) < 1e-9
    assert second.first_scheduled_time >= first.last_token_time  # it queued through the first's whole run
    assert s.request_queue_time.sum >= first.last_token_time - first.first_scheduled_time > s.request_prefill_time.sum


def test_a_histogram_counts_each_observation_in_its_bucket_and_above():
    h = Histogram()
    for seconds in (0.001, 0.3, 0.3, 99.0):
        h.observe(seconds)
    assert h.count == 4 and h.sum == 0.001 + 0.6 + 99.0
    assert h.buckets[0] == 1 and h.buckets[LATENCY_BUCKETS.index(0.5)] == 2 and sum(h.buckets) == 3  # 99 s: +Inf only


def test_the_histograms_are_valid_prometheus_and_the_operator_reads_their_sums_and_counts():
    stats = RankStats()
    stats.time_to_first_token.observe(0.2)
    stats.time_to_first_token.observe(0.4)
    stats.inter_token_latency.observe(0.05)
    stats.request_queue_time.observe(0.15)
    stats.request_prefill_time.observe(0.05)
    text = render("generation", [(0, stats), (1, RankStats())])
    assert 'adpfleet_time_to_first_token_seconds_bucket{role="generation",rank="0",le="0.25"} 1.0' in text
    assert 'adpfleet_time_to_first_token_seconds_bucket{role="generation",rank="0",le="+Inf"} 2.0' in text
    assert 'adpfleet_request_queue_time_seconds_sum{role="generation",rank="0"} 0.15' in text
    ranks = ADPFLEET.parse(text)
    assert (ranks[0].ttft_sum, ranks[0].ttft_count) == (0.6000000000000001, 2.0)
    assert (ranks[0].itl_sum, ranks[0].itl_count, ranks[1].ttft_count) == (0.05, 1.0, 0.0)
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/setup installs it (Debian package prometheus)"
    families = "\n".join(line for line in text.splitlines()
                         if any(f in line for f in ("_latency_", "_first_token_", "_time_seconds")))
    out = subprocess.run([promtool, "check", "metrics"], input=families + "\n", capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
