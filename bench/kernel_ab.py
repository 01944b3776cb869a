"""A/B of C++ kernel builds in one run: each arm a process that loads one build of
runtime/model/kernels (ADPFLEET_KERNEL_DIR), the arms alternated round by round; the CPU time per
call (process_time, which other load on a shared machine moves far less than wall time) of the
kernels on the bench model's shapes, and each arm's outputs against the first arm's.

    .venv/bin/python bench/kernel_ab.py main=/tmp/kern-main head= --rounds 3

An arm is NAME=DIR: DIR holds a build under this tree's build name (`kernels.build_dir().name`),
e.g. main's library copied there, so the Python is this tree's and only the library differs;
an empty DIR is this tree's own build. Shapes: paged decode attention for the long workload's
32 requests (bench/engine_throughput.py, prompts 512-2048, 64 tokens into their decode: 8 heads,
4 KV heads, head_dim 64, 16-token blocks) and SiLU x mul on the MLP's gate_up output for a decode
pass (32 tokens) and a prefill chunk (2,048 tokens). Writes bench/results/kernel_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CALLS = {"attention": 40, "silu_decode": 2000, "silu_prefill": 40}


def kernel_calls():
    """name -> a call of one kernel on fixed random inputs (seed 0)."""
    import torch

    sys.path.insert(0, str(BENCH))
    import engine_throughput as et

    g = torch.Generator().manual_seed(0)
    bs, kv_heads, heads, dim = 16, 4, 8, 64
    lens = [len(p) + 64 for p in et.make_prompts(32, 512, 2048, 8192, 0)]
    width = max(-(-n // bs) for n in lens)
    k_cache = torch.randn(32 * width * bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(32 * width * bs, kv_heads, dim, generator=g)
    tables = torch.arange(32 * width, dtype=torch.int32).view(32, width)
    seq_lens, q = torch.tensor(lens, dtype=torch.int32), torch.randn(32, heads, dim, generator=g)
    x_decode, x_prefill = torch.randn(32, 3072, generator=g), torch.randn(2048, 3072, generator=g)
    ops = torch.ops.adpfleet
    return {"attention": lambda: ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, bs, 0.125),
            "silu_decode": lambda: ops.silu_and_mul(x_decode), "silu_prefill": lambda: ops.silu_and_mul(x_prefill)}


def worker(out_dir: Path, arm: str) -> None:
    import torch

    from adpfleet.runtime.model import kernels

    kernels.load()
    torch.set_num_threads(2)
    result = {}
    for name, call in kernel_calls().items():
        torch.save(call(), out_dir / f"{arm}-{name}.pt")  # the first call also warms it up
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(CALLS[name]):
            call()
        result[name] = {"cpu_ms": 1e3 * (time.process_time() - cpu) / CALLS[name],
                        "wall_ms": 1e3 * (time.perf_counter() - wall) / CALLS[name]}
    print(json.dumps(result))


def compare(arms: dict, runs: dict, out_dir: Path) -> dict:
    import torch

    first = next(iter(arms))
    report = {}
    for name in CALLS:
        medians = {arm: statistics.median(r[name]["cpu_ms"] for r in runs[arm]) for arm in arms}
        same = {arm: torch.equal(torch.load(out_dir / f"{arm}-{name}.pt"), torch.load(out_dir / f"{first}-{name}.pt"))
                for arm in arms}
        report[name] = {"median_cpu_ms": {a: round(m, 4) for a, m in medians.items()},
                        f"cpu_ratio_{first}_to_arm": {a: round(medians[first] / m, 3) for a, m in medians.items()},
                        f"outputs_equal_to_{first}": same}
        print(name, report[name])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arms", nargs="+", metavar="NAME=DIR")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=BENCH / "results" / "kernel_ab.json")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(Path(args.worker[0]), args.worker[1])
    arms = dict(a.split("=", 1) for a in args.arms)
    runs = {arm: [] for arm in arms}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="kernel-ab-") as tmp:
        for _ in range(args.rounds):
            for arm, kernel_dir in arms.items():
                env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")  # as the bench's engine side runs
                if kernel_dir:
                    env["ADPFLEET_KERNEL_DIR"] = kernel_dir
                proc = subprocess.run([sys.executable, __file__, *args.arms, "--worker", tmp, arm], env=env,
                                      capture_output=True, text=True, check=True)
                runs[arm].append(json.loads(proc.stdout.splitlines()[-1]))
                print(arm, runs[arm][-1], flush=True)
        report = compare(arms, runs, Path(tmp))
    args.out.write_text(json.dumps({"benchmark": "kernel_ab", "issue": 29, "arms": arms, "rounds": args.rounds,
                                    "calls_per_round": CALLS, "threads": 2, "started_unix": round(started),
                                    "load_1m_at_end": os.getloadavg()[0], "kernels": report, "runs": runs},
                                   indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
