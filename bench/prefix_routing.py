"""Multi-turn chat through the router: round-robin, least-loaded and cache-aware, on the same fleet.

The fleet: 2 aggregated servers x 2 ADP ranks of a random ~34 M-parameter Llama (bench/
engine_throughput.py's `small`: a prompt's prefill costs real time, unlike the built-in tiny
models), prefix caches on, the fleet's internal token set; one router per policy in front of it
(`adpfleet router --policy P`, the cache-aware one with `--tokenizer` the model directory).
The arms take turns on the same servers, `--rounds` times, each run with prompts of its own (a
salt in every system prompt), so no run finds another's blocks.

The workload (closed loop): `--sessions` sessions of `--turns` turns; sessions in groups of
`--group` share a system prompt of `--system` tokens; turn k sends the whole conversation so far
(system prompt, then per earlier turn the user's 32 tokens and a fixed 32-token answer the client
resends, then the new user turn) and streams `--max-tokens` tokens (ignore_eos). `hot`: every
session shares one system prompt (the lockstep-imbalance case).

Reported per arm (ratios against least-loaded, today's router, measured in the same run: the
table's "x LL" is the median over rounds of each round's ratio; the JSON has the pooled ones too):
TTFT p50 / p99 (the router's first streamed output), throughput (completion tokens / wall time of
the run), prefill tokens computed (the servers' `adpfleet_prompt_tokens_total`: hits skipped), hit
tokens (`adpfleet_prefix_cache_hits_total`) against the ideal — one unbounded cache that held every
prompt block of every request whose prompt was computed (first token streamed) before this one
was sent — rank imbalance (max/mean of the
ranks' pending tokens in the servers' snapshots, sampled every 0.1 s while a server has work: the
quantity the bound keeps under 1.25; the servers export no per-pass scheduled-token series), and
vetoed passes (`adpfleet_forward_vetoed_total`). The machine is shared (2 cores, other jobs): the
numbers are contended, the arms interleaved so that the ratios hold.

    .venv/bin/python bench/prefix_routing.py                       # ~15 min on 2 busy cores
    .venv/bin/python bench/prefix_routing.py --quick               # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from servers import RouterProcess, Server, metric  # noqa: E402

from adpfleet.contract.router_policy import ROUTER_POLICIES  # noqa: E402
from adpfleet.runtime.engine import block_hash  # noqa: E402
from adpfleet.runtime.serving.rank_routing import SNAPSHOT_PATH  # noqa: E402

DEFAULT_OUT = HERE / "results" / "prefix_routing.json"
TOKEN = "bench-internal-token"
B = 16  # the servers' tokens per block
USER_TOKENS, ANSWER_TOKENS = 32, 32
BASELINE = "least-loaded"
COUNTERS = ("adpfleet_prompt_tokens_total", "adpfleet_prefix_cache_hits_total", "adpfleet_prefix_cache_queries_total",
            "adpfleet_forward_vetoed_total", "adpfleet_requests_finished_total")


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


@dataclass
class Fleet:
    servers: list[Server]
    routers: dict[str, RouterProcess]
    http: httpx.AsyncClient = field(default_factory=lambda: httpx.AsyncClient(timeout=300, trust_env=False))

    def counters(self) -> dict[str, float]:
        return {name: sum(metric(s, name) for s in self.servers) for name in COUNTERS}


async def one_turn(fleet: Fleet, url: str, prompt: list[int], max_tokens: int) -> Sent:
    record = Sent(prompt, time.monotonic())
    body = {"model": None, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with fleet.http.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data:") and not record.first and line.strip() != "data: [DONE]":
                record.first = time.monotonic()
    record.done = time.monotonic()
    return record


async def session(fleet: Fleet, url: str, turns: list[list[int]], max_tokens: int, out: list[Sent]) -> None:
    for prompt in turns:
        out.append(await one_turn(fleet, url, prompt, max_tokens))


async def sample_imbalance(fleet: Fleet, samples: list[float], stop: asyncio.Event) -> None:
    """max/mean of the ranks' pending tokens of each server with work, every 0.1 s."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    while not stop.is_set():
        for s in fleet.servers:
            snap = (await fleet.http.get(s.url + SNAPSHOT_PATH, headers=headers)).json()
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


