"""The cost of authentication on request latency: the same servers and router with and without
credentials, in one run.

Two arms, each an aggregated tiny server (1 rank) with a router in front of it:

    open    no API key, no internal token (the default)
    auth    server: API key + internal token; router: API key for its clients, the internal token
            to its server (what a fleet with both secrets runs)

Three request kinds, each sent one at a time over one keep-alive connection:

    GET /v1/models on the server              the HTTP path alone, no engine: where a check weighs most
    POST /v1/completions (1 token), server    the path of a request, engine included
    POST /v1/completions (1 token), router    the same through the router (two authenticated hops)

Rounds interleave the arms; a round's number is the median latency of its requests; an arm's
number is its best round (other load on the machine counts least). The ratio is auth / open.

    .venv/bin/python bench/auth_overhead.py [--quick] [--out bench/results/auth_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from common import format_table, machine_info
from disagg_serving import Proc

ROOT = Path(__file__).resolve().parent.parent
KEY, TOKEN = "bench-api-key", "bench-internal-token"
KINDS = {"models (server)": ("server", "GET", "/v1/models", None),
         "completion (server)": ("server", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
         "completion (router)": ("router", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})}


def start_arm(name: str, logs: Path) -> dict:
    secret = []
    if name == "auth":
        (logs / "token").write_text(TOKEN)
        secret = ["--api-key", KEY, "--internal-token-file", str(logs / "token")]
    server = Proc(["serve", "--model", "tiny", "--kv-blocks", "64", *secret], logs / f"server-{name}.log")
    server.wait_healthy()
    router = Proc(["router", "--aggregated", server.url, *secret], logs / f"router-{name}.log")
    router.wait_healthy()
    headers = {"Authorization": f"Bearer {KEY}"} if name == "auth" else {}
    return {"server": server, "router": router, "client": httpx.Client(headers=headers, timeout=30, trust_env=False)}


def round_median_ms(arm: dict, kind: str, n: int) -> float:
    target, method, path, body = KINDS[kind]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = arm["client"].request(method, arm[target].url + path, json=body)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    return statistics.median(times) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run to check that everything works")
    ap.add_argument("--out", default=str(ROOT / "bench/results/auth_overhead.json"))
    args = ap.parse_args()
    rounds, n = (2, 10) if args.quick else (9, 60)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"adpfleet-auth-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    arms = {}
    try:
        for name in ("open", "auth"):
            arms[name] = start_arm(name, logs)
        for arm in arms.values():  # warm-up: connections, the preparation threads, the first forward
            for kind in KINDS:
                round_median_ms(arm, kind, 3)
        samples = {name: {kind: [] for kind in KINDS} for name in arms}
        for _ in range(rounds):
            for kind in KINDS:
                for name, arm in arms.items():
                    samples[name][kind].append(round_median_ms(arm, kind, n))
    finally:
        for arm in arms.values():
            arm["client"].close()
            for proc in (arm["router"], arm["server"]):
                proc.stop()
    rows, results = [], []
    for kind in KINDS:
        best = {name: min(samples[name][kind]) for name in arms}
        ratio = best["auth"] / best["open"]
        rows.append([kind, round(best["open"], 3), round(best["auth"], 3), round(ratio, 3)])
        results.append({"request": kind, "open_ms": round(best["open"], 4), "auth_ms": round(best["auth"], 4),
                        "ratio_auth_vs_open": round(ratio, 4),
                        "round_medians_ms": {name: [round(x, 4) for x in samples[name][kind]] for name in arms}})
    print(f"\nLatency with and without authentication (best of {rounds} interleaved rounds, median of {n} "
          "sequential requests each; tiny model, 1 rank, CPU)")
    print(format_table(["request", "open ms", "auth ms", "auth / open"], rows))
    out = {"benchmark": "auth_overhead", "quick": args.quick, "rounds": rounds, "requests_per_round": n,
           "results": results, "machine": machine_info(), "logs": str(logs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
