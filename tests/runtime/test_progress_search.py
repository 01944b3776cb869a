"""The progress guarantee, by search (tests/runtime/progress_sim.py): the real executor loop of
2–4 ranks over random configurations and events, shared-prefix workloads with the prefix cache
on or off, in the aggregated, context and generation roles. With padding on it must find
nothing (the cache's invariants included); with padding off it must find the stall — that is how
we know the search can see one. A fixed-seed budget here, a smaller one in the CI profile
(tests/budgets.py: every event below is reached by seed 6, the stall without padding by seed 5);
`progress_sim.py --deep` searches for minutes."""

import pytest

from budgets import budget
from progress_sim import search

pytestmark = pytest.mark.slow

PASSES = 300
SEEDS = range(budget(40, 16))
EVENTS_REACHED = ("burst above the cap on one rank", "empty batch at the active-request cap", "starve fault",
                  "abort", "held KV aborted", "transfer abandoned", "hold expired at its lease", "hold pulled",
                  "draft tokens accepted", "pre_schedule dummy committed", "post_schedule dummy committed",
                  # the prefix cache, and the roles
                  "prefix hit", "hit on a block another request holds", "hit up to the last token's block",
                  "cached block evicted", "prefix cache full (no uncached free block)", "admitted from a full cache",
                  "pre_schedule dummy from the cache", "post_schedule dummy from the cache", "pulled KV placed",
                  "aggregated role", "context role", "generation role")


def test_with_padding_no_pass_is_vetoed_no_work_stalls_nothing_leaks_and_every_counter_agrees():
    report = search(SEEDS, passes=PASSES)
    assert [str(v) for v in report.violations] == []
    assert report.runs == len(SEEDS) and report.passes >= len(SEEDS) * PASSES  # no run ended early
    missing = [event for event in EVENTS_REACHED if not report.coverage[event]]
    assert missing == [], f"the search no longer reaches {missing}: widen its events"


def test_without_padding_the_search_finds_the_stall():
    """Both forms of the seed's stall: a rank whose requests do not fit its KV (held for
    transfers, no fault involved) schedules an empty batch and vetoes peers that could run (P1);
    and a rank that cannot schedule at all freezes every other rank's work past any bound (P2)."""

    def found(report):
        return {"vetoed without a fault", "stall"} <= kinds(report)

    report = search(range(budget(200, 40)), pad=False, passes=PASSES, stop_when=found)
    assert found(report), [str(v) for v in report.violations]
    assert not [v for v in report.violations if v.kind not in ("vetoed", "stall")]


def test_without_the_reserve_padding_still_bounds_stalls_but_cannot_always_afford_its_dummy():
    """Upstream's fix alone: when held KV takes every block the dummy is unaffordable and the
    rank vetoes its peers (P1 fails), until the hold is pulled or expires (P2 holds)."""
    report = search(range(40), reserve=False, passes=PASSES,
                    stop_when=lambda r: "vetoed without a fault" in kinds(r) and r.runs >= 12)
    assert "vetoed without a fault" in kinds(report)
    assert report.coverage["post_schedule dummy unaffordable"] > 0
    assert [str(v) for v in report.violations if v.kind != "vetoed"] == []


def kinds(report) -> set[str]:
    out = set()
    for v in report.violations:
        out.add(v.kind)
        if v.kind == "vetoed" and not v.starved:
            out.add("vetoed without a fault")
    return out
