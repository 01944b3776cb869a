"""The local cluster's numbers for docs/cluster.md.

    .venv/bin/python bench/local_cluster.py [--window 60] [--json bench/results/local_cluster.json]

Starts a fresh local cluster in a temporary directory and measures: control-plane start (to
/readyz), pod create-to-Ready latency of a trivial HTTP server (with and without a readiness
probe), the CPU and RSS of the node agent and of each control-plane component over one window with
20 idle pods, and how long 300 status-only pods (50 fleets × 6) take to be Ready. Prints a table
and writes JSON; stops the cluster at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import ProcessSampler, format_table  # noqa: E402

from adpfleet.cluster.testing import http_server_pod, pod_manifest, pod_ready, start_cluster, wait_for  # noqa: E402


def create_to_ready(cluster, ns: str, manifest: dict) -> float:
    started = time.monotonic()
    cluster.core.create_namespaced_pod(ns, manifest)
    cluster.wait_for_pod(ns, manifest["metadata"]["name"], timeout=60)
    return time.monotonic() - started


def all_ready(cluster, ns: str, count: int) -> bool:
    pods = cluster.core.list_namespaced_pod(ns).items
    return len(pods) == count and all(pod_ready(p) for p in pods)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "local_cluster.json")
    parser.add_argument("--window", type=float, default=60.0, help="CPU sampling window (s)")
    args = parser.parse_args()
    from kubernetes import client

    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="adpfleet-measure-") as tmp:
        started = time.monotonic()
        cluster = start_cluster(Path(tmp) / "cluster", agent_args=[])
        results["cluster_up_s"] = time.monotonic() - started
        results["apiserver_ready_s"] = cluster.report.apiserver_ready_s
        try:
            core = cluster.core
            for ns in ("latency", "idle", "fleet"):
                core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
                wait_for(lambda: core.read_namespaced_service_account("default", ns), timeout=30, what="default SA")

            no_probe = [create_to_ready(cluster, "latency", pod_manifest(
                f"bare-{i}", ["python3", "-m", "http.server", "--bind", "$(POD_IP)", "8080"])) for i in range(5)]
            probed = [create_to_ready(cluster, "latency", http_server_pod(f"probed-{i}")) for i in range(5)]
            results["create_to_ready_no_probe_s"] = statistics.median(no_probe)
            results["create_to_ready_http_probe_1s_s"] = statistics.median(probed)
            core.delete_collection_namespaced_pod("latency")

            for i in range(20):  # idle servers, probed at the default period (10 s)
                core.create_namespaced_pod("idle", http_server_pod(f"idle-{i}", probe_period=10))
            wait_for(lambda: all_ready(cluster, "idle", 20), timeout=180, what="20 idle pods Ready", interval=1)
            wait_for(lambda: not core.list_namespaced_pod("latency").items, timeout=60, what="latency pods gone")
            components = cluster.plane.state["components"]
            window_start = time.monotonic()
            samplers = {name: ProcessSampler(record["pid"], interval=args.window / 10).start()
                        for name, record in components.items()}
            time.sleep(args.window)  # a measurement window, not a wait for a condition
            for name, sampler in samplers.items():
                sampler.stop()
                sampler.sample()
                results[f"{name}_cpu_percent_20_idle_pods"] = sampler.cpu_percent(window_start, time.monotonic())
                results[f"{name}_rss_mib"] = sampler.peak_rss()

            started = time.monotonic()
            ghost = {"annotations": {"adpfleet.io/node-agent": "status-only"}}
            for i in range(300):
                core.create_namespaced_pod("fleet", pod_manifest(f"fleet-{i // 6}-{i % 6}", ["serve"], metadata=ghost))
            wait_for(lambda: all_ready(cluster, "fleet", 300), timeout=300, what="300 status-only pods", interval=0.5)
            results["status_only_300_pods_create_to_all_ready_s"] = time.monotonic() - started
        finally:
            cluster.plane.down()

    print(format_table(["measurement", "value"], [[k, round(v, 2)] for k, v in results.items()]))
    results["machine"] = {"cpu_count": os.cpu_count(), "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
                          "window_s": args.window}
    args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
