"""Loading and fetching large checkpoints (issue 15): memory while loading, load time against a
plain read of the same bytes, and download throughput from the local hub against plain HTTP.

    flock /tmp/adpfleet-heavy.lock .venv/bin/python bench/model_loading.py          # ~3 min
    .venv/bin/python bench/model_loading.py --quick                                 # a smoke run

One random Llama (~155 M parameters, bfloat16, ~310 MB) is saved once with `save_pretrained`,
sharded at 100 MB (`model-0000N-of-00004.safetensors` + index). Every measurement runs in a fresh
process, after the checkpoint's pages are dropped from the page cache (posix_fadvise DONTNEED), so
each reads from the disk:
- load: `load_model` as one rank (world 1) and as rank 0 of 2 (it keeps half of every MLP), in
  bfloat16. Peak RSS is the process's VmHWM, final RSS its VmRSS after loading; the target is
  peak <= 1.3 x final. Load time is compared with reading every shard's bytes into memory.
- download: the real `huggingface_hub` client (`resolve_model("hf://...")`) from the local hub
  (tests/runtime/hub_server.py, loopback), against plain HTTP GETs (httpx, sequential, 1 MB writes)
  of the same files from the same server. Both write to the same disk.
Every measurement runs --rounds times, interleaved, and keeps its best round (other load on a
shared machine only slows a round down).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))  # the local hub of the test suite

DEFAULT_OUT = HERE / "results" / "model_loading.json"
PEAK_TARGET = 1.3
MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
QUICK = dict(MODEL, num_hidden_layers=2, vocab_size=8000)


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def drop_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- children (one measurement each, in a fresh process) ----------------------------------------
def child_load(path: str, rank: int, world: int) -> dict:
    import torch

    from adpfleet.runtime.model.loader import load_model
    from adpfleet.runtime.model.parallel import ParallelContext

    torch.set_num_threads(1)
    baseline = status_mb("VmRSS")
    t0 = time.perf_counter()
    model = load_model(path, ParallelContext(rank, world), dtype=torch.bfloat16)
    load_s = time.perf_counter() - t0
    gc.collect()
    params_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"load_s": load_s, "baseline_rss_mb": baseline, "peak_rss_mb": status_mb("VmHWM"),
            "final_rss_mb": status_mb("VmRSS"), "params_mb": params_mb}


def child_read(files: list[str]) -> dict:
    buf = bytearray(8 << 20)
    t0 = time.perf_counter()
    total = 0
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return {"read_s": time.perf_counter() - t0, "bytes": total}


def child_hub(url: str, repo: str, dest: str) -> dict:
    os.environ["HF_ENDPOINT"] = url
    # the client's modules are imported before the clock starts, as httpx is for plain HTTP
    from huggingface_hub import HfApi, snapshot_download  # noqa: F401
    from huggingface_hub.errors import HfHubHTTPError  # noqa: F401

    import adpfleet.runtime.model.config  # noqa: F401
    from adpfleet.runtime.model.sources.fetch import resolve_model

    t0 = time.perf_counter()
    resolve_model(f"hf://{repo}", dest=dest)
    return {"download_s": time.perf_counter() - t0}


def child_plain(urls: list[str], dest: str) -> dict:
    import httpx

    t0 = time.perf_counter()
    with httpx.Client(follow_redirects=True, timeout=60) as client:
        for url in urls:
            with client.stream("GET", url) as r, open(Path(dest) / url.rsplit("/", 1)[1], "wb") as f:
                r.raise_for_status()
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
    return {"download_s": time.perf_counter() - t0}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(f"child {args[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the run ------------------------------------------------------------------------------------
def make_checkpoint(path: Path, model: dict) -> None:
    import torch
    import transformers

    if (path / "model.safetensors.index.json").is_file():
        return
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model))
    finally:
        torch.set_default_dtype(torch.float32)
    hf.save_pretrained(str(path), max_shard_size="100MB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="keep the checkpoint here between runs")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        result = {"load": lambda: child_load(rest[0], int(rest[1]), int(rest[2])),
                  "read": lambda: child_read(rest), "hub": lambda: child_hub(*rest),
                  "plain": lambda: child_plain(rest[1:], rest[0])}[kind]()
        print(json.dumps(result))
        return 0

    from common import format_table, machine_info
    from hub_server import LocalHub

    rounds = 1 if args.quick else args.rounds
    work = Path(args.workdir or tempfile.mkdtemp(prefix="adpfleet-loading-"))
    ckpt = work / "checkpoint"
    make_checkpoint(ckpt, QUICK if args.quick else MODEL)
    files = sorted(str(p) for p in ckpt.iterdir() if p.is_file())
    shards = [f for f in files if f.endswith(".safetensors")]
    ckpt_bytes = sum(os.path.getsize(f) for f in shards)

    cases = {"load, 1 rank": ("1", "0"), "load, rank 0 of 2": ("2", "0")}
    load = {name: [] for name in cases}
    reads, hub_runs, plain_runs = [], [], []
    with LocalHub() as hub:
        sha = hub.add_commit("bench/llama", ckpt)
        needed = [f for f in files if not Path(f).name.startswith(".")]
        urls = [f"{hub.url}/bench/llama/resolve/{sha}/{Path(f).name}" for f in needed]
        for _ in range(rounds):
            for name, (world, rank) in cases.items():
                drop_page_cache(files)
                load[name].append(run_child("load", str(ckpt), rank, world))
            drop_page_cache(files)
            reads.append(run_child("read", *shards))
            for runs, kind in ((hub_runs, "hub"), (plain_runs, "plain")):
                dest = work / f"download-{kind}"
                shutil.rmtree(dest, ignore_errors=True)
                dest.mkdir()
                drop_page_cache(files)
                runs.append(run_child(kind, hub.url, "bench/llama", str(dest / "model")) if kind == "hub"
                            else run_child(kind, str(dest), *urls))
                shutil.rmtree(dest)
    best_read = min(r["read_s"] for r in reads)
    rows, results = [], {}
    for name, runs in load.items():
        best = min(runs, key=lambda r: r["load_s"])
        worst_peak = max(r["peak_rss_mb"] / r["final_rss_mb"] for r in runs)
        # the same without the process's resident size before loading (torch and the interpreter)
        worst_model_peak = max((r["peak_rss_mb"] - r["baseline_rss_mb"]) / (r["final_rss_mb"] - r["baseline_rss_mb"])
                               for r in runs)
        results[name] = {"best": best, "rounds": runs, "peak_over_final_worst": worst_peak,
                         "model_peak_over_model_final_worst": worst_model_peak,
                         "load_over_read": best["load_s"] / best_read}
        rows.append([name, best["params_mb"], best["baseline_rss_mb"], best["final_rss_mb"], best["peak_rss_mb"],
                     worst_peak, worst_model_peak, best["load_s"], best["load_s"] / best_read])
    hub_best = min(r["download_s"] for r in hub_runs)
    plain_best = min(r["download_s"] for r in plain_runs)
    total_mb = sum(os.path.getsize(f) for f in needed) / 1e6
    report = {
        "machine": machine_info(), "quick": args.quick, "rounds": rounds,
        "checkpoint": {"model": QUICK if args.quick else MODEL, "dtype": "bfloat16", "shards": len(shards),
                       "weight_bytes": ckpt_bytes},
        "load": results, "read_all_shards_s": {"best": best_read, "rounds": [r["read_s"] for r in reads]},
        "download": {"bytes": int(total_mb * 1e6), "hub_client_s": hub_best, "plain_http_s": plain_best,
                     "hub_mb_per_s": total_mb / hub_best, "plain_mb_per_s": total_mb / plain_best,
                     "hub_over_plain_throughput": plain_best / hub_best,
                     "rounds": {"hub": hub_runs, "plain": plain_runs}},
        "peak_target": PEAK_TARGET,
    }
    print(f"checkpoint: {len(shards)} shards, {ckpt_bytes / 1e6:.0f} MB (bfloat16); reading them: {best_read:.2f} s")
    print(format_table(["case", "params MB", "RSS before MB", "final RSS MB", "peak RSS MB", "peak/final",
                        "peak/final above before", "load s", "load/read"], rows))
    print(format_table(["download", "seconds", "MB/s"], [
        ["huggingface_hub from the local hub", hub_best, total_mb / hub_best],
        ["plain HTTP, same files, same server", plain_best, total_mb / plain_best]]))
    print(f"hub client / plain HTTP throughput: {plain_best / hub_best:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["peak_over_final_worst"] <= PEAK_TARGET for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
