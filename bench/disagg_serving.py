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

from adpfleet.cluster.processes import free_port

ROOT = Path(__file__).resolve().parent.parent


# ---- processes -----------------------------------------------------------------------------------
class Proc:
    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "adpfleet", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def wait_healthy(self, timeout: float = 300, status: int = 200) -> None:
        """Until /health answers `status` (another than 200: e.g. a router that found its servers unusable)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.url}/health did not answer {status} within {timeout} s; see {self.log.name}")

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


SHORT_PROMPT_TOKENS = 200  # short prompts are 16-96 characters, long ones 384-1024


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft_s"] for r in results]
    short = [r["ttft_s"] for r in results if r["prompt_tokens"] < SHORT_PROMPT_TOKENS]
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    gaps = [g for r in results for g in r["chunk_gaps_s"]]
    out_tokens = sum(r["completion_tokens"] for r in results)
    return {"requests": len(results), "wall_s": round(wall, 2), "output_tokens": out_tokens,
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "output_tokens_per_s": round(out_tokens / wall, 1), "requests_per_s": round(len(results) / wall, 3),
            "ttft_ms": {"p50": round(pct(ttft, 50) * 1e3, 1), "p99": round(pct(ttft, 99) * 1e3, 1)},
            "ttft_short_ms": {"p50": round(pct(short, 50) * 1e3, 1), "p99": round(pct(short, 99) * 1e3, 1),
                              "requests": len(short)},
            "itl_ms": {"p50": round(pct(tpot, 50) * 1e3, 2), "p99": round(pct(tpot, 99) * 1e3, 2)},
            "chunk_gap_ms": {"p50": round(pct(gaps, 50) * 1e3, 2), "p99": round(pct(gaps, 99) * 1e3, 2)}}


def serve_arms(arms: list[str], logs: Path, requests: list[dict], concurrency: int, engine_args: list[str],
               rounds: int) -> list[dict]:
    """Both arms up at once, their workloads run in turn (the order swapped every round), so load
    from elsewhere hits both; per arm, the round with the lowest short-prompt TTFT p50 (every
    round is kept under `rounds`)."""
    procs = {arm: start_arm(arm, logs, engine_args) for arm in arms}
    try:
        for arm in arms:
            asyncio.run(run_workload(procs[arm][0].url, requests[:concurrency], concurrency))  # warm-up
        seen: dict[str, list[dict]] = {arm: [] for arm in arms}
        for r in range(rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                results, wall = asyncio.run(run_workload(procs[arm][0].url, requests, concurrency))
                seen[arm].append(summarize(results, wall))
        out = []
        for arm in arms:
            metrics = httpx.get(procs[arm][0].url + "/metrics", trust_env=False).text
            retries = next(float(line.split()[-1]) for line in metrics.splitlines()
                           if line.startswith("adpfleet_router_retries_total"))
            best = min(seen[arm], key=lambda s: s["ttft_short_ms"]["p50"])
            out.append({"arm": arm, **best, "router_retries": retries, "rounds": seen[arm]})
        return out
    finally:
        for arm_procs in procs.values():
            for p in arm_procs:
                p.stop()


# ---- KV transfer vs raw loopback TCP -------------------------------------------------------------
class KVPulls:
    """Pulls of one request's KV through the servers' transfer code (`KVTransferServer` + the
    generation rank's `KVPuller`: pooled connection, reused buffers, the payload released once
    checked, as the engine releases it once placed); the tiny model's shape (2 layers x 2 KV heads
    x 32 dims, float32: 1 KiB per token for K and V), its blocks scattered as in a paged cache."""

    def __init__(self, nbytes: int):
        import torch

        from adpfleet.runtime.executor import kv_transfer

        bs = 16
        self.tokens = tokens = max(1, nbytes // 1024)
        blocks = -(-tokens // bs)
        self.k, self.v = torch.randn(2, blocks * bs, 2, 32), torch.randn(2, blocks * bs, 2, 32)
        table = random.Random(0).sample(range(blocks), blocks)
        self.slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(tokens)])
        self.server = kv_transfer.KVTransferServer("127.0.0.1", 0, self.k, self.v,
                                                   lambda handle: ((table, tokens), lambda: None), bs)
        self.puller = kv_transfer.KVPuller(kv_transfer.KVLayout.of(self.k), 60)
        self.nbytes = 2 * self.k[:, :tokens].numel() * 4

    def once(self) -> float:
        import torch

        t0 = time.perf_counter()
        payload = self.puller.pull(self.server.endpoint, "bench", self.tokens)
        seconds = time.perf_counter() - t0
        assert torch.equal(payload.k, self.k[:, self.slots]) and torch.equal(payload.v, self.v[:, self.slots])
        payload.release()
        return seconds

    def close(self) -> None:
        self.puller.close()
        self.server.close()


class LoopbackTCP:
    """`nbytes` over 127.0.0.1 the plainest way (sendall from memory, recv_into one preallocated
    buffer, a request line and an acknowledgement like the KV protocol's): on a new connection per
    transfer (`persistent=False`), or on one connection kept open."""

    def __init__(self, nbytes: int, persistent: bool):
        self.data = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20) or 1))[:nbytes] \
            if nbytes >= 1 << 20 else memoryview(os.urandom(nbytes))
        self.buf = memoryview(bytearray(nbytes))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.persistent, self.conn = persistent, None
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while conn.recv(4, socket.MSG_WAITALL) == b"GET\n":
                    conn.sendall(self.data)
                    conn.recv(3, socket.MSG_WAITALL)

    def once(self) -> float:
        t0 = time.perf_counter()
        if self.conn is None:
            self.conn = socket.create_connection(self.listener.getsockname())
            self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn.sendall(b"GET\n")
        got = 0
        while got < len(self.buf):
            got += self.conn.recv_into(self.buf[got:], min(len(self.buf) - got, 1 << 22))
        self.conn.sendall(b"OK\n")
        if not self.persistent:
            self.conn.close()
            self.conn = None
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


def transfer_rounds(nbytes: int, repeats: int) -> dict:
    """The KV transfer and both loopback baselines, interleaved pull by pull (so a burst of load
    from elsewhere hits all three), best and median GB/s of each."""
    sides = {"kv_transfer": KVPulls(nbytes)}
    moved = sides["kv_transfer"].nbytes
    sides["loopback_tcp"] = LoopbackTCP(moved, persistent=False)
    sides["loopback_tcp_persistent"] = LoopbackTCP(moved, persistent=True)
    times: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for name, side in sides.items():
            side.once()  # warm-up: connections, buffers, first touches
        for _ in range(repeats):
            for name, side in sides.items():
                times[name].append(side.once())
    finally:
        for side in sides.values():
            side.close()
    out = {"bytes": moved}
    for name, ts in times.items():
        out[f"{name}_gbps"] = round(moved / min(ts) / 1e9, 3)
        out[f"{name}_gbps_median"] = round(moved / statistics.median(ts) / 1e9, 3)
    out["ratio"] = round(out["kv_transfer_gbps"] / out["loopback_tcp_gbps"], 3)
    out["ratio_to_persistent"] = round(out["kv_transfer_gbps"] / out["loopback_tcp_persistent_gbps"], 3)
    return out


# ---- main ----------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small run to check that everything works")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved workload rounds per arm (default 3)")
    ap.add_argument("--transfer-only", action="store_true", help="only the KV transfer against loopback TCP")
    ap.add_argument("--out", default=str(ROOT / "bench/results/disagg_serving.json"))
    args = ap.parse_args()
    n = args.requests or (16 if args.quick else 96)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"adpfleet-disagg-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    engine_args = ["--kv-blocks", "512", "--max-num-tokens", "1024"]
    requests = workload(n, args.seed)
    rounds = args.rounds or (1 if args.quick else 3)
    arms = [] if args.transfer_only else serve_arms(["aggregated", "disaggregated"], logs, requests,
                                                    args.concurrency, engine_args, rounds)

    repeats = 3 if args.quick else 9
    transfer = [{"payload": label, **transfer_rounds(nbytes, repeats)}
                for label, nbytes in (("one request (512 tokens)", 512 * 1024), ("64 MiB", 64 << 20),
                                      ("256 MiB", 256 << 20))]

    if arms:
        print(f"\nAggregated vs disaggregated through the router ({n} requests, concurrency {args.concurrency}, "
              f"4 ADP ranks per arm, tiny model, CPU; best of {rounds} interleaved rounds by short-prompt TTFT p50)")
        print(f"{'arm':<14} {'tok/s':>7} {'req/s':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'short p50':>10} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'wall s':>7}")
        for a in arms:
            print(f"{a['arm']:<14} {a['output_tokens_per_s']:>7} {a['requests_per_s']:>6} {a['ttft_ms']['p50']:>7}ms "
                  f"{a['ttft_ms']['p99']:>7}ms {a['ttft_short_ms']['p50']:>8}ms {a['itl_ms']['p50']:>6}ms "
                  f"{a['itl_ms']['p99']:>6}ms {a['wall_s']:>7}")
    print(f"\nKV transfer (KVTransferServer + KVPuller) vs raw loopback TCP, best of {repeats} interleaved pulls, GB/s")
    print(f"{'payload':<26} {'bytes':>11} {'KV transfer':>12} {'TCP new conn':>13} {'ratio':>6} "
          f"{'TCP kept conn':>14} {'ratio':>6}")
    for t in transfer:
        print(f"{t['payload']:<26} {t['bytes']:>11} {t['kv_transfer_gbps']:>12} {t['loopback_tcp_gbps']:>13} "
              f"{t['ratio']:>6.2f} {t['loopback_tcp_persistent_gbps']:>14} {t['ratio_to_persistent']:>6.2f}")
    result = {"benchmark": "disagg_serving", "quick": args.quick, "seed": args.seed, "requests": n,
              "concurrency": args.concurrency, "engine_args": engine_args, "rounds": rounds,
              "transfer_repeats": repeats,
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
