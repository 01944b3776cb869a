"""The ADP stall A/B on this machine: the same workload with post-schedule padding on and off.

Two context ranks (gloo), a KV cache small enough that finished prompts held for transfer
starve a rank now and then, the capacity-blind ADP router, and a simulated generation side that
pulls each held KV 100 ms after its prompt finished (reaped only after forwards, as upstream).

Part 2 measures what the padding code costs when it never fires: an aggregated workload that
never starves, pass time and collectives per pass with padding on vs off, alternated.

    .venv/bin/python bench/stall_ab.py [--quick] [--out bench/results/stall_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time

from adpfleet.runtime.executor.offline import OfflineRanks


def stall_arm(pad: bool, n: int, seed: int, stall_after: float) -> dict:
    rng = random.Random(seed)
    ranks = OfflineRanks(2, "tiny", role="context", pad_empty_batch=pad, kv_blocks=48, tokens_per_block=16,
                         max_num_tokens=64, transfer="simulated", transfer_latency_s=0.1)
    try:
        ranks.group.wait_ready(300)
        start = time.monotonic()
        ids = []
        for _ in range(n):
            ids.append(ranks.submit([rng.randrange(256) for _ in range(rng.randint(16, 300))], max_tokens=1))
        completed_all = ranks.wait_progress(ids, stall_after=stall_after, timeout=600)
        wall = time.monotonic() - start - (0 if completed_all else stall_after)
        time.sleep(0.3)  # one last stats report from each rank
        stats = [ranks.stats(r) for r in (0, 1)]
        dummies = {o: sum(s.padding_dummies[("post_schedule", o)] for s in stats)
                   for o in ("committed", "rolled_back", "unaffordable", "failed")}
        return {"padding": pad, "requests": n, "fetched": sum(s.requests_fetched for s in stats),
                "completed": sum(1 for i in ids if i in ranks.done), "stalled": not completed_all,
                "wall_s": round(wall, 2), "empty_batch_events": sum(s.empty_batch_iterations for s in stats),
                "vetoed_passes": max(s.forward_vetoed for s in stats), "post_schedule_dummies": dummies}
    finally:
        ranks.close()


def overhead_arm(pad: bool, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    ranks = OfflineRanks(2, "tiny", pad_empty_batch=pad, kv_blocks=256, tokens_per_block=16, max_num_tokens=256)
    try:
        ranks.group.wait_ready(300)
        ids = [ranks.submit([rng.randrange(256) for _ in range(rng.randint(32, 128))], max_tokens=32,
                            ignore_eos=True) for _ in range(n)]
        assert ranks.wait(ids, 600), "the overhead workload did not finish"
        time.sleep(0.3)
        s = [ranks.stats(r) for r in (0, 1)]
        return {"padding": pad, "pass_ms": 1000 * sum(x.busy_pass_seconds for x in s) / sum(x.busy_passes for x in s),
                "control_collectives_per_pass": s[0].control_collective_calls / s[0].iterations,
                "collectives_per_forward": (s[0].collective_calls - s[0].control_collective_calls) / max(1, s[0].forward_steps),
                "dummies": sum(sum(x.padding_dummies[("post_schedule", o)] for o in ("committed", "rolled_back")) for x in s)}
    finally:
        ranks.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    ap.add_argument("--out", default="bench/results/stall_ab.json")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    n_stall, n_over, rounds = (150, 16, 1) if args.quick else (400, 48, 5)

    ab = [stall_arm(pad, n_stall, args.seed, stall_after=10.0) for pad in (False, True)]
    print("\nADP stall A/B (2 context ranks, same workload and seed)")
    print(f"{'padding':>8} {'requests':>8} {'fetched':>8} {'completed':>9} {'stalled':>8} {'wall s':>7} "
          f"{'empty-batch':>11} {'committed':>9} {'rolled back':>11} {'unaffordable':>12}")
    for a in ab:
        d = a["post_schedule_dummies"]
        print(f"{'on' if a['padding'] else 'off':>8} {a['requests']:>8} {a['fetched']:>8} {a['completed']:>9} "
              f"{str(a['stalled']):>8} {a['wall_s']:>7} {a['empty_batch_events']:>11} {d['committed']:>9} "
              f"{d['rolled_back']:>11} {d['unaffordable']:>12}")

    over = []
    for _ in range(rounds):
        for pad in (True, False):
            over.append(overhead_arm(pad, n_over, args.seed))
    on = statistics.median(o["pass_ms"] for o in over if o["padding"])
    off = statistics.median(o["pass_ms"] for o in over if not o["padding"])
    coll = {pad: sorted({round(o["control_collectives_per_pass"], 3) for o in over if o["padding"] == pad}) for pad in (True, False)}
    fwd = {pad: sorted({round(o["collectives_per_forward"], 3) for o in over if o["padding"] == pad}) for pad in (True, False)}
    print(f"\nPadding cost on a workload that never starves ({rounds} alternated rounds, medians)")
    print(f"{'padding':>8} {'pass ms':>8} {'control collectives/pass':>25} {'model collectives/forward':>26}")
    print(f"{'on':>8} {on:>8.3f} {str(coll[True]):>25} {str(fwd[True]):>26}")
    print(f"{'off':>8} {off:>8.3f} {str(coll[False]):>25} {str(fwd[False]):>26}")
    print(f"ratio on/off: {on / off:.3f} (target <= 1.02); dummies made: {sum(o['dummies'] for o in over)}")

    result = {"stall_ab": ab, "overhead": {"rounds": over, "pass_ms_on": on, "pass_ms_off": off, "ratio": on / off,
                                           "control_collectives_per_pass": {str(k): v for k, v in coll.items()},
                                           "model_collectives_per_forward": {str(k): v for k, v in fwd.items()}},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "quick": args.quick}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    ok = ab[0]["stalled"] and not ab[1]["stalled"] and ab[1]["completed"] == ab[1]["requests"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
