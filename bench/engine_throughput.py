"""Engine throughput vs Hugging Face `generate`: same weights, same workload, same machine.

    .venv/bin/python bench/engine_throughput.py            # the full CPU run (~6 min on an idle 2-core machine)
    .venv/bin/python bench/engine_throughput.py --quick    # a smoke run (~1 min, mostly imports)
    python bench/engine_throughput.py --device cuda --dtype bfloat16 --model 1b   # on a GPU (bench/gpu_check.sh)

One random Llama model is saved once and loaded by both sides: `small` (~34 M parameters, the CPU
default) or `1b` (the shape of Llama 3.2 1B, 1.24 B parameters, for GPUs). The workload is a list
of requests with prompts of random lengths (fixed seed, same order for both sides), greedy output
with EOS ignored, the same torch thread count. adpfleet's engine runs it with continuous
batching; transformers runs it as static, left-padded batches of each size in --hf-batch-sizes,
and the fastest is the baseline. Each side runs in its own process, so its peak RSS is its own.
Throughput is generated tokens per second of wall time over the whole workload. Every side runs
--rounds times, interleaved with the others, and keeps its fastest round: on a shared machine
other load only ever slows a round down. A matmul probe before each timed round shows how much of
the machine that round had.

Two limits, and each side's fraction of them:
- compute: the workload's ideal FLOPs (no padding; `workload_flops`) at the device's measured
  matmul throughput in the run's dtype;
- decode memory bandwidth (--decode-split, the default on CUDA): decode time is the wall time of
  the workload minus that of the same workload generating one token (prefill only), and its
  limit is the bytes an ideal decode must read (`decode_bytes`: the weights once per step for
  all requests together, each request's K/V once per step) at the measured copy bandwidth.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adpfleet.runtime.cpu_budget import sleep_between_regions  # noqa: E402
from common import busy_neighbour, format_table, machine_info, matmul_gflops, peak_rss_mb  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "engine_throughput.json"
TARGET_RATIO = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

MODELS = {
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2),
    # Llama 3.2 1B's shape (default RoPE instead of its "llama3" scaling; random weights)
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
               rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2),
}
SIDE_TITLES = {"engine": "adpfleet engine", "hf": "transformers generate", "vllm": "vLLM (offline LLM)"}
PEERS = {"vllm": ("vllm", {}), "vllm-eager": ("vllm", {"VLLM_PEER_ENFORCE_EAGER": "1"})}  # arm: side, env
FIRST_TOKEN_ID = 3  # prompts avoid pad (0), BOS and EOS
# matmul probe [m, k] @ [k, n]: a GPU needs a larger product than a CPU to reach its peak
PROBE_SHAPE = {"cpu": (2048, 2048, 1024), "cuda": (8192, 8192, 8192)}


WORKLOADS = ("short", "long", "mixed")


def workloads(quick: bool, device: str, kind: str = "short") -> dict:
    """The requests of a run. short: 64 prompts of 16-256 tokens, 64 new (the CPU default); long:
    32 prompts of 512-2048, 128 new, where attention weighs more; mixed: short's requests as a
    stream, 16 at once and then one more every 2 engine steps, arriving while the others decode."""
    if quick:
        wl = dict(num_requests=16, min_prompt=16, max_prompt=64, new_tokens=16, hf_batch_sizes=[8, 16])
    elif device == "cuda":  # a GPU decodes many requests at once: more of them, longer
        wl = dict(num_requests=128, min_prompt=16, max_prompt=512, new_tokens=128, hf_batch_sizes=[32, 64, 128])
    elif kind == "long":
        wl = dict(num_requests=32, min_prompt=512, max_prompt=2048, new_tokens=128, hf_batch_sizes=[8, 16, 32])
    else:
        wl = dict(num_requests=64, min_prompt=16, max_prompt=256, new_tokens=64, hf_batch_sizes=[8, 16, 32, 64])
    if kind == "mixed":
        first = wl["num_requests"] // 4
        wl["arrivals"] = [0] * first + [2 * (i + 1) for i in range(wl["num_requests"] - first)]
    return wl


def make_prompts(num_requests: int, min_prompt: int, max_prompt: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_prompt, max_prompt + 1, (num_requests,), generator=g).tolist()
    return [torch.randint(FIRST_TOKEN_ID, vocab, (n,), generator=g).tolist() for n in lengths]


# -- the ideal work -----------------------------------------------------------------------------
def _shape(model: dict) -> tuple[int, int, int, int]:
    h = model["hidden_size"]
    head_dim = h // model["num_attention_heads"]
    q_size, kv_size = model["num_attention_heads"] * head_dim, model["num_key_value_heads"] * head_dim
    layer_weights = h * (q_size + 2 * kv_size) + q_size * h + 3 * h * model["intermediate_size"]
    return h, q_size, kv_size, layer_weights


def workload_flops(model: dict, prompt_lens: list[int], new_tokens: int) -> dict:
    """FLOPs of the workload done once, without padding: every prompt token and every generated
    token but the last runs through the layers (P + new_tokens - 1 positions per request), and
    the lm_head runs once per generated token.

    - linear layers: 2 FLOPs per weight per token (q, k, v, o, gate, up, down);
    - attention: a query at position t attends to t + 1 keys; QK^T and PV cost
      2 * heads * head_dim * (t + 1) each, so 4 * q_size * (t + 1) per layer (issue 2's
      "4 x layers x seq_len x hidden per token", summed exactly);
    - lm_head: 2 * hidden * vocab per generated token. Embedding lookups, norms, RoPE and
      activations are left out (well under 1% here)."""
    h, q_size, _, layer_weights = _shape(model)
    layers = model["num_hidden_layers"]
    positions = [p + new_tokens - 1 for p in prompt_lens]
    linear = sum(2 * layers * layer_weights * n for n in positions)
    attention = sum(4 * layers * q_size * n * (n + 1) // 2 for n in positions)
    lm_head = 2 * h * model["vocab_size"] * new_tokens * len(prompt_lens)
    return {"linear": linear, "attention": attention, "lm_head": lm_head, "total": linear + attention + lm_head}


def decode_bytes(model: dict, prompt_lens: list[int], new_tokens: int, element_bytes: int) -> dict:
    """Bytes an ideal decode reads: tokens 2..new_tokens take new_tokens - 1 steps of every request
    together; each step reads the layer weights and the lm_head once, and each request's K/V of
    every layer for the positions it attends to (P + s at step s). Embedding rows, norms and the
    K/V written are left out (well under 1%)."""
    h, _, kv_size, layer_weights = _shape(model)
    layers, steps = model["num_hidden_layers"], new_tokens - 1
    weights = (layers * layer_weights + h * model["vocab_size"]) * element_bytes * steps
    kv_per_token = 2 * layers * kv_size * element_bytes
    kv = kv_per_token * sum(p + s for p in prompt_lens for s in range(1, steps + 1))
    return {"weights": weights, "kv": kv, "total": weights + kv}


# -- the two sides, each in its own process -----------------------------------------------------
def prepare_engine(workdir: Path, spec: dict):
    """Load adpfleet's engine, warm it up; return (run the workload -> outputs, settings)."""
    from adpfleet.runtime.config import EngineConfig
    from adpfleet.runtime.engine.llm_engine import LLMEngine
    from adpfleet.runtime.engine.sampling import SamplingParams

    prompts, tpb = spec["prompts"], spec["tokens_per_block"]
    blocks_per_request = -(-(max(map(len, prompts)) + spec["new_tokens"]) // tpb)
    config = EngineConfig(model=str(workdir / "model"), device=spec["device"], dtype=spec["dtype"],
                          tokens_per_block=tpb,
                          kv_blocks=len(prompts) * blocks_per_request + 16,  # every request fits at once
                          max_num_tokens=spec["max_num_tokens"], max_batch_size=len(prompts),
                          max_num_active_requests=len(prompts),
                          prefix_cache=spec.get("prefix_cache", True))  # bench/prefix_cache.py turns it off
    engine = LLMEngine(config)
    engine.generate([p[:16] for p in prompts[:4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up

    def run(new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        if spec.get("arrivals"):
            return stream(engine, prompts, params, spec["arrivals"])
        return [r.output_token_ids for r in engine.generate(prompts, params)]

    settings = {k: getattr(config, k) for k in ("kv_blocks", "tokens_per_block", "max_num_tokens",
                                                "max_batch_size", "max_num_active_requests", "prefix_cache")}
    from adpfleet.runtime.model.attention import default_decode_backend

    backend = default_decode_backend(torch.device(spec["device"]))
    return run, {"batch_size": "continuous", "engine_config": settings, "decode_attention": backend}


def stream(engine, prompts: list[list[int]], params, arrivals: list[int]) -> list[list[int]]:
    """The mixed stream: request i is added after step arrivals[i], while the earlier ones decode
    (bench/vllm_peer.py's `stream`, step for step)."""
    reqs, step = [], 0
    while len(reqs) < len(prompts) or any(not r.is_finished for r in reqs):
        while len(reqs) < len(prompts) and arrivals[len(reqs)] <= step:
            reqs.append(engine.add_request(prompts[len(reqs)], params))
        engine.step()
        step += 1
    return [r.output_token_ids for r in reqs]


def prepare_hf(workdir: Path, spec: dict, batch_size: int):
    """Load the transformers model, warm it up; return (run the workload in static batches, info)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    # transformers < 4.56 names the argument torch_dtype (and would take `dtype` as a config field)
    dtype_arg = "dtype" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
    model = transformers.LlamaForCausalLM.from_pretrained(
        str(workdir / "model"), **{dtype_arg: DTYPES[spec["dtype"]]}).to(spec["device"]).eval()
    model.generation_config.eos_token_id = None  # every request runs the full new_tokens, as ignore_eos
    prompts, device = spec["prompts"], spec["device"]

    def generate(batch: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)  # padding side: left
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, width:].tolist()

    generate([p[:16] for p in prompts[:batch_size]], 4)  # warm-up

    def run(new_tokens: int) -> list[list[int]]:
        return [out for i in range(0, len(prompts), batch_size)
                for out in generate(prompts[i:i + batch_size], new_tokens)]

    return run, {"batch_size": batch_size, "attn_implementation": model.config._attn_implementation}


def run_side(side: str, workdir: Path, threads: int) -> None:
    """Worker entry point: run one side once, write its result next to the workload."""
    torch.set_num_threads(threads)
    spec = json.loads((workdir / "workload.json").read_text())
    if side == "save":
        counts = save_model(workdir / "model", spec.get("model_config") or MODELS[spec["model"]], spec["seed"],
                            spec["device"],
                            DTYPES[spec["dtype"]])
        (workdir / "result-save.json").write_text(json.dumps(counts))
        return
    device, dtype = spec["device"], DTYPES[spec["dtype"]]
    run, info = prepare_engine(workdir, spec) if side == "engine" else \
        prepare_hf(workdir, spec, int(side.split("-")[1]))
    result = {}
    if spec["decode_split"]:  # the same workload generating one token: its prefill
        start = time.perf_counter()
        run(1)
        result["prefill_wall_s"] = time.perf_counter() - start
    probe = matmul_gflops(*PROBE_SHAPE[device], repeats=3, trials=3, device=device, dtype=dtype)  # this side's share
    load_before = os.getloadavg()[0]
    cpu, start = time.process_time(), time.perf_counter()
    outputs = run(spec["new_tokens"])
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if [len(o) for o in outputs] != [spec["new_tokens"]] * len(spec["prompts"]):
        raise SystemExit(f"{side}: expected {spec['new_tokens']} tokens for each of {len(spec['prompts'])} "
                         f"requests, got lengths {sorted({len(o) for o in outputs})}")
    result |= info | {"side": side, "wall_s": wall, "cpu_s": cpu, "outputs": outputs, "matmul_probe_gflops": probe,
                      "load_1m_before_after": [load_before, os.getloadavg()[0]],
                      "threads": torch.get_num_threads(), "peak_rss_mb": peak_rss_mb()}
    if device == "cuda":
        result["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
    (workdir / f"result-{side}.json").write_text(json.dumps(result))


def measure_bandwidth(device: str, threads: int) -> float:
    """The device's memory bandwidth, measured in a process of its own: the probe's buffers would
    otherwise raise this process's peak RSS, which every side started from it inherits (Linux
    keeps the parent's high-water mark across fork and exec in ru_maxrss)."""
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from common import memory_gbps; "
            "torch.set_num_threads(int(sys.argv[3])); print(memory_gbps(sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parent), device, str(threads)],
                         check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def spawn_side(side: str, workdir: Path, threads: int, env: dict | None = None, label: str | None = None) -> dict:
    """Run `side` once in a process of its own (with `env` added to its environment); print and
    return its result. `label` names the arm in the printout (default: the side)."""
    if side == "vllm":
        result = run_vllm(workdir, threads, env or {})
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--workdir", str(workdir),
               "--threads", str(threads)]
        child_env = {**os.environ, **(env or {})}
        if side == "engine":  # as a server's ranks run it (an arm's own OMP_WAIT_POLICY, even empty, wins)
            sleep_between_regions(child_env)
        subprocess.run(cmd, check=True, env=child_env)
        result = json.loads((workdir / f"result-{side}.json").read_text())
    probe = f"  (matmul probe {result['matmul_probe_gflops']:.0f} GFLOP/s)" if "matmul_probe_gflops" in result else ""
    print(f"  {label or side:8s} {result['wall_s']:7.2f} s wall{probe}", flush=True)
    return result


def run_vllm(workdir: Path, threads: int, env: dict) -> dict:
    """vLLM's side (bench/vllm_peer.py) in the vLLM environment's Python, from a directory of its
    own (see that script); its OpenMP threads bound to the first `threads` CPUs, its KV cache sized
    to hold every request at once."""
    from adpfleet.cluster import vllm_env

    spec = json.loads((workdir / "workload.json").read_text())
    kv_bytes = 2 * spec["kv_bytes_per_token"] * sum(len(p) + spec["new_tokens"] for p in spec["prompts"])
    cwd = workdir / "vllm"
    (cwd / "tmp").mkdir(parents=True, exist_ok=True)
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    vllm_envvars = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TMPDIR": str(cwd / "tmp"),
                    "VLLM_CPU_KVCACHE_SPACE": str(max(1, -(-kv_bytes // 2**30))),
                    "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    proc = subprocess.run([str(vllm_env.locate().python), str(Path(__file__).resolve().with_name("vllm_peer.py")),
                           str(workdir / "workload.json")], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **vllm_envvars, **env})
    if proc.returncode != 0:
        raise SystemExit(f"vllm side failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    # vLLM logs to stdout too, around the one line that is the result
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"side": "vllm"')]
    if not lines:
        raise SystemExit(f"vllm side printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1])
    return result | {"batch_size": "continuous", "threads": len(cpus), "cpu_s": None}  # its engine core is a child


def best_of_rounds(runs: list[dict]) -> dict:
    """A side's fastest round (other load on the machine only ever slows a round down); its peak
    RSS is the largest of any round, and every round's wall time is kept."""
    best = min(runs, key=lambda r: r["wall_s"])
    best = best | {"peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
                   "wall_s_all_rounds": [round(r["wall_s"], 3) for r in runs]}
    if best.get("cpu_s") is not None:  # CPU time, less sensitive than wall time to other load
        best["cpu_s_all_rounds"] = [round(r["cpu_s"], 2) for r in runs]
    if "matmul_probe_gflops" in best:  # vLLM's side runs no probe
        best["matmul_probe_gflops_all_rounds"] = [round(r["matmul_probe_gflops"], 1) for r in runs]
    return best


def engine_arms(engine_envs: list[str], threads: int) -> dict[str, tuple[str, dict, int]]:
    """The engine's arms, name -> (side, environment added, torch threads): "engine" as it ships,
    and one per --engine-env ("OMP_WAIT_POLICY=PASSIVE,threads=1"; threads=N is not a variable)."""
    arms = {"engine": ("engine", {}, threads)}
    for spec in engine_envs:
        pairs = [item.split("=", 1) for item in spec.split(",")]
        if any(len(pair) != 2 or not pair[0] for pair in pairs):
            raise SystemExit(f"--engine-env {spec!r}: expected VAR=VAL[,VAR=VAL]")
        env = dict(pairs)
        arm_threads = env.pop("threads", threads)
        if not str(arm_threads).isdigit() or int(arm_threads) < 1:
            raise SystemExit(f"--engine-env {spec!r}: threads must be a positive integer")
        arms[f"engine[{spec}]"] = ("engine", env, int(arm_threads))
    return arms


def side_summary(name: str, r: dict, generated_tokens: int, prompt_tokens: int, flops: float, limit_s: float,
                 engine_outputs: list[list[int]]) -> dict:
    """One arm's line of the report, from its best round."""
    wall = r["wall_s"]
    side = {"side": SIDE_TITLES[r["side"].split("-")[0]], "arm": name, "batch_size": r["batch_size"],
            "wall_s": round(wall, 3), "cpu_s": None if r["cpu_s"] is None else round(r["cpu_s"], 2),
            "generated_tokens_per_s": round(generated_tokens / wall, 1),
            "total_tokens_per_s": round((prompt_tokens + generated_tokens) / wall, 1),
            "fraction_of_compute_limit": round(limit_s / wall, 4), "achieved_gflops": round(flops / wall / 1e9, 1),
            "peak_rss_mb": round(r["peak_rss_mb"], 1), "threads": r["threads"],
            "wall_s_all_rounds": r["wall_s_all_rounds"], "wall_s_median": statistics.median(r["wall_s_all_rounds"]),
            "cpu_s_median": statistics.median(r["cpu_s_all_rounds"]) if "cpu_s_all_rounds" in r else None,
            "requests_identical_to_engine": sum(a == b for a, b in zip(r["outputs"], engine_outputs))}
    side |= {k: r[k] for k in ("matmul_probe_gflops_all_rounds", "engine_config", "attn_implementation",
                               "decode_attention", "peak_gpu_memory_mb", "enforce_eager") if k in r}
    if "load_1m_before_after" in r:
        side["load_1m_before_after"] = [round(x, 2) for x in r["load_1m_before_after"]]
    return side


def neighbour_summary(near: dict, quiet: dict, generated_tokens: int) -> dict:
    return {"wall_s": round(near["wall_s"], 3), "wall_s_all_rounds": near["wall_s_all_rounds"],
            "generated_tokens_per_s": round(generated_tokens / near["wall_s"], 1),
            "ratio_to_quiet": round(quiet["wall_s"] / near["wall_s"], 3)}


def decode_split_summary(r: dict, wl: dict, decode_limit_s: float) -> dict:
    decode_s = r["wall_s"] - r["prefill_wall_s"]  # <= 0 only when load slowed the prefill-only run: unknown
    return {"prefill_wall_s": round(r["prefill_wall_s"], 3), "decode_s": round(decode_s, 3),
            "decode_tokens_per_s": round(wl["num_requests"] * (wl["new_tokens"] - 1) / decode_s, 1)
            if decode_s > 0 else None,
            "decode_fraction_of_bandwidth_limit": round(decode_limit_s / decode_s, 4) if decode_s > 0 else None}


# -- the comparison -----------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke run (16 requests, 16 tokens, 1 round, "
                                                         "the bandwidth probed once: before the run, not after too)")
    ap.add_argument("--out", type=Path, help="JSON results (default bench/results/engine_throughput.json; "
                                            "--quick: engine_throughput.quick.json in the temp dir)")
    ap.add_argument("--rounds", type=int, help="run every side this many times, interleaved, and keep each "
                                               "side's fastest (default 2; --quick: 1)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--model", choices=list(MODELS), default="small", help="the random Llama's shape")
    ap.add_argument("--decode-split", action=argparse.BooleanOptionalAction, default=None,
                    help="also time the prefill alone, for decode's fraction of the memory-bandwidth limit "
                         "(default: on for cuda)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, both sides (default: all cores)")
    ap.add_argument("--hf-batch-sizes", type=lambda s: [] if s == "none" else [int(x) for x in s.split(",")],
                    help="static batch sizes tried for transformers (default 8,16,32,64; cuda: 32,64,128; "
                         "none: no transformers side, for an A/B of engine arms)")
    ap.add_argument("--max-num-tokens", type=int, default=2048, help="engine: tokens per forward pass")
    ap.add_argument("--tokens-per-block", type=int, default=16, help="engine: KV block size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workload", choices=WORKLOADS, default="short",
                    help="short (64 x 16-256 tokens, 64 new), long (32 x 512-2048, 128 new) or mixed (short's "
                         "requests arriving while the others decode); --quick shrinks any of them")
    ap.add_argument("--peer", choices=list(PEERS), action="append", default=[],
                    help="also run vLLM (offline, from the vLLM environment: scripts/setup --with-vllm; "
                         "vllm-eager: without torch.compile); the headline ratio is then the engine's against it")
    ap.add_argument("--engine-env", action="append", default=[], metavar="VAR=VAL[,VAR=VAL]",
                    help="one more engine arm with these environment variables (threads=N: its torch threads), "
                         "interleaved with the others: an A/B in one run")
    ap.add_argument("--neighbour", action="store_true",
                    help="run every arm a second time beside a busy process pinned to the last CPU (what a pod "
                         "meets on a shared node), and report each arm's throughput then as a ratio of its own")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # worker mode: save | engine | hf-N
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return run_side(args.side, args.workdir, args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device on this machine")

    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    element_bytes = torch.empty(0, dtype=dtype).element_size()
    decode_split = args.decode_split if args.decode_split is not None else args.device == "cuda"
    wl = workloads(args.quick, args.device, args.workload)
    model_cfg = MODELS[args.model] | {"max_position_embeddings": max(MODELS[args.model]["max_position_embeddings"],
                                                                     wl["max_prompt"] + wl["new_tokens"])}
    batch_sizes = wl["hf_batch_sizes"] if args.hf_batch_sizes is None else args.hf_batch_sizes
    rounds = args.rounds or (1 if args.quick else 2)
    out = args.out or (Path(tempfile.gettempdir()) / "engine_throughput.quick.json" if args.quick else DEFAULT_OUT)
    prompts = make_prompts(wl["num_requests"], wl["min_prompt"], wl["max_prompt"], model_cfg["vocab_size"], args.seed)
    prompt_lens = [len(p) for p in prompts]
    prompt_tokens = sum(prompt_lens)
    generated_tokens = wl["num_requests"] * wl["new_tokens"]
    flops = workload_flops(model_cfg, prompt_lens, wl["new_tokens"])
    dbytes = decode_bytes(model_cfg, prompt_lens, wl["new_tokens"], element_bytes)
    arms = engine_arms(args.engine_env, args.threads) | {f"hf-{n}": (f"hf-{n}", {}, args.threads) for n in batch_sizes}
    arms |= {peer: (PEERS[peer][0], PEERS[peer][1], args.threads) for peer in args.peer}
    side_names = list(arms)

    print(f"measuring {args.dtype} matmul throughput and memory bandwidth on {args.device} ...", flush=True)
    matmul_before = matmul_gflops(*PROBE_SHAPE[args.device], device=args.device, dtype=dtype)
    bandwidth = measure_bandwidth(args.device, args.threads)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="engine-throughput-") as tmp:
        workdir = Path(tmp)
        (workdir / "workload.json").write_text(json.dumps(
            {"prompts": prompts, "new_tokens": wl["new_tokens"], "max_num_tokens": args.max_num_tokens,
             "tokens_per_block": args.tokens_per_block, "device": args.device, "dtype": args.dtype,
             "decode_split": decode_split, "model": args.model, "model_config": model_cfg, "seed": args.seed,
             "model_dir": str(workdir / "model"), "arrivals": wl.get("arrivals"),
             "kv_bytes_per_token": 2 * model_cfg["num_hidden_layers"] * _shape(model_cfg)[2] * element_bytes}))
        # saved by a worker too: the random model would raise this process's (inherited) peak RSS
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--side", "save", "--workdir", str(workdir),
                        "--threads", str(args.threads)], check=True)
        num_params = json.loads((workdir / "result-save.json").read_text())
        runs = {name: [] for name in side_names}
        crowded = {name: [] for name in side_names} if args.neighbour else {}
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", flush=True)
            for name, (side, env, threads) in arms.items():
                runs[name].append(spawn_side(side, workdir, threads, env, name))
                if args.neighbour:
                    with busy_neighbour(max(os.sched_getaffinity(0))):
                        crowded[name].append(spawn_side(side, workdir, threads, env, name + " +neighbour"))
    matmul_after = matmul_gflops(*PROBE_SHAPE[args.device], device=args.device, dtype=dtype)
    if not args.quick:  # a smoke run skips the second probe: a process of its own, torch imported again
        bandwidth = max(bandwidth, measure_bandwidth(args.device, args.threads))
    results = [best_of_rounds(runs[name]) for name in side_names]
    # The machine's peak is the best matmul rate seen at any point of the run.
    peak_gflops = max([matmul_before, matmul_after] + [x["matmul_probe_gflops"] for v in runs.values() for x in v
                                                       if "matmul_probe_gflops" in x])

    engine_outputs = results[0]["outputs"]
    limit_s = flops["total"] / (peak_gflops * 1e9)
    decode_limit_s = dbytes["total"] / (bandwidth * 1e9)
    rows, sides = [], []
    for name, r in zip(side_names, results):
        side = side_summary(name, r, generated_tokens, prompt_tokens, flops["total"], limit_s, engine_outputs)
        if name in crowded:  # the same arm beside a busy neighbour: its best round against its own quiet best
            side["with_neighbour"] = neighbour_summary(best_of_rounds(crowded[name]), r, generated_tokens)
        if "prefill_wall_s" in r:
            side |= decode_split_summary(r, wl, decode_limit_s)
        sides.append(side)
        rows.append([name, side["batch_size"], r["wall_s"], side["cpu_s"] or "-", side["generated_tokens_per_s"],
                     side["total_tokens_per_s"], 100 * side["fraction_of_compute_limit"]]
                    + ([side["decode_tokens_per_s"] or "-", 100 * (side["decode_fraction_of_bandwidth_limit"] or 0)]
                       if decode_split else [])
                    + ([side["with_neighbour"]["ratio_to_quiet"]] if crowded else [])
                    + [side["peak_rss_mb"], f"{side['requests_identical_to_engine']}/{len(prompts)}"])

    engine = sides[0]
    best_hf = max((s for s in sides if s["side"] == SIDE_TITLES["hf"]), key=lambda s: s["generated_tokens_per_s"],
                  default=None)
    ratio = engine["generated_tokens_per_s"] / best_hf["generated_tokens_per_s"] if best_hf else None
    peers = {s["arm"]: round(engine["generated_tokens_per_s"] / s["generated_tokens_per_s"], 3)
             for s in sides if s["arm"] in args.peer}
    print()
    print(format_table(["arm", "batch", "wall s", "CPU s", "gen tok/s", "total tok/s", "% of compute limit"]
                       + (["decode tok/s", "% of bandwidth limit"] if decode_split else [])
                       + (["with neighbour / quiet"] if crowded else [])
                       + ["peak RSS MB", "same tokens"], rows))
    # an A/B of engine arms on a loaded machine: the ratio of median rounds (every round interleaved)
    ab = {s["arm"]: {"wall": round(s["wall_s_median"] / engine["wall_s_median"], 3),
                     "cpu": round(s["cpu_s_median"] / engine["cpu_s_median"], 3)}
          for s in sides[1:] if s["arm"].startswith("engine[")}
    print()
    for arm, arm_ratio in ab.items():
        print(f"{arm} / engine, medians of {rounds} rounds: wall {arm_ratio['wall']:.3f}x, CPU {arm_ratio['cpu']:.3f}x "
              f"(> 1: the engine as it ships is faster)")
    for peer, peer_ratio in peers.items():
        print(f"engine / {peer}: {peer_ratio:.2f}x")
    if best_hf:
        print(f"engine / best transformers (batch {best_hf['batch_size']}): {ratio:.2f}x "
              f"(target >= {TARGET_RATIO:.1f}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    print(f"compute limit: {flops['total'] / 1e9:.1f} GFLOP / {peak_gflops:.1f} GFLOP/s = {limit_s:.2f} s; "
          f"best of {rounds} round(s) per side; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if decode_split:
        print(f"decode bandwidth limit: {dbytes['total'] / 1e9:.1f} GB / {bandwidth:.0f} GB/s = {decode_limit_s:.3f} s")

    machine = machine_info() | {"torch_threads": args.threads}
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    report = {
        "benchmark": "engine_throughput", "issue": 29, "quick": args.quick, "rounds": rounds,
        "workload_kind": args.workload, "neighbour": "a busy process pinned to the last CPU" if crowded else None,
        "started_unix": round(started), "duration_s": round(time.time() - started, 1),
        "device": args.device, "machine": machine,
        "model": {"name": args.model, "config": model_cfg, "parameters": num_params, "dtype": args.dtype},
        "workload": {"requests": len(prompts), "prompt_tokens_min_max": [wl["min_prompt"], wl["max_prompt"]],
                     "prompt_tokens": prompt_tokens, "new_tokens_per_request": wl["new_tokens"],
                     "generated_tokens": generated_tokens, "sampling": "greedy, EOS ignored", "seed": args.seed,
                     "arrivals_after_step": wl.get("arrivals")},
        "compute_limit": {"peak_matmul_gflops": round(peak_gflops, 1),
                          "matmul_gflops_before_after": [round(matmul_before, 1), round(matmul_after, 1)],
                          "matmul_shape": "[{0}, {1}] @ [{1}, {2}] {3}, best of 5 x 10, torch.mm and (CPU) oneDNN "
                                          "(peak: the best rate seen before, during or after the run)"
                                          .format(*PROBE_SHAPE[args.device], args.dtype),
                          "workload_gflop": {k: round(v / 1e9, 2) for k, v in flops.items()},
                          "limit_wall_s": round(limit_s, 3),
                          "limit_generated_tokens_per_s": round(generated_tokens / limit_s, 1)},
        "sides": sides,
        "best_transformers_batch_size": best_hf and best_hf["batch_size"],
        "ratio_engine_to_best_transformers": ratio and round(ratio, 3),
        **{f"ratio_engine_to_{peer}": peer_ratio for peer, peer_ratio in peers.items()},
        "median_ratio_arm_to_engine": ab,
        "target_ratio": TARGET_RATIO, "target_met": ratio is not None and ratio >= TARGET_RATIO,
    }
    if decode_split:
        report["decode_bandwidth_limit"] = {
            "memory_gbps": round(bandwidth, 1), "probe": "copy of a 1 GiB buffer, bytes read + written, best of 5 x 5",
            "decode_gb": {k: round(v / 1e9, 3) for k, v in dbytes.items()}, "limit_s": round(decode_limit_s, 4)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


def save_model(path: Path, model_cfg: dict, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Save the random Llama both sides load; return its parameter counts."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    with torch.device(device):  # a 1B model initialises in seconds on a GPU
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model_cfg)).to(dtype).eval()
    model.save_pretrained(str(path))
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    return {"total": total, "embedding": embed, "lm_head": model.lm_head.weight.numel(),
            "non_embedding": total - embed}


if __name__ == "__main__":
    main()
