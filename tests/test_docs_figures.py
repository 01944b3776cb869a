"""A figure the docs cite is the one its benchmark's JSON holds (both come from the same run)."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_install_md_cites_the_time_to_ready_of_bench_results_install_json():
    seconds = json.loads((ROOT / "bench/results/install.json").read_text())["seconds"]
    page = (ROOT / "docs/install.md").read_text()
    assert "bench/results/install.json" in page
    cited = ["helm install --wait (operator Ready)", "fleet applied -> both servers Ready",
             "fleet applied -> fleet Ready (router included)", "fleet applied -> first completion"]
    missing = [f"{step}: {seconds[step]:.1f} s" for step in cited if f"{seconds[step]:.1f} s" not in page]
    assert missing == [], missing


def _remediation_tables() -> dict[str, list[str]]:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bench_remediation", ROOT / "bench" / "remediation.py")
    bench = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(bench)  # it puts bench/ and tests/operator/ on sys.path itself
    return bench.markdown_tables(json.loads((ROOT / "bench/results/remediation.json").read_text()))


def test_the_remediation_docs_cite_every_fault_row_of_bench_results_remediation_json():
    """docs/remediation.md holds both tables of the run (timings; what clients saw), and
    docs/benchmarks.md what clients saw, every row as bench/remediation.py renders it from the JSON."""
    tables = _remediation_tables()
    result = json.loads((ROOT / "bench/results/remediation.json").read_text())
    assert {r["servers_per_role"] for r in result["faults"]} >= {1, 2}  # the one- and two-server cases
    assert {r["fault"] for r in result["faults"]} >= {"freeze", "stop-serving-kv"}  # issue 14's two sides
    for page, wanted in (("docs/remediation.md", tables["timing"] + tables["clients"]),
                         ("docs/benchmarks.md", tables["clients"])):
        lines = set((ROOT / page).read_text().splitlines())
        missing = [line for line in wanted if line not in lines]
        assert missing == [], f"{page} lacks these rows of bench/results/remediation.json: {missing}"
