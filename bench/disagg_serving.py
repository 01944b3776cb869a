"""Aggregated vs disaggregated serving through the router, on this machine, in one run.

Both arms serve the same seeded mixed workload (mostly short prompts, some long ones, varied
answer lengths) through `adpfleet router`, with the same number of ADP ranks:

    aggregated      2 aggregated servers x 2 ranks
    disaggregated   1 context server x 2 ranks + 1 generation server x 2 ranks

and report throughput, time to first token (TTFT) and inter-token latency (ITL) at p50/p99.
Then the KV transfer path itself (`kv_transfer.KVTransferServer` + `fetch`, the code the servers
use) in GB/s, next to raw loopback TCP measured with the same payload sizes in the same run.

    .venv/bin/python bench/disagg_serving.py [--quick] [--out bench/results/disagg_serving.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


# ---- processes -----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "adpfleet", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url} not healthy within {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_arm(arm: str, logs: Path, engine_args: list[str]) -> list[Proc]:
    def server(role: str) -> Proc:
        return Proc(["serve", "--role", role, "--model", "tiny", "--dp", "2", "--kv-port", "0", *engine_args],
                    logs / f"{arm}-{role}-{len(procs)}.log")
    procs: list[Proc] = []
    if arm == "aggregated":
        procs += [server("aggregated"), server("aggregated")]
        flags = ["--aggregated", procs[0].url, "--aggregated", procs[1].url]
    else:
        procs += [server("context"), server("generation")]
        flags = ["--context", procs[0].url, "--generation", procs[1].url]
    for p in procs:
        p.wait_healthy()
    router = Proc(["router", *flags, "--request-timeout", "600"], logs / f"{arm}-router.log")
    router.wait_healthy()
    return [router, *procs]


# ---- workload ------------------------------------------------------------------------------------
def workload(n: int, seed: int) -> list[dict]:
    """Mostly short prompts with short answers (chat-like), some long prompts (RAG-like)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    requests = []
    for _ in range(n):
        long = rng.random() < 0.25
        prompt_len = rng.randint(384, 1024) if long else rng.randint(16, 96)
        max_tokens = rng.randint(16, 48) if long else rng.randint(24, 96)
        requests.append({"prompt": "".join(rng.choice(letters) for _ in range(prompt_len)), "max_tokens": max_tokens,
                         "temperature": 0, "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}})
    return requests


async def one(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    arrivals, usage = [], None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and (chunk["choices"][0].get("text") or chunk["choices"][0].get("finish_reason")):
                arrivals.append(time.perf_counter())
    tokens = usage["completion_tokens"]
    first, last = arrivals[0], arrivals[-1]
    return {"ttft_s": first - t0, "latency_s": last - t0, "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": tokens, "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None,
            "chunk_gaps_s": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def run_workload(url: str, requests: list[dict], concurrency: int) -> tuple[list[dict], float]:
    queue = list(enumerate(requests))
    results: list[dict | None] = [None] * len(requests)

    async def worker(http):
        while queue:
            i, body = queue.pop(0)
            results[i] = await one(http, url, body)
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return results, wall


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    gaps = [g for r in results for g in r["chunk_gaps_s"]]
    out_tokens = sum(r["completion_tokens"] for r in results)
    return {"requests": len(results), "wall_s": round(wall, 2), "output_tokens": out_tokens,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "output_tokens_per_s": round(out_tokens / wall, 1), "requests_per_s": round(len(results) / wall, 3),
            "ttft_ms": {"p50": round(pct(ttft, 50) * 1e3, 1), "p99": round(pct(ttft, 99) * 1e3, 1)},
            "itl_ms": {"p50": round(pct(tpot, 50) * 1e3, 2), "p99": round(pct(tpot, 99) * 1e3, 2)},
            "chunk_gap_ms": {"p50": round(pct(gaps, 50) * 1e3, 2), "p99": round(pct(gaps, 99) * 1e3, 2)}}


def serve_arm(arm: str, logs: Path, requests: list[dict], concurrency: int, engine_args: list[str]) -> dict:
    procs = start_arm(arm, logs, engine_args)
    try:
        router = procs[0]
        asyncio.run(run_workload(router.url, requests[:concurrency], concurrency))  # warm-up
        results, wall = asyncio.run(run_workload(router.url, requests, concurrency))
        metrics = httpx.get(router.url + "/metrics", trust_env=False).text
        retries = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("adpfleet_router_retries_total"))
        return {"arm": arm, **summarize(results, wall), "router_retries": retries}
    finally:
        for p in procs:
            p.stop()


# ---- KV transfer vs raw loopback TCP -------------------------------------------------------------
def kv_transfer_gbps(nbytes: int, repeats: int) -> tuple[float, int]:
    """Median GB/s of pulling one request's KV through the servers' transfer code; the tiny
    model's shape (2 layers x 2 KV heads x 32 dims, float32: 1 KiB per token for K and V)."""
    import torch

    from adpfleet.runtime.executor import kv_transfer

    import random

    bs = 16
    tokens = max(1, nbytes // 1024)
    blocks = -(-tokens // bs)
    k = torch.randn(2, blocks * bs, 2, 32)
    v = torch.randn(2, blocks * bs, 2, 32)
    table = random.Random(0).sample(range(blocks), blocks)  # a paged cache: blocks scattered, in any order
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(tokens)])
    server = kv_transfer.KVTransferServer("127.0.0.1", 0, k, v, lambda handle: ((table, tokens), lambda: None), bs)
    try:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            payload = kv_transfer.fetch(server.endpoint, "bench", 60, kv_transfer.KVLayout.of(k), tokens)
            times.append(time.perf_counter() - t0)
        assert torch.equal(payload.k, k[:, slots]) and torch.equal(payload.v, v[:, slots])
    finally:
        server.close()
    moved = 2 * payload.k.numel() * 4
    return moved / statistics.median(times) / 1e9, moved


def loopback_tcp_gbps(nbytes: int, repeats: int) -> float:
    """Median GB/s of one connection per transfer sending `nbytes` over 127.0.0.1 (sendall from
    memory, recv_into a preallocated buffer): the ceiling for any transfer over loopback TCP."""
    data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20) or 1))[:nbytes] if nbytes >= 1 << 20 \
        else memoryview(os.urandom(nbytes))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        for _ in range(repeats):
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.recv(16)
                conn.sendall(data)
                conn.recv(16)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    buf = memoryview(bytearray(len(data)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(b"GET\n")
            got = 0
            while got < len(buf):
                got += conn.recv_into(buf[got:], min(len(buf) - got, 1 << 22))
            conn.sendall(b"OK\n")
        times.append(time.perf_counter() - t0)
    t.join()
    listener.close()
    return len(data) / statistics.median(times) / 1e9


# ---- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run to check that everything works")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/disagg_serving.json"))
    args = ap.parse_args()
    n = args.requests or (16 if args.quick else 96)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"adpfleet-disagg-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    engine_args = ["--kv-blocks", "512", "--max-num-tokens", "1024"]
    requests = workload(n, args.seed)
    arms = [serve_arm(arm, logs, requests, args.concurrency, engine_args) for arm in ("aggregated", "disaggregated")]

    repeats = 3 if args.quick else 7
    transfer = []
    for label, nbytes in (("one request (512 tokens)", 512 * 1024), ("64 MiB", 64 << 20), ("256 MiB", 256 << 20)):
        kv, moved = kv_transfer_gbps(nbytes, repeats)
        transfer.append({"payload": label, "bytes": moved, "kv_transfer_gbps": round(kv, 3),
                         "loopback_tcp_gbps": round(loopback_tcp_gbps(moved, repeats), 3)})

    print(f"\nAggregated vs disaggregated through the router ({n} requests, concurrency {args.concurrency}, "
          f"4 ADP ranks per arm, tiny model, CPU)")
    print(f"{'arm':<14} {'tok/s':>7} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'wall s':>7}")
    for a in arms:
        print(f"{a['arm']:<14} {a['output_tokens_per_s']:>7} {a['requests_per_s']:>6} {a['ttft_ms']['p50']:>7}ms "
              f"{a['ttft_ms']['p99']:>7}ms {a['itl_ms']['p50']:>6}ms {a['itl_ms']['p99']:>6}ms {a['wall_s']:>7}")
    print("\nKV transfer (KVTransferServer + fetch) vs raw loopback TCP, median of "
          f"{repeats}, GB/s")
    print(f"{'payload':<26} {'bytes':>11} {'KV transfer':>12} {'loopback TCP':>13} {'ratio':>6}")
    for t in transfer:
        print(f"{t['payload']:<26} {t['bytes']:>11} {t['kv_transfer_gbps']:>12} {t['loopback_tcp_gbps']:>13} "
              f"{t['kv_transfer_gbps'] / t['loopback_tcp_gbps']:>6.2f}")
    result = {"benchmark": "disagg_serving", "quick": args.quick, "seed": args.seed, "requests": n,
              "concurrency": args.concurrency, "engine_args": engine_args,
              "arms": arms, "kv_transfer": transfer,
              "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(),
                          "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
              "logs": str(logs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
