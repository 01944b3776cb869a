"""Autoscaling, measured: the built-in policy against fixed fleets, on a load that steps up 4x and back.

    .venv/bin/python bench/autoscale.py [--trough-rps 1] [--factor 4] [--phases 20 70 70]

A fresh local control plane and node agent run the operator; one after another, three fleets of
real tiny-model servers (one ADP rank each) take the same open-loop load through their router:
Poisson arrivals at the trough rate, then `factor` times it, then the trough again (the same
arrival times for every arm, from one seed), each request a streamed completion:
  - policy: both roles autoscaled by the built-in policy (operator/decisions/autoscaling.py)
    between 1 and `--max-servers`, with short stabilisation windows so the run fits in minutes;
  - fixed-peak: each role fixed at the servers the policy ran at the peak (the arm runs after the
    policy's), held throughout;
  - fixed-trough: one server per role.
Per arm: server-seconds (server pods alive, starting and draining ones included, over the load),
client-side time to first token p50/p99 per phase, errors (an HTTP error or an error event) and
lost requests (no answer by the deadline), and for the policy arm the time from the step up to the
first scale-up decision and to the first new server serving (Ready, so the router sends to it),
and from the step down to the last scale-down. Prints a table, writes bench/results/autoscale.json
and bench/results/autoscale.png (load, servers per role and TTFT over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from common import Background, operator_cluster, wait  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "autoscale.json"
PLOT = ROOT / "bench" / "results" / "autoscale.png"
NAMESPACE = "bench"
ROLES = ("context", "generation")
PHASES = ("trough", "peak", "trough again")
PROMPT = "tell me about attention data parallelism and why a starved rank vetoes every forward " * 2


# ---- the load -----------------------------------------------------------------------------------

def arrivals(rates: list[tuple[float, float]], seed: int) -> list[float]:
    """Poisson arrival times (seconds from the start) for phases of (duration, requests/s)."""
    rng, out, start = random.Random(seed), [], 0.0
    for duration, rps in rates:
        t = start + rng.expovariate(rps)
        while t < start + duration:
            out.append(t)
            t += rng.expovariate(rps)
        start += duration
    return out


@dataclass
class Request:
    sent: float              # seconds from the load's start
    ttft: float | None = None
    end: float | None = None
    kind: str = "lost"       # completed | error | lost (no answer by the deadline)
    tokens: int = 0
    detail: str = ""


async def _one(http: httpx.AsyncClient, url: str, req: Request, t0: float, max_tokens: int, i: int) -> None:
    body = {"prompt": f"request {i}: {PROMPT}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                req.kind, req.detail = "error", f"{r.status_code} {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    req.kind, req.detail = "error", str(event["error"])[:200]
                    return
                if any(c.get("text") for c in event.get("choices", [])):
                    if req.ttft is None:
                        req.ttft = time.monotonic() - start
                    req.tokens += 1
            req.kind = "completed" if req.tokens else "error"
    except httpx.TimeoutException as e:
        req.kind, req.detail = "lost", type(e).__name__
    except httpx.HTTPError as e:
        req.kind, req.detail = "error", f"{type(e).__name__}: {e}"
    finally:
        req.end = time.monotonic() - t0


async def _drive(url: str, schedule: list[float], t0: float, max_tokens: int, deadline: float) -> list[Request]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline, connect=5.0), limits=limits) as http:
        requests, tasks = [], []
        for i, at in enumerate(schedule):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            req = Request(sent=time.monotonic() - t0)
            requests.append(req)
            tasks.append(asyncio.create_task(_one(http, url, req, t0, max_tokens, i)))
        await asyncio.gather(*tasks)
    return requests


# ---- what the fleet did -------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    role: str
    seen: float                 # monotonic, first listed
    ready: float | None = None  # first seen Ready without the drain annotation
    drained: float | None = None
    gone: float | None = None   # deletion seen (or the pod vanished)


class FleetWatch(Background):
    """Polls a fleet's server pods and its InferenceFleetRoles: every server's life, and every
    scaling decision (status.lastScale) as it appears."""

    def __init__(self, core, custom, namespace: str, fleet: str, operator_url: str):
        super().__init__()
        self.core, self.custom, self.ns, self.fleet = core, custom, namespace, fleet
        self.operator_url = operator_url
        self.servers: dict[str, Server] = {}  # uid -> Server
        self.decisions: list[dict] = []
        self.signals: list[tuple[float, str, str, float]] = []  # (monotonic, role, signal, value), as the policy read
        self._lock = threading.Lock()

    def _read_signals(self, now: float) -> None:
        try:
            text = httpx.get(self.operator_url + "/metrics", timeout=2).text
        except httpx.HTTPError:
            return
        for line in text.splitlines():
            if line.startswith("adpfleet_operator_role_signal{") and f'fleet="{self.fleet}"' in line:
                labels, value = line[line.index("{") + 1:line.index("}")], float(line.rsplit(" ", 1)[1])
                fields = dict(kv.split("=", 1) for kv in labels.split(","))
                self.signals.append((now, fields["role"].strip('"'), fields["signal"].strip('"'), value))

    def _run(self) -> None:
        from adpfleet.operator.resource import names

        seen_decisions = set()
        while not self._stop.is_set():
            try:
                pods = self.core.list_namespaced_pod(self.ns, label_selector=names.discovery_selector(self.fleet)).items
                roles = [self.custom.get_namespaced_custom_object(names.GROUP, names.VERSION, self.ns,
                                                                  names.ROLE_PLURAL,
                                                                  names.role_object_name(self.fleet, r))
                         for r in ROLES]
            except Exception:  # noqa: BLE001 - a transient API error: poll again
                self._stop.wait(0.2)
                continue
            now = time.monotonic()
            with self._lock:
                listed = set()
                for p in pods:
                    uid = p.metadata.uid
                    listed.add(uid)
                    s = self.servers.setdefault(uid, Server(p.metadata.name, p.metadata.labels[names.LABEL_ROLE], now))
                    draining = (p.metadata.annotations or {}).get(names.ANNOTATION_DRAIN) == "true"
                    if draining and s.drained is None:
                        s.drained = now
                    if p.metadata.deletion_timestamp is not None and s.gone is None:
                        s.gone = now
                    ready = any(c.type == "Ready" and c.status == "True" for c in (p.status.conditions or []))
                    if ready and not draining and s.ready is None:
                        s.ready = now
                for uid, s in self.servers.items():
                    if uid not in listed and s.gone is None:
                        s.gone = now
                for obj in roles:
                    last = (obj.get("status") or {}).get("lastScale")
                    if last and (key := (obj["metadata"]["name"], last.get("time"), last.get("desired"))) \
                            not in seen_decisions:
                        seen_decisions.add(key)
                        role = obj["metadata"]["name"].removeprefix(f"{self.fleet}-")
                        self.decisions.append({"at": now, "role": role,
                                               **{k: last.get(k) for k in ("previous", "desired", "reason",
                                                                            "message", "source")}})
                self._read_signals(now)
            self._stop.wait(0.5)

    def counts(self, role: str, t: float) -> tuple[int, int]:
        """(servers alive, servers serving) of `role` at monotonic time `t`."""
        with self._lock:
            alive = [s for s in self.servers.values()
                     if s.role == role and s.seen <= t and (s.gone is None or s.gone > t)]
            serving = [s for s in alive
                       if s.ready is not None and s.ready <= t and (s.drained is None or s.drained > t)]
            return len(alive), len(serving)

    def signal(self, role: str, name: str, start: float, end: float) -> list[float]:
        with self._lock:
            return [v for t, r, n, v in self.signals if r == role and n == name and start <= t < end]

    def server_seconds(self, start: float, end: float) -> dict[str, float]:
        with self._lock:
            out = {}
            for role in ROLES:
                out[role] = sum(max(0.0, min(end, s.gone if s.gone is not None else end) - max(start, s.seen))
                                for s in self.servers.values() if s.role == role)
            return out


# ---- one arm --------------------------------------------------------------------------------------

def fleet_manifest(name: str, arm: str, args, peak: dict[str, int]) -> dict:
    from adpfleet.operator.resource import names

    def role(servers: int, autoscaled: bool) -> dict:
        spec = {"servers": servers, "adpRanks": 1, "probes": {"readinessPeriodSeconds": 1},
                "terminationGracePeriodSeconds": 5, "drainTimeoutSeconds": 10,
                "engine": {"kvBlocks": args.kv_blocks, "maxBatchSize": args.max_batch,
                           "maxNumActiveRequests": 256}}
        if autoscaled:
            spec["autoscaling"] = {
                "enabled": True, "minServers": 1, "maxServers": args.max_servers,
                "targets": {"waitingPerRank": args.waiting_target},
                "scaleUp": {"stabilizationWindowSeconds": args.up_window, "maxServersPerStep": 2},
                "scaleDown": {"stabilizationWindowSeconds": args.down_window, "maxServersPerStep": 1}}
        return spec

    servers = {r: {"policy": 1, "fixed-peak": peak[r], "fixed-trough": 1}[arm] for r in ROLES}
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"image": "adpfleet:dev", "model": {"name": "tiny"},
                     "context": role(servers["context"], arm == "policy"),
                     "generation": role(servers["generation"], arm == "policy"),
                     "monitoring": {"scrapeIntervalSeconds": args.interval}}}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)  # nearest rank
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def run_arm(arm: str, args, core, custom, schedule, bounds, operator_url: str, peak: dict[str, int]) -> dict:
    from adpfleet.operator.resource import names

    name = f"as-{arm}"
    custom.create_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL,
                                           fleet_manifest(name, arm, args, peak))

    def fleet_ready():
        fleet = custom.get_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, name)
        ready = next((c for c in fleet.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})
        return ready.get("status") == "True"

    wait(fleet_ready, 300, f"fleet {name} Ready")
    router = next(p for p in core.list_namespaced_pod(NAMESPACE, label_selector=f"{names.LABEL_FLEET}={name}").items
                  if p.metadata.labels.get("app.kubernetes.io/component") == "router" and p.status.pod_ip)
    url = f"http://{router.status.pod_ip}:{names.ROUTER_HTTP_PORT}"
    for _ in range(3):  # warm-up, not measured: each server's first request pays one-time costs
        httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=60).raise_for_status()
    watch = FleetWatch(core, custom, NAMESPACE, name, operator_url).start()
    time.sleep(1.0)
    t0 = time.monotonic()
    requests = asyncio.run(_drive(url, schedule, t0, args.max_tokens, args.deadline))
    t_end = t0 + bounds[-1]
    if time.monotonic() < t_end:
        time.sleep(t_end - time.monotonic())
    watch.stop()
    custom.delete_namespaced_custom_object(names.GROUP, names.VERSION, NAMESPACE, names.PLURAL, name)
    wait(lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=f"{names.LABEL_FLEET}={name}").items,
         120, f"fleet {name}'s pods gone")
    return summarise(arm, requests, watch, t0, bounds)


def summarise(arm: str, requests: list[Request], watch: FleetWatch, t0: float, bounds: list[float]) -> dict:
    step_up, step_down, end = bounds[1], bounds[2], bounds[3]
    seconds = watch.server_seconds(t0, t0 + end)
    phases = {}
    for phase, lo, hi in zip(PHASES, bounds, bounds[1:]):
        ttfts = [r.ttft for r in requests if lo <= r.sent < hi and r.kind == "completed" and r.ttft is not None]
        phases[phase] = {"requests": sum(lo <= r.sent < hi for r in requests),
                         "ttft_p50_s": _round(percentile(ttfts, 50)), "ttft_p99_s": _round(percentile(ttfts, 99))}
    ttfts = [r.ttft for r in requests if r.kind == "completed" and r.ttft is not None]
    e2e = [r.end - r.sent for r in requests if r.kind == "completed"]
    signals = {}  # what the policy read during the load (the operator reads them only for autoscaled roles)
    for role in ROLES:
        for name in ("waiting_per_rank", "running_per_rank", "kv_cache_utilization", "transfer_share"):
            values = watch.signal(role, name, t0, t0 + end)
            if values:
                signals[f"{role}_{name}"] = {"mean": _round(statistics.fmean(values)), "max": _round(max(values))}
    held = [u * s for u, s in zip(watch.signal("context", "kv_cache_utilization", t0, t0 + end),
                                  watch.signal("context", "transfer_share", t0, t0 + end))]
    if held:
        signals["context_held_for_transfers"] = {"mean": _round(statistics.fmean(held)), "max": _round(max(held))}
    timeline = []
    t = 0.0
    while t <= end:
        row = {"t": round(t, 1)}
        for role in ROLES:
            row[role], row[f"{role}_serving"] = watch.counts(role, t0 + t)
        timeline.append(row)
        t += 1.0
    # the servers the step brought: the first of each role seen after it, and when it served
    added = {}
    for role in ROLES:
        new = sorted((s for s in watch.servers.values() if s.role == role and s.seen >= t0 + step_up),
                     key=lambda s: s.seen)
        if new:
            added[role] = {"seen_after_step_s": _round(new[0].seen - t0 - step_up),
                           "serving_after_step_s": _round(new[0].ready - t0 - step_up) if new[0].ready else None}
    decisions = [{**d, "at": round(d["at"] - t0, 1)} for d in watch.decisions if d["at"] >= t0]
    ups = [d for d in decisions if d["at"] >= step_up and (d["desired"] or 0) > (d["previous"] or 0)]
    downs = [d for d in decisions if d["at"] >= step_down and (d["desired"] or 0) < (d["previous"] or 0)]
    serving = [a["serving_after_step_s"] for a in added.values() if a["serving_after_step_s"] is not None]
    return {
        "arm": arm,
        "server_seconds": {**{r: round(v, 1) for r, v in seconds.items()}, "total": round(sum(seconds.values()), 1)},
        "requests": len(requests),
        "completed": sum(r.kind == "completed" for r in requests),
        "errors": sum(r.kind == "error" for r in requests),
        "lost": sum(r.kind == "lost" for r in requests),
        "error_details": sorted({r.detail for r in requests if r.kind != "completed"})[:5],
        "ttft_p50_s": _round(percentile(ttfts, 50)), "ttft_p99_s": _round(percentile(ttfts, 99)),
        "e2e_p50_s": _round(percentile(e2e, 50)), "e2e_p99_s": _round(percentile(e2e, 99)),
        "phases": phases, "signals": signals,
        "step_to_first_scale_up_s": _round(ups[0]["at"] - step_up) if ups else None,
        "step_to_new_server_serving_s": min(serving) if serving else None,
        "added_after_step": added,
        "step_down_to_first_scale_down_s": _round(downs[0]["at"] - step_down) if downs else None,
        "step_down_to_last_scale_down_s": _round(downs[-1]["at"] - step_down) if downs else None,
        "servers_at_peak": {r: max(row[r] for row in timeline if step_up <= row["t"] < step_down) for r in ROLES},
        "servers_at_end": {r: timeline[-1][r] for r in ROLES},
        "decisions": decisions,
        "timeline": timeline,
        "ttft_series": [[round(r.sent, 2), round(r.ttft, 3)] for r in requests if r.ttft is not None
                        and r.kind == "completed"],
    }


def _round(v, digits: int = 3):
    return None if v is None else round(v, digits)


def run(args) -> dict:
    durations = args.phases
    rates = [(durations[0], args.trough_rps), (durations[1], args.trough_rps * args.factor),
             (durations[2], args.trough_rps)]
    bounds = [0.0, durations[0], durations[0] + durations[1], sum(durations)]
    schedule = arrivals(rates, args.seed)
    with operator_cluster("adpfleet-bench-autoscale-", NAMESPACE) as cluster:
        arms = []
        peak = {r: args.peak_servers for r in ROLES}
        for arm in args.arms:
            started = time.monotonic()
            arms.append(run_arm(arm, args, cluster.core, cluster.custom, schedule, bounds, cluster.operator_url, peak))
            if arm == "policy":  # the fixed fleet for the peak: the size the policy found for it, held throughout
                peak = dict(arms[-1]["servers_at_peak"])
            arms[-1]["wall_s"] = round(time.monotonic() - started, 1)
            brief = {k: v for k, v in arms[-1].items() if k not in ("timeline", "ttft_series", "decisions")}
            print(f"{arm}: {json.dumps(brief)}", flush=True)
        return {"phases_s": durations, "phase_names": list(PHASES), "trough_rps": args.trough_rps,
                "factor": args.factor, "requests_per_arm": len(schedule), "seed": args.seed,
                "max_tokens": args.max_tokens, "scrape_interval_s": args.interval,
                "policy": {"min_servers": 1, "max_servers": args.max_servers,
                           "targets": {"waitingPerRank": args.waiting_target},
                           "scale_up_window_s": args.up_window, "scale_down_window_s": args.down_window,
                           "max_batch_size": args.max_batch},
                "peak_servers": peak, "arms": arms, "state_dir": str(cluster.state),
                "arrivals_s": [round(t, 2) for t in schedule]}


# ---- report -------------------------------------------------------------------------------------

def table_rows(result: dict) -> tuple[list[str], list[list]]:
    headers = ["arm", "server-s", "vs fixed-peak", "TTFT p50 s", "TTFT p99 s", "peak p99 s", "errors", "lost",
               "step→serving s", "servers at peak", "servers at end"]
    peak = next((a["server_seconds"]["total"] for a in result["arms"] if a["arm"] == "fixed-peak"), None)
    rows = []
    for a in result["arms"]:
        rows.append([a["arm"], a["server_seconds"]["total"],
                     f"{a['server_seconds']['total'] / peak:.2f}x" if peak else "-",
                     a["ttft_p50_s"], a["ttft_p99_s"], a["phases"]["peak"]["ttft_p99_s"], a["errors"], a["lost"],
                     a["step_to_new_server_serving_s"] if a["step_to_new_server_serving_s"] is not None else "-",
                     "+".join(str(a["servers_at_peak"][r]) for r in ROLES),
                     "+".join(str(a["servers_at_end"][r]) for r in ROLES)])
    return headers, rows


def doc_rows(result: dict) -> list[str]:
    """The rows of docs/benchmarks.md's autoscaling table (tests/test_docs_figures.py checks them
    against the JSON)."""
    peak = next(a["server_seconds"]["total"] for a in result["arms"] if a["arm"] == "fixed-peak")
    rows = []
    for a in result["arms"]:
        sizes = " + ".join(f"{min(row[r] for row in a['timeline'])}–{max(row[r] for row in a['timeline'])}"
                           if a["arm"] == "policy" else str(a["servers_at_peak"][r]) for r in ROLES)
        step = a["step_to_new_server_serving_s"]
        rows.append(f"| {a['arm']} | {sizes} | {a['server_seconds']['total']:.0f} | "
                    f"{a['server_seconds']['total'] / peak:.2f}x | {a['ttft_p50_s']:.3f} | {a['ttft_p99_s']:.3f} | "
                    f"{a['phases']['peak']['ttft_p99_s']:.3f} | {a['errors']} | {a['lost']} | "
                    f"{'-' if step is None else f'{step:.1f}'} |")
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    bounds = [0.0, result["phases_s"][0], sum(result["phases_s"][:2]), sum(result["phases_s"])]
    colors = {"policy": "tab:blue", "fixed-peak": "tab:green", "fixed-trough": "tab:red"}
    fig, axes = plt.subplots(4, 1, figsize=(10, 9.5), sharex=True, gridspec_kw={"height_ratios": [1, 1, 1, 1.6]})
    ax_load, ax_ctx, ax_gen, ax_ttft = axes
    rps = [result["trough_rps"], result["trough_rps"] * result["factor"], result["trough_rps"]]
    ax_load.step(bounds, rps + rps[-1:], where="post", color="black", lw=1.2, label="offered load")
    sent = result["arrivals_s"]
    ax_load.hist(sent, bins=range(0, int(bounds[-1]) + 5, 5), weights=[1 / 5] * len(sent), color="0.8",
                 label="requests sent (per s, 5 s bins)")
    ax_load.set_ylabel("requests/s")
    ax_load.legend(loc="upper right", fontsize=8, frameon=False)
    for a in result["arms"]:
        ts = [row["t"] for row in a["timeline"]]
        for ax, role in ((ax_ctx, "context"), (ax_gen, "generation")):
            offset = {"policy": 0.0, "fixed-peak": 0.04, "fixed-trough": -0.04}[a["arm"]]  # keep equal lines apart
            ax.step(ts, [row[role] + offset for row in a["timeline"]], where="post", color=colors[a["arm"]], lw=1.4,
                    label=f"{a['arm']} (alive)")
            if a["arm"] == "policy":
                ax.step(ts, [row[f"{role}_serving"] for row in a["timeline"]], where="post", color=colors["policy"],
                        lw=0.9, ls="--", label="policy (serving)")
                for d in a["decisions"]:
                    if d["role"] == role:
                        ax.annotate(d["reason"], (d["at"], d["desired"]), fontsize=6, xytext=(2, 3),
                                    textcoords="offset points", color=colors["policy"])
        pts = a["ttft_series"]
        ax_ttft.scatter([p[0] for p in pts], [p[1] for p in pts], s=3, color=colors[a["arm"]], alpha=0.3)
        window = [(t, statistics.median([v for s, v in pts if t - 5 <= s < t] or [float("nan")]))
                  for t in range(5, int(bounds[-1]) + 1)]
        ax_ttft.plot([w[0] for w in window], [w[1] for w in window], color=colors[a["arm"]], lw=1.4,
                     label=f"{a['arm']} (5 s median)")
    for ax, role in ((ax_ctx, "context"), (ax_gen, "generation")):
        ax.set_ylabel(f"{role}\nservers")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, result["policy"]["max_servers"] + 0.8)
    ax_ctx.legend(loc="upper right", fontsize=7, ncol=4, frameon=False)
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("TTFT s (client)")
    ax_ttft.set_xlabel("seconds since the load began")
    ax_ttft.legend(loc="upper left", fontsize=8, frameon=False)
    for ax in axes:
        for b in bounds[1:3]:
            ax.axvline(b, color="0.5", ls=":", lw=1)
    ax_load.set_title(f"adpfleet autoscaling: {result['trough_rps']:g} → {result['trough_rps'] * result['factor']:g}"
                      f" → {result['trough_rps']:g} requests/s, tiny model, {result['machine']['cpu_count']} CPU cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trough-rps", type=float, default=1.0)
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--phases", type=float, nargs=3, default=[20, 70, 70], metavar=("TROUGH", "PEAK", "TROUGH"),
                   help="seconds of each phase")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=1, help="engine.maxBatchSize: requests one rank runs at once")
    p.add_argument("--kv-blocks", type=int, default=128)
    p.add_argument("--max-servers", type=int, default=3, help="the policy's maxServers per role")
    p.add_argument("--peak-servers", type=int, default=3,
                   help="servers per role of the fixed-peak arm when no policy arm runs first (after one: the "
                        "servers it ran at the peak)")
    p.add_argument("--waiting-target", type=float, default=1.0, help="autoscaling.targets.waitingPerRank")
    p.add_argument("--up-window", type=int, default=3, help="scaleUp.stabilizationWindowSeconds")
    p.add_argument("--down-window", type=int, default=15, help="scaleDown.stabilizationWindowSeconds")
    p.add_argument("--interval", type=int, default=1, help="monitoring.scrapeIntervalSeconds")
    p.add_argument("--deadline", type=float, default=60.0, help="a request with no answer by then is lost")
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--arms", nargs="+", default=["policy", "fixed-peak", "fixed-trough"],
                   choices=["policy", "fixed-peak", "fixed-trough"])
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, default=PLOT)
    args = p.parse_args()
    from common import format_table, machine_info

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still takes its cluster down
    started = time.monotonic()
    result = run(args)
    result["machine"] = machine_info()
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(format_table(*table_rows(result)))
    if any(a["arm"] == "fixed-peak" for a in result["arms"]):
        print("\n".join(doc_rows(result)))
    for a in result["arms"]:
        if a["arm"] == "policy":
            print("policy decisions:", "; ".join(f"{d['at']:.0f}s {d['role']} {d['previous']}->{d['desired']} "
                                                 f"{d['reason']}" for d in a["decisions"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.plot)
    print(f"wrote {args.out} and {args.plot} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
