"""The ADP stall A/B on this machine: four arms, the active-request-cap scenario, and padding's cost.

Part 1, four arms on one workload: post-schedule padding off/on × the padding reserve off/on
(`--no-pad-empty-batch`, `--no-padding-reserve`). Two context ranks, a KV cache small enough that
finished prompts held for transfer starve a rank now and then, the capacity-blind ADP router, and
a simulated generation side that pulls each held KV `--pull-ms` after its prompt finished (a fast
and a slow generation side by default).

Part 2, the cap scenario: a burst above `max_num_active_requests` on one context rank while its
peer has work — on this tree and on the tree before the fix (`--before REV`, run from a copy of
that revision), where the rank at the cap voted 0 forever.

Part 3, what the padding code costs when it never fires: an aggregated workload that never
starves, pass time and collectives per pass with padding on vs off, alternated.

    .venv/bin/python bench/stall_ab.py [--quick] [--before REV] [--out bench/results/stall_ab.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adpfleet.runtime.executor.offline import OfflineRanks

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("committed", "rolled_back", "unaffordable", "failed")
CAP_BEFORE_FIX = "03f351b"  # main before issue 11: no dummy at the cap, KV reaped only after forwards


def observe(ranks: OfflineRanks, ids: list[str], start: float, stall_after: float) -> dict:
    completed_all = ranks.wait_progress(ids, stall_after=stall_after, timeout=600)
    wall = time.monotonic() - start - (0 if completed_all else stall_after)
    time.sleep(0.3)  # one last stats report from each rank
    stats = [ranks.stats(r) for r in (0, 1)]
    return {"fetched": sum(s.requests_fetched for s in stats),
            "completed": sum(1 for i in ids if i in ranks.done), "stalled": not completed_all,
            "wall_s": round(wall, 2), "empty_batch_events": sum(s.empty_batch_iterations for s in stats),
            "vetoed_passes": max(s.forward_vetoed for s in stats),
            "dummies": {phase: {o: sum(s.padding_dummies[(phase, o)] for s in stats) for o in OUTCOMES}
                        for phase in ("pre_schedule", "post_schedule")}}


def stall_arm(pad: bool, reserve: bool, n: int, seed: int, pull_s: float, stall_after: float) -> dict:
    rng = random.Random(seed)
    ranks = OfflineRanks(2, "tiny", role="context", pad_empty_batch=pad, padding_reserve=reserve, kv_blocks=48,
                         tokens_per_block=16, max_num_tokens=64, transfer="simulated", transfer_latency_s=pull_s)
    try:
        ranks.group.wait_ready(300)
        start = time.monotonic()
        ids = [ranks.submit([rng.randrange(256) for _ in range(rng.randint(16, 300))], max_tokens=1)
               for _ in range(n)]
        return {"padding": pad, "reserve": reserve, "requests": n, **observe(ranks, ids, start, stall_after)}
    finally:
        ranks.close()


def cap_arm(n: int, seed: int, stall_after: float) -> dict:
    """A burst of `n` prompts on rank 0 (cap 8) and a stream on rank 1; padding and its reserve on.
    Uses only knobs the tree before the fix has, so `--before` can run it there."""
    rng = random.Random(seed)
    ranks = OfflineRanks(2, "tiny", role="context", kv_blocks=24, tokens_per_block=16, max_num_tokens=64,
                         max_num_active_requests=8, transfer="simulated", transfer_latency_s=0.1)
    try:
        ranks.group.wait_ready(300)
        start = time.monotonic()
        ids = [ranks.submit([rng.randrange(256) for _ in range(rng.randint(40, 120))], rank=0, max_tokens=1)
               for _ in range(n)]
        ids += [ranks.submit([rng.randrange(256) for _ in range(rng.randint(40, 120))], rank=1, max_tokens=1)
                for _ in range(n // 4)]
        return {"requests": len(ids), **observe(ranks, ids, start, stall_after)}
    finally:
        ranks.close()


def cap_arm_before(rev: str, n: int, seed: int, stall_after: float) -> dict:
    """The cap scenario on a copy of the tree at `rev` (this script, that tree's packages)."""
    with tempfile.TemporaryDirectory(prefix="adpfleet-before-") as tmp:
        tree = Path(tmp)
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        for sub in ("runtime", "operator", "cluster"):  # pyproject's package-dir mapping
            (tree / "adpfleet" / sub).symlink_to(tree / sub)
        proc = subprocess.run([sys.executable, __file__, "--cap-arm-json", str(n), str(seed), str(stall_after)],
                              env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the cap scenario at {rev} failed:\n{proc.stderr[-3000:]}")
        return {"tree": rev, **json.loads(proc.stdout.splitlines()[-1])}


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


def row(label: str, a: dict) -> str:
    post, pre = a["dummies"]["post_schedule"], a["dummies"]["pre_schedule"]
    return (f"{label:<32} {a['fetched']:>7} {a['completed']:>9} {str(a['stalled']):>7} {a['wall_s']:>7} "
            f"{a['empty_batch_events']:>11} {a['vetoed_passes']:>7} {post['committed']:>9} {post['rolled_back']:>8} "
            f"{post['unaffordable']:>12} {pre['unaffordable']:>16}")


HEADER = (f"{'arm':<32} {'fetched':>7} {'completed':>9} {'stalled':>7} {'wall s':>7} {'empty-batch':>11} "
          f"{'vetoed':>7} {'committed':>9} {'rolled':>8} {'unaffordable':>12} {'pre unaffordable':>16}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    ap.add_argument("--out", default="bench/results/stall_ab.json")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pull-ms", type=float, nargs="+", default=[100.0, 1000.0],
                    help="simulated pull latencies of held KV (one A/B each)")
    ap.add_argument("--before", default=CAP_BEFORE_FIX, help="the revision the cap scenario is compared to")
    ap.add_argument("--cap-arm-json", nargs=3, metavar=("N", "SEED", "STALL_AFTER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cap_arm_json:  # the child run of cap_arm_before, in the other tree
        n, seed, stall_after = args.cap_arm_json
        print(json.dumps(cap_arm(int(n), int(seed), float(stall_after))))
        return 0
    n_stall, n_cap, n_over, rounds = (150, 24, 16, 1) if args.quick else (400, 64, 48, 5)
    stall_after = 10.0

    arms = []
    for pull_ms in args.pull_ms:
        arms += [{"pull_ms": pull_ms, **stall_arm(pad, reserve, n_stall, args.seed, pull_ms / 1000, stall_after)}
                 for pad, reserve in ((False, False), (True, False), (False, True), (True, True))]
    print(f"\nADP stall A/B: 2 context ranks, {n_stall} prompts, same seed")
    print(HEADER)
    for a in arms:
        print(row(f"pull {a['pull_ms']:.0f} ms: pad {'on' if a['padding'] else 'off'}, "
                  f"res. {'on' if a['reserve'] else 'off'}", a))

    cap = {"after": cap_arm(n_cap, args.seed, stall_after),
           "before": cap_arm_before(args.before, n_cap, args.seed, stall_after)}
    print(f"\nThe cap scenario: {n_cap} prompts on rank 0 (max_num_active_requests 8), {n_cap // 4} on rank 1")
    print(HEADER)
    print(row(f"before the fix ({args.before})", cap["before"]))
    print(row("after the fix", cap["after"]))

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

    result = {"stall_ab": arms, "cap": cap,
              "overhead": {"rounds": over, "pass_ms_on": on, "pass_ms_off": off, "ratio": on / off,
                           "control_collectives_per_pass": {str(k): v for k, v in coll.items()},
                           "model_collectives_per_forward": {str(k): v for k, v in fwd.items()}},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "quick": args.quick}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")
    both = [a for a in arms if a["padding"] and a["reserve"]]
    ok = all(not a["stalled"] and a["completed"] == a["requests"] for a in both) and cap["before"]["stalled"] \
        and not cap["after"]["stalled"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
