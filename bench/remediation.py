"""Stall remediation, measured per fault on real fleets under a steady client load: what it costs
clients (errors they see, requests retried or held, added latency) and that only the server at
fault restarts.

    .venv/bin/python bench/remediation.py [--window 6] [--interval 1] [--clients 4] [--baseline 20]
        [--engines adpfleet,vllm] [--shapes 1 2] [--faults starve freeze ...]

A fresh local control plane and node agent run the operator; then, one after the other, the fleets of
`--engines`, in that order, behind their router. adpfleet's: one fleet per `--shapes` entry of real
servers that accept injected faults, one server per role, then two (context servers: 2 ADP ranks,
padding off; generation servers: 1 rank). vLLM's (issue 27): two aggregated `vllm serve` servers of a
tiny random Llama (cluster/vllm_model.py), read by the operator in vLLM's dialect; its one fault,
`freeze`, SIGSTOPs the `VLLM::EngineCore` of a server whose engine runs requests, from the node's side
(/health stays 200, the counters go flat); its clients ask for 384 tokens so that a frozen engine
always has requests running. Each fleet first serves a fault-free baseline phase of the workload,
then takes these faults in sequence (those of `--faults` it can), each once the fleet is Ready again
and every earlier restart resolved:
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
last token (from the fault where the engine exports no last-progress time: vLLM); progress restored ≤
restart time + 10 s; 0 collateral restarts; 0 client-visible errors for a single-server fault in a
role with two servers (issues 14, 18). Every frozen engine's detection and fault → progress restored
are put beside how long others take to notice one (issue 27's anchors: Dynamo's canary health check
15-21 s, vLLM's own proposals 60 s, SGLang/TensorRT-LLM watchdogs 300 s), as ratios. The JSON records
the load average before the run started (`contended`). Prints a table, writes
bench/results/remediation.json and plots tokens/s over time with fault and action markers to
docs/remediation-bench.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "operator"))  # the e2e tests' fleet and fault helpers
sys.path.insert(0, str(ROOT / "bench"))

from common import Background, operator_cluster, wait  # noqa: E402
from stall_harness import (Load, Outcome, inject, remediations, stall_fleet, tokens_per_second,  # noqa: E402
                           vllm_requests_running, vllm_stall_fleet)

RESULTS = ROOT / "bench" / "results" / "remediation.json"
PLOT = ROOT / "docs" / "remediation-bench.png"
NAMESPACE = "bench"
FAULTS = [("starve", 1, "context", "vetoed"), ("freeze", 0, "generation", "hung"),
          ("stop-reaping", 0, "context", "transfer"), ("stop-serving-kv", 0, "context", "transfer")]
# the vLLM fleet's fault: its EngineCore SIGSTOPped from the node's side (/health stays 200, the counters go flat)
VLLM_FAULTS = [("freeze", 0, "aggregated", "hung")]
ENGINES = ("adpfleet", "vllm")
SHAPES = (1, 2)  # servers per role of adpfleet's fleets
VLLM_SERVERS = 2  # aggregated servers of the vLLM fleet: the frozen one's peer serves on
# Each engine's workload. vLLM's requests decode for seconds, so a frozen engine always has requests running
# (one frozen as its last request ended reports 0 running and cannot be told from an idle one:
# docs/remediation.md, "Dialects"); tests/operator/test_vllm_fleet_e2e.py freezes the same way.
LOAD = {"adpfleet": {"max_tokens": 24, "deadline": 90.0}, "vllm": {"max_tokens": 384, "deadline": 240.0}}
# How long others take to notice a wedged engine (issue 27): what a fault's detection and recovery are put beside.
ANCHORS = {"dynamo_canary": {"seconds": [15, 21], "label": "Dynamo canary",
                             "what": "Dynamo's canary health check (its multinode design)"},
           "vllm_proposals": {"seconds": [60], "label": "vLLM proposals", "what": "vLLM's own proposals"},
           "watchdogs": {"seconds": [300], "label": "watchdogs", "what": "SGLang / TensorRT-LLM watchdogs"}}
SETTLE_S = 5.0   # an episode ends this long after progress was restored


@dataclass(frozen=True)
class Case:
    """One fleet of the run, and the faults it takes in order: (fault, rank, role, expected signature)."""
    engine: str
    servers: int  # per role
    faults: tuple[tuple[str, int, str, str], ...]

    @property
    def name(self) -> str:
        return f"bench{self.servers}" if self.engine == "adpfleet" else f"bench{self.engine}"

    @property
    def roles(self) -> tuple[str, ...]:
        return ("context", "generation") if self.engine == "adpfleet" else ("aggregated",)


def cases(engines: list[str], shapes: list[int], faults: list[str]) -> list[Case]:
    """The fleets of `engines`, in their order: adpfleet's one per shape, vLLM's one; each takes those of
    `faults` it can."""
    out = []
    for engine in engines:
        if engine == "adpfleet":
            out += [Case("adpfleet", n, tuple(f for f in FAULTS if f[0] in faults)) for n in shapes]
        else:
            out.append(Case("vllm", VLLM_SERVERS, tuple(f for f in VLLM_FAULTS if f[0] in faults)))
    return out


def anchor_ratios(row: dict) -> dict:
    """Each anchor's seconds over this fault's detection and over its fault → progress restored: how many
    times sooner (low and high where the anchor is a range)."""
    return {key: {"detection_x": [round(a / row["fault_to_detection_s"], 1) for a in anchor["seconds"]],
                  "progress_x": [round(a / row["fault_to_progress_s"], 1) for a in anchor["seconds"]]}
            for key, anchor in ANCHORS.items()}


def targets(row: dict, budget: float) -> dict:
    """Which targets a fault met. An engine that exports no last-progress time (vLLM) is held to the budget
    from the fault itself: its last token came at the fault or before."""
    after_last_token = row["last_progress_to_detection_s"]
    met = {"detection_ok": (row["fault_to_detection_s"] if after_last_token is None else after_last_token) <= budget,
           "progress_ok": row["delete_to_progress_s"] <= row["restart_s"] + 10,
           "collateral_ok": row["collateral_restarts"] == 0,
           # issue 18's goal: a single-server fault in a role with two servers costs clients no error
           "no_client_errors_ok": row["servers_per_role"] < 2 or row["episode"]["client_visible_errors"] == 0}
    return {**met, "targets_met": all(met.values())}


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


@dataclass
class Episode:
    """One fault's moments (time.time()) from its injection to 5 s after progress was restored."""
    victim: object  # the V1Pod at fault
    record: dict    # the operator's remediation record of it
    fault: float
    decision: float
    deleted: float
    ready: float     # its replacement Ready
    restored: float  # the first request completed through the router after the deletion
    end: float
    router_retries: float


