"""runtime/cpu_budget.py against fake cgroup trees (v2's cpu.max, v1's cfs files) and the real
affinity mask."""

import os

import pytest

from adpfleet.runtime import cpu_budget

AFFINITY = len(os.sched_getaffinity(0))


def v2(tmp_path, text):
    (tmp_path / "cpu.max").write_text(text + "\n")
    return tmp_path


def v1(tmp_path, quota, period="100000"):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text(quota + "\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text(period + "\n")
    return tmp_path


@pytest.mark.parametrize("text, cpus", [("150000 100000", 1.5), ("200000 100000", 2.0), ("50000 100000", 0.5),
                                        ("max 100000", None), ("garbage", None), ("x 100000", None)])
def test_cgroup_v2_quota(tmp_path, text, cpus):
    assert cpu_budget.quota_cpus(v2(tmp_path, text)) == cpus


@pytest.mark.parametrize("quota, cpus", [("300000", 3.0), ("-1", None), ("", None)])
def test_cgroup_v1_quota(tmp_path, quota, cpus):
    assert cpu_budget.quota_cpus(v1(tmp_path, quota)) == cpus


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cpu_budget.quota_cpus(tmp_path) is None
    assert cpu_budget.available_cpus(tmp_path) == AFFINITY


def test_quota_caps_the_affinity_mask_rounding_down_never_below_one(tmp_path):
    assert cpu_budget.available_cpus(v2(tmp_path, "100000 100000")) == 1
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert cpu_budget.available_cpus(tmp_path) == 1  # half a CPU: still one thread
    (tmp_path / "cpu.max").write_text(f"{(AFFINITY + 10) * 100000} 100000\n")
    assert cpu_budget.available_cpus(tmp_path) == AFFINITY  # a quota above the mask: the mask


@pytest.mark.skipif(AFFINITY < 2, reason="needs 2 CPUs in the affinity mask")
def test_fractional_quota_rounds_down(tmp_path):
    assert cpu_budget.available_cpus(v2(tmp_path, "190000 100000")) == 1
    (tmp_path / "cpu.max").unlink()  # v1 from here on
    assert cpu_budget.available_cpus(v1(tmp_path, "250000")) == 2


@pytest.mark.skipif(AFFINITY < 2, reason="needs 2 CPUs in the affinity mask")
def test_ranks_share_the_budget(tmp_path):
    root = v2(tmp_path, "200000 100000")
    assert cpu_budget.threads_per_rank(1, root, {}) == 2
    assert cpu_budget.threads_per_rank(2, root, {}) == 1
    assert cpu_budget.threads_per_rank(3, root, {}) == 1


@pytest.mark.skipif(AFFINITY < 2, reason="needs 2 CPUs in the affinity mask")
@pytest.mark.parametrize("value, threads", [("3", 3), (" 1 ", 1), ("0", 2), ("two", 2), ("", 2)])
def test_an_explicit_omp_num_threads_wins_over_the_budget(tmp_path, value, threads):
    """The operator passes a role's engine.threadsPerRank as OMP_NUM_THREADS; nonsense is ignored."""
    root = v2(tmp_path, "200000 100000")
    assert cpu_budget.threads_per_rank(1, root, {"OMP_NUM_THREADS": value}) == threads


def test_openmp_threads_sleep_between_regions_unless_the_environment_chose():
    env = {}
    cpu_budget.sleep_between_regions(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    cpu_budget.sleep_between_regions(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
