"""Stall remediation, measured per fault on real fleets under a steady client load: what it costs
clients (errors they see, requests retried or held, added latency) and that only the server at
fault restarts.

    .venv/bin/python bench/remediation.py [--window 6] [--interval 1] [--clients 4] [--baseline 20]

A fresh local control plane and node agent run the operator; then, one after the other, two fleets
of real servers that accept injected faults, behind the router: one server per role, then two
(context servers: 2 ADP ranks, padding off; generation servers: 1 rank). Each fleet first serves a
fault-free baseline phase of the workload, then takes these faults in sequence, each once the fleet
is Ready again and every earlier restart resolved:
  - starve a context rank (vetoed)
  - freeze a generation rank (hung): the KV its pulls left on the context server is its symptom,
    never the context server's (issue 14)
  - stop KV reaping on a context server (transfer)
  - stop serving KV on a context server: its transfer server takes pulls and never answers (transfer)
Per fault:
  - detection: fault → the operator's decision; last real token → decision (from the evidence);
    fault → drain; fault → the pod's deletion; restart (deleted → replacement Ready); deleted →
    first request completed through the router;
  - what clients saw, over the requests in flight at any time from the fault to 5 s after progress
    was restored: client-visible errors (an HTTP error answer, an error event in a stream, a stream
    cut without [DONE], or no answer by the client's deadline) apart from requests the router
    retried on another server (X-Adpfleet-Attempts > 1) or held in its queue (X-Adpfleet-Queued-Seconds)
    that completed;
  - added latency: p50/p99 of request latency and of time to first token (streamed requests)
    against the fleet's own baseline phase;
  - collateral restarts: restarts of any server other than the one at fault, from the fault to the
    next fault (or the end).
Half the clients stream, half do not. Targets: detection ≤ window + 2 scrape intervals after the
last token; progress restored ≤ restart time + 10 s; 0 collateral restarts; 0 client-visible errors
for a single-server fault in a role with two servers (issues 14, 18). Prints a table, writes
bench/results/remediation.json and plots tokens/s over time with fault and action markers to
docs/remediation-bench.png.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the e2e tests' fleet and fault helpers
sys.path.insert(0, str(ROOT / "bench"))

from common import Background, operator_cluster, wait  # noqa: E402
from stall_harness import Load, Outcome, inject, remediations, stall_fleet, tokens_per_second  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "remediation.json"
PLOT = ROOT / "docs" / "remediation-bench.png"
NAMESPACE = "bench"
FAULTS = [("starve", 1, "context", "vetoed"), ("freeze", 0, "generation", "hung"),
          ("stop-reaping", 0, "context", "transfer"), ("stop-serving-kv", 0, "context", "transfer")]
SHAPES = (1, 2)  # servers per role
SETTLE_S = 5.0   # an episode ends this long after progress was restored


# ---- what clients saw --------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 3)


def stats(outcomes: list[Outcome]) -> dict:
    """What clients saw over a set of requests."""
    done = [o for o in outcomes if o.kind == "completed"]
    visible = [o for o in outcomes if o.kind != "completed"]
    latency = [o.end - o.start for o in done]
    ttft = [o.ttft for o in done if o.streamed and o.ttft is not None]
    kinds: dict[str, int] = {}
    for o in visible:
        key = "lost" if o.kind == "lost" else o.detail.split(":", 1)[0].split(" ", 1)[0]
        kinds[key] = kinds.get(key, 0) + 1
    return {"requests": len(outcomes), "completed": len(done), "client_visible_errors": len(visible),
            "errors_by_kind": kinds, "errors_after_tokens": sum(o.after_tokens for o in visible),
            "error_details": sorted({o.detail[:200] for o in visible})[:6],
            "retried": sum(o.attempts > 1 for o in done), "held_in_queue": sum(o.queued >= 0.05 for o in done),
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99)}


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


class Bench:
    """The control plane, the operator, and what each fleet shape measured."""

    def __init__(self, args, core, custom):
        self.args, self.core, self.custom = args, core, custom

    # -- the fleet -----------------------------------------------------------------------------
    def fleet(self, name: str) -> dict:
        from adpfleet.operator.resource import names
        return self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, name)

    def live(self, name: str, role: str) -> list:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"adpfleet.io/fleet={name},"
                                             f"adpfleet.io/role={role}").items
        return sorted((p for p in pods if p.metadata.deletion_timestamp is None), key=lambda p: p.metadata.name)

    def healthy(self, name: str, n: int) -> bool:
        for role in ("context", "generation"):
            pods = self.live(name, role)
            if len(pods) != n or not all(any(c.type == "Ready" and c.status == "True"
                                              for c in (p.status.conditions or [])) for p in pods):
                return False
        ready = next((c for c in self.fleet(name).get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
        return ready.get("status") == "True"

    def settled(self, name: str) -> bool:
        """No restart underway or unresolved: a stall of a server whose last restart is unresolved
        would climb the escalation ladder instead of restarting it again."""
        return not [r for r in remediations(self.fleet(name)) if r["action"].startswith("Restart")
                    and r["outcome"] in ("Pending", "Succeeded")]

    def router_url(self, name: str) -> str:
        from adpfleet.operator.resource import names
        selector = ",".join(f"{k}={v}" for k, v in names.router_selector(name).items())
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
        ip = next(p.status.pod_ip for p in pods if p.metadata.deletion_timestamp is None and p.status.pod_ip)
        return f"http://{ip}:{names.ROUTER_HTTP_PORT}"

    # -- one shape -----------------------------------------------------------------------------
    def shape(self, n: int, t0: float) -> dict:
        from adpfleet.operator.decisions.history import parse_rfc3339
        from adpfleet.operator.resource import names

        args, name = self.args, f"bench{n}"
        manifest = stall_fleet(name, window=args.window, interval=args.interval, cooldown=5, budget=100)
        manifest["metadata"]["namespace"] = NAMESPACE
        for role in ("context", "generation"):
            manifest["spec"][role]["servers"] = n
        self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, manifest)
        wait(lambda: self.healthy(name, n), 420, f"fleet {name} Ready")
        watch = PodWatch(self.core, NAMESPACE).start()
        url = self.router_url(name)
        rows = []
        try:
            with Load(url, clients=args.clients, streaming=True) as load:
                wait(lambda: load.completed_since(time.time() - 5) >= 3, 120, "traffic flowing")
                time.sleep(3)  # warm
                b0 = time.time()
                time.sleep(args.baseline)
                b1 = time.time()
                baseline = stats([o for o in load.snapshot() if o.start >= b0 and o.end <= b1])
                baseline.update(start_at_s=round(b0 - t0, 2), end_at_s=round(b1 - t0, 2))
                print(f"{name} baseline: {json.dumps(baseline)}", flush=True)
                for fault, rank, role, signature in [f for f in FAULTS if f[0] in args.faults]:
                    wait(lambda: self.healthy(name, n) and self.settled(name), 300, "the fleet Ready, restarts resolved")
                    start = time.time()
                    wait(lambda: load.completed_since(start) >= 3, 120, "traffic flowing")
                    victim = self.live(name, role)[0]
                    retries_before = router_retries(url)
                    t_fault = time.time()
                    inject(self.core, victim, fault, rank)
                    record = wait(lambda: next((r for r in remediations(self.fleet(name))
                                                if r["server"] == victim.metadata.name
                                                and parse_rfc3339(r["time"]) >= t_fault and r["outcome"] == "Succeeded"),
                                               None), 240, f"the remediation of {victim.metadata.name}")
                    t_decision = parse_rfc3339(record["time"])
                    uid = victim.metadata.uid
                    t_deleted = wait(lambda: watch.deleted.get(uid), 60, "the deletion")
                    new = wait(lambda: watch.replacement(victim.metadata.name, t_fault), 120, "the replacement pod")
                    t_ready = wait(lambda: watch.ready.get(new), 300, "the replacement Ready")
                    t_restored = wait(lambda: min((o.end for o in load.snapshot() if o.kind == "completed"
                                                   and o.end > t_deleted), default=None), 120, "progress restored")
                    t_end = t_restored + SETTLE_S
                    time.sleep(max(0.0, t_end - time.time()))
                    since_progress = re.search(r"seconds_since_last_progress=([0-9.]+)", record["message"])
                    episode = stats([o for o in load.snapshot() if o.start <= t_end and o.end >= t_fault])
                    rows.append({
                        "servers_per_role": n, "fault": fault, "rank": rank, "role": role,
                        "server": victim.metadata.name, "uid": uid, "expected_signature": signature,
                        "signature": record["signature"], "action": record["action"], "targets": record["targets"],
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
                        "episode_end_at_s": round(t_end - t0, 2),
                        "episode": episode,
                        "added_latency_p50_s": _minus(episode["latency_p50_s"], baseline["latency_p50_s"]),
                        "added_latency_p99_s": _minus(episode["latency_p99_s"], baseline["latency_p99_s"]),
                        "added_ttft_p50_s": _minus(episode["ttft_p50_s"], baseline["ttft_p50_s"]),
                        "added_ttft_p99_s": _minus(episode["ttft_p99_s"], baseline["ttft_p99_s"]),
                        "router_retries": router_retries(url) - retries_before,
                    })
                    print(json.dumps(rows[-1]), flush=True)
                wait(lambda: self.healthy(name, n) and self.settled(name), 300, "the fleet Ready, restarts resolved")
                time.sleep(3)
                t_last = time.time()
            outcomes = load.snapshot()
        finally:
            watch.stop()
        # collateral restarts: any server pod other than the victim deleted from the fault to the next fault
        ends = [parse_t0(r, t0) for r in rows[1:]] + [t_last]
        for row, until in zip(rows, ends):
            since = row["fault_at_s"] + t0
            others = sorted({watch.names[u] for u, t in watch.deleted.items() if since <= t <= until
                             and u != row["uid"]})
            records = [f"{r['action']} {r['server']} ({r['outcome']})" for r in remediations(self.fleet(name))
                       if r["server"] != row["server"] and since <= parse_rfc3339(r["time"]) <= until]
            row["collateral_restarts"] = len(others)
            row["collateral_servers"] = others
            row["other_remediation_records"] = records
        outside = [o for o in outcomes if not any(r["fault_at_s"] + t0 <= o.end and o.start <= r["episode_end_at_s"] + t0
                                                  for r in rows)]
        self.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, name)
        wait(lambda: not self.core.list_namespaced_pod(NAMESPACE, label_selector=f"adpfleet.io/fleet={name}").items,
             180, f"fleet {name}'s pods gone")
        return {"servers_per_role": n, "fleet": name, "baseline": baseline, "faults": rows,
                "all_requests": stats(outcomes), "outside_episodes": stats(outside),
                "tokens_per_second": tokens_per_second(outcomes, t0, t_last)}


def parse_t0(row: dict, t0: float) -> float:
    return row["fault_at_s"] + t0


def _minus(a, b):
    return None if a is None or b is None else round(a - b, 3)


def run(args) -> dict:
    with operator_cluster("adpfleet-bench-remediation-", NAMESPACE,
                          agent_args=["--backoff-initial=1", "--backoff-max=8"]) as cluster:
        bench = Bench(args, cluster.core, cluster.custom)
        shapes = []
        for n in args.shapes:
            t0 = time.time()
            shapes.append(bench.shape(n, t0))
        budget = args.window + 2 * args.interval
        for shape in shapes:
            for row in shape["faults"]:
                row["detection_ok"] = (row["last_progress_to_detection_s"] or 1e9) <= budget
                row["progress_ok"] = row["delete_to_progress_s"] <= row["restart_s"] + 10
                row["collateral_ok"] = row["collateral_restarts"] == 0
                # issue 18's goal: a single-server fault in a role with two servers costs clients no error
                row["no_client_errors_ok"] = row["servers_per_role"] < 2 or row["episode"]["client_visible_errors"] == 0
                row["targets_met"] = all(row[k] for k in ("detection_ok", "progress_ok", "collateral_ok",
                                                          "no_client_errors_ok"))
        return {"window_s": args.window, "interval_s": args.interval, "clients": args.clients,
                "streamed_clients": args.clients // 2, "baseline_s": args.baseline, "settle_s": SETTLE_S,
                "detection_budget_s": budget, "shapes": shapes,
                "faults": [row for shape in shapes for row in shape["faults"]], "state_dir": str(cluster.state)}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["shapes"]
    fig, axes = plt.subplots(len(shapes), 1, figsize=(11, 3.4 * len(shapes) + 0.8), squeeze=False)
    for ax, shape in zip(axes[:, 0], shapes):
        xs = [t for t, _ in shape["tokens_per_second"]]
        ys = [v for _, v in shape["tokens_per_second"]]
        ax.plot(xs, ys, lw=1, color="black", label="tokens/s completed through the router")
        b = shape["baseline"]
        ax.axvspan(b["start_at_s"], b["end_at_s"], color="0.9", label="baseline phase")
        for i, row in enumerate(shape["faults"]):
            first = i == 0
            ax.axvline(row["fault_at_s"], color="red", ls="--", lw=1, label="fault injected" if first else None)
            ax.axvline(row["detection_at_s"], color="orange", lw=1, label="stall detected (decision)" if first else None)
            ax.axvline(row["delete_at_s"], color="blue", lw=1, label="drained + pod deleted" if first else None)
            ax.axvline(row["ready_at_s"], color="green", lw=1, label="replacement Ready" if first else None)
            ax.text(row["fault_at_s"], max(ys or [1]) * 0.98, f" {row['fault']}\n ({row['signature']})", fontsize=7,
                    va="top")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{shape['servers_per_role']} server(s) per role", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(f"adpfleet stall remediation (window {result['window_s']} s, scrape every {result['interval_s']} s)")
    axes[-1, 0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


FAULT_LABELS = {"starve": "starve context rank 1", "freeze": "freeze generation rank 0",
                "stop-reaping": "stop KV reaping (context)", "stop-serving-kv": "stop serving KV (context)"}


def _s(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def markdown_tables(result: dict) -> dict[str, list[str]]:
    """The docs' tables, rendered from the JSON (docs/remediation.md and docs/benchmarks.md hold
    these lines as written; tests/test_docs_figures.py checks it)."""
    timing = ["| per role | fault | signature | fault → detected s | last token → detected s | fault → pod deleted s "
              "| restart s (deleted → Ready) | deleted → progress s | collateral restarts | targets |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    clients = ["| per role | fault | requests | client-visible errors | of them streams cut after tokens "
               "| retried by the router | held in its queue | latency p50 / p99 s | baseline p50 / p99 s "
               "| TTFT p50 / p99 s | baseline TTFT p50 / p99 s |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in result["shapes"]:
        b = shape["baseline"]
        for r in shape["faults"]:
            e = r["episode"]
            label = FAULT_LABELS[r["fault"]]
            timing.append(f"| {r['servers_per_role']} | {label} | {r['signature']} | {_s(r['fault_to_detection_s'])} "
                          f"| {_s(r['last_progress_to_detection_s'])} | {_s(r['fault_to_delete_s'])} "
                          f"| {_s(r['restart_s'])} | {_s(r['delete_to_progress_s'])} | {r['collateral_restarts']} "
                          f"| {'met' if r['targets_met'] else 'NOT met'} |")
            clients.append(f"| {r['servers_per_role']} | {label} | {e['requests']} | {e['client_visible_errors']} "
                           f"| {e['errors_after_tokens']} | {e['retried']} | {e['held_in_queue']} "
                           f"| {_s(e['latency_p50_s'])} / {_s(e['latency_p99_s'])} "
                           f"| {_s(b['latency_p50_s'])} / {_s(b['latency_p99_s'])} "
                           f"| {_s(e['ttft_p50_s'])} / {_s(e['ttft_p99_s'])} "
                           f"| {_s(b['ttft_p50_s'])} / {_s(b['ttft_p99_s'])} |")
    return {"timing": timing, "clients": clients}


def table(result: dict) -> str:
    from common import format_table

    headers = ["per role", "fault", "signature", "fault→detect s", "last token→detect s", "fault→delete s",
               "restart s", "delete→progress s", "requests", "client-visible errors", "retried", "held",
               "latency p50/p99 s (baseline)", "TTFT p50/p99 s (baseline)", "collateral restarts", "targets"]
    rows = []
    for shape in result["shapes"]:
        b = shape["baseline"]
        for r in shape["faults"]:
            e = r["episode"]
            rows.append([r["servers_per_role"], r["fault"], r["signature"], r["fault_to_detection_s"],
                         r["last_progress_to_detection_s"], r["fault_to_delete_s"], r["restart_s"],
                         r["delete_to_progress_s"], e["requests"], e["client_visible_errors"], e["retried"],
                         e["held_in_queue"],
                         f"{e['latency_p50_s']}/{e['latency_p99_s']} ({b['latency_p50_s']}/{b['latency_p99_s']})",
                         f"{e['ttft_p50_s']}/{e['ttft_p99_s']} ({b['ttft_p50_s']}/{b['ttft_p99_s']})",
                         r["collateral_restarts"], "met" if r["targets_met"] else "NOT met"])
    return format_table(headers, rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=6, help="remediation.stallWindowSeconds")
    p.add_argument("--interval", type=int, default=1, help="monitoring.scrapeIntervalSeconds")
    p.add_argument("--clients", type=int, default=4, help="half of them stream")
    p.add_argument("--baseline", type=float, default=20, help="seconds of fault-free load per fleet, first")
    p.add_argument("--shapes", type=int, nargs="+", default=list(SHAPES), help="servers per role, one fleet each")
    p.add_argument("--faults", nargs="+", default=[f[0] for f in FAULTS], choices=[f[0] for f in FAULTS])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, default=PLOT)
    args = p.parse_args()
    from common import machine_info

    started = time.time()
    result = run(args)
    result["machine"] = machine_info()
    result["wall_s"] = round(time.time() - started, 1)
    print(table(result))
    for shape in result["shapes"]:
        print(f"{shape['servers_per_role']} per role: baseline {shape['baseline']}; all requests "
              f"{shape['all_requests']['requests']}, client-visible errors {shape['all_requests']['client_visible_errors']}"
              f" ({shape['outside_episodes']['client_visible_errors']} outside the fault episodes)")
    print(f"detection budget (window + 2 intervals): {result['detection_budget_s']} s; wall {result['wall_s']} s")
    for lines in markdown_tables(result).values():
        print("\n".join(lines) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0 if all(r["targets_met"] for r in result["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
