"""The chart's alert rules with the stall alerts' windows shortened, for the alert-path end-to-end
test: with the shipped 1m window and 15s `for` a stall cannot reach the operator in under ~75 s.

Generated from the shipped file each time, never a copy kept by hand: everything but the stall
alerts' range selectors, `offset` and `for` stays as shipped, and a shipped rule that no longer
says 1m and 15s fails here rather than leave the test on windows nobody chose. promtool keeps
testing the shipped file itself (tests/alerts)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

RULES = Path(__file__).resolve().parents[1] / "charts" / "adpfleet" / "files" / "alert-rules.yaml"
STALL_ALERTS = ("AdpfleetServerStalled", "AdpfleetRankStarving")  # the ones the operator's webhook acts on
SHIPPED_WINDOW, SHIPPED_FOR = "1m", "15s"
WINDOW_IN_EXPR = re.compile(r"\[1m(:?)\]|offset 1m\b")
ANY_WINDOW = re.compile(r"\[(\w+?):?\]|offset (\w+)")


def short_window_rules(window_s: int, for_s: int, shipped: Path = RULES) -> str:
    """The shipped rule group, its stall alerts judged over `window_s` seconds and confirmed after
    `for_s` seconds (YAML text for Prometheus' rule_files)."""
    group = yaml.safe_load(shipped.read_text())
    stall_rules = [r for g in group["groups"] for r in g["rules"] if r.get("alert") in STALL_ALERTS]
    assert {r["alert"] for r in stall_rules} == set(STALL_ALERTS), f"{shipped}: stall alerts missing"
    for rule in stall_rules:
        assert rule["for"] == SHIPPED_FOR, f"{rule['alert']}: `for` is {rule['for']}, not {SHIPPED_FOR}: update me"
        expr, n = WINDOW_IN_EXPR.subn(lambda m: shorten(m, window_s), rule["expr"])
        left = {a or b for a, b in ANY_WINDOW.findall(expr)} - {f"{window_s}s"}
        assert n and not left, f"{rule['alert']}: it no longer judges over {SHIPPED_WINDOW} alone: update me"
        rule["expr"], rule["for"] = expr, f"{for_s}s"
    return yaml.safe_dump(group, sort_keys=False)


def shorten(match: re.Match, window_s: int) -> str:
    if match.group(0).startswith("offset"):
        return f"offset {window_s}s"
    return f"[{window_s}s{match.group(1)}]"
