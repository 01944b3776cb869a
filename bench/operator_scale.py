"""Operator at scale against the real API server: 50 fleets of 6 servers each.

    .venv/bin/python bench/operator_scale.py [--fleets 50] [--steady-periods 3] [--resync-seconds 10]

A fresh local control plane (etcd, kube-apiserver, kube-controller-manager, node agent) is started
in a temporary directory. Fleets carry the node agent's status-only annotation (spec.podMetadata),
so their pods are bound, given an address and reported Ready without running a process: this
measures the operator and the control plane, not the inference servers.

The operator runs as a real `adpfleet operator` process whose every API request goes through a
counting proxy (cluster/apiproxy.py), so request counts are observed from outside the operator.
Measured:
  - time from the apply of all fleets to every fleet Ready (and Progressing=False) at its generation;
  - API requests per fleet until then, by verb (reads, writes; the operator's watches excluded);
  - requests and writes per steady-state period (one resync period: every fleet reconciled once
    from the caches), over several periods;
  - the operator's RSS (peak and at rest) and CPU (seconds during convergence, % of a core at rest).
Targets: converge < 60 s, 0 writes at steady state, RSS < 200 MB.

Prints a table and writes bench/results/operator_scale.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import Background, ProcessSampler  # noqa: E402
RESULTS = ROOT / "bench" / "results" / "operator_scale.json"
STATUS_ONLY = {"adpfleet.io/node-agent": "status-only"}
NAMESPACE = "bench"
WATCHED_KINDS = 7  # fleets, pods, deployments, services, service accounts, roles, role bindings


def fleet(name: str, context: int, generation: int) -> dict:
    role = lambda n: {"servers": n, "adpRanks": 2, "engine": {"kvBlocks": 64}}  # noqa: E731
    return {"apiVersion": "adpfleet.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"image": "adpfleet:bench", "model": {"name": "tiny"}, "context": role(context),
                     "generation": role(generation), "podMetadata": {"annotations": STATUS_ONLY}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PodChangeCounter(Background):
    """Counts pod watch events (ADDED/MODIFIED/DELETED) in the namespace while it runs."""

    def __init__(self, api_client):
        from kubernetes import client
        super().__init__()
        self.core = client.CoreV1Api(api_client)
        self.count = 0

    def start(self) -> "PodChangeCounter":
        version = self.core.list_namespaced_pod(NAMESPACE).metadata.resource_version
        self._version = version
        return super().start()

    def _run(self) -> None:
        from kubernetes import watch
        while not self._stop.is_set():
            for event in watch.Watch().stream(self.core.list_namespaced_pod, NAMESPACE,
                                              resource_version=self._version, timeout_seconds=1):
                self._version = event["object"].metadata.resource_version
                if not self._stop.is_set():
                    self.count += 1


def all_fleets(custom) -> list[dict]:
    return custom.list_namespaced_custom_object("adpfleet.io", "v1alpha1", NAMESPACE, "inferencefleets")["items"]


def converged(item: dict) -> bool:
    status = item.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
    return (status.get("observedGeneration") == item["metadata"]["generation"]
            and conditions.get("Ready") == "True" and conditions.get("Progressing") == "False")


def by_verb(requests) -> dict[str, int]:
    return dict(sorted(Counter(r.verb for r in requests if r.verb != "watch").items()))


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {")


def run(args) -> dict:
    from kubernetes import client, config

    from adpfleet.cluster.apiproxy import CountingProxy
    from adpfleet.cluster.controlplane import ControlPlane
    from adpfleet.operator.resource import crd

    state = Path(tempfile.mkdtemp(prefix="adpfleet-bench-"))
    plane = ControlPlane(state, agent_args=[])
    t = time.monotonic()
    report = plane.up()
    print(f"control plane up in {time.monotonic() - t:.1f} s ({state})", flush=True)
    operator = sampler = None
    try:
        kubectl = [str(report.binaries.kubectl), f"--kubeconfig={plane.kubeconfig}"]
        crd_file = state / "crd.yaml"
        crd_file.write_text(crd.crd_yaml())
        subprocess.run(kubectl + ["apply", "--server-side", "-f", str(crd_file)], check=True, capture_output=True)
        subprocess.run(kubectl + ["create", "namespace", NAMESPACE], check=True, capture_output=True)
        api = config.new_client_from_config(str(plane.kubeconfig))
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        deadline = time.monotonic() + 60
        while not any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(NAMESPACE).items):
            assert time.monotonic() < deadline, "no default service account"
            time.sleep(0.2)
        time.sleep(1)  # the CRD's discovery document must be served before the operator starts

        proxy = CountingProxy(plane.kubeconfig).start()
        port = free_port()
        argv = [str(Path(sys.executable).with_name("adpfleet")), "operator", "--namespace", NAMESPACE,
                "--http-host", "127.0.0.1", "--http-port", str(port), "--resync-seconds", str(args.resync_seconds),
                "--stall-detection", args.stall_detection]
        log = open(state / "operator.log", "w")
        operator = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env={"KUBECONFIG": str(proxy.write_kubeconfig(state / "operator.kubeconfig")),
                                         "PATH": "/usr/bin:/bin", "HOME": str(state)})
        sampler = ProcessSampler(operator.pid).start()
        deadline = time.monotonic() + 60
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2).status == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and operator.poll() is None, f"operator did not start: {state}"
            time.sleep(0.2)
        # Ready means kopf has started; its watches (one per resource kind) open just after. Start
        # the clock when they are open, so the operator's own start-up is not billed to the fleets.
        while len({r.resource for r in proxy.snapshot() if r.verb == "watch"}) < WATCHED_KINDS:
            assert time.monotonic() < deadline, f"the operator's watches did not open: {state}"
            time.sleep(0.2)
        time.sleep(1)
        rss_idle = sampler.peak_rss(time.monotonic() - 1)

        manifests = [fleet(f"fleet-{i:03d}", args.context, args.generation) for i in range(args.fleets)]
        applied = state / "fleets.yaml"
        applied.write_text(yaml.safe_dump_all(manifests))
        start = time.monotonic()
        subprocess.run(kubectl + ["apply", "--server-side", "-f", str(applied)], check=True, capture_output=True)
        apply_seconds = time.monotonic() - start
        ready_at = None
        while ready_at is None:
            items = all_fleets(custom)
            if len(items) == args.fleets and all(converged(i) for i in items):
                ready_at = time.monotonic()
            elif time.monotonic() - start > args.timeout:
                raise SystemExit(f"not converged after {args.timeout} s: "
                                 f"{sum(converged(i) for i in items)}/{args.fleets}")
            else:
                time.sleep(0.2)
        converge_seconds = ready_at - start
        print(f"{args.fleets} fleets Ready in {converge_seconds:.1f} s", flush=True)
        converge_requests = [r for r in proxy.snapshot() if start <= r.time <= ready_at]

        # Let the last writes of convergence (status, events) pass, then measure whole resync periods.
        settle_until = time.monotonic() + 3
        while time.monotonic() < settle_until:
            time.sleep(0.2)
        passes_before = metric(port, "adpfleet_operator_reconciles_total")
        # Writes at rest are only a fault if nothing changed: count the changes to pods that the
        # operator did not make (the node agent's status updates, e.g. readiness) in the same window.
        pod_changes = PodChangeCounter(api).start()
        steady_start = time.monotonic()
        time.sleep(args.steady_periods * args.resync_seconds)
        steady_end = time.monotonic()
        pod_changes.stop()
        passes = metric(port, "adpfleet_operator_reconciles_total") - passes_before
        steady = [r for r in proxy.snapshot() if steady_start <= r.time <= steady_end]
        pods = len(core.list_namespaced_pod(NAMESPACE).items)

        result = {
            "fleets": args.fleets,
            "servers_per_fleet": args.context + args.generation,
            "pods": pods,
            "converge_seconds": round(converge_seconds, 2),
            "apply_seconds": round(apply_seconds, 2),
            "converge_requests_per_fleet": round(len([r for r in converge_requests if r.verb != "watch"])
                                                 / args.fleets, 1),
            "converge_writes_per_fleet": round(len(CountingProxy.writes(converge_requests)) / args.fleets, 1),
            "converge_requests_by_verb": by_verb(converge_requests),
            "converge_requests_by_resource": dict(Counter(f"{r.verb} {r.resource}" for r in converge_requests
                                                          if r.verb != "watch").most_common()),
            "stall_detection": args.stall_detection,
            "steady_periods": args.steady_periods,
            "resync_seconds": args.resync_seconds,
            "steady_reconcile_passes": int(passes),
            "steady_requests_per_period": round(len([r for r in steady if r.verb != "watch"]) / args.steady_periods, 2),
            "steady_writes_per_period": round(len(CountingProxy.writes(steady)) / args.steady_periods, 2),
            "steady_pod_changes_by_others": pod_changes.count,
            "steady_requests_by_resource": dict(Counter(f"{r.verb} {r.resource}" for r in steady
                                                        if r.verb != "watch").most_common()),
            "steady_requests_first": [f"{r.verb} {r.path} -> {r.status}" for r in steady if r.verb != "watch"][:20],
            "operator_rss_mb_idle": round(rss_idle, 1),
            "operator_rss_mb_peak": round(sampler.peak_rss(), 1),
            "operator_rss_mb_steady": round(sampler.peak_rss(steady_start, steady_end), 1),
            "operator_cpu_seconds_converge": round(sampler.cpu_seconds(start, ready_at), 2),
            "operator_cpu_percent_steady": round(100 * sampler.cpu_seconds(steady_start, steady_end)
                                                 / (steady_end - steady_start), 2),
            "targets": {"converge_seconds": 60, "steady_writes_per_period": 0, "operator_rss_mb_peak": 200},
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
        }
        result["targets_met"] = (result["converge_seconds"] < 60 and result["steady_writes_per_period"] == 0
                                 and result["operator_rss_mb_peak"] < 200)
        proxy.stop()
        return result
    finally:
        if sampler:
            sampler.stop()
        if operator and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
        if not args.keep:
            plane.down()
        else:
            print(f"kept the control plane: {state}")


def table(result: dict) -> str:
    rows = [
        ("fleets x servers (pods incl. routers)", f"{result['fleets']} x {result['servers_per_fleet']} "
                                                   f"({result['pods']})", ""),
        ("apply -> all fleets Ready", f"{result['converge_seconds']:.1f} s", "< 60 s"),
        ("API requests per fleet to converge", f"{result['converge_requests_per_fleet']:.1f}", ""),
        ("  of which writes", f"{result['converge_writes_per_fleet']:.1f}", ""),
        (f"requests per steady period ({result['resync_seconds']:g} s resync, "
         f"{result['steady_reconcile_passes']} passes in {result['steady_periods']})",
         f"{result['steady_requests_per_period']:g}", ""),
        ("writes per steady period", f"{result['steady_writes_per_period']:g}", "0"),
        ("operator RSS idle / peak / steady", f"{result['operator_rss_mb_idle']:.0f} / "
                                              f"{result['operator_rss_mb_peak']:.0f} / "
                                              f"{result['operator_rss_mb_steady']:.0f} MB", "< 200 MB"),
        ("operator CPU while converging", f"{result['operator_cpu_seconds_converge']:.1f} s", ""),
        ("operator CPU at rest", f"{result['operator_cpu_percent_steady']:.2f} % of a core", ""),
    ]
    widths = [max(len(r[i]) for r in rows + [("measure", "value", "target")]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("measure", "value", "target"), widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleets", type=int, default=50)
    p.add_argument("--context", type=int, default=3, help="context servers per fleet")
    p.add_argument("--generation", type=int, default=3, help="generation servers per fleet")
    p.add_argument("--steady-periods", type=int, default=3)
    p.add_argument("--resync-seconds", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--stall-detection", choices=["off", "on"], default="off",
                   help="the operator's stall detection scrapes every server's /metrics; status-only pods run no "
                        "server, so it is off by default here (it would only measure failing scrapes)")
    p.add_argument("--keep", action="store_true", help="leave the control plane running")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args()
    result = run(args)
    print(table(result))
    print(f"by verb while converging: {result['converge_requests_by_verb']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
