"""The prefix cache on the engine alone (docs/engine.md, "The prefix cache"):

- time to first token of a 1k-token prompt whose first 90 % an earlier request sent (warm) against
  one whose prefix nobody sent (cold), on one engine with the cache on (target: warm <= 0.15x cold);
- the throughput workload of bench/engine_throughput.py (random prompts: nothing shared) with the
  cache on and off: what the cache's bookkeeping costs when it never hits (target: no loss).

    .venv/bin/python bench/prefix_cache.py            # ~5 min on an idle 2-core machine
    .venv/bin/python bench/prefix_cache.py --quick    # a smoke run

The model is engine_throughput's random `small` Llama (~34 M parameters), the engine its defaults
(16-token blocks, 2048-token passes: a 1k-token prompt is one chunk). Time to first token is the
engine's own (arrival to first token, as `adpfleet_time_to_first_token_seconds` observes it) over
--ttft-rounds pairs, each with a system prompt of its own; the ratio is of each side's fastest
(the median of the pairs' ratios is kept too). Throughput: each arm runs in
its own process (engine_throughput's worker), the arms interleaved for --rounds, each keeping its
fastest round (other load on the machine only ever slows a round down).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, machine_info  # noqa: E402
from engine_throughput import FIRST_TOKEN_ID, MODELS, make_prompts, save_model, spawn_side, workloads  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "prefix_cache.json"
TTFT_TARGET, THROUGHPUT_TARGET = 0.15, 1.0


def time_to_first_token(model_dir: Path, prompt_tokens: int, shared: float, rounds: int, seed: int) -> dict:
    """Cold and warm time to first token, each round on a system prompt nobody sent before."""
    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.engine.llm_engine import LLMEngine
    from adpfleet.runtime.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir)))
    vocab, g = MODELS["small"]["vocab_size"], torch.Generator().manual_seed(seed)
    n_shared = int(prompt_tokens * shared)

    def draw(n: int) -> list[int]:
        return torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=g).tolist()

    def ttft(prompt: list[int]) -> float:
        req = engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        return req.last_token_time - req.arrival_time

    ttft(draw(prompt_tokens))  # warm-up
    cold, warm = [], []
    for _ in range(rounds):
        system = draw(n_shared)
        hits = engine.stats.prefix_cache_hits
        cold.append(ttft(system + draw(prompt_tokens - n_shared)))
        assert engine.stats.prefix_cache_hits == hits, "a cold prompt found something in the cache"
        warm.append(ttft(system + draw(prompt_tokens - n_shared)))
    ratio = min(warm) / min(cold)  # each side's fastest: other load only ever slows a prompt down
    return {"prompt_tokens": prompt_tokens, "shared_tokens": n_shared,
            "tokens_found_per_warm_prompt": n_shared // engine.config.tokens_per_block * engine.config.tokens_per_block,
            "rounds": rounds, "cold_ms": [round(1e3 * x, 2) for x in cold], "warm_ms": [round(1e3 * x, 2) for x in warm],
            "cold_median_ms": round(1e3 * statistics.median(cold), 2),
            "warm_median_ms": round(1e3 * statistics.median(warm), 2),
            "warm_over_cold_fastest": round(ratio, 4),
            "warm_over_cold_median_of_pairs": round(statistics.median(w / c for w, c in zip(warm, cold)), 4),
            "target": TTFT_TARGET, "target_met": ratio <= TTFT_TARGET}


def throughput(model_dir: Path, workdir: Path, quick: bool, rounds: int, threads: int, seed: int) -> dict:
    """engine_throughput's workload, its engine side with the prefix cache on and off."""
    wl = workloads(quick, "cpu")
    prompts = make_prompts(wl["num_requests"], wl["min_prompt"], wl["max_prompt"], MODELS["small"]["vocab_size"], seed)
    arms = {}
    for on in (True, False):
        arm = workdir / ("cache-on" if on else "cache-off")
        arm.mkdir()
        (arm / "model").symlink_to(model_dir)
        (arm / "workload.json").write_text(json.dumps(
            {"prompts": prompts, "new_tokens": wl["new_tokens"], "max_num_tokens": 2048, "tokens_per_block": 16,
             "device": "cpu", "dtype": "float32", "decode_split": False, "model": "small", "seed": seed,
             "prefix_cache": on}))
        arms[on] = arm
    runs = {True: [], False: []}
    for r in range(rounds):
        print(f"throughput round {r + 1}/{rounds}", flush=True)
        for on, arm in arms.items():
            runs[on].append(spawn_side("engine", arm, threads))
    generated = wl["num_requests"] * wl["new_tokens"]
    best = {on: min(rs, key=lambda x: x["wall_s"]) for on, rs in runs.items()}
    rate = {on: generated / best[on]["wall_s"] for on in best}
    ratio = rate[True] / rate[False]
    return {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "generated_tokens": generated,
            "generated_tokens_per_s": {"cache_on": round(rate[True], 1), "cache_off": round(rate[False], 1)},
            "wall_s_all_rounds": {("cache_on" if on else "cache_off"): [round(x["wall_s"], 3) for x in rs]
                                  for on, rs in runs.items()},
            "outputs_identical": best[True]["outputs"] == best[False]["outputs"],
            "on_over_off": round(ratio, 4), "target": THROUGHPUT_TARGET}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (3 TTFT pairs, the quick workload, 1 round)")
    ap.add_argument("--out", type=Path, help="JSON results (default bench/results/prefix_cache.json; "
                                            "--quick: prefix_cache.quick.json in the temp dir)")
    ap.add_argument("--rounds", type=int, help="throughput rounds per arm, interleaved (default 3; --quick: 1)")
    ap.add_argument("--ttft-rounds", type=int, help="cold/warm pairs (default 9; --quick: 3)")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--shared", type=float, default=0.9, help="fraction of the prompt an earlier request sent")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rounds, ttft_rounds = args.rounds or (1 if args.quick else 3), args.ttft_rounds or (3 if args.quick else 9)
    out = args.out or (Path(tempfile.gettempdir()) / "prefix_cache.quick.json" if args.quick else DEFAULT_OUT)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
        model_dir = Path(tmp) / "model"
        save_model(model_dir, MODELS["small"], args.seed)
        ttft = time_to_first_token(model_dir, args.prompt_tokens, args.shared, ttft_rounds, args.seed)
        tput = throughput(model_dir, Path(tmp), args.quick, rounds, args.threads, args.seed)
    tput["target_met"] = tput["on_over_off"] >= THROUGHPUT_TARGET
    print()
    print(format_table(["measure", "cache off / cold", "cache on / warm", "ratio", "target"], [
        [f"TTFT ms (fastest), {args.prompt_tokens}-token prompt, {args.shared:.0%} shared", min(ttft["cold_ms"]),
         min(ttft["warm_ms"]), ttft["warm_over_cold_fastest"], f"<= {TTFT_TARGET}"],
        ["generated tok/s, engine_throughput workload", tput["generated_tokens_per_s"]["cache_off"],
         tput["generated_tokens_per_s"]["cache_on"], tput["on_over_off"], f">= {THROUGHPUT_TARGET}"]]))
    print(f"outputs identical on and off: {tput['outputs_identical']}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    report = {"benchmark": "prefix_cache", "issue": 28, "quick": args.quick, "started_unix": round(started),
              "duration_s": round(time.time() - started, 1), "machine": machine_info() | {"torch_threads": args.threads},
              "load_1m_after": round(os.getloadavg()[0], 2), "model": {"name": "small", "config": MODELS["small"]},
              "time_to_first_token": ttft, "throughput": tput}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
