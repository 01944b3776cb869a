"""bench/remediation.py's pure parts: which fleets a run brings up and which faults each takes, how a
fault's row is held to its targets, and how it is put beside the anchors of issue 27."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_remediation", ROOT / "bench" / "remediation.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


bench = _bench()


def row(**fields) -> dict:
    base = {"servers_per_role": 2, "fault_to_detection_s": 6.0, "last_progress_to_detection_s": 6.0,
            "fault_to_progress_s": 10.0, "delete_to_progress_s": 0.5, "restart_s": 30.0, "collateral_restarts": 0,
            "episode": {"client_visible_errors": 0}}
    return {**base, **fields}


def test_by_default_a_run_brings_up_adpfleets_fleets_then_the_vllm_fleet_which_takes_only_its_freeze():
    args = bench.arguments([])
    cases = bench.cases(args.engines, args.shapes, args.faults)
    assert [(c.engine, c.servers, c.name) for c in cases] == [("adpfleet", 1, "bench1"), ("adpfleet", 2, "bench2"),
                                                              ("vllm", 2, "benchvllm")]
    assert [f[0] for f in cases[0].faults] == ["starve", "freeze", "stop-reaping", "stop-serving-kv"]
    assert cases[2].faults == (("freeze", 0, "aggregated", "hung"),) and cases[2].roles == ("aggregated",)


def test_engines_shapes_and_faults_select_the_fleets_in_the_order_given():
    args = bench.arguments(["--engines", "vllm,adpfleet", "--shapes", "1", "--faults", "freeze", "starve"])
    cases = bench.cases(args.engines, args.shapes, args.faults)
    assert [(c.engine, c.servers, [f[0] for f in c.faults]) for c in cases] == [
        ("vllm", 2, ["freeze"]), ("adpfleet", 1, ["starve", "freeze"])]
    only_adpfleet = bench.arguments(["--engines", "adpfleet", "--shapes", "2"])
    assert [c.engine for c in bench.cases(only_adpfleet.engines, only_adpfleet.shapes, only_adpfleet.faults)] == \
        ["adpfleet"]
    # a fault the vLLM fleet cannot take leaves it its baseline only
    assert bench.cases(["vllm"], [1], ["starve"])[0].faults == ()


def test_an_unknown_engine_is_refused_with_the_known_ones():
    with pytest.raises(argparse.ArgumentTypeError, match="adpfleet, vllm"):
        bench.engine_list("adpfleet,sglang")
    with pytest.raises(SystemExit):
        bench.arguments(["--engines", ""])


def test_anchor_ratios_say_how_many_times_sooner_than_each_anchor_a_fault_was_detected_and_progress_restored():
    ratios = bench.anchor_ratios(row(fault_to_detection_s=7.5, fault_to_progress_s=30.0))
    assert ratios == {"dynamo_canary": {"detection_x": [2.0, 2.8], "progress_x": [0.5, 0.7]},
                      "vllm_proposals": {"detection_x": [8.0], "progress_x": [2.0]},
                      "watchdogs": {"detection_x": [40.0], "progress_x": [10.0]}}


def test_the_detection_target_counts_from_the_last_token_or_from_the_fault_where_the_engine_exports_no_progress_time():
    budget = 8
    assert bench.targets(row(fault_to_detection_s=9.5, last_progress_to_detection_s=7.0), budget)["detection_ok"]
    # vLLM exports no last-progress time: its last token came at the fault or before
    assert not bench.targets(row(fault_to_detection_s=9.5, last_progress_to_detection_s=None), budget)["detection_ok"]
    assert bench.targets(row(fault_to_detection_s=7.9, last_progress_to_detection_s=None), budget)["targets_met"]


def test_a_client_error_misses_the_target_only_where_the_role_had_a_second_server():
    errors = {"client_visible_errors": 1}
    assert bench.targets(row(servers_per_role=1, episode=errors), 8)["targets_met"]
    missed = bench.targets(row(servers_per_role=2, episode=errors), 8)
    assert not missed["no_client_errors_ok"] and not missed["targets_met"]
