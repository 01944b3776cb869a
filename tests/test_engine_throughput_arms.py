"""bench/engine_throughput.py's arms and workloads (pure logic; the bench itself runs in
tests/test_gpu_check.py): the engine A/B arms parsed from --engine-env, refused when malformed,
and the mixed stream's arrivals."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import engine_throughput as bench  # noqa: E402


def test_engine_arms_carry_their_environment_and_threads():
    arms = bench.engine_arms(["OMP_WAIT_POLICY=PASSIVE", "threads=1,GOMP_SPINCOUNT=0"], threads=2)
    assert arms == {"engine": ("engine", {}, 2),
                    "engine[OMP_WAIT_POLICY=PASSIVE]": ("engine", {"OMP_WAIT_POLICY": "PASSIVE"}, 2),
                    "engine[threads=1,GOMP_SPINCOUNT=0]": ("engine", {"GOMP_SPINCOUNT": "0"}, 1)}


@pytest.mark.parametrize("spec", ["OMP_WAIT_POLICY", "=1", "threads=0", "threads=x", "A=1,B"])
def test_malformed_engine_env_is_refused_naming_the_option(spec):
    with pytest.raises(SystemExit, match="--engine-env"):
        bench.engine_arms([spec], threads=2)


def test_mixed_stream_starts_a_quarter_then_one_request_every_second_step():
    short, mixed = bench.workloads(False, "cpu", "short"), bench.workloads(False, "cpu", "mixed")
    assert "arrivals" not in short and {k: v for k, v in mixed.items() if k != "arrivals"} == short
    arrivals = mixed["arrivals"]
    assert len(arrivals) == 64 and arrivals[:16] == [0] * 16 and arrivals[16:19] == [2, 4, 6]
    assert arrivals == sorted(arrivals)


def test_long_workload_is_longer_prompts_and_more_tokens():
    long = bench.workloads(False, "cpu", "long")
    assert (long["min_prompt"], long["max_prompt"], long["new_tokens"]) == (512, 2048, 128)
