"""The install figures of docs/install.md, from one run.

    .venv/bin/python bench/install.py [--json bench/results/install.json]

Runs the chart's install tests (tests/chart/test_install.py: a fresh local cluster, the commands of
docs/install.md's Quickstart as written — `helm install`, `kubectl rollout status`, the tiny example
fleet, a completion through its router — then `helm upgrade --wait`) and reports the times they
record: the operator Ready after `helm install`, the fleet's servers Ready, the fleet Ready with its
router, the first completion, the upgraded operator Ready. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import format_table, machine_info  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(ROOT / "bench/results/install.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "timings.json"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/chart/test_install.py"], cwd=ROOT,
                              env={**os.environ, "ADPFLEET_INSTALL_TIMINGS": str(out)})
        if proc.returncode != 0 or not out.exists():
            print("the install tests failed: no figures", file=sys.stderr)
            return 1
        timings = json.loads(out.read_text())
    print(format_table(["step", "seconds"], [[k, round(v, 1)] for k, v in timings.items()]))
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "seconds": timings}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