class Bench:
    """The control plane, the operator, and what each fleet measured."""

    def __init__(self, args, core, custom):
        self.args, self.core, self.custom = args, core, custom

    # -- the fleet -----------------------------------------------------------------------------
    def fleet(self, name: str) -> dict:
        from adpfleet.operator.resource import names
        return self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, name)

    def manifest(self, case: Case) -> dict:
        args = self.args
        if case.engine == "vllm":
            from adpfleet.cluster.vllm_model import build_model
            manifest = vllm_stall_fleet(case.name, str(build_model()), window=args.window, interval=args.interval,
                                        servers=case.servers, cooldown=5, budget=100)
        else:
            manifest = stall_fleet(case.name, window=args.window, interval=args.interval, cooldown=5, budget=100)
            for role in case.roles:
                manifest["spec"][role]["servers"] = case.servers
        manifest["metadata"]["namespace"] = NAMESPACE
        return manifest

    def live(self, name: str, role: str) -> list:
        pods = self.core.list_namespaced_pod(NAMESPACE, label_selector=f"adpfleet.io/fleet={name},"
                                             f"adpfleet.io/role={role}").items
        return sorted((p for p in pods if p.metadata.deletion_timestamp is None), key=lambda p: p.metadata.name)

    def healthy(self, case: Case) -> bool:
        for role in case.roles:
            pods = self.live(case.name, role)
            if len(pods) != case.servers or not all(any(c.type == "Ready" and c.status == "True"
                                                        for c in (p.status.conditions or [])) for p in pods):
                return False
        ready = next((c for c in self.fleet(case.name).get("status", {}).get("conditions", [])
                      if c["type"] == "Ready"), {})
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

    # -- one fault -----------------------------------------------------------------------------
    def inject(self, case: Case, fault: str, rank: int, role: str) -> tuple[object, float]:
        """Inject `fault`; (the pod at fault, the time of the injection). adpfleet's servers take it over
        POST /faults (their first server of `role`); a vLLM engine is frozen from the node's side, on a
        server whose engine runs requests."""
        pods = self.live(case.name, role)
        if case.engine == "vllm":
            from adpfleet.cluster import processes
            from adpfleet.cluster.vllm_env import ENGINE_CORE
            by_name = {p.metadata.name: p for p in pods}
            name, t_fault = processes.freeze_busy_pod({n: p.metadata.uid for n, p in by_name.items()}, ENGINE_CORE,
                                                      lambda n: vllm_requests_running(by_name[n]))
            return by_name[name], t_fault
        t_fault = time.time()
        inject(self.core, pods[0], fault, rank)
        return pods[0], t_fault

    def episode(self, case: Case, fault: tuple, load: Load, watch: "PodWatch", url: str) -> Episode:
        """`fault` injected once the fleet is Ready and settled, with traffic flowing; its moments."""
        from adpfleet.operator.decisions.history import parse_rfc3339

        wait(lambda: self.healthy(case) and self.settled(case.name), 300, "the fleet Ready, restarts resolved")
        start = time.time()
        wait(lambda: load.completed_since(start) >= 3, 120, "traffic flowing")
        retries_before = router_retries(url)
        victim, t_fault = self.inject(case, *fault[:3])
        record = wait(lambda: next((r for r in remediations(self.fleet(case.name))
                                    if r["server"] == victim.metadata.name
                                    and parse_rfc3339(r["time"]) >= t_fault and r["outcome"] == "Succeeded"),
                                   None), 240, f"the remediation of {victim.metadata.name}")
        uid = victim.metadata.uid
        t_deleted = wait(lambda: watch.deleted.get(uid), 60, "the deletion")
        new = wait(lambda: watch.replacement(victim.metadata.name, t_fault), 120, "the replacement pod")
        # a vLLM server's start: minutes on loaded cores
        t_ready = wait(lambda: watch.ready.get(new), 900, "the replacement Ready")
        t_restored = wait(lambda: min((o.end for o in load.snapshot() if o.kind == "completed"
                                       and o.end > t_deleted), default=None), 120, "progress restored")
        t_end = t_restored + SETTLE_S
        time.sleep(max(0.0, t_end - time.time()))
        return Episode(victim, record, t_fault, parse_rfc3339(record["time"]), t_deleted, t_ready, t_restored, t_end,
                       router_retries(url) - retries_before)

    # -- one fleet -----------------------------------------------------------------------------
    def shape(self, case: Case, t0: float) -> dict:
        from adpfleet.operator.resource import names

        self.custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL,
                                                    self.manifest(case))
        wait(lambda: self.healthy(case), 900 if case.engine == "vllm" else 420, f"fleet {case.name} Ready")
        watch = PodWatch(self.core, NAMESPACE).start()
        url = self.router_url(case.name)
        rows = []
        try:
            with Load(url, clients=self.args.clients, streaming=True, **LOAD[case.engine]) as load:
                baseline = self.baseline(case, load, t0)
                for fault in case.faults:
                    e = self.episode(case, fault, load, watch, url)
                    rows.append(fault_row(case, fault, e, watch, stats([o for o in load.snapshot()
                                                                         if o.start <= e.end and o.end >= e.fault]),
                                          baseline, t0))
                    print(json.dumps(rows[-1]), flush=True)
                wait(lambda: self.healthy(case) and self.settled(case.name), 600, "the fleet Ready, restarts resolved")
                time.sleep(3)
                t_last = time.time()
            outcomes = load.snapshot()
        finally:
            watch.stop()
        self.collateral(case, rows, watch, t0, t_last)
        outside = [o for o in outcomes if not any(r["fault_at_s"] + t0 <= o.end and o.start <= r["episode_end_at_s"] + t0
                                                  for r in rows)]
        self.custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, case.name)
        wait(lambda: not self.core.list_namespaced_pod(NAMESPACE, label_selector=f"adpfleet.io/fleet={case.name}")
             .items, 180, f"fleet {case.name}'s pods gone")
        return {"engine": case.engine, "servers_per_role": case.servers, "fleet": case.name, "load": LOAD[case.engine],
                "baseline": baseline, "faults": rows, "all_requests": stats(outcomes),
                "outside_episodes": stats(outside), "tokens_per_second": tokens_per_second(outcomes, t0, t_last)}

    def baseline(self, case: Case, load: Load, t0: float) -> dict:
        """What clients saw over the fleet's fault-free phase, after a warm-up."""
        wait(lambda: load.completed_since(time.time() - 5) >= 3, 120, "traffic flowing")
        time.sleep(3)  # warm
        b0 = time.time()
        time.sleep(self.args.baseline)
        b1 = time.time()
        baseline = stats([o for o in load.snapshot() if o.start >= b0 and o.end <= b1])
        baseline.update(start_at_s=round(b0 - t0, 2), end_at_s=round(b1 - t0, 2))
        print(f"{case.name} baseline: {json.dumps(baseline)}", flush=True)
        return baseline

    def collateral(self, case: Case, rows: list[dict], watch: "PodWatch", t0: float, t_last: float) -> None:
        """Per fault, restarts of any server other than the one at fault from the fault to the next fault."""
        from adpfleet.operator.decisions.history import parse_rfc3339

        ends = [parse_t0(r, t0) for r in rows[1:]] + [t_last]
        for row, until in zip(rows, ends):
            since = row["fault_at_s"] + t0
            others = sorted({watch.names[u] for u, t in watch.deleted.items() if since <= t <= until
                             and u != row["uid"]})
            records = [f"{r['action']} {r['server']} ({r['outcome']})" for r in remediations(self.fleet(case.name))
                       if r["server"] != row["server"] and since <= parse_rfc3339(r["time"]) <= until]
            row["collateral_restarts"] = len(others)
            row["collateral_servers"] = others
            row["other_remediation_records"] = records


