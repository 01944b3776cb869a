"""vLLM's dialect, on expositions captured from the real `vllm serve` (vLLM 0.32.0, tests/fixtures/vllm/,
docs/vllm-notes.md): each engine read as a rank, a missing gauge unknown (never 0), progress as
tokens or engine steps, and the verdicts detection draws from them: a frozen engine is hung, a
server that just started, an idle one and a long prefill are not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adpfleet.operator.adapters.dialects import ADPFLEET, dialect_for
from adpfleet.operator.adapters.dialects.exposition import ScrapeError
from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.decisions.detection import judge
from adpfleet.operator.resource.vocabulary import ServerState, Signature
from adpfleet.runtime.metrics import RankStats, render

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
VLLM = dialect_for("vllm")


def captured(name: str) -> str:
    return (FIXTURES / f"vllm-0.32.0-{name}.txt").read_text()


def series(key: str) -> dict:
    return json.loads((FIXTURES / "vllm-0.32.0-series.json").read_text())[key]


def exposition(values: dict) -> str:
    """Prometheus text of one recorded scrape of the series file (bare names are engine 0's)."""
    engine_0 = '{engine="0"}'
    lines = [f"{name if '{' in name else name + engine_0} {value!r}" for name, value in values.items()
             if name.startswith("vllm:")]
    return "\n".join(lines).replace('"}', '",model_name="tiny"}') + "\n"


def scrape(at: float, text: str) -> Scrape:
    return Scrape(at=at, ranks=VLLM.parse(text), lockstep=VLLM.lockstep)


def verdict(samples, window: float, interval: float):
    return judge("v-aggregated-0", "aggregated", samples, window_seconds=window, interval_seconds=interval)


# ---- reading one exposition ----------------------------------------------------------------------

def test_a_server_that_just_started_exports_every_series_at_zero():
    ranks = VLLM.parse(captured("started"))
    assert set(ranks) == {0}
    assert (ranks[0].work, ranks[0].tokens, ranks[0].kv_cache_blocks_used) == (0.0, 0.0, 0.0)
    assert ranks[0].kv_cache_capacity_blocks == 8192  # cache_config_info's num_gpu_blocks


def test_an_engine_that_has_not_stepped_has_unknown_work_never_zero():
    ranks = VLLM.parse(captured("dp2-started"))  # DP=2: the queue and KV gauges appear after a first step
    assert set(ranks) == {0, 1}
    assert all(r.requests_running is None and r.work is None and r.kv_cache_blocks_used is None
               for r in ranks.values())
    assert all(r.tokens == 0 for r in ranks.values())  # the counters are there, at 0


def test_what_vllm_does_not_export_is_unknown():
    r = VLLM.parse(captured("under-load"))[0]
    assert (r.iterations, r.forward_vetoed, r.empty_batch_iterations, r.kv_transfers_in_flight) == (None,) * 4
    assert r.work == 4 and r.tokens == 52 + 10977 and r.kv_cache_blocks_used == pytest.approx(0.00928 * 8192, 0.01)


def test_each_engine_is_its_own_rank():
    ranks = VLLM.parse(captured("dp2-engine0-frozen-21s"))
    assert (ranks[0].work, ranks[1].work) == (4, 0)
    assert (ranks[0].generation_tokens, ranks[1].generation_tokens) == (7884, 16000)


@pytest.mark.parametrize("text, words", [
    ("", "no vllm: series"),
    (render("context", [(0, RankStats())]), "no vllm: series"),  # an adpfleet server read as vLLM
    ('vllm:num_requests_running{engine="0",model_name="m"} 1\n', "engine 0 lacks vllm:prompt_tokens_total"),
    ('vllm:prompt_tokens_total{model_name="m"} 1\n', "no integer 'engine' label"),
    ('vllm:prompt_tokens_total{engine="x"} 1\n', "no integer 'engine' label"),
    ('vllm:generation_tokens_total{engine="0"} -1\n', "is -1"),
    ("<html>502</html>", "not Prometheus text"),
])
def test_a_text_that_is_not_a_vllm_servers_is_refused_with_what_is_wrong(text, words):
    with pytest.raises(ScrapeError, match=words):
        VLLM.parse(text)


def test_a_vllm_server_read_as_adpfleet_is_refused():
    with pytest.raises(ScrapeError, match="no adpfleet_"):
        ADPFLEET.parse(captured("under-load"))


def test_dialects_are_found_by_engine_name_and_an_unknown_engine_is_named():
    assert dialect_for("adpfleet") is ADPFLEET and not VLLM.lockstep and ADPFLEET.lockstep
    with pytest.raises(ValueError, match="engine 'sglang': known engines are adpfleet, vllm"):
        dialect_for("sglang")


# ---- progress: tokens, or engine steps ------------------------------------------------------------

def test_a_frozen_engine_moves_nothing():
    frozen_3s, frozen_11s = VLLM.parse(captured("engine-frozen-3s"))[0], VLLM.parse(captured("engine-frozen-11s"))[0]
    assert frozen_3s.work == 4 and not frozen_11s.progressed_since(frozen_3s)


def test_serving_is_progress():
    assert VLLM.parse(captured("under-load"))[0].progressed_since(VLLM.parse(captured("started"))[0])


def test_a_prefill_chunk_is_progress_though_no_token_counter_moves():
    before, after = VLLM.parse(captured("mfu-long-prefill-first-chunk"))[0], \
        VLLM.parse(captured("mfu-long-prefill-after-chunk-1"))[0]
    assert after.tokens == before.tokens and after.progressed_since(before)


# ---- verdicts ---------------------------------------------------------------------------------------

def test_a_server_that_just_started_is_never_judged():
    text = captured("dp2-started")
    v = verdict([scrape(t, text) for t in range(40)], window=10, interval=1)
    assert v.state is ServerState.WARMING_UP and "unknown" in v.reason


def test_an_idle_server_is_idle_though_nothing_moves():
    text = captured("idle-after-serving")
    assert verdict([scrape(t, text) for t in range(40)], window=10, interval=1).state is ServerState.IDLE


def test_a_frozen_engine_with_work_is_hung_after_a_window():
    """The real freeze: SIGSTOP of VLLM::EngineCore under 4 streams, scraped every ~1.4 s for 18 s."""
    scrapes = [scrape(s["t"], exposition(s)) for s in series("engine_frozen_20s")["scrapes"]]
    states = [verdict(scrapes[:n], window=10, interval=1.4) for n in range(1, len(scrapes) + 1)]
    first = next(i for i, v in enumerate(states) if v.stalled)
    assert all(not v.stalled for v in states[:first]) and all(v.stalled for v in states[first:])
    # frozen just before t=0: called after the window (less detection's jitter allowance), within two scrapes
    assert 10 - 1.25 * 1.4 <= scrapes[first].at <= 10 + 2 * 1.4
    assert (states[-1].signature, states[-1].ranks) == (Signature.HUNG, (0,))
    assert "no engine step while having work" in states[-1].reason


def test_dp2_with_only_engine_0_frozen_is_hung_on_rank_0_while_rank_1_progresses():
    record = series("dp2_engine0_frozen")
    scrapes = [scrape(0.0, exposition(record["load"]))] + [scrape(s["t"], exposition(s)) for s in record["frozen"]]
    v = verdict(scrapes, window=10, interval=7)
    assert v.stalled and (v.signature, v.ranks) == (Signature.HUNG, (0,))
    engine_1 = [verdict([s.rank(1) for s in scrapes[:n]], window=10, interval=7) for n in (3, 4)]
    assert [v.state for v in engine_1] == [ServerState.PROGRESSING, ServerState.IDLE]  # it finished its streams
    # judged as one (summed) the server would look busy: engine 1's progress hides engine 0's hang
    summed = verdict([Scrape(at=s.at, ranks=s.ranks) for s in scrapes], window=10, interval=7)
    assert summed.state is ServerState.PROGRESSING


def test_a_long_prefill_on_a_slow_cpu_is_never_stalled_when_the_window_exceeds_its_longest_step():
    """8000 prompt tokens in 4 chunks of 33-60 s on one loaded core: no token for 170 s, but each
    chunk's KV allocation is a step."""
    scrapes = [scrape(s["t"], exposition(s)) for s in series("long_prefill_default")["scrapes"]]
    judged = [verdict(scrapes[:n], window=90, interval=1.7) for n in range(1, len(scrapes) + 1)]
    assert not any(v.stalled for v in judged)
    assert any(v.state is ServerState.PROGRESSING and "engine steps" in v.reason for v in judged)


def test_a_window_shorter_than_one_step_would_flag_that_prefill():
    """Why the stall window must exceed the longest engine step (nothing moves within a step)."""
    scrapes = [scrape(s["t"], exposition(s)) for s in series("long_prefill_default")["scrapes"]]
    assert any(verdict(scrapes[:n], window=30, interval=1.7).stalled for n in range(1, len(scrapes) + 1))
