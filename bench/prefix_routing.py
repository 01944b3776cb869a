"""Multi-turn chat with prefix caching: through the router (round-robin, least-loaded, cache-aware)
on an aggregated and on a disaggregated fleet, and on one engine alone (adpfleet's cache on and
off, and vLLM's CPU build with its prefix caching on, the peer).

Parts (`--parts`, comma-separated; all by default), each on fleets of its own, one after another:
- `aggregated`: 2 aggregated servers x 2 ADP ranks, one router per policy in front of them
  (`adpfleet router --policy P`, the cache-aware one with `--tokenizer` the model directory);
- `disaggregated`: 1 context + 1 generation server x 2 ADP ranks, one router per policy (cache-
  aware: the context rank chosen by prefix, the generation server by load);
- `engine`: one server of one rank, sent the workload directly (no router): `adpfleet serve` with
  the prefix cache on and with `--no-prefix-cache` (the baseline);
- `vllm`: adds `vllm serve` (DP 1, prefix caching on, eager unless --vllm-compile) to the engine
  part, sent the same requests the same way, so that its TTFT is measured as adpfleet's is.
The model is a random ~34 M-parameter Llama (bench/engine_throughput.py's `small`: a prompt's
prefill costs real time, unlike the built-in tiny models). A part's arms take turns on the same
servers (after one warm-up request each), `--rounds` times, each run with prompts of its own (a
salt in every system prompt), so no run finds another's blocks. The engine alone with a 1k-token
90 %-shared prompt, warm against cold, is bench/prefix_cache.py's.

The workload (closed loop): `--sessions` sessions of `--turns` turns; sessions in groups of
`--group` share a system prompt of `--system` tokens; turn k sends the whole conversation so far
(system prompt, then per earlier turn the user's 32 tokens and a fixed 32-token answer the client
resends, then the new user turn) and streams `--max-tokens` tokens (ignore_eos). `hot`: every
session shares one system prompt (the lockstep-imbalance case; routed parts only).

Reported per arm (ratios against the part's baseline — least-loaded, today's router, or the engine
with its cache off — measured in the same run: the table's "x base" is the median over rounds of
each round's ratio; the JSON has the pooled ones too): TTFT p50 / p99 (the first streamed output
the client sees), throughput (completion tokens / wall time of the run), prefill tokens computed
(`adpfleet_prompt_tokens_total`: hits skipped; vLLM's prompt tokens less its hits), hit tokens
(`adpfleet_prefix_cache_hits_total`, `vllm:prefix_cache_hits`) against the ideal — one unbounded
cache that held every prompt block of every request whose prompt was computed (first token
streamed) before this one was sent — the per-pass rank imbalance (the servers' histogram
`adpfleet_pass_imbalance`, max/mean of the ranks' scheduled tokens of every pass that ran: mean,
percentiles as bucket bounds, share over 1.25; the JSON also has the older proxy, max/mean of the
ranks' pending tokens sampled from the servers' snapshots every 0.1 s), and vetoed passes
(`adpfleet_forward_vetoed_total`). The JSON keeps the load average at the start and the end: on a
shared machine the arms are interleaved so that the ratios hold.

    .venv/bin/python bench/prefix_routing.py                            # ~40 min on 2 busy cores
    .venv/bin/python bench/prefix_routing.py --parts aggregated --quick # one part, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))  # the suite's server and router processes

from common import format_table, machine_info  # noqa: E402
from engine_throughput import FIRST_TOKEN_ID, MODELS, save_model  # noqa: E402
from servers import Process, RouterProcess, Server, free_port  # noqa: E402

from adpfleet.contract.metrics import IMBALANCE_BUCKETS  # noqa: E402
from adpfleet.contract.router_policy import CACHE_AWARE, LEAST_LOADED, ROUTER_POLICIES  # noqa: E402
from adpfleet.runtime.engine import block_hash  # noqa: E402
from adpfleet.runtime.serving.rank_routing import SNAPSHOT_PATH  # noqa: E402

DEFAULT_OUT = HERE / "results" / "prefix_routing.json"
TOKEN = "bench-internal-token"
B = 16  # the servers' tokens per block
USER_TOKENS, ANSWER_TOKENS = 32, 32


@dataclass
class Workload:
    sessions: int
    turns: int
    group: int
    system: int
    max_tokens: int

    def conversations(self, salt: int, vocab: int) -> list[list[list[int]]]:
        """Per session, the prompt of each turn (token ids)."""
        rng = random.Random(salt)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]
        systems = [[FIRST_TOKEN_ID + salt % (vocab - FIRST_TOKEN_ID)] + tokens(self.system - 1)
                   for _ in range(-(-self.sessions // self.group))]
        out = []
        for s in range(self.sessions):
            history, turns = list(systems[s // self.group]), []
            for _ in range(self.turns):
                history += tokens(USER_TOKENS)
                turns.append(list(history))
                history += tokens(ANSWER_TOKENS)
            out.append(turns)
        return out


@dataclass
class Sent:
    prompt: list[int]
    sent: float
    first: float = 0.0
    done: float = 0.0


# Where a request's time to first token goes, as the servers that compute prompts observe it (the
# histograms' sums and counts; vLLM's names, which adpfleet's follow): arrival to the first pass
# that ran its prompt, and from there to its first token.
LATENCY_SPLIT = {"server_ttft": "time_to_first_token_seconds", "queue": "request_queue_time_seconds",
                 "prefill_time": "request_prefill_time_seconds"}
# each part's sum and count: the field an arm's counters give it -> its series, less the dialect's prefix
LATENCY_FIELDS = {f"{key}_{part}": f"{name}_{part}"
                  for key, name in LATENCY_SPLIT.items() for part in ("sum", "count")}


@dataclass
class Arm:
    """One way of serving the workload: the URL its requests go to and the servers that count them.
    `prefill` compute prompts (aggregated or context servers), `decode` finish requests (aggregated
    or generation), `snapshots` are the ADP servers whose ranks' balance is sampled; `dialect` says
    whose /metrics these are (adpfleet or vllm)."""
    url: str
    prefill: list[Process]
    decode: list[Process]
    snapshots: list[Process] = field(default_factory=list)
    dialect: str = "adpfleet"
    model: str | None = None  # the name a vLLM server serves
    router: RouterProcess | None = None

    def counters(self) -> dict[str, float]:
        """prefill (tokens computed), hits, queries, vetoed, finished, summed over the arm's servers,
        and the cumulative buckets (`imb_le_<bound>`), sum and count of the per-pass imbalance."""
        if self.dialect == "vllm":
            (v,) = {*self.prefill, *self.decode}
            m = scrape(v)
            prompt, hits = m("vllm:prompt_tokens_total"), m("vllm:prefix_cache_hits_total")
            return {"prefill": prompt - hits, "hits": hits, "queries": m("vllm:prefix_cache_queries_total"),
                    "vetoed": 0.0, "finished": m("vllm:request_success_total"),
                    **{field: m("vllm:" + series) for field, series in LATENCY_FIELDS.items()}}
        got = {s: scrape(s) for s in dict.fromkeys([*self.prefill, *self.decode])}
        out = {"prefill": sum(got[s]("adpfleet_prompt_tokens_total") for s in self.prefill),
               "hits": sum(got[s]("adpfleet_prefix_cache_hits_total") for s in self.prefill),
               "queries": sum(got[s]("adpfleet_prefix_cache_queries_total") for s in self.prefill),
               "vetoed": sum(m("adpfleet_forward_vetoed_total") for m in got.values()),
               "finished": sum(got[s]("adpfleet_requests_finished_total") for s in self.decode),
               **{field: sum(got[s]("adpfleet_" + series) for s in self.prefill)
                  for field, series in LATENCY_FIELDS.items()}}
        # every rank of a server observes the same passes: rank 0's series are the server's
        adp = [got[s] for s in self.snapshots]
        for part in ("sum", "count"):
            out[f"imb_{part}"] = sum(m(f"adpfleet_pass_imbalance_{part}", rank="0") for m in adp)
        for bound in IMBALANCE_BUCKETS:
            out[f"imb_le_{bound}"] = sum(m("adpfleet_pass_imbalance_bucket", rank="0", le=str(bound)) for m in adp)
        return out


def scrape(server: Process):
    """One read of a server's /metrics: a function summing the samples of a name whose labels
    include the given ones."""
    text = httpx.get(server.url + "/metrics", timeout=10, trust_env=False).text
    samples = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]

    def m(name: str, **labels) -> float:
        return sum(float(v) for k, v in samples if k.split("{")[0] == name
                   and all(f'{lk}="{lv}"' in k for lk, lv in labels.items()))
    return m


@dataclass
class Part:
    """A fleet and the arms that take turns on it; each arm's ratios are against `baseline`'s."""
    fleet: str
    arms: dict[str, Arm]
    baseline: str
    workloads: dict[str, tuple[Workload, int]]
    processes: list[Process]
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=300, trust_env=False))

    def stop(self) -> None:
        for p in self.processes:
            p.stop()


async def one_turn(http: httpx.AsyncClient, arm: Arm, prompt: list[int], max_tokens: int) -> Sent:
    record = Sent(prompt, time.monotonic())
    body = {"model": arm.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with http.stream("POST", arm.url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data:") and not record.first and line.strip() != "data: [DONE]":
                record.first = time.monotonic()
    record.done = time.monotonic()
    return record


async def session(http: httpx.AsyncClient, arm: Arm, turns: list[list[int]], max_tokens: int,
                  out: list[Sent]) -> None:
    for prompt in turns:
        out.append(await one_turn(http, arm, prompt, max_tokens))


async def sample_imbalance(http: httpx.AsyncClient, servers: list[Process], samples: list[float],
                           stop: asyncio.Event) -> None:
    """max/mean of the ranks' pending tokens of each server with work, every 0.1 s."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    while not stop.is_set():
        for s in servers:
            snap = (await http.get(s.url + SNAPSHOT_PATH, headers=headers)).json()
            if sum(r["pending_tokens"] for r in snap["ranks"]) > 0:
                samples.append(snap["imbalance"])
        await asyncio.sleep(0.1)


