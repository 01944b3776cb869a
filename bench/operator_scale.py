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

    .venv/bin/python bench/operator_scale.py --scrape

The operator as it runs in production: every server pod answers /metrics (one process,
cluster/synthetic_metrics.py, listens on every pod's own 127.x address and serves 2 ranks of
synthetic counters), stall detection is on and every role has the autoscaling policy on (3 to 6
servers, at its floor: it decides every tick and changes nothing), scraped every 5 s with a 30 s
stall window (DryRun: a stall is recorded, not acted on). Measured at rest: the operator's CPU (% of
one core) and RSS, scrapes per second, the scrape latency p99 (from the operator's own histogram);
then one server is made to hang (its counters stop) and the time to the operator's decision (the
DryRun record's time) is compared with window + 2 intervals. Targets: < 50 % of a core, < 250 MB,
decision within window + 2 intervals. Writes bench/results/operator_scale_detection.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

import yaml

from adpfleet.cluster.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import Background, ProcessSampler  # noqa: E402
RESULTS = ROOT / "bench" / "results" / "operator_scale.json"
STATUS_ONLY = {"adpfleet.io/node-agent": "status-only"}
NAMESPACE = "bench"
WATCHED_KINDS = 7  # fleets, pods, deployments, services, service accounts, roles, role bindings
RESULTS_SCRAPE = ROOT / "bench" / "results" / "operator_scale_detection.json"
SCRAPE_INTERVAL, STALL_WINDOW = 5, 30  # seconds (--scrape)
SCRAPE_TARGETS = {"operator_cpu_percent_steady": 50, "operator_rss_mb_peak": 250}


def fleet(name: str, context: int, generation: int, scrape: bool = False) -> dict:
    def role(n: int) -> dict:
        out = {"servers": n, "adpRanks": 2, "engine": {"kvBlocks": 64}}
        if scrape:  # the policy reads every tick's scrapes; at its floor it holds the count
            out["autoscaling"] = {"enabled": True, "minServers": n, "maxServers": 2 * n,
                                  "targets": {"waitingPerRank": 4, "kvCacheUtilization": 0.8}}
        return out
    spec = {"image": "adpfleet:bench", "model": {"name": "tiny"}, "context": role(context),
            "generation": role(generation), "podMetadata": {"annotations": STATUS_ONLY}}
    if scrape:
        spec["monitoring"] = {"scrapeIntervalSeconds": SCRAPE_INTERVAL}
        spec["remediation"] = {"mode": "DryRun", "stallWindowSeconds": STALL_WINDOW}
    return {"apiVersion": "adpfleet.io/v1alpha1", "kind": "InferenceFleet",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


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


def metric(port: int, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {"
               and all(f'{k}="{v}"' in line for k, v in labels.items()))


def histogram(port: int, name: str) -> dict[float, float]:
    """Cumulative bucket counts of a histogram on the operator's /metrics: upper bound -> count."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(bound)] = float(line.rsplit(" ", 1)[1])
    return out


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The q-quantile of the observations between two reads of a histogram, interpolated within
    its bucket (as Prometheus's histogram_quantile does)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return None


class SyntheticServers:
    """cluster/synthetic_metrics.py in its own process: /metrics on every server pod's address."""

    def __init__(self, kubeconfig: Path, log: Path):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "adpfleet.cluster.synthetic_metrics", "--kubeconfig",
                                      str(kubeconfig), "--namespace", NAMESPACE, "--control-port", str(self.port)],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.call("/pods")
                break
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, f"synthetic servers did not start: {log}"
                time.sleep(0.2)

    def call(self, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method="POST" if body else "GET",
                                         data=json.dumps(body).encode() if body else None)
        with urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def detect_stall(custom, servers: SyntheticServers, fleet_name: str, pod: str, timeout: float) -> dict:
    """Make `pod` hang (its counters stop), then wait for the operator's decision on it: the
    DryRun record in the fleet's status. Seconds from the hang to the decision, and to the moment
    this poll saw the Stalled condition."""
    from adpfleet.operator.decisions.history import parse_rfc3339

    hung_at = servers.call("/stall", {"pod": pod, "signature": "hung"})["stalled_at"]
    seen_stalled = None
    deadline = time.time() + timeout
    while time.time() < deadline:
        item = custom.get_namespaced_custom_object("adpfleet.io", "v1alpha1", NAMESPACE, "inferencefleets", fleet_name)
        status = item.get("status") or {}
        stalled = next((c for c in status.get("conditions", []) if c["type"] == "Stalled"), {})
        if seen_stalled is None and stalled.get("status") == "True":
            seen_stalled = time.time()
        records = [r for r in status.get("recentRemediations") or [] if r.get("server") == pod]
        if records:
            decided = min(parse_rfc3339(r["time"]) for r in records)
            return {"pod": pod, "signature": "hung", "record": records[-1],
                    "hung_to_decision_seconds": round(decided - hung_at, 1),
                    "hung_to_stalled_condition_seen_seconds": round((seen_stalled or time.time()) - hung_at, 1)}
        time.sleep(0.5)
    raise SystemExit(f"no decision on {pod} within {timeout:.0f} s of its hang")


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
    operator = sampler = servers = None
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
        if args.scrape:
            servers = SyntheticServers(plane.kubeconfig, state / "synthetic_metrics.log")

        proxy = CountingProxy(plane.kubeconfig).start()
        port = free_port()
        argv = [str(Path(sys.executable).with_name("adpfleet")), "operator", "--namespace", NAMESPACE,
                "--http-host", "127.0.0.1", "--http-port", str(port), "--resync-seconds", str(args.resync_seconds),
                "--stall-detection", "on" if args.scrape else args.stall_detection]
        log = open(state / "operator.log", "w")
        operator = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    env={"KUBECONFIG": str(proxy.write_kubeconfig(state / "operator.kubeconfig")),
                                         "PATH": "/usr/bin:/bin", "HOME": str(state)})
        sampler = ProcessSampler(operator.pid).start()
        servers_sampler = ProcessSampler(servers.proc.pid).start() if servers else None
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

        manifests = [fleet(f"fleet-{i:03d}", args.context, args.generation, args.scrape) for i in range(args.fleets)]
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
        if args.scrape:  # every server answering, and each scraped a few times: detection is in its stride
            server_pods = args.fleets * (args.context + args.generation)
            while len(servers.call("/pods")) < server_pods:
                assert time.monotonic() - ready_at < 60, "the synthetic servers did not follow the pods"
                time.sleep(0.5)
            settle_until = time.monotonic() + 3 * SCRAPE_INTERVAL
        while time.monotonic() < settle_until:
            time.sleep(0.2)
        passes_before = metric(port, "adpfleet_operator_reconciles_total")
        if args.scrape:
            scrapes_before = {r: metric(port, "adpfleet_operator_scrapes_total", result=r) for r in ("ok", "failed")}
            latency_before = histogram(port, "adpfleet_operator_scrape_duration_seconds")
        # Writes at rest are only a fault if nothing changed: count the changes to pods that the
        # operator did not make (the node agent's status updates, e.g. readiness) in the same window.
        pod_changes = PodChangeCounter(api).start()
        steady_start = time.monotonic()
        time.sleep(args.steady_periods * args.resync_seconds)
        steady_end = time.monotonic()
        pod_changes.stop()
        passes = metric(port, "adpfleet_operator_reconciles_total") - passes_before
        if args.scrape:
            scrapes = {r: metric(port, "adpfleet_operator_scrapes_total", result=r) - scrapes_before[r]
                       for r in ("ok", "failed")}
            latency_after = histogram(port, "adpfleet_operator_scrape_duration_seconds")
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
            "stall_detection": "on" if args.scrape else args.stall_detection,
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
        if args.scrape:
            # the fleet in the middle, a generation server (scraped by detection and the policy alike)
            victim_fleet = f"fleet-{args.fleets // 2:03d}"
            victim = next(p.metadata.name for p in core.list_namespaced_pod(
                NAMESPACE, label_selector=f"adpfleet.io/fleet={victim_fleet},adpfleet.io/role=generation").items)
            bound = STALL_WINDOW + 2 * SCRAPE_INTERVAL
            stall = detect_stall(custom, servers, victim_fleet, victim, timeout=3 * bound)
            steady_seconds = steady_end - steady_start
            latency = {f"p{int(q * 100)}": quantile(q, latency_before, latency_after) for q in (0.5, 0.99)}
            result.update({
                "scrape_interval_seconds": SCRAPE_INTERVAL,
                "stall_window_seconds": STALL_WINDOW,
                "ranks_per_server": 2,
                "autoscaling": "on, every role (at its floor: decides every tick, changes nothing)",
                "steady_scrapes_per_second": round(sum(scrapes.values()) / steady_seconds, 1),
                "steady_scrapes_failed": int(scrapes["failed"]),
                "operator_cpu_ms_per_scrape": round(1000 * sampler.cpu_seconds(steady_start, steady_end)
                                                    / max(1.0, sum(scrapes.values())), 2),
                "scrape_latency_ms": {k: (round(1000 * v, 2) if v is not None else None) for k, v in latency.items()},
                "scrape_latency_note": "interpolated within the operator's histogram buckets "
                                       "(adpfleet_operator_scrape_duration_seconds), over the steady window",
                "stall": stall,
                "stall_decision_bound_seconds": bound,
                "synthetic_servers_cpu_percent_steady": round(servers_sampler.cpu_percent(steady_start, steady_end), 1),
            })
            result["targets"] = {**result["targets"], **SCRAPE_TARGETS, "hung_to_decision_seconds": bound}
            result["targets_met"] = (result["targets_met"] and result["steady_scrapes_failed"] == 0
                                     and result["operator_cpu_percent_steady"] < SCRAPE_TARGETS[
                                         "operator_cpu_percent_steady"]
                                     and result["operator_rss_mb_peak"] < SCRAPE_TARGETS["operator_rss_mb_peak"]
                                     and stall["hung_to_decision_seconds"] <= bound)
        proxy.stop()
        return result
    finally:
        if sampler:
            sampler.stop()
        if servers:
            servers.stop()
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


BEFORE_KEYS = ("operator_cpu_percent_steady", "operator_cpu_ms_per_scrape", "operator_rss_mb_peak", "scrape_latency_ms",
               "steady_scrapes_per_second", "steady_scrapes_failed", "stall", "machine")


def with_before(result: dict, before: dict, tree: str) -> dict:
    """`result` with another tree's run of the same benchmark (e.g. main before a change) as "before"."""
    return {**result, "before": {"tree": tree, **{k: before.get(k) for k in BEFORE_KEYS}}}


def scrape_table(result: dict) -> str:
    stall = result["stall"]
    rows = [
        ("servers scraped (x 2 ranks), interval", f"{result['fleets'] * result['servers_per_fleet']}, "
                                                   f"{result['scrape_interval_seconds']} s", ""),
        ("scrapes per second at rest (failed)", f"{result['steady_scrapes_per_second']:g} "
                                                f"({result['steady_scrapes_failed']})", ""),
        ("operator CPU at rest", f"{result['operator_cpu_percent_steady']:.1f} % of a core "
                                 f"({result['operator_cpu_ms_per_scrape']:.2f} ms per scrape)", "< 50 %"),
        ("operator RSS peak", f"{result['operator_rss_mb_peak']:.0f} MB", "< 250 MB"),
        ("scrape latency p50 / p99", f"{result['scrape_latency_ms']['p50']} / {result['scrape_latency_ms']['p99']} ms",
         ""),
        ("hung -> decision (DryRun record)", f"{stall['hung_to_decision_seconds']:.1f} s",
         f"<= {result['stall_decision_bound_seconds']} s (window + 2 intervals)"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


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
    p.add_argument("--scrape", action="store_true",
                   help="servers answer /metrics (synthetic), stall detection and autoscaling on: the operator's "
                        "scrape path at scale (writes operator_scale_detection.json)")
    p.add_argument("--before", type=Path, help="with --scrape: a JSON this benchmark wrote for another tree (e.g. "
                                               "main before a change), kept in this run's JSON as 'before'")
    p.add_argument("--before-tree", default="", help="what --before was run on (a commit)")
    p.add_argument("--keep", action="store_true", help="leave the control plane running")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    args.output = args.output or (RESULTS_SCRAPE if args.scrape else RESULTS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the control plane and servers on the way out
    result = run(args)
    if args.before:
        result = with_before(result, json.loads(args.before.read_text()), args.before_tree)
    print(table(result))
    if args.scrape:
        print(scrape_table(result))
    print(f"by verb while converging: {result['converge_requests_by_verb']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
