"""bench/gpu_check.sh, the CUDA path's one script, runs its steps on the CPU (so it does not rot
between the runs on a GPU machine): 1, 3 and 4. Step 2 runs the kernel, metadata and parity test
modules with --device and --dtype, which the suite runs itself."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_gpu_check_runs_its_steps_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--steps", "1,3,4"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "CPU decode attention kernel: built" in run.stdout
    assert "2/4" not in run.stdout and not list(tmp_path.glob("tests-*.log"))  # step 2 left out
    completion = json.loads((tmp_path / "completion.json").read_text())
    assert completion["usage"]["completion_tokens"] == 8
    report = json.loads((tmp_path / "engine_throughput.json").read_text())
    assert report["device"] == "cpu" and report["model"]["name"] == "small"
    engine = report["sides"][0]
    assert engine["decode_attention"] == "kernel"
    assert engine["fraction_of_compute_limit"] > 0
    # decode = the whole run minus a prefill-only run; None when load made the prefill-only run slower
    assert engine["decode_fraction_of_bandwidth_limit"] is None or engine["decode_fraction_of_bandwidth_limit"] > 0
    assert engine["requests_identical_to_engine"] == report["workload"]["requests"]