def ideal_hit_tokens(sent: list[Sent]) -> int:
    """Hit tokens of one unbounded cache holding every prompt block of the requests whose prompt
    was computed (their first token streamed) before each request was sent."""
    finished = sorted(sent, key=lambda r: r.first)
    total, held, i = 0, set(), 0
    for r in sorted(sent, key=lambda r: r.sent):
        while i < len(finished) and finished[i].first <= r.sent:
            held.update(block_hash.block_hashes(finished[i].prompt, B))
            i += 1
        hits = 0
        for h in block_hash.prefix_hashes(r.prompt, B):
            if h not in held:
                break
            hits += 1
        total += hits * B
    return total


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def run_arm(part: Part, name: str, workload: Workload, salt: int, vocab: int) -> dict:
    arm = part.arms[name]
    before = arm.counters()
    sent: list[Sent] = []
    samples: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_imbalance(part.http, arm.snapshots, samples, stop))
    started = time.monotonic()
    await asyncio.gather(*(session(part.http, arm, turns, workload.max_tokens, sent)
                           for turns in workload.conversations(salt, vocab)))
    wall = time.monotonic() - started
    stop.set()
    await sampler
    # the ranks' counters follow the outputs on the pipe: wait until every request is counted
    deadline = time.monotonic() + 30
    while arm.counters()["finished"] - before["finished"] < len(sent) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    after = arm.counters()
    d = {k: after[k] - before[k] for k in after}
    return {"arm": name, "requests": len(sent), "wall_s": wall, "ttft": [r.first - r.sent for r in sent],
            "completion_tokens": len(sent) * workload.max_tokens, "prefill_tokens": d["prefill"],
            "hit_tokens": d["hits"], "query_tokens": d["queries"], "ideal_hit_tokens": ideal_hit_tokens(sent),
            "vetoed_passes": d["vetoed"] if arm.dialect == "adpfleet" else None, "imbalance_samples": samples,
            "pass_imbalance": {k.removeprefix("imb_"): v for k, v in d.items() if k.startswith("imb_")},
            "latency_split": {field: d[field] for field in LATENCY_FIELDS},
            "router": router_counts(arm.router) if arm.router else {}}


