"""Where each engine's time goes: torch.profiler on adpfleet's engine and on vLLM's, same workload.

    .venv/bin/python bench/profile_engines.py                    # short workload, 3 profiled rounds each
    .venv/bin/python bench/profile_engines.py --workload long
    .venv/bin/python bench/profile_engines.py --no-vllm          # our engine alone (no vLLM environment)
    .venv/bin/python bench/profile_engines.py --ab 5             # not a profile: this work's changes A/B (AB_ARMS)

Both engines run bench/engine_throughput.py's workload (the same saved random Llama, prompts and
settings, prefix caching off so that every run does the whole work), each in a process of its
own: once unprofiled (its wall time), then --rounds times under torch.profiler, keeping the
fastest (other load on the machine only ever slows a round down). vLLM (bench/vllm_peer.py, its
own environment) runs its engine core in the driver process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
so that one profiler sees the model, the scheduler and the Python around them. Every operator's
self time on the thread that called it (which waits for its intra-op workers) goes to one row of
CATEGORIES; what the operators leave of the profiled wall time is Python (scheduling, metadata,
sampling bookkeeping, outputs) and the profiler's own cost per operator. Prints the two tables
side by side; writes bench/results/profile_engines-WORKLOAD.json.

`op_table` is imported by bench/vllm_peer.py too (vLLM's Python: torch only, nothing of adpfleet).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# (row, pattern on "scope/op name"): an operator's first match; a scope is a `record_function`
# label around the code that calls it (our engine's RoPE, SiLU x mul and RMSNorm: plain torch ops
# whose names alone do not say which step they belong to).
CATEGORIES = [
    ("GEMM (linear layers, lm_head)", r"/(mkldnn::_linear_pointwise|aten::(linear|addmm|mm|matmul)|_C\w*::(onednn_mm"
                                      r"|weight_packed_linear\w*)|mkl::\w+)$"),
    ("attention kernels", r"/(adpfleet::paged_decode_attention|aten::_?scaled_dot_product\w*|_C\w*::\w*attention\w*)$"),
    ("KV cache write", r"/(aten::index_copy_|_C\w*::\w*reshape_and_cache\w*)$"),
    ("torch.compile graphs (inductor-fused ops)", r"(CompiledFxGraph|Torch-Compiled Region|inductor|cpp_fused)"),
    ("RMSNorm (+ residual add)", r"(^rms_norm/|/(aten::rms_norm|adpfleet::(add_)?rms_norm|"
                                 r"_C\w*::(fused_add_)?rms_norm)$)"),
    ("RoPE", r"(^rope/|/(adpfleet::rope|_C\w*::rotary_embedding)$)"),
    ("SiLU x mul", r"(^silu_and_mul/|/(adpfleet|_C\w*)::silu_and_mul$)"),
    ("residual add, other elementwise", r"/aten::(add|add_|mul|mul_|sub|div|neg|silu|exp|pow|rsqrt|mean|clamp\w*)$"),
    ("sampling (argmax, softmax, top-k)", r"/(aten::(argmax|max|softmax|_softmax|topk|sort|gather|log_softmax|"
                                          r"multinomial)|_C\w*::\w*sampl\w*)$"),
    ("copy, cat, index, allocation", r"/aten::(copy_|cat|index|index_select|to|_to_copy|empty\w*|zeros\w*|ones\w*|"
                                     r"full\w*|arange|contiguous|clone|embedding|slice|select|view|reshape|"
                                     r"transpose|unsqueeze|split\w*|chunk|narrow|as_strided|t|tensor|item|"
                                     r"_local_scalar_dense|fill_|zero_|stack|where|lift_fresh|detach\w*|"
                                     r"index_put_|_unsafe_view|permute|expand|squeeze)$"),
    ("other operators", r"/[\w.]+::"),
]
PYTHON_ROW = "Python, scheduling, metadata (wall - operators)"
ROWS = [name for name, _ in CATEGORIES] + [PYTHON_ROW]
SCOPES = ("rope", "silu_and_mul", "rms_norm")


def op_table(prof, scopes=SCOPES) -> dict[str, dict]:
    """"scope/op name" -> {self_us, count} over every event the profiler recorded: an operator's
    self time (its children's excluded, so nothing counts twice), under the innermost of `scopes`
    around it ("" when none). A scope's own self time (Python in it) is left out with the rest."""
    table: dict[str, dict] = {}
    for e in prof.events():
        if e.name in scopes:
            continue
        parent, scope = e.cpu_parent, ""
        while parent is not None and not scope:
            scope = parent.name if parent.name in scopes else ""
            parent = parent.cpu_parent
        row = table.setdefault(f"{scope}/{e.name}", {"self_us": 0.0, "count": 0})
        row["self_us"] += e.self_cpu_time_total
        row["count"] += 1
    return table


def categorize(table: dict[str, dict], profiled_wall_s: float) -> dict[str, float]:
    """Seconds per row of ROWS; events matching no row (Python-level annotations) are Python."""
    seconds = dict.fromkeys(ROWS, 0.0)
    for key, row in table.items():
        name = next((n for n, pattern in CATEGORIES if re.search(pattern, key)), None)
        if name is not None:
            seconds[name] += row["self_us"] / 1e6
    seconds[PYTHON_ROW] = max(0.0, profiled_wall_s - sum(seconds.values()))
    return seconds


def top_ops(table: dict[str, dict], n: int = 12) -> list[dict]:
    rows = sorted(table.items(), key=lambda kv: -kv[1]["self_us"])[:n]
    return [{"op": k, "self_s": round(v["self_us"] / 1e6, 4), "count": v["count"]} for k, v in rows]


# -- our engine's side (the project's environment) ------------------------------------------------
def profile_engine(workdir: Path) -> dict:
    """Worker: the engine on the workload, unprofiled then profiled; RoPE, SiLU x mul and RMSNorm
    each run inside a record_function scope of their name."""
    import torch
    from torch.profiler import record_function

    import engine_throughput
    from adpfleet.runtime.model import layers

    def scoped(name, fn):
        def call(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return call

    layers.Rope.__call__ = scoped("rope", layers.Rope.__call__)
    layers.rms_norm = scoped("rms_norm", layers.rms_norm)
    layers.silu_and_mul = scoped("silu_and_mul", layers.silu_and_mul)
    spec = json.loads((workdir / "workload.json").read_text())
    torch.set_num_threads(spec["threads"])
    run, info = engine_throughput.prepare_engine(workdir, spec)
    start = time.perf_counter()
    outputs = run(spec["new_tokens"])
    wall = time.perf_counter() - start
    result = {"side": "engine", "wall_s": wall, "outputs": outputs, "threads": torch.get_num_threads(),
              "decode_attention": info["decode_attention"]}
    return result | profiled_rounds(lambda: run(spec["new_tokens"]), spec["profile_rounds"])


def profiled_rounds(run, rounds: int) -> dict:
    """`run` under torch.profiler `rounds` times: the fastest round's wall time and operator table
    (on a loaded machine other work only ever slows a round down), and every round's wall time."""
    from torch.profiler import ProfilerActivity, profile

    best, walls = None, []
    for _ in range(rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            run()
            walls.append(time.perf_counter() - start)
        if best is None or walls[-1] < best["profiled_wall_s"]:
            best = {"profiled_wall_s": walls[-1], "ops": op_table(prof)}
    return best | {"profiled_wall_s_all_rounds": [round(w, 3) for w in walls]}


AB_METHOD = """One engine process loads the model once; between runs the model's code switches
the changes of AB_ARMS in and out (runtime/model/layers.py: `fused`, `onednn_weight`). Each arm runs
the workload once per round, the arms interleaved, after an untimed round that meets every arm's
shapes; medians of wall and CPU time (process_time: less sensitive to other load), as ratios to
the engine as shipped, and each arm's tokens against the first arm's."""
# Our engine with this work's changes undone in turn (runtime/model/layers.py): arm -> (fused
# elementwise kernels, prepacked oneDNN weights).
AB_ARMS = {"before (plain weights, torch elementwise)": (False, False), "+ prepacked weights": (False, True),
           "+ fused elementwise (as shipped)": (True, True)}


def ab_engine(workdir: Path) -> dict:
    """Worker: one engine, the AB_ARMS switched in and out of the model's code between runs, each
    arm run once per round, interleaved; every run's wall and CPU time, and its tokens."""
    import statistics

    import torch

    import engine_throughput
    from adpfleet.runtime.model import layers

    spec = json.loads((workdir / "workload.json").read_text())
    torch.set_num_threads(spec["threads"])
    run, _ = engine_throughput.prepare_engine(workdir, spec)
    shipped = layers.fused, layers.onednn_weight
    runs = {arm: [] for arm in AB_ARMS}
    outputs = {}
    for r in range(spec["ab_rounds"] + 1):  # round 0 warms every arm's shapes up, untimed
        for arm, (fused, packed) in AB_ARMS.items():
            layers.fused = shipped[0] if fused else (lambda x: False)
            layers.onednn_weight = shipped[1] if packed else (lambda w: w)
            cpu, start = time.process_time(), time.perf_counter()
            outputs[arm] = run(spec["new_tokens"])
            if r:
                runs[arm].append((time.perf_counter() - start, time.process_time() - cpu))
                wall, cpu = runs[arm][-1]
                print(f"  round {r}: {arm:40s} {wall:7.2f} s wall, {cpu:7.2f} s CPU", flush=True)
    base = list(AB_ARMS)[0]
    return {arm: {"wall_s_all_rounds": [round(w, 3) for w, _ in v], "cpu_s_all_rounds": [round(c, 3) for _, c in v],
                  "wall_s_median": statistics.median(w for w, _ in v),
                  "cpu_s_median": statistics.median(c for _, c in v),
                  "requests_identical_to_before": sum(a == b for a, b in zip(outputs[arm], outputs[base]))}
            for arm, v in runs.items()}


# -- the comparison -------------------------------------------------------------------------------
def side_report(result: dict) -> dict:
    seconds = categorize(result["ops"], result["profiled_wall_s"])
    return {"wall_s": round(result["wall_s"], 3), "profiled_wall_s": round(result["profiled_wall_s"], 3),
            "profiled_wall_s_all_rounds": result["profiled_wall_s_all_rounds"],
            "seconds": {k: round(v, 4) for k, v in seconds.items()},
            "share": {k: round(v / result["profiled_wall_s"], 4) for k, v in seconds.items()},
            "top_ops": top_ops(result["ops"]),
            "ops": {k: {"self_s": round(v["self_us"] / 1e6, 5), "count": v["count"]} for k, v in result["ops"].items()}}


def print_tables(engine: dict, vllm: dict) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    rows = [[row, engine["seconds"][row], 100 * engine["share"][row], vllm["seconds"][row], 100 * vllm["share"][row],
             engine["seconds"][row] - vllm["seconds"][row]] for row in ROWS]
    rows.append(["profiled wall", engine["profiled_wall_s"], 100.0, vllm["profiled_wall_s"], 100.0,
                 engine["profiled_wall_s"] - vllm["profiled_wall_s"]])
    rows.append(["unprofiled wall", engine["wall_s"], "", vllm["wall_s"], "", engine["wall_s"] - vllm["wall_s"]])
    print(format_table(["row", "adpfleet s", "%", "vLLM s", "%", "adpfleet - vLLM s"], rows))
    for side, report in (("adpfleet", engine), ("vLLM", vllm)):
        print(f"\n{side}: top operators by self time")
        print(format_table(["scope/op", "self s", "calls"],
                           [[o["op"], o["self_s"], o["count"]] for o in report["top_ops"]]))


def write_workload(workdir: Path, args, et) -> list[list[int]]:
    """bench/engine_throughput.py's workload and random model, in `workdir`; returns the prompts."""
    wl = et.workloads(args.quick, "cpu", args.workload)
    model_cfg = et.MODELS["small"] | {"max_position_embeddings": max(et.MODELS["small"]["max_position_embeddings"],
                                                                      wl["max_prompt"] + wl["new_tokens"])}
    prompts = et.make_prompts(wl["num_requests"], wl["min_prompt"], wl["max_prompt"], model_cfg["vocab_size"], 0)
    (workdir / "workload.json").write_text(json.dumps(
        {"prompts": prompts, "new_tokens": wl["new_tokens"], "max_num_tokens": 2048, "tokens_per_block": 16,
         "device": "cpu", "dtype": "float32", "model": "small", "model_config": model_cfg, "seed": 0,
         "model_dir": str(workdir / "model"), "threads": args.threads,
         "kv_bytes_per_token": 2 * model_cfg["num_hidden_layers"] * et._shape(model_cfg)[2] * 4,
         "prefix_cache": False,  # every run does the whole work again
         "profile_rounds": args.rounds, "ab_rounds": args.ab}))
    subprocess.run([sys.executable, str(Path(et.__file__)), "--side", "save", "--workdir", str(workdir),
                    "--threads", str(args.threads)], check=True)
    return prompts


def run_engine_side(side: str, workdir: Path, et) -> dict:
    env = dict(os.environ)
    et.sleep_between_regions(env)  # as the bench's engine side and a server's ranks run
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--side", side, "--workdir", str(workdir)],
                   check=True, env=env)
    return json.loads((workdir / f"result-profile-{side}.json").read_text())


def ab_report(arms: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import format_table

    shipped = arms[list(AB_ARMS)[-1]]
    for arm in arms.values():
        arm["median_ratio_to_shipped"] = {"wall": round(arm["wall_s_median"] / shipped["wall_s_median"], 3),
                                          "cpu": round(arm["cpu_s_median"] / shipped["cpu_s_median"], 3)}
    print(format_table(["arm", "median wall s", "median CPU s", "wall / shipped", "CPU / shipped", "same tokens"],
                       [[name, a["wall_s_median"], a["cpu_s_median"], a["median_ratio_to_shipped"]["wall"],
                         a["median_ratio_to_shipped"]["cpu"], a["requests_identical_to_before"]]
                        for name, a in arms.items()]))
    return {"ab_arms": arms}


def profile_report(engine: dict, vllm: dict | None, prompts: list) -> dict:
    report = {"engine": side_report(engine) | {"decode_attention": engine["decode_attention"]}}
    if vllm is None:
        print(json.dumps(report["engine"], indent=1))
        return report
    report["vllm"] = side_report(vllm) | {"engine_core": "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
                                          "enforce_eager": vllm["enforce_eager"]}
    report["requests_identical"] = sum(a == b for a, b in zip(engine["outputs"], vllm["outputs"]))
    print_tables(report["engine"], report["vllm"])
    print(f"\nsame tokens: {report['requests_identical']}/{len(prompts)}")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=["short", "long"], default="short")
    ap.add_argument("--quick", action="store_true", help="engine_throughput's --quick workload")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="profiled runs per engine; the fastest is kept")
    ap.add_argument("--no-vllm", action="store_true", help="profile our engine only")
    ap.add_argument("--ab", type=int, metavar="ROUNDS", help="instead of profiling: our engine with this work's "
                    "changes undone in turn (AB_ARMS), ROUNDS interleaved runs each in one process; median ratios")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.side in ("engine", "ab"):
        result = profile_engine(args.workdir) if args.side == "engine" else ab_engine(args.workdir)
        (args.workdir / f"result-profile-{args.side}.json").write_text(json.dumps(result))
        return
    import engine_throughput as et

    kind = f"{'ab' if args.ab else 'profile'}_engines-{args.workload}{'-quick' if args.quick else ''}"
    out = args.out or RESULTS / f"{kind}.json"
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="profile-engines-") as tmp:
        workdir = Path(tmp)
        prompts = write_workload(workdir, args, et)
        if args.ab:
            result = ab_report(run_engine_side("ab", workdir, et))
        else:
            engine = run_engine_side("engine", workdir, et)
            vllm = None if args.no_vllm else et.run_vllm(workdir, args.threads, {"VLLM_PEER_PROFILE": "1"})
            result = profile_report(engine, vllm, prompts)
    report = {"benchmark": kind.split("-")[0], "issue": 29, "workload_kind": args.workload, "quick": args.quick,
              "threads": args.threads, "rounds": args.ab or args.rounds, "model": "small", "dtype": "float32",
              "started_unix": round(started), "duration_s": round(time.time() - started, 1),
              "load_1m_at_end": os.getloadavg()[0], "machine": et.machine_info(),
              "method": (AB_METHOD if args.ab else __doc__.split("\n\n")[2]).replace("\n", " ")} | result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
