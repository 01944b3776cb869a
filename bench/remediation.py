"""Stall remediation, measured per fault on a real fleet under a steady client load.

    .venv/bin/python bench/remediation.py [--window 6] [--interval 1] [--clients 4]

A fresh local control plane and node agent run the operator and a fleet (one context server with
2 ADP ranks and padding off, one generation server, the router; servers accept injected faults).
For each fault — starve a context rank (vetoed), freeze the generation rank (hung), stop KV reaping
on the context server (transfer) — it measures:
  - detection: fault → the operator's decision (its Pending record), and last real token → decision
    (the server's own `adpfleet_last_progress_timestamp_seconds`, from the evidence);
  - first action: fault → the drain annotation; the pod's deletion;
  - restart: deletion → the replacement Ready; progress restored: deletion → first request
    completed through the router;
  - requests in the episode: completed, failed with an explicit error, retried by the router, lost
    (no answer by the client's deadline).
Targets (issue 7): detection ≤ window + 2 scrape intervals after the last token; progress restored
≤ restart time + 10 s; 0 lost. Prints a table, writes bench/results/remediation.json and plots
tokens/s over time with fault and action markers to docs/remediation-bench.png.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the e2e tests' fleet, load and fault helpers
sys.path.insert(0, str(ROOT / "bench"))

from common import Background  # noqa: E402
from stall_harness import Load, free_port, inject, remediations, stall_fleet  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "remediation.json"
PLOT = ROOT / "docs" / "remediation-bench.png"
NAMESPACE = "bench"
FLEET = "bench"
FAULTS = [("starve", 1, "context", "vetoed"), ("freeze", 0, "generation", "hung"),
          ("stop-reaping", 0, "context", "transfer")]


class PodWatch(Background):
    """Polls the fleet's server pods: when each uid was drained, deleted, and became Ready."""

    def __init__(self, core, namespace: str):
        super().__init__()
        self.core, self.ns = core, namespace
        self.first_seen: dict[str, float] = {}
        self.drained: dict[str, float] = {}
        self.deleted: dict[str, float] = {}
        self.ready: dict[str, float] = {}
        self.names: dict[str, str] = {}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = self.core.list_namespaced_pod(self.ns, label_selector="adpfleet.io/role").items
            except Exception:  # noqa: BLE001 - a transient API error: poll again
                time.sleep(0.2)
                continue
            now = time.time()
            for p in pods:
                uid = p.metadata.uid
                self.names[uid] = p.metadata.name
                self.first_seen.setdefault(uid, now)
                if (p.metadata.annotations or {}).get("adpfleet.io/drain") == "true":
                    self.drained.setdefault(uid, now)
                if p.metadata.deletion_timestamp is not None:
                    self.deleted.setdefault(uid, now)
                if any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or [])):
                    self.ready.setdefault(uid, now)
            time.sleep(0.1)

    def replacement(self, name: str, after: float) -> str | None:
        for uid, seen in sorted(self.first_seen.items(), key=lambda kv: kv[1]):
            if self.names[uid] == name and seen > after:
                return uid
        return None


def router_retries(url: str) -> float:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("adpfleet_router_retries") and not line.startswith("#"))