IMBALANCE_BOUND = 1.25  # the issue's target for the hot-prefix case (the servers' own bound: docs/adp.md)


def imbalance_summary(samples: list[float]) -> dict:
    """Percentiles of the sampled imbalance of the ranks' pending tokens and the share of samples
    over the bound (None: no ADP server in the arm, nothing sampled)."""
    keys = ("mean", "p50", "p90", "p99", "over_bound")
    if not samples:
        return {**{f"pending_imbalance_{k}": None for k in keys}, "pending_imbalance_samples": 0}
    values = (statistics.fmean(samples), percentile(samples, 0.5), percentile(samples, 0.9),
              percentile(samples, 0.99), sum(x > IMBALANCE_BOUND for x in samples) / len(samples))
    return {**{f"pending_imbalance_{k}": v for k, v in zip(keys, values)}, "pending_imbalance_samples": len(samples)}


def pass_imbalance_summary(h: dict[str, float]) -> dict:
    """The servers' per-pass imbalance histogram (`le_<bound>` cumulative counts, sum, count): its
    mean, percentiles (a bucket's upper bound: the smallest bound that many passes were at or
    under) and the share of passes over the bound. None: no ADP server, or no pass ran."""
    keys = ("mean", "p50", "p90", "p99", "over_bound")
    if not h.get("count"):
        return {**{f"pass_imbalance_{k}": None for k in keys}, "pass_imbalance_passes": 0}
    n = h["count"]

    def quantile(q: float) -> float | None:  # None: past the last finite bucket
        return next((b for b in IMBALANCE_BUCKETS if h[f"le_{b}"] >= q * n), None)
    values = (h["sum"] / n, quantile(0.5), quantile(0.9), quantile(0.99), 1 - h[f"le_{IMBALANCE_BOUND}"] / n)
    return {**{f"pass_imbalance_{k}": v for k, v in zip(keys, values)}, "pass_imbalance_passes": int(n)}


