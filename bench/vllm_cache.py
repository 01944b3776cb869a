"""A vLLM server's start with its cache volume empty (a first start) and filled (a restart) (issue 30).

    .venv/bin/python bench/vllm_cache.py [--pairs 2]

One local control plane and operator, the real vLLM (`scripts/setup --with-vllm`). Each start is one
InferenceFleet of one aggregated `vllm serve` server (the vLLM e2e tests' flags: float32, eager, one
unbound OpenMP thread; no router), its `vllm.cache` a hostPath: a new empty directory (cold) or the
one an earlier start filled (warm). Per start: the fleet applied -> the server pod Ready (wall), and
the CPU-seconds of the server container's processes when it turned Ready (each live process's own
time plus that of the children it reaped: vLLM's model-inspection subprocess, its engine's
workers). Pairs alternate their order (cold, warm; then warm, cold) so a drift of the machine's
load falls on both arms. Prints a table and writes bench/results/vllm_cache.json; docs/operator.md
cites it (tests/test_docs_figures.py checks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import format_table, machine_info, operator_cluster, wait  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "vllm_cache.json"
NAMESPACE = "bench"
START_TIMEOUT = 600  # seconds: a vLLM start on two cores that other work shares
METRICS = ("apply_to_ready_s", "server_cpu_s")


def manifest(name: str, model_dir: str, cache_dir: Path) -> dict:
    from adpfleet.operator.resource import names

    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"image": "adpfleet:dev", "engine": "vllm", "router": {"enabled": False},
                     "model": {"uri": model_dir, "servedName": "tiny-llama"},
                     "vllm": {"image": "vllm/vllm-openai:v0.32.0", "args": ["--dtype", "float32", "--enforce-eager"],
                              "cache": {"hostPath": {"path": str(cache_dir)}}},
                     "aggregated": {"servers": 1, "terminationGracePeriodSeconds": 5,
                                    "probes": {"readinessPeriodSeconds": 1, "startupTimeoutSeconds": START_TIMEOUT},
                                    "env": [{"name": k, "value": v} for k, v in env.items()]}}}


def ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def server_cpu_seconds(pod_uid: str) -> float:
    """CPU-seconds of the pod's server container so far: every live process of it (found by the node
    agent's mark, then by descent) with the children it has reaped."""
    from adpfleet.cluster import processes

    roots = processes.processes_with_env("ADPFLEET_POD_UID", pod_uid)
    total = 0.0
    for proc, _title in processes.process_titles(roots):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def start(cluster, name: str, model_dir: str, cache_dir: Path) -> dict:
    """Apply a one-server fleet, wait for its pod Ready, read its CPU, delete the fleet."""
    from adpfleet.operator.resource import names
    custom, core = cluster.custom, cluster.core
    selector = f"{names.LABEL_FLEET}={name}"
    t0 = time.monotonic()
    custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL,
                                           manifest(name, model_dir, cache_dir))
    pod = wait(lambda: next((p for p in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
                             if ready(p)), None), START_TIMEOUT, f"{name}: its server Ready", interval=0.2)
    wall = time.monotonic() - t0
    cpu = server_cpu_seconds(pod.metadata.uid)
    custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, name)
    wait(lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=selector).items, 180, f"{name}'s pod gone")
    return {"apply_to_ready_s": round(wall, 1), "server_cpu_s": round(cpu, 1),
            "modelinfos": len(list((cache_dir / "modelinfos").glob("*.json")))}


def run(args) -> dict:
    from adpfleet.cluster.vllm_model import build_model

    model_dir = str(build_model())
    rows: dict[str, list[dict]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="adpfleet-bench-vllm-cache-") as tmp, \
            operator_cluster("adpfleet-bench-vllm-cache-", NAMESPACE) as cluster:
        filled: Path | None = None
        for i in range(args.pairs):
            for arm in ("cold", "warm") if i % 2 == 0 or filled is None else ("warm", "cold"):
                cache = Path(tempfile.mkdtemp(dir=tmp)) if arm == "cold" else filled
                row = {"pair": i, **start(cluster, f"vc{i}{arm}", model_dir, cache)}
                filled = cache
                print(f"pair {i} {arm}: {json.dumps(row)}", flush=True)
                rows[arm].append(row)
    arms = [{"arm": arm, "starts": starts, **{m: round(statistics.median(r[m] for r in starts), 1) for m in METRICS}}
            for arm, starts in rows.items()]
    cold, warm = arms
    return {"benchmark": "vllm_cache", "pairs": args.pairs, "arms": arms,
            "ratio_warm_to_cold": {m: round(warm[m] / cold[m], 2) for m in METRICS},
            "contended": "2 cores shared with other test suites and helpers during the run",
            "machine": machine_info()}


def doc_rows(result: dict) -> list[str]:
    """The table docs/operator.md shows: one markdown row per arm and one for the ratio."""
    rows = [f"| {a['arm']} | {a['apply_to_ready_s']} s | {a['server_cpu_s']} s |" for a in result["arms"]]
    ratio = result["ratio_warm_to_cold"]
    rows.append(f"| warm / cold | {ratio['apply_to_ready_s']:.2f}x | {ratio['server_cpu_s']:.2f}x |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    result = run(args)
    print(format_table(["cache", "apply -> Ready s", "server CPU s at Ready"],
                       [[a["arm"], *(a[m] for m in METRICS)] for a in result["arms"]]))
    print("\n".join(doc_rows(result)))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