def fault_row(case: Case, fault: tuple, e: Episode, watch: "PodWatch", episode: dict, baseline: dict,
              t0: float) -> dict:
    """One fault's row: its moments relative to the fault and to t0, and what clients saw against the baseline."""
    kind, rank, role, signature = fault
    uid = e.victim.metadata.uid
    since_progress = re.search(r"seconds_since_last_progress=([0-9.]+)", e.record["message"])
    return {
        "engine": case.engine, "servers_per_role": case.servers, "fault": kind, "rank": rank, "role": role,
        "server": e.victim.metadata.name, "uid": uid, "expected_signature": signature,
        "signature": e.record["signature"], "action": e.record["action"], "targets": e.record["targets"],
        "fault_at_s": round(e.fault - t0, 2),
        "fault_to_detection_s": round(e.decision - e.fault, 2),
        "last_progress_to_detection_s": float(since_progress.group(1)) if since_progress else None,
        "fault_to_drain_s": round(watch.drained.get(uid, e.deleted) - e.fault, 2),
        "fault_to_delete_s": round(e.deleted - e.fault, 2),
        "restart_s": round(e.ready - e.deleted, 2),
        "delete_to_progress_s": round(e.restored - e.deleted, 2),
        "fault_to_progress_s": round(e.restored - e.fault, 2),
        "detection_at_s": round(e.decision - t0, 2), "delete_at_s": round(e.deleted - t0, 2),
        "ready_at_s": round(e.ready - t0, 2), "restored_at_s": round(e.restored - t0, 2),
        "episode_end_at_s": round(e.end - t0, 2),
        "episode": episode,
        "added_latency_p50_s": _minus(episode["latency_p50_s"], baseline["latency_p50_s"]),
        "added_latency_p99_s": _minus(episode["latency_p99_s"], baseline["latency_p99_s"]),
        "added_ttft_p50_s": _minus(episode["ttft_p50_s"], baseline["ttft_p50_s"]),
        "added_ttft_p99_s": _minus(episode["ttft_p99_s"], baseline["ttft_p99_s"]),
        "router_retries": e.router_retries,
    }