def summarize(runs: list[dict]) -> dict:
    """One arm's runs pooled."""
    ttft = [t for r in runs for t in r["ttft"]]
    total = {k: sum(r[k] for r in runs) for k in ("requests", "wall_s", "completion_tokens", "prefill_tokens",
                                                  "hit_tokens", "query_tokens", "ideal_hit_tokens")}
    vetoed = None if runs[0]["vetoed_passes"] is None else sum(r["vetoed_passes"] for r in runs)
    return {**total, "vetoed_passes": vetoed, "ttft_p50_s": percentile(ttft, 0.5),
            "ttft_p99_s": percentile(ttft, 0.99), "throughput_tok_s": total["completion_tokens"] / total["wall_s"],
            "hit_rate": total["hit_tokens"] / max(1, total["query_tokens"]),
            "hit_vs_ideal": total["hit_tokens"] / max(1, total["ideal_hit_tokens"]),
            **imbalance_summary([s for r in runs for s in r["imbalance_samples"]]),
            **pass_imbalance_summary({k: sum(r["pass_imbalance"].get(k, 0) for r in runs)
                                      for k in runs[0]["pass_imbalance"]}),
            **latency_split_summary(ttft, [r["latency_split"] for r in runs]), "router": runs[-1]["router"]}


def latency_split_summary(ttft: list[float], splits: list[dict]) -> dict:
    """Mean time to first token as the clients saw it, and as the servers that compute prompts
    observed it, split into the queue before the first pass that ran the prompt and the prefill
    from there (None: no observation). The clients' mean less the servers' is the router, the
    wire and, on a disaggregated fleet, the KV transfer and the generation server's first step."""
    total = {k: sum(s[k] for s in splits) for k in splits[0]}
    means = {f"{k}_mean_s": total[f"{k}_sum"] / total[f"{k}_count"] if total[f"{k}_count"] else None
             for k in LATENCY_SPLIT}
    return {"client_ttft_mean_s": statistics.fmean(ttft) if ttft else None, **means}