async def run_arm(fleet: Fleet, policy: str, workload: Workload, salt: int, vocab: int) -> dict:
    before = fleet.counters()
    sent: list[Sent] = []
    samples: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_imbalance(fleet, samples, stop))
    started = time.monotonic()
    url = fleet.routers[policy].url
    await asyncio.gather(*(session(fleet, url, turns, workload.max_tokens, sent)
                           for turns in workload.conversations(salt, vocab)))
    wall = time.monotonic() - started
    stop.set()
    await sampler
    # the ranks' counters follow the outputs on the pipe: wait until every request is counted
    deadline = time.monotonic() + 30
    while fleet.counters()["adpfleet_requests_finished_total"] - before["adpfleet_requests_finished_total"] < len(sent):
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    after = fleet.counters()
    d = {k: after[k] - before[k] for k in COUNTERS}
    ttft = [r.first - r.sent for r in sent]
    return {"policy": policy, "requests": len(sent), "wall_s": wall, "ttft": ttft,
            "completion_tokens": len(sent) * workload.max_tokens, "prefill_tokens": d["adpfleet_prompt_tokens_total"],
            "hit_tokens": d["adpfleet_prefix_cache_hits_total"], "query_tokens": d["adpfleet_prefix_cache_queries_total"],
            "ideal_hit_tokens": ideal_hit_tokens(sent), "vetoed_passes": d["adpfleet_forward_vetoed_total"],
            "imbalance_samples": samples}


def summarize(runs: list[dict]) -> dict:
    """One arm's runs pooled."""
    ttft = [t for r in runs for t in r["ttft"]]
    samples = [s for r in runs for s in r["imbalance_samples"]]
    total = {k: sum(r[k] for r in runs) for k in ("requests", "wall_s", "completion_tokens", "prefill_tokens",
                                                  "hit_tokens", "query_tokens", "ideal_hit_tokens", "vetoed_passes")}
    return {**total, "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "throughput_tok_s": total["completion_tokens"] / total["wall_s"],
            "hit_rate": total["hit_tokens"] / max(1, total["query_tokens"]),
            "hit_vs_ideal": total["hit_tokens"] / max(1, total["ideal_hit_tokens"]),
            "imbalance_mean": statistics.fmean(samples) if samples else 1.0,
            "imbalance_p90": percentile(samples, 0.9) if samples else 1.0, "imbalance_samples": len(samples),
            "router": runs[-1].get("router", {})}


RATIOS = ("ttft_p50_s", "ttft_p99_s", "throughput_tok_s", "prefill_tokens")


