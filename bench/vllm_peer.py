"""vLLM's side of bench/engine_throughput.py, run by the vLLM environment's Python (its own torch).

    VLLM_PYTHON bench/vllm_peer.py WORKLOAD.json    # prints one JSON line: wall_s, cpu_s, outputs, ...

WORKLOAD.json is the bench's workload file: the saved model's directory (`model_dir`), the token-id
prompts, new_tokens, max_num_tokens and, for the mixed stream, `arrivals` (request i joins after
the engine's step arrivals[i]). vLLM runs offline: `LLM` with `skip_tokenizer_init=True`, float32,
`max_num_seqs` = the number of requests (64 in the bench), `max_num_batched_tokens` = the engine's
max_num_tokens, greedy, EOS ignored. Start it from a directory other than the checkout's root (its
spawned engine process would import the checkout's operator/ in place of the standard library's);
VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND come from the caller.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

EAGER = os.environ.get("VLLM_PEER_ENFORCE_EAGER") == "1"  # the bench's vllm-eager arm: no torch.compile
# bench/profile_engines.py: the engine core in this process, one more run under torch.profiler
PROFILE = os.environ.get("VLLM_PEER_PROFILE") == "1"
if PROFILE:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM, SamplingParams

    prompts, new_tokens = spec["prompts"], spec["new_tokens"]
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, dtype="float32", seed=spec.get("seed", 0),
              max_num_seqs=len(prompts), max_num_batched_tokens=spec["max_num_tokens"],
              max_model_len=max(map(len, prompts)) + new_tokens, enforce_eager=EAGER,
              enable_prefix_caching=not PROFILE)  # a profiled second run does the whole work again
    llm.generate([{"prompt_token_ids": p[:16]} for p in prompts[:4]],  # warm-up, as the engine's
                 SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False), use_tqdm=False)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    def run() -> list[list[int]]:
        if spec.get("arrivals"):
            return stream(llm, prompts, params, spec["arrivals"])
        return [list(r.outputs[0].token_ids)
                for r in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    cpu, start = time.process_time(), time.perf_counter()
    outputs = run()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    # process_time is the driver's alone: the engine core is a child process, counted on exit
    result = {"side": "vllm", "wall_s": wall, "driver_cpu_s": cpu, "outputs": outputs,
              "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), "enforce_eager": EAGER,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if PROFILE:
        from profile_engines import profiled_rounds  # this script's folder, torch-only

        result |= profiled_rounds(run, spec["profile_rounds"])
    print(json.dumps(result))


def stream(llm, prompts: list[list[int]], params, arrivals: list[int]) -> list[list[int]]:
    """The mixed stream: request i is added after step arrivals[i], while the earlier ones decode."""
    engine, outputs, step, added = llm.llm_engine, {}, 0, 0
    while added < len(prompts) or engine.has_unfinished_requests():
        while added < len(prompts) and arrivals[added] <= step:
            engine.add_request(str(added), {"prompt_token_ids": prompts[added]}, params)
            added += 1
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
        step += 1
    return [outputs[i] for i in range(len(prompts))]


if __name__ == "__main__":
    main()
