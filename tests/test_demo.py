"""`adpfleet demo --quick` end to end on the session's local cluster: the stall is detected and
recovered, and the restart of the fleet's only generation server costs clients latency, never
errors (the router retries what was on it and holds new requests until the replacement is Ready)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.k8s, pytest.mark.slow]


def test_the_demo_detects_and_recovers_the_stall_without_losing_requests(k8s_cluster, tmp_path):
    env = {**os.environ, "ADPFLEET_CLUSTER_DIR": str(k8s_cluster.plane.dir), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "adpfleet", "demo", "--quick", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    summary = json.loads((tmp_path / "demo-summary.json").read_text()) if (tmp_path / "demo-summary.json").exists() else {}
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary["detection_s"] is not None and summary["recovery_s"] is not None
    assert summary["requests_completed"] > 0
    assert "ReadTimeout" not in summary["errors"], "a request hung past its deadline"
    assert summary["requests_failed"] == 0, summary["errors"]
    assert summary["router_queued"] > 0  # requests did wait for the replacement
    assert summary["latency"]["before_fault"]["requests"] > 0 and summary["latency"]["from_fault"]["requests"] > 0
    assert (tmp_path / "demo-progress.png").stat().st_size > 10_000
    assert k8s_cluster.plane.status()  # the demo reused the cluster and left it running
