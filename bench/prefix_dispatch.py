"""The server's ADP dispatcher on a 2-rank lockstep fleet: prefix hits and per-pass imbalance.

A quick measurement, not the issue's full bench (bench/prefix_routing.py, through the router):
real `ADPExecutor`s, engines, schedulers and prefix caches stepping in lockstep on threads
(tests/runtime/lockstep.py), a token table for a network (scheduling is what is measured, not
matmuls), and the server's own `ADPDispatcher` fed with the ranks' cache events after every pass,
as the rank group does. Arms:
  least-loaded   today's rule before this change: fewest requests, then fewest prompt + max tokens;
  prefix         the dispatcher (longest hit within max/mean pending tokens <= 1.25);
  prefix-nobound the dispatcher with no bound: what the bound costs in hits and buys in balance.
Workloads (closed loop: a session sends its next turn a few passes after its answer):
  chat   16 sessions x 5 turns, 4 system prompts of 256 tokens shared by groups of 4 sessions;
  hot    the same, every session sharing one system prompt.
Reported: hit rate (hit / looked-up prompt tokens, the engines' counters) and against the ideal
(one unbounded cache that saw every block any rank computed); per-pass imbalance, max/mean of the
ranks' real tokens in a pass where the fleet had work (mean over passes), and the lockstep cost
sum(max) / sum(mean) (a pass lasts as long as its busiest rank); passes to finish.

    .venv/bin/python bench/prefix_dispatch.py [--seed N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "runtime"))  # the lockstep fleet of the test suite

from lockstep import LockstepFleet, TableModel  # noqa: E402

from adpfleet.runtime.config import EngineConfig  # noqa: E402
from adpfleet.runtime.engine import block_hash  # noqa: E402
from adpfleet.runtime.engine.cache_events import STORED  # noqa: E402
from adpfleet.runtime.engine.llm_engine import LLMEngine  # noqa: E402
from adpfleet.runtime.engine.request import Request  # noqa: E402
from adpfleet.runtime.engine.sampling import SamplingParams  # noqa: E402
from adpfleet.runtime.executor.adp_dispatcher import ADPDispatcher  # noqa: E402

B, RANKS, VOCAB = 16, 2, 300
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 256, 32, 32


class LeastLoaded(ADPDispatcher):
    """The rule before prefix placement: fewest requests, then fewest prompt + max tokens, blind to caches."""

    def __init__(self, dp: int, tokens_per_block: int):
        super().__init__(dp, tokens_per_block)
        self.budget: dict[str, int] = {}  # request id -> its prompt + max tokens

    def assign(self, request: Request, rank: int | None = None) -> int:
        tokens = [0] * self.dp
        for rid, placement in self.placed.items():
            tokens[placement.rank] += self.budget[rid]
        self.budget[request.request_id] = request.num_prompt_tokens + request.params.max_tokens
        return super().assign(request, min(range(self.dp), key=lambda r: (self.requests[r], tokens[r], r)))


def sessions(hot: bool, rng: random.Random) -> list[list[list[int]]]:
    """Per session, the user turns (token lists); the first one starts with its system prompt."""
    systems = [[rng.randrange(1, VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(1 if hot else 4)]
    return [[systems[s % len(systems)] + [rng.randrange(1, VOCAB) for _ in range(USER_TOKENS)]]
            + [[rng.randrange(1, VOCAB) for _ in range(USER_TOKENS)] for _ in range(4)] for s in range(16)]


def run(arm: str, hot: bool, seed: int) -> dict:
    rng = random.Random(seed)
    table = [rng.randrange(1, VOCAB) for _ in range(320)]
    config = EngineConfig(model="tiny-dense", kv_blocks=192, tokens_per_block=B)
    fleet = LockstepFleet([LLMEngine(config, model=TableModel(table)) for _ in range(RANKS)])
    dispatcher = (LeastLoaded(RANKS, B) if arm == "least-loaded"
                  else ADPDispatcher(RANKS, B, math.inf if arm == "prefix-nobound" else 1.25))
    turns = sessions(hot, rng)
    history: list[list[int]] = [[] for _ in turns]  # each session's conversation so far
    live: dict[str, tuple[int, Request]] = {}
    due = {s: s * 3 for s in range(len(turns))}  # session -> pass its next turn arrives
    ideal_seen, ideal_hits, queries = set(), 0, 0
    imbalance, busiest, mean_work, passes = [], 0, 0.0, 0
    while due or dispatcher.placed:
        new = {}
        for s in [s for s, at in due.items() if at <= passes]:
            del due[s]
            prompt = history[s] + turns[s].pop(0)
            req = Request(f"s{s}-{len(turns[s])}", prompt, SamplingParams(max_tokens=ANSWER_TOKENS, ignore_eos=True))
            hashes = block_hash.prefix_hashes(prompt, B)
            ideal_hits += next((i for i, h in enumerate(hashes) if h not in ideal_seen), len(hashes)) * B
            queries += len(prompt)
            new.setdefault(dispatcher.assign(req), []).append(req)
            live[req.request_id] = (s, req)
        before = [e.stats.prompt_tokens + e.stats.generation_tokens for e in fleet.engines]
        results = fleet.step(new)
        work = [e.stats.prompt_tokens + e.stats.generation_tokens - b for e, b in zip(fleet.engines, before)]
        passes += 1
        if results[0].fleet_has_work and sum(work):
            imbalance.append(max(work) / (sum(work) / RANKS))
            busiest, mean_work = busiest + max(work), mean_work + sum(work) / RANKS
        for rank, (engine, result) in enumerate(zip(fleet.engines, results)):
            events = engine.kv.events.take()
            dispatcher.view.apply(rank, events)
            ideal_seen.update(bytes.fromhex(h) for kind, h in events if kind == STORED)
            for out in result.outputs:
                if not out.finished:
                    dispatcher.progress(out.request_id, out.completion_tokens)
                    continue
                dispatcher.release(out.request_id)
                s, req = live.pop(out.request_id)
                history[s] = req.all_token_ids
                if turns[s]:
                    due[s] = passes + rng.randrange(1, 8)
    fleet.close()
    hits = sum(e.stats.prefix_cache_hits for e in fleet.engines)
    looked_up = sum(e.stats.prefix_cache_queries for e in fleet.engines)
    return {"arm": arm, "workload": "hot" if hot else "chat", "hit_rate": hits / looked_up,
            "hit_rate_vs_ideal": hits / ideal_hits if ideal_hits else None, "ideal_hit_rate": ideal_hits / queries,
            "pass_imbalance_mean": statistics.fmean(imbalance), "lockstep_cost": busiest / mean_work,
            "passes": passes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    rows = [run(arm, hot, args.seed) for hot in (False, True) for arm in ("least-loaded", "prefix", "prefix-nobound")]
    print(f"{'workload':8} {'arm':15} {'hit rate':>8} {'vs ideal':>8} {'pass max/mean':>13} {'sum max/mean':>12} "
          f"{'passes':>6}")
    for r in rows:
        print(f"{r['workload']:8} {r['arm']:15} {r['hit_rate']:8.3f} {r['hit_rate_vs_ideal']:8.3f} "
              f"{r['pass_imbalance_mean']:13.3f} {r['lockstep_cost']:12.3f} {r['passes']:6d}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
