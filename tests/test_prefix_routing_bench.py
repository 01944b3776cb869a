"""bench/prefix_routing.py's pure parts (the bench itself is run by hand: docs/benchmarks.md): the
multi-turn workload, the ideal hit count it is judged against, the imbalance summary, and --parts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import prefix_routing as bench  # noqa: E402

B = bench.B


def test_each_turn_resends_the_conversation_and_groups_share_a_system_prompt():
    convs = bench.Workload(sessions=4, turns=3, group=2, system=B * 2, max_tokens=4).conversations(7, vocab=512)
    assert len(convs) == 4 and all(len(c) == 3 for c in convs)
    for turns in convs:
        for earlier, later in zip(turns, turns[1:]):
            assert later[:len(earlier)] == earlier
            assert len(later) == len(earlier) + bench.ANSWER_TOKENS + bench.USER_TOKENS
    system = B * 2
    assert convs[0][0][:system] == convs[1][0][:system] != convs[2][0][:system]
    hot = bench.Workload(sessions=4, turns=1, group=4, system=system, max_tokens=4).conversations(7, vocab=512)
    assert len({tuple(c[0][:system]) for c in hot}) == 1


def sent(prompt, at, first):
    return bench.Sent(prompt, sent=at, first=first)


def test_ideal_hits_count_only_prompts_computed_before_the_request_was_sent():
    shared = list(range(10, 10 + 3 * B))
    a = sent(shared + [1] * B, at=0.0, first=1.0)
    early = sent(shared + [2] * B, at=0.5, first=2.0)  # sent while a's prompt was still being computed
    late = sent(shared + [3] * B, at=1.5, first=3.0)
    assert bench.ideal_hit_tokens([a, early]) == 0
    assert bench.ideal_hit_tokens([a, early, late]) == 3 * B
    whole = sent(a.prompt + [4] * 5, at=4.0, first=5.0)  # a partial last block is never a hit
    assert bench.ideal_hit_tokens([a, whole]) == 4 * B


def test_imbalance_summaries_give_percentiles_and_the_share_over_the_bound():
    s = bench.imbalance_summary([1.0] * 8 + [1.3, 2.0])
    assert s["pending_imbalance_p50"] == 1.0 and s["pending_imbalance_p99"] == 2.0
    assert s["pending_imbalance_over_bound"] == pytest.approx(0.2) and s["pending_imbalance_samples"] == 10
    assert bench.imbalance_summary([])["pending_imbalance_p90"] is None
    # the servers' histogram, cumulative: 10 passes, 6 at 1.0, 2 more by 1.25, 2 more by 2.0
    cumulative = dict(zip(bench.IMBALANCE_BUCKETS, (6, 6, 7, 8, 8, 10, 10, 10, 10)))
    h = {"count": 10, "sum": 12.5, **{f"le_{b}": n for b, n in cumulative.items()}}
    p = bench.pass_imbalance_summary(h)
    assert (p["pass_imbalance_mean"], p["pass_imbalance_p50"], p["pass_imbalance_p90"]) == (1.25, 1.0, 2.0)
    assert p["pass_imbalance_over_bound"] == pytest.approx(0.2) and p["pass_imbalance_passes"] == 10
    assert bench.pass_imbalance_summary({})["pass_imbalance_p50"] is None


def test_the_latency_split_pools_the_rounds_sums_and_counts_into_means():
    rounds = [{"server_ttft_sum": 3.0, "server_ttft_count": 2, "queue_sum": 2.0, "queue_count": 2,
               "prefill_time_sum": 1.0, "prefill_time_count": 2},
              {"server_ttft_sum": 1.0, "server_ttft_count": 2, "queue_sum": 0.0, "queue_count": 2,
               "prefill_time_sum": 1.0, "prefill_time_count": 2}]
    split = bench.latency_split_summary([1.5, 2.5], rounds)
    assert split == {"client_ttft_mean_s": 2.0, "server_ttft_mean_s": 1.0, "queue_mean_s": 0.5,
                     "prefill_time_mean_s": 0.5}
    assert bench.latency_split_summary([], [dict.fromkeys(rounds[0], 0)]) == dict.fromkeys(split)


def test_parts_pick_the_arms_and_an_unknown_part_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["prefix_routing.py", "--parts", "vllm,disaggregated"])
    assert list(bench.plan(bench.parse_args())) == ["disaggregated", "engine"]
    monkeypatch.setattr(sys, "argv", ["prefix_routing.py", "--parts", "aggregated,vlm"])
    with pytest.raises(SystemExit):
        bench.parse_args()
    assert "--parts: unknown ['vlm']" in capsys.readouterr().err


def test_a_workload_of_zero_rounds_is_left_out(monkeypatch):
    """--hot-rounds 0 runs the chat workload alone (an empty workload once failed the part at its end)."""
    monkeypatch.setattr(sys, "argv", ["prefix_routing.py", "--parts", "aggregated", "--hot-rounds", "0"])
    (_, workloads), = bench.plan(bench.parse_args()).values()
    assert list(workloads) == ["chat"]