RATIOS = ("ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "prefill_tokens")


def with_ratios(arms: dict[str, dict], runs: dict[str, list[dict]], baseline: str) -> dict[str, dict]:
    """Each arm against the baseline: pooled over the rounds, and the median of the rounds' own
    ratios (the arms of one round ran back to back: the machine's load drifts less within one)."""
    base = arms[baseline]
    for name, arm in arms.items():
        arm["vs_baseline"] = {k: arm[k] / base[k] if base[k] else None for k in RATIOS}
        per_round = [(summarize([mine]), summarize([theirs])) for mine, theirs in zip(runs[name], runs[baseline])]
        arm["vs_baseline_per_round_median"] = {
            k: statistics.median(m[k] / b[k] for m, b in per_round if b[k]) if any(b[k] for _, b in per_round)
            else None for k in RATIOS}
    return arms


def table(results: dict) -> str:
    rows = []
    for part, workloads in results.items():
        for name, arms in workloads.get("workloads", {}).items():
            for arm_name, a in arms.items():
                r = a["vs_baseline_per_round_median"]
                rows.append([part, name, arm_name, a["requests"], a["ttft_p50_s"] * 1000, r["ttft_p50_s"],
                             a["ttft_p99_s"] * 1000, r["ttft_p99_s"], a["throughput_tok_s"], r["throughput_tok_s"],
                             int(a["prefill_tokens"]), r["prefill_tokens"], a["hit_rate"], a["hit_vs_ideal"],
                             *(dash(a[f"pass_imbalance_{k}"]) for k in ("mean", "p50", "p90", "p99", "over_bound")),
                             dash(None if a["vetoed_passes"] is None else int(a["vetoed_passes"]))])
    return format_table(["part", "workload", "arm", "reqs", "TTFT p50 ms", "x base", "TTFT p99 ms", "x base", "tok/s",
                         "x base", "prefill tok", "x base", "hit rate", "hit/ideal", "pass imbal mean", "p50", "p90",
                         "p99", "passes > 1.25", "vetoed"], rows)


def latency_table(results: dict) -> str:
    """Where the time to first token goes: each arm's means, in ms."""
    rows = []
    for part, workloads in results.items():
        for name, arms in workloads.get("workloads", {}).items():
            for arm_name, a in arms.items():
                ms = [None if a[k] is None else a[k] * 1000 for k in
                      ("client_ttft_mean_s", "server_ttft_mean_s", "queue_mean_s", "prefill_time_mean_s")]
                outside = None if None in ms[:2] else ms[0] - ms[1]
                rows.append([part, name, arm_name, *map(dash, ms), dash(outside)])
    return format_table(["part", "workload", "arm", "client TTFT ms", "server TTFT ms", "queue ms", "prefill ms",
                         "client - server ms"], rows)


def dash(value):
    return "-" if value is None else value


def router_counts(router: RouterProcess) -> dict:
    names = ("adpfleet_router_prefix_decisions_total", "adpfleet_router_prefix_predictions_total",
             "adpfleet_router_prefix_snapshots_total")
    return {k: v for k, v in router.metrics().items() if k.split("{")[0] in names}


def adp_server(model_dir: Path, logs: Path, role: str, *extra: str, dp: int = 2, kv_blocks: int = 512,
               label: str = "", behind_router: bool = True) -> Server:
    """`adpfleet serve` of the bench's model; one behind a router takes the fleet's internal token
    (its snapshot is for the router's eyes only), one the bench talks to directly is open."""
    env = {"ADPFLEET_INTERNAL_TOKEN": TOKEN} if behind_router else {}
    return Server("--role", role, "--model", str(model_dir), "--dp", str(dp), "--kv-blocks", str(kv_blocks), *extra,
                  log_path=logs / f"{role}{label}.log", env=env)


def start_routers(model_dir: Path, logs: Path, servers: list[str], **usable: int) -> dict[str, RouterProcess]:
    """One router per policy in front of the same servers (`servers`: its --ROLE URL flags)."""
    routers = {p: RouterProcess(logs, *servers, "--policy", p, *(["--tokenizer", str(model_dir)]
                                                                 if p == CACHE_AWARE else []),
                                env={"ADPFLEET_INTERNAL_TOKEN": TOKEN}) for p in ROUTER_POLICIES}
    for r in routers.values():
        r.wait_healthy(120)
        r.wait_usable(**usable)
    return routers


def routed_part(model_dir: Path, logs: Path, args, workloads: dict) -> Part:
    """2 aggregated servers x 2 ADP ranks behind one router per policy."""
    servers = [adp_server(model_dir, logs, "aggregated", kv_blocks=args.kv_blocks, label=f"-{i}") for i in range(2)]
    for s in servers:
        s.wait_healthy(600)
    routers = start_routers(model_dir, logs, [f for s in servers for f in ("--aggregated", s.url)], aggregated=2)
    arms = {p: Arm(r.url, servers, servers, servers, router=r) for p, r in routers.items()}
    return Part("2 aggregated servers x 2 ADP ranks", arms, LEAST_LOADED, workloads, [*routers.values(), *servers])


def disaggregated_part(model_dir: Path, logs: Path, args, workloads: dict) -> Part:
    """1 context + 1 generation server x 2 ADP ranks behind one router per policy: the context rank
    chosen by prefix (cache-aware), the generation server by load."""
    ctx = adp_server(model_dir, logs, "context", kv_blocks=args.kv_blocks)
    gen = adp_server(model_dir, logs, "generation", kv_blocks=args.kv_blocks)
    for s in (ctx, gen):
        s.wait_healthy(600)
    routers = start_routers(model_dir, logs, ["--context", ctx.url, "--generation", gen.url], context=1, generation=1)
    arms = {p: Arm(r.url, [ctx], [gen], [ctx, gen], router=r) for p, r in routers.items()}
    return Part("1 context + 1 generation server x 2 ADP ranks", arms, LEAST_LOADED, workloads,
                [*routers.values(), ctx, gen])


ENGINE_ON, ENGINE_OFF, VLLM = "adpfleet cache on", "adpfleet cache off", "vllm prefix caching on"


def engine_part(model_dir: Path, logs: Path, args, workloads: dict, with_vllm: bool) -> Part:
    """One engine, one rank, no router: adpfleet's server with the prefix cache on and off, and
    (`with_vllm`) `vllm serve` with its prefix caching on, each sent the workload directly."""
    on = adp_server(model_dir, logs, "aggregated", dp=1, kv_blocks=args.kv_blocks, label="-cache-on",
                    behind_router=False)
    off = adp_server(model_dir, logs, "aggregated", "--no-prefix-cache", dp=1, kv_blocks=args.kv_blocks,
                     label="-cache-off", behind_router=False)
    arms = {ENGINE_ON: Arm(on.url, [on], [on]), ENGINE_OFF: Arm(off.url, [off], [off])}
    processes: list[Process] = [on, off]
    if with_vllm:
        vllm = vllm_server(model_dir, logs / "vllm", compile=args.vllm_compile)
        processes.append(vllm)
        arms[VLLM] = Arm(vllm.url, [vllm], [vllm], dialect="vllm", model=VLLM_MODEL_NAME)
    try:
        for p in processes:
            p.wait_healthy(900)
    except Exception:
        for p in processes:
            p.stop()
        raise
    return Part("1 server x 1 rank, no router", arms, ENGINE_OFF, workloads, processes)


VLLM_MODEL_NAME, VLLM_BLOCK = "small", 32


def vllm_server(model_dir: Path, workdir: Path, compile: bool) -> Process:
    """`vllm serve` (its CPU build, DP 1) as the adpfleet server is run: float32, 2048-token passes,
    prompts as token ids (no tokenizer), prefix caching on, OpenMP on one core as the adpfleet
    rank's one thread; eager unless `compile` (as the suite runs it: torch.compile took over 10 min
    to start here); 32-token blocks (its CPU backend's smallest fast size: 16 warns that it is
    not optimized), so it can find a prefix to 32 tokens where adpfleet finds it to 16. From a
    directory of its own (cluster/vllm_env.py says why)."""
    from adpfleet.cluster import vllm_env

    (workdir / "tmp").mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = vllm_env.locate().serve_command(
        model_dir, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", VLLM_MODEL_NAME,
        "--dtype", "float32", "--skip-tokenizer-init", "--enable-prefix-caching", "--block-size", str(VLLM_BLOCK),
        "--max-num-batched-tokens", "2048", "--max-model-len", "1024", *([] if compile else ["--enforce-eager"]))
    env = {"TMPDIR": str(workdir / "tmp"), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(sorted(os.sched_getaffinity(0))[0]),
           "VLLM_ENGINE_READY_TIMEOUT_S": "1800"}
    return Process(cmd, port, workdir / "vllm.log", env=env, cwd=workdir)


async def run_part(part: Part, vocab: int, salt: int) -> dict:
    """Every workload's rounds, the arms interleaved (each first in turn), with prompts of their own."""
    results = {}
    names = list(part.arms)
    warm_up = random.Random(-salt)  # one short request per arm first: no arm pays its servers' first passes
    for arm in part.arms.values():
        await one_turn(part.http, arm, [warm_up.randrange(FIRST_TOKEN_ID, vocab) for _ in range(2 * B)], 2)
    for wl_name, (workload, rounds) in part.workloads.items():
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                salt += 1
                run = await run_arm(part, name, workload, salt, vocab)
                runs[name].append(run)
                print(f"  {wl_name} round {rnd + 1}/{rounds} {name}: {run['requests']} requests in "
                      f"{run['wall_s']:.1f} s, TTFT p50 {percentile(run['ttft'], 0.5) * 1000:.0f} ms", flush=True)
        results[wl_name] = with_ratios({n: summarize(r) for n, r in runs.items()}, runs, part.baseline)
    await part.http.aclose()
    return {"fleet": part.fleet, "baseline": part.baseline, "workloads": results}


PARTS = ("aggregated", "disaggregated", "engine", "vllm")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"comma-separated, of {', '.join(PARTS)} (vllm: the peer's arm in the engine part)")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="sessions sharing one system prompt")
    ap.add_argument("--system", type=int, default=384, help="system prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the chat workload (routed parts)")
    ap.add_argument("--hot-rounds", type=int, default=2, help="rounds of the hot-prefix workload (routed parts)")
    ap.add_argument("--engine-rounds", type=int, default=2, help="rounds of the chat workload (engine part)")
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--vllm-compile", action="store_true",
                    help="vLLM with torch.compile (its default; over 10 min to start on 2 busy cores); else eager")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 sessions x 2 turns, one round")
    ap.add_argument("--json", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if unknown := set(args.parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.quick:
        args.sessions, args.turns, args.system, args.rounds, args.hot_rounds, args.engine_rounds = 4, 2, 128, 1, 1, 1
    return args


def plan(args) -> dict[str, tuple]:
    """Part name -> (builder, its workloads), in the order they run."""
    chat = Workload(args.sessions, args.turns, args.group, args.system, args.max_tokens)
    hot = Workload(args.sessions, args.turns, args.sessions, args.system, args.max_tokens)
    routed = {name: (w, rounds) for name, w, rounds in (("chat", chat, args.rounds), ("hot", hot, args.hot_rounds))
              if rounds > 0}  # --hot-rounds 0: chat only
    parts = {}
    if "aggregated" in args.parts:
        parts["aggregated"] = (routed_part, routed)
    if "disaggregated" in args.parts:
        parts["disaggregated"] = (disaggregated_part, routed)
    if {"engine", "vllm"} & set(args.parts):
        with_vllm = "vllm" in args.parts
        parts["engine"] = (lambda *a: engine_part(*a, with_vllm=with_vllm), {"chat": (chat, args.engine_rounds)})
    return parts


def run_one_part(build, model_dir: Path, logs: Path, args, workloads: dict, vocab: int, salt: int) -> dict:
    """One part's results, or its error: a part that fails (a peer that would not start) leaves the
    others' results standing."""
    part = None
    try:
        part = build(model_dir, logs, args, workloads)
        return asyncio.run(run_part(part, vocab, salt))
    except Exception as exc:  # noqa: BLE001 (reported in the JSON and the table's place)
        print(f"  failed: {exc!r}"[:2000], flush=True)
        return {"error": repr(exc)[:2000]}
    finally:
        if part is not None:
            part.stop()


def main() -> None:
    args = parse_args()
    model, results, salt = MODELS["small"], {}, 1
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
        model_dir, logs = Path(tmp) / "model", Path(tmp) / "logs"
        logs.mkdir()
        save_model(model_dir, model, seed=0)
        for name, (build, workloads) in plan(args).items():
            print(f"{name}:", flush=True)
            results[name] = run_one_part(build, model_dir, logs, args, workloads, model["vocab_size"], salt)
            salt += 1000
    print(table(results))
    print(latency_table(results))
    out = {"bench": "prefix_routing", "machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
           "model": "small (random Llama, ~34 M parameters)",
           "load_1m_after": round(os.getloadavg()[0], 2),  # machine_info has it at the start
           "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