def parse_t0(row: dict, t0: float) -> float:
    return row["fault_at_s"] + t0


def _minus(a, b):
    return None if a is None or b is None else round(a - b, 3)


def run(args) -> dict:
    load_at_start = os.getloadavg()
    with operator_cluster("adpfleet-bench-remediation-", NAMESPACE,
                          agent_args=["--backoff-initial=1", "--backoff-max=8"]) as cluster:
        bench = Bench(args, cluster.core, cluster.custom)
        shapes = []
        for case in cases(args.engines, args.shapes, args.faults):
            shapes.append(bench.shape(case, time.time()))
        budget = args.window + 2 * args.interval
        for row in (row for shape in shapes for row in shape["faults"]):
            row.update(targets(row, budget))
            row["anchor_ratios"] = anchor_ratios(row)
        return {"window_s": args.window, "interval_s": args.interval, "clients": args.clients,
                "streamed_clients": args.clients // 2, "baseline_s": args.baseline, "settle_s": SETTLE_S,
                "detection_budget_s": budget, "engines": args.engines, "anchors": ANCHORS,
                # others' jobs on these cores before the bench started anything of its own
                "load_average_at_start": [round(x, 2) for x in load_at_start],
                "contended": load_at_start[0] >= 0.5 * (os.cpu_count() or 1),
                "shapes": shapes, "faults": [row for shape in shapes for row in shape["faults"]],
                "state_dir": str(cluster.state)}


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
        ax.set_title(f"{_engine(shape)} fleet, {shape['servers_per_role']} server(s) per role", fontsize=9)
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(f"adpfleet stall remediation (window {result['window_s']} s, scrape every {result['interval_s']} s)")
    axes[-1, 0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


FAULT_LABELS = {("adpfleet", "starve"): "starve context rank 1", ("adpfleet", "freeze"): "freeze generation rank 0",
                ("adpfleet", "stop-reaping"): "stop KV reaping (context)",
                ("adpfleet", "stop-serving-kv"): "stop serving KV (context)",
                ("vllm", "freeze"): "freeze EngineCore (aggregated)"}


def _engine(shape_or_row: dict) -> str:
    return shape_or_row.get("engine", "adpfleet")  # runs before engines were selectable had adpfleet's only


def _s(v) -> str:
    return "–" if v is None else f"{v:.2f}"


def _x(ratios: list[float]) -> str:
    return "–".join(f"{r:.1f}" for r in ratios) + "×"


def _timing_line(r: dict) -> str:
    return (f"| {_engine(r)} | {r['servers_per_role']} | {FAULT_LABELS[_engine(r), r['fault']]} | {r['signature']} "
            f"| {_s(r['fault_to_detection_s'])} | {_s(r['last_progress_to_detection_s'])} "
            f"| {_s(r['fault_to_delete_s'])} | {_s(r['restart_s'])} | {_s(r['delete_to_progress_s'])} "
            f"| {r['collateral_restarts']} | {'met' if r['targets_met'] else 'NOT met'} |")


def _clients_line(r: dict, b: dict) -> str:
    e = r["episode"]
    return (f"| {_engine(r)} | {r['servers_per_role']} | {FAULT_LABELS[_engine(r), r['fault']]} | {e['requests']} "
            f"| {e['client_visible_errors']} | {e['errors_after_tokens']} | {e['retried']} | {e['held_in_queue']} "
            f"| {_s(e['latency_p50_s'])} / {_s(e['latency_p99_s'])} "
            f"| {_s(b['latency_p50_s'])} / {_s(b['latency_p99_s'])} "
            f"| {_s(e['ttft_p50_s'])} / {_s(e['ttft_p99_s'])} | {_s(b['ttft_p50_s'])} / {_s(b['ttft_p99_s'])} |")


def _anchor_line(r: dict) -> str:
    ratios = r["anchor_ratios"]
    return (f"| {_engine(r)} | {r['servers_per_role']} | {FAULT_LABELS[_engine(r), r['fault']]} "
            f"| {_s(r['fault_to_detection_s'])} | {_s(r['fault_to_progress_s'])} "
            + " ".join(f"| {_x(ratios[k]['detection_x'])} / {_x(ratios[k]['progress_x'])}" for k in ANCHORS) + " |")


def markdown_tables(result: dict) -> dict[str, list[str]]:
    """The docs' tables, rendered from the JSON (docs/remediation.md and docs/benchmarks.md hold
    these lines as written; tests/test_docs_figures.py checks it). `anchors`: every frozen engine
    (adpfleet's and vLLM's `freeze`) against how long others take to notice one."""
    timing = ["| engine | per role | fault | signature | fault → detected s | last token → detected s "
              "| fault → pod deleted s | restart s (deleted → Ready) | deleted → progress s "
              "| collateral restarts | targets |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    clients = ["| engine | per role | fault | requests | client-visible errors | of them streams cut after tokens "
               "| retried by the router | held in its queue | latency p50 / p99 s | baseline p50 / p99 s "
               "| TTFT p50 / p99 s | baseline TTFT p50 / p99 s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    anchors = ["| engine | per role | fault | fault → detected s | fault → progress s "
               + " ".join(f"| vs {a['label']} {'–'.join(map(str, a['seconds']))} s: × detected / restored"
                          for a in ANCHORS.values()) + " |", "|---|---|---|---|---|---|---|---|"]
    for shape in result["shapes"]:
        for r in shape["faults"]:
            timing.append(_timing_line(r))
            clients.append(_clients_line(r, shape["baseline"]))
            if r["fault"] == "freeze":
                anchors.append(_anchor_line(r))
    return {"timing": timing, "clients": clients, "anchors": anchors}


def table(result: dict) -> str:
    from common import format_table

    headers = ["engine", "per role", "fault", "signature", "fault→detect s", "last token→detect s",
               "fault→delete s", "restart s", "delete→progress s", "requests", "client-visible errors", "retried", "held",
               "latency p50/p99 s (baseline)", "TTFT p50/p99 s (baseline)", "collateral restarts", "targets"]
    rows = []
    for shape in result["shapes"]:
        b = shape["baseline"]
        for r in shape["faults"]:
            e = r["episode"]
            rows.append([_engine(r), r["servers_per_role"], r["fault"], r["signature"], r["fault_to_detection_s"],
                         r["last_progress_to_detection_s"], r["fault_to_delete_s"], r["restart_s"],
                         r["delete_to_progress_s"], e["requests"], e["client_visible_errors"], e["retried"],
                         e["held_in_queue"],
                         f"{e['latency_p50_s']}/{e['latency_p99_s']} ({b['latency_p50_s']}/{b['latency_p99_s']})",
                         f"{e['ttft_p50_s']}/{e['ttft_p99_s']} ({b['ttft_p50_s']}/{b['ttft_p99_s']})",
                         r["collateral_restarts"], "met" if r["targets_met"] else "NOT met"])
    return format_table(headers, rows)


def engine_list(text: str) -> list[str]:
    """`--engines adpfleet,vllm`: the engines whose fleets run, in the order given."""
    engines = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise argparse.ArgumentTypeError(f"{text!r}: engines are a comma-separated list of {', '.join(ENGINES)}")
    return engines


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--window", type=int, default=6, help="remediation.stallWindowSeconds")
    p.add_argument("--interval", type=int, default=1, help="monitoring.scrapeIntervalSeconds")
    p.add_argument("--clients", type=int, default=4, help="half of them stream")
    p.add_argument("--baseline", type=float, default=20, help="seconds of fault-free load per fleet, first")
    p.add_argument("--engines", type=engine_list, default=list(ENGINES),
                   help="whose fleets run, comma-separated (default: adpfleet,vllm; vllm needs "
                        "`scripts/setup --with-vllm`)")
    p.add_argument("--shapes", type=int, nargs="+", default=list(SHAPES),
                   help="servers per role of adpfleet's fleets, one fleet each")
    p.add_argument("--faults", nargs="+", default=[f[0] for f in FAULTS], choices=[f[0] for f in FAULTS],
                   help="the vLLM fleet takes `freeze` (its EngineCore) only")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, default=PLOT)
    return p.parse_args(argv)


def main() -> int:
    args = arguments()
    from common import machine_info

    started = time.time()
    result = run(args)
    result["machine"] = machine_info()
    result["wall_s"] = round(time.time() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")  # first: a run's numbers outlive its rendering
    print(table(result))
    for shape in result["shapes"]:
        print(f"{shape['engine']}, {shape['servers_per_role']} per role: baseline {shape['baseline']}; all requests "
              f"{shape['all_requests']['requests']}, client-visible errors {shape['all_requests']['client_visible_errors']}"
              f" ({shape['outside_episodes']['client_visible_errors']} outside the fault episodes)")
    print(f"detection budget (window + 2 intervals): {result['detection_budget_s']} s; wall {result['wall_s']} s; "
          f"load average at start {result['load_average_at_start']} (contended: {result['contended']})")
    for lines in markdown_tables(result).values():
        print("\n".join(lines) + "\n")
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    return 0 if all(r["targets_met"] for r in result["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
