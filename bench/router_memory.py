"""What a holder of the API key can make the router hold in memory (issue 25, finding 5).

A router whose only server is unusable (nothing listens at its URL), so every request waits in its
queue (`--queue-timeout 20`, the default `--queue-size 256` and `--queue-max-bytes`). Two attacks,
each sent all at once, while the router's RSS is sampled every 50 ms:

    over the value limit   4 bodies of 4 MiB, ~524k tiny JSON objects each (`{"a":0},` repeated):
                           the issue's attack; ~100 bytes of Python objects per 4 bytes of JSON
    at the value limit     32 bodies of 1 MiB, 131,070 such objects (262,143 values: just within
                           MAX_JSON_VALUES), the most one body may expand to

    .venv/bin/python bench/router_memory.py [--label after] [--out bench/results/router_memory.json]

Each run is stored under its `--label` in the results file (other labels are kept), so the code
before a change and after it can be measured into one file.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from common import ProcessSampler, format_table
from disagg_serving import Proc, free_port

ROOT = Path(__file__).resolve().parent.parent
ATTACKS = {"over the value limit": (4, 524_000), "at the value limit": (32, 131_070)}


def tiny_objects(n: int) -> bytes:
    return b'{"prompt": "x", "max_tokens": 1, "x": [' + b",".join([b'{"a":0}'] * n) + b"]}"


def attack(router: Proc, requests: int, objects: int) -> dict:
    body, sampler = tiny_objects(objects), ProcessSampler(router.proc.pid, interval=0.05)
    sampler.sample()
    sampler.start()
    post = lambda: httpx.post(router.url + "/v1/completions", content=body, timeout=180,  # noqa: E731
                              headers={"content-type": "application/json"}, trust_env=False)
    with concurrent.futures.ThreadPoolExecutor(requests) as pool:
        answers = [f.result() for f in [pool.submit(post) for _ in range(requests)]]
    time.sleep(0.5)
    sampler.stop()
    sampler.sample()
    codes = collections.Counter(f"{a.status_code} {a.json()['error'].get('code')}" for a in answers)
    return {"requests": requests, "body_bytes": len(body), "rss_before_mib": round(sampler.samples[0][1], 1),
            "rss_peak_mib": round(sampler.peak_rss(), 1), "rss_after_mib": round(sampler.samples[-1][1], 1),
            "answers": dict(sorted(codes.items()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/router_memory.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, (requests, objects) in ATTACKS.items():  # a fresh router each: what the last one left counts
            router = Proc(["router", "--aggregated", f"http://127.0.0.1:{free_port()}", "--queue-timeout", "20",
                           "--health-interval", "0.5"], Path(logs) / "router.log")
            try:
                router.wait_healthy(60, status=503)  # its probe found the server unusable: every request waits
                results[name] = attack(router, requests, objects)
            finally:
                router.stop()
    stored = json.loads(args.out.read_text()) if args.out.exists() else {}
    stored[args.label] = results
    args.out.write_text(json.dumps(stored, indent=1) + "\n")
    rows = [[label, name, r["requests"], r["rss_before_mib"], r["rss_peak_mib"], r["rss_after_mib"],
             ", ".join(f"{n}x {code}" for code, n in r["answers"].items())]
            for label, runs in stored.items() for name, r in runs.items()]
    print(format_table(["code", "attack", "requests", "RSS before MiB", "peak MiB", "after MiB", "answers"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
