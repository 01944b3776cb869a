"""A figure the docs cite is the one its benchmark's JSON holds (both come from the same run)."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_install_md_cites_the_time_to_ready_of_bench_results_install_json():
    seconds = json.loads((ROOT / "bench/results/install.json").read_text())["seconds"]
    page = (ROOT / "docs/install.md").read_text()
    assert "bench/results/install.json" in page
    cited = ["helm install, rollout status (operator Ready)", "fleet applied -> both servers Ready",
             "fleet applied -> fleet Ready (router included)", "fleet applied -> first completion"]
    missing = [f"{step}: {seconds[step]:.1f} s" for step in cited if f"{seconds[step]:.1f} s" not in page]
    assert missing == [], missing