def with_ratios(arms: dict[str, dict], runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Each arm against least-loaded: pooled over the rounds, and the median of the rounds' own
    ratios (the arms of one round ran back to back: the machine's load drifts less within one)."""
    base = arms[BASELINE]
    for policy, arm in arms.items():
        arm["vs_least_loaded"] = {k: arm[k] / base[k] if base[k] else None for k in RATIOS}
        per_round = [(summarize([mine]), summarize([theirs])) for mine, theirs in zip(runs[policy], runs[BASELINE])]
        arm["vs_least_loaded_per_round_median"] = {
            k: statistics.median(m[k] / b[k] for m, b in per_round if b[k]) for k in RATIOS}
    return arms


def table(results: dict) -> str:
    rows = []
    for name, arms in results.items():
        for policy, a in arms.items():
            r = a["vs_least_loaded_per_round_median"]
            rows.append([name, policy, a["requests"], a["ttft_p50_s"] * 1000, r["ttft_p50_s"], a["ttft_p99_s"] * 1000,
                         r["ttft_p99_s"], a["throughput_tok_s"], r["throughput_tok_s"], int(a["prefill_tokens"]),
                         r["prefill_tokens"],
                         a["hit_rate"], a["hit_vs_ideal"], a["imbalance_mean"], a["imbalance_p90"],
                         int(a["vetoed_passes"])])
    return format_table(["workload", "policy", "reqs", "TTFT p50 ms", "x LL", "TTFT p99 ms", "x LL", "tok/s",
                         "x LL", "prefill tok", "x LL", "hit rate", "hit/ideal", "imbal mean", "imbal p90", "vetoed"], rows)


def router_counts(router: RouterProcess) -> dict:
    names = ("adpfleet_router_prefix_decisions_total", "adpfleet_router_prefix_predictions_total",
             "adpfleet_router_prefix_snapshots_total")
    return {k: v for k, v in router.metrics().items() if k.split("{")[0] in names}


def start_fleet(model_dir: Path, logs: Path, kv_blocks: int) -> Fleet:
    env = {"ADPFLEET_INTERNAL_TOKEN": TOKEN}
    servers = [Server("--role", "aggregated", "--model", str(model_dir), "--dp", "2", "--kv-blocks", str(kv_blocks),
                      log_path=logs / f"server-{i}.log", env=env) for i in range(2)]
    for s in servers:
        s.wait_healthy(600)
    urls = [f for s in servers for f in ("--aggregated", s.url)]
    routers = {p: RouterProcess(logs, *urls, "--policy", p, *(["--tokenizer", str(model_dir)] if p == "cache-aware"
                                                                else []), env=env) for p in ROUTER_POLICIES}
    for r in routers.values():
        r.wait_healthy(120)
        r.wait_usable(aggregated=2)
    return Fleet(servers, routers)


async def bench(fleet: Fleet, workloads: dict[str, tuple[Workload, int]], vocab: int) -> dict:
    results = {}
    salt = 1
    for name, (workload, rounds) in workloads.items():
        runs: dict[str, list[dict]] = {p: [] for p in ROUTER_POLICIES}
        for rnd in range(rounds):
            order = ROUTER_POLICIES[rnd % 3:] + ROUTER_POLICIES[:rnd % 3]  # interleaved, each first in turn
            for policy in order:
                salt += 1
                run = await run_arm(fleet, policy, workload, salt, vocab)
                run["router"] = router_counts(fleet.routers[policy])
                runs[policy].append(run)
                print(f"  {name} round {rnd + 1}/{rounds} {policy}: {run['requests']} requests in {run['wall_s']:.1f} s,"
                      f" TTFT p50 {percentile(run['ttft'], 0.5) * 1000:.0f} ms", flush=True)
        results[name] = with_ratios({p: summarize(r) for p, r in runs.items()}, runs)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--group", type=int, default=4, help="sessions sharing one system prompt")
    ap.add_argument("--system", type=int, default=384, help="system prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the chat workload")
    ap.add_argument("--hot-rounds", type=int, default=2, help="rounds of the hot-prefix workload")
    ap.add_argument("--kv-blocks", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 sessions x 2 turns, one round")
    ap.add_argument("--json", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.system, args.rounds, args.hot_rounds = 4, 2, 128, 1, 1
    chat = Workload(args.sessions, args.turns, args.group, args.system, args.max_tokens)
    hot = Workload(args.sessions, args.turns, args.sessions, args.system, args.max_tokens)
    workloads = {"chat": (chat, args.rounds), "hot": (hot, args.hot_rounds)}
    model = MODELS["small"]
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
        model_dir, logs = Path(tmp) / "model", Path(tmp) / "logs"
        logs.mkdir()
        save_model(model_dir, model, seed=0)
        fleet = start_fleet(model_dir, logs, args.kv_blocks)
        try:
            results = asyncio.run(bench(fleet, workloads, model["vocab_size"]))
        finally:
            for p in [*fleet.routers.values(), *fleet.servers]:
                p.stop()
    print(table(results))
    out = {"bench": "prefix_routing", "machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
           "fleet": "2 aggregated servers x 2 ADP ranks, model 'small' (random Llama, ~34 M parameters)",
           "contended": "2 shared CPU cores; other jobs ran at the same time", "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
