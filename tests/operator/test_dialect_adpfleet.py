"""adpfleet's dialect: the runtime's exposition read per rank, and every text that is not one refused
with what is wrong (the shared Prometheus text reading is tested here, on adpfleet's families)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.operator.adapters.dialects import exposition
from adpfleet.operator.adapters.dialects.adpfleet import parse
from adpfleet.operator.adapters.dialects.exposition import ScrapeError
from adpfleet.runtime.metrics import RankStats, render
from budgets import examples


def test_parses_the_runtime_exposition_per_rank():
    a, b = RankStats(iterations=10, prompt_tokens=5, requests_waiting=2), RankStats(iterations=10, generation_tokens=7)
    ranks = parse(render("context", [(0, a), (1, b)]))
    assert set(ranks) == {0, 1}
    assert ranks[0].iterations == 10 and ranks[0].tokens == 5 and ranks[0].work == 2
    assert ranks[1].tokens == 7 and ranks[1].last_progress_timestamp == pytest.approx(b.last_progress_timestamp)


@pytest.mark.parametrize("text, words", [
    ("<html><body>502 Bad Gateway</body></html>", "not Prometheus text"),
    ("garbage garbage garbage", "not Prometheus text"),
    ("", "no adpfleet_"),
    ("node_cpu_seconds_total 5\n", "no adpfleet_"),
    ('adpfleet_iterations_total{role="context",rank="0"} 1\n', "lacks"),
    ('adpfleet_iterations_total{role="context"} 1\n', "no integer 'rank' label"),
    ('adpfleet_iterations_total{role="context",rank="x"} 1\n', "no integer 'rank' label"),
    ('adpfleet_iterations_total{role="context",rank="0"} NaN\n', "is nan"),
    ('adpfleet_iterations_total{role="context",rank="0"} -3\n', "is -3"),
    ("\x00\x01\x02", "not Prometheus text"),
])
def test_garbage_is_a_scrape_error_that_says_what_is_wrong(text, words):
    with pytest.raises(ScrapeError, match=words):
        parse(text)


def test_a_truncated_exposition_is_a_scrape_error():
    full = render("context", [(0, RankStats())])
    with pytest.raises(ScrapeError):
        parse(full[: len(full) // 2])


def _outcome(text):
    try:
        return parse(text)
    except ScrapeError as e:
        return f"ScrapeError: {e}"


_LINES = render("context", [(0, RankStats(iterations=3, prompt_tokens=2)), (1, RankStats(generation_tokens=5))]).split("\n")
_ODD = ["", "# a comment", "adpfleet_iterations_total{rank=\"0\"}\t7", "adpfleet_iterations_total{rank=\"0\"} 7\r",
        "adpfleet_iterations_total{rank=\"1\"} 7 }", "adpfleet_iterations_total{rank=\"1\"} 7 123",
        "adpfleet_requests_waiting{rank=\"0\"}  1e3  ", "adpfleet_requests_waiting{rank=\"0\"} 1_0",
        "adpfleet_requests_waiting{rank=\"0\"} Infinity", "adpfleet_requests_waiting{rank=\"0\"} +Inf",
        "adpfleet_requests_waiting{rank=\"0\"} .5", "adpfleet_requests_waiting{rank=\"0\",x=\"}\"} 4",
        "adpfleet_requests_waiting{rank=\"0\"}4", "adpfleet_requests_waiting 4", "adpfleet_requests_waiting\t4",
        "adpfleet_requests_waiting{rank=\"0\"} NaN", "adpfleet_requests_waiting{rank=\"0\"} -1",
        "adpfleet_last_progress_timestamp_seconds{rank=\"1\"} -1", "other_metric{rank=\"0\"} 1 2 3",
        "other metric 1", "{rank=\"0\"} 1", "adpfleet_kv_transfers_in_flight{rank=\"0\"} \u0661",
        "<html>", "adpfleet_iterations_total_extra{rank=\"0\"} 9"]


@settings(max_examples=examples(400), deadline=None)
@given(st.lists(st.sampled_from(_LINES + _ODD), max_size=60), st.booleans())
def test_the_fast_path_reads_every_text_exactly_as_the_line_by_line_path(lines, newline_at_end):
    """The whole-text regular expression is a shortcut, never a second opinion: any text it accepts
    yields what the line-by-line reading yields, and any other text is read line by line."""
    text = "\n".join(lines) + ("\n" if newline_at_end else "")
    fast = _outcome(text)
    regex = exposition._EXPOSITION
    exposition._EXPOSITION = re.compile(r"(?!)")  # never matches: every text goes line by line
    try:
        slow = _outcome(text)
    finally:
        exposition._EXPOSITION = regex
    assert fast == slow


def test_the_runtime_exposition_takes_the_fast_path():
    assert exposition._EXPOSITION.fullmatch(render("context", [(0, RankStats()), (1, RankStats())]))


def test_an_oversized_exposition_is_refused_before_parsing():
    with pytest.raises(ScrapeError, match="bytes"):
        parse("#" * (5 * 1024 * 1024))