def wait(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception:  # noqa: BLE001 - not yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def run(args) -> dict:
    from kubernetes import client, config

    from adpfleet.cluster.controlplane import ControlPlane
    from adpfleet.operator.decisions.history import parse_rfc3339
    from adpfleet.operator.resource import crd, names

    state = Path(tempfile.mkdtemp(prefix="adpfleet-bench-remediation-"))
    plane = ControlPlane(state, agent_args=["--backoff-initial=1", "--backoff-max=8"])
    report = plane.up()
    operator = watch = None
    try:
        kubectl = [str(report.binaries.kubectl), f"--kubeconfig={plane.kubeconfig}"]
        (state / "crd.yaml").write_text(crd.crd_yaml())
        subprocess.run(kubectl + ["apply", "--server-side", "-f", str(state / "crd.yaml")], check=True,
                       capture_output=True)
        subprocess.run(kubectl + ["create", "namespace", NAMESPACE], check=True, capture_output=True)
        api = config.new_client_from_config(str(plane.kubeconfig))
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        wait(lambda: core.read_namespaced_service_account("default", NAMESPACE), 60, "the default service account")
        time.sleep(1)
        port = free_port()
        operator = subprocess.Popen(
            [str(Path(sys.executable).with_name("adpfleet")), "operator", "--namespace", NAMESPACE, "--http-host",
             "127.0.0.1", "--http-port", str(port), "--log-format", "plain"],
            stdout=open(state / "operator.log", "w"), stderr=subprocess.STDOUT,
            env={"KUBECONFIG": str(plane.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(state)})
        wait(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200, 60, "the operator")
        manifest = stall_fleet(FLEET, window=args.window, interval=args.interval, cooldown=5, budget=100)
        manifest["metadata"]["namespace"] = NAMESPACE
        custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, manifest)

        def fleet():
            return custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, FLEET)

        def live(role):
            return [p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"adpfleet.io/role={role}").items
                    if p.metadata.deletion_timestamp is None]

        def healthy():
            pods = [live("context"), live("generation")]
            if not all(len(p) == 1 and any(c.type == "Ready" and c.status == "True"
                                           for c in (p[0].status.conditions or [])) for p in pods):
                return False
            ready = next((c for c in fleet().get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
            return ready.get("status") == "True"

        def router_url():
            pods = core.list_namespaced_pod(NAMESPACE, label_selector="app.kubernetes.io/component=router").items
            ip = next(p.status.pod_ip for p in pods if p.metadata.deletion_timestamp is None and p.status.pod_ip)
            return f"http://{ip}:{names.ROUTER_HTTP_PORT}"

        wait(healthy, 300, "the fleet Ready")
        watch = PodWatch(core, NAMESPACE).start()
        url = router_url()
        rows = []
        t0 = time.time()
        with Load(url, clients=args.clients) as load:
            wait(lambda: load.completed_since(time.time() - 5) >= 3, 120, "traffic flowing")
            time.sleep(5)
            for fault, rank, role, signature in FAULTS:
                wait(healthy, 300, "the fleet Ready")
                start = time.time()
                wait(lambda: load.completed_since(start) >= 3, 120, "traffic flowing")
                victim = live(role)[0]
                retries_before = router_retries(url)
                t_fault = time.time()
                inject(core, victim, fault, rank)
                record = wait(lambda: next((r for r in remediations(fleet()) if r["server"] == victim.metadata.name
                                            and parse_rfc3339(r["time"]) >= t_fault and r["outcome"] == "Succeeded"),
                                           None), 240, f"the remediation of {victim.metadata.name}")
                t_decision = parse_rfc3339(record["time"])
                uid = victim.metadata.uid
                t_deleted = wait(lambda: watch.deleted.get(uid), 60, "the deletion")
                new = wait(lambda: watch.replacement(victim.metadata.name, t_fault), 120, "the replacement pod")
                t_ready = wait(lambda: watch.ready.get(new), 300, "the replacement Ready")
                t_restored = wait(lambda: min((o.end for o in load.outcomes if o.kind == "completed"
                                               and o.end > t_deleted), default=None), 120, "progress restored")
                time.sleep(3)
                since_progress = re.search(r"seconds_since_last_progress=([0-9.]+)", record["message"])
                episode = [o for o in load.outcomes if t_fault <= o.start <= t_restored]
                rows.append({
                    "fault": fault, "rank": rank, "server": victim.metadata.name, "expected_signature": signature,
                    "signature": record["signature"], "action": record["action"],
                    "fault_at_s": round(t_fault - t0, 2),
                    "fault_to_detection_s": round(t_decision - t_fault, 2),
                    "last_progress_to_detection_s": float(since_progress.group(1)) if since_progress else None,
                    "fault_to_drain_s": round(watch.drained.get(uid, t_deleted) - t_fault, 2),
                    "fault_to_delete_s": round(t_deleted - t_fault, 2),
                    "restart_s": round(t_ready - t_deleted, 2),
                    "delete_to_progress_s": round(t_restored - t_deleted, 2),
                    "fault_to_progress_s": round(t_restored - t_fault, 2),
                    "detection_at_s": round(t_decision - t0, 2), "delete_at_s": round(t_deleted - t0, 2),
                    "ready_at_s": round(t_ready - t0, 2), "restored_at_s": round(t_restored - t0, 2),
                    "completed": sum(o.kind == "completed" for o in episode),
                    "failed": sum(o.kind == "error" for o in episode),
                    "lost": sum(o.kind == "lost" for o in episode),
                    "router_retries": router_retries(router_url()) - retries_before,
                })
                print(json.dumps(rows[-1]), flush=True)
            time.sleep(10)
        t_end = time.time()
        totals = load.counts()
        series = load.tokens_per_second(t0, t_end)
        budget = args.window + 2 * args.interval
        for row in rows:
            row["detection_ok"] = (row["last_progress_to_detection_s"] or 1e9) <= budget
            row["progress_ok"] = row["delete_to_progress_s"] <= row["restart_s"] + 10
        return {"window_s": args.window, "interval_s": args.interval, "clients": args.clients,
                "detection_budget_s": budget, "faults": rows, "requests": totals,
                "tokens_per_second": series, "state_dir": str(state)}
    finally:
        if watch:
            watch.stop()
        if operator:
            operator.terminate()
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
        plane.down()


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [t for t, _ in result["tokens_per_second"]]
    ys = [v for _, v in result["tokens_per_second"]]
    fig, ax = plt.subplots(figsize=(11, 4.4))
    ax.plot(xs, ys, lw=1, color="black", label="tokens/s completed through the router")
    for i, row in enumerate(result["faults"]):
        first = i == 0
        ax.axvline(row["fault_at_s"], color="red", ls="--", lw=1, label="fault injected" if first else None)
        ax.axvline(row["detection_at_s"], color="orange", lw=1, label="stall detected (decision)" if first else None)
        ax.axvline(row["delete_at_s"], color="blue", lw=1, label="drained + pod deleted" if first else None)
        ax.axvline(row["ready_at_s"], color="green", lw=1, label="replacement Ready" if first else None)
        ax.text(row["fault_at_s"], max(ys or [1]) * 0.95, f" {row['fault']}\n ({row['signature']})", fontsize=8,
                va="top")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"adpfleet stall remediation (window {result['window_s']} s, scrape every {result['interval_s']} s)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=6, help="remediation.stallWindowSeconds")
    p.add_argument("--interval", type=int, default=1, help="monitoring.scrapeIntervalSeconds")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, default=PLOT)
    args = p.parse_args()
    from common import format_table, machine_info

    result = run(args)
    result["machine"] = machine_info()
    headers = ["fault", "signature", "fault→detect s", "last token→detect s", "fault→delete s", "restart s",
               "delete→progress s", "completed", "failed", "retried", "lost", "targets met"]
    rows = [[r["fault"], r["signature"], r["fault_to_detection_s"], r["last_progress_to_detection_s"],
             r["fault_to_delete_s"], r["restart_s"], r["delete_to_progress_s"], r["completed"], r["failed"],
             r["router_retries"], r["lost"], "yes" if r["detection_ok"] and r["progress_ok"] and not r["lost"] else "NO"]
            for r in result["faults"]]
    print(format_table(headers, rows))
    print(f"detection budget (window + 2 intervals): {result['detection_budget_s']} s; all requests: "
          f"{result['requests']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0 if all(r["detection_ok"] and r["progress_ok"] and not r["lost"] for r in result["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
