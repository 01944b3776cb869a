"""The progress search: a seeded simulator that drives the real `ADPExecutor.step` of 2–4 ranks in
one process (lockstep threads, an in-process all-gather, the real scheduler, KV cache manager,
KV hold and padding, a token-table model) through random configurations and random events, and
checks after every pass:

- progress (with padding and its reserve on):
  P1  no rank whose scheduled batch has a real request is ever vetoed (every pass in which the
      fleet has work runs the forward);
  P2  while a rank that is not starved by a fault has a real request, a real token (prompt or
      output) is processed at least every `bound` passes: 1 on aggregated ranks, 2·L + 1 on
      context ranks (L = the KV lease in passes). Derivation: docs/adp.md.
- no leak: at most one dummy per rank and none outliving its pass; every request holds exactly
  the blocks of its computed tokens; used blocks = the blocks of active and held requests; no
  hold outlives its lease (+ one lease for a transfer that is reading it); an idle fleet whose
  leases have run out uses no KV; every request finishes once the events stop.
- accounting: every counter agrees with what the probes saw (iterations, forwards, vetoes,
  empty batches, dummies by phase and outcome, prompt / generation / draft / accepted tokens,
  finished requests).

Events: arrival bursts below, at and above `max_num_active_requests` (on one rank, as a
capacity-blind router can do, or balanced), prompt and output lengths up to what validation
admits, greedy and seeded sampled requests, aborts, `starve` faults on a rank for a while, KV
transfers pulled soon, late or never (until the lease), transfers that start and are abandoned.

    .venv/bin/python tests/runtime/progress_sim.py --deep [--minutes 5] [--no-padding] [--seed N]
"""

from __future__ import annotations

import argparse
import collections
import logging
import random
import sys
import time
from dataclasses import dataclass, field

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import RequestState
from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams
from adpfleet.runtime.executor import faults
from adpfleet.runtime.executor.adp_router import pick_rank
from adpfleet.runtime.executor.kv_hold import KVHold
from adpfleet.runtime.metrics import RankStats
from lockstep import LockstepFleet, TableModel, cycle_table

TOKENS = 32  # prompts draw from the first TOKENS ids; the table model cycles among them
NEVER = float("inf")


@dataclass
class Knobs:
    """One random configuration of a fleet."""
    ranks: int
    role: str  # "aggregated" or "context"
    kv_blocks: int
    tokens_per_block: int
    max_num_tokens: int
    max_batch_size: int
    max_num_active_requests: int
    draft_tokens: int
    lease: int  # passes a held KV waits for its pull
    pad_empty_batch: bool = True
    padding_reserve: bool = True

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model="tiny-dense", kv_blocks=self.kv_blocks, tokens_per_block=self.tokens_per_block,
                            max_num_tokens=self.max_num_tokens, max_batch_size=self.max_batch_size,
                            max_num_active_requests=self.max_num_active_requests,
                            draft_tokens=self.draft_tokens, padding_reserve=self.padding_reserve)


def random_knobs(rng: random.Random, pad: bool = True, reserve: bool = True) -> Knobs:
    while True:
        draft = rng.choice([0, 0, 1, 2, 3])
        k = Knobs(ranks=rng.randint(2, 4), role=rng.choice(["aggregated", "context"]),
                  kv_blocks=rng.randint(2, 24), tokens_per_block=rng.choice([1, 2, 4, 8]),
                  max_num_tokens=rng.randint(1 + draft, 48), max_batch_size=rng.randint(1, 8),
                  max_num_active_requests=rng.randint(1, 8), draft_tokens=draft,
                  lease=rng.choice([3, 10, 30]), pad_empty_batch=pad, padding_reserve=reserve)
        try:
            k.engine_config().validate()
        except ValueError:
            continue
        return k


class SimClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimPuller:
    """The generation side of one context rank: each held request is pulled soon, late, or never
    (then its lease frees it); a transfer the simulator completed counts as pulled."""

    def __init__(self, rng: random.Random, lease: int):
        self.rng, self.lease = rng, lease
        self.at: dict[str, float] = {}

    def pulled(self, request_id: str, held_since: float, now: float) -> bool:
        if request_id not in self.at:
            r = self.rng.random()
            self.at[request_id] = held_since + (self.rng.randint(1, 3) if r < 0.4 else
                                                self.rng.randint(self.lease // 2, 2 * self.lease) if r < 0.7
                                                else NEVER)
        return now >= self.at[request_id]

    def complete(self, request_id: str) -> None:
        self.at[request_id] = 0.0


@dataclass
class Violation:
    seed: int
    passes: int
    kind: str  # "vetoed" (P1), "stall" (P2), "leak", "accounting", "error"
    message: str
    knobs: Knobs
    starved: list[int]  # ranks under a `starve` fault at the time

    def __str__(self) -> str:
        return (f"seed {self.seed}, pass {self.passes}: {self.kind}: {self.message} (starved ranks: "
                f"{self.starved or 'none'})\n  {self.knobs}")


class RankProbe:
    """Wraps one rank's scheduling, forward, sampling and dummy allocation to see each pass."""

    def __init__(self, engine: LLMEngine, padding):
        self.engine, self.padding = engine, padding
        self.reset()
        schedule, forward, sample, allocate = (engine.schedule_batch, engine.runner.forward,
                                               engine.runner.sample, padding._allocate)

        def schedule_batch():
            batch = schedule()
            self.scheduled_empty = batch.is_empty
            self.scheduled_real = any(not q.is_dummy for q in batch.requests)
            return batch

        def run(batch, pad_to=None):
            self.forward_batch = (list(batch.context), list(batch.generation), batch.decode_query_len)
            return forward(batch, pad_to)

        def sampled(batch, logits):
            out = sample(batch, logits)
            self.sampled = out
            return out

        def allocate_dummy(dummy, num_tokens):
            if padding.dummy is not None:
                self.errors.append(f"a second dummy ({dummy.dummy_phase}) while one is live")
            kv = engine.kv
            affordable = kv.blocks_for(num_tokens) <= kv.available_for(dummy)
            ok = allocate(dummy, num_tokens)
            self.allocs.append((dummy.dummy_phase, ok, affordable))
            return ok

        engine.schedule_batch, engine.runner.forward, engine.runner.sample = schedule_batch, run, sampled
        padding._allocate = allocate_dummy

    def reset(self) -> None:
        self.scheduled_empty = None
        self.scheduled_real = False
        self.forward_batch = None
        self.sampled = {}
        self.allocs = []
        self.errors = []


class Simulation:
    def __init__(self, seed: int, knobs: Knobs | None = None, passes: int = 400, drain: int | None = None):
        self.seed = seed
        self.rng = random.Random(seed)
        self.knobs = knobs or random_knobs(self.rng)
        self.passes = passes
        self.drain = drain or 2 * self.knobs.lease + 100
        self.table = cycle_table(self.rng, 320, TOKENS)
        self.clock = SimClock()
        k = self.knobs
        self.engines = []
        for r in range(k.ranks):
            hold = None
            if k.role == "context":
                puller = SimPuller(random.Random(seed * 1000 + r), k.lease)
                hold = lambda kv, puller=puller: KVHold(kv, puller, k.lease, clock=self.clock)  # noqa: E731
            self.engines.append(LLMEngine(k.engine_config(), model=TableModel(self.table), kv_hold=hold))
        self.fleet = LockstepFleet(self.engines, pad_empty_batch=k.pad_empty_batch)
        self.probes = [RankProbe(e, x.padding) for e, x in zip(self.engines, self.fleet.executors)]
        self.expected = [RankStats() for _ in self.engines]  # the counters as the probes saw them
        self.finished = [0] * k.ranks
        self.live: dict[str, int] = {}  # request id -> rank
        self.starved_until = [0] * k.ranks
        self.completions: list[tuple[int, int, str]] = []  # (pass, rank, request id) of started transfers
        self.n = 0
        self.pass_no = 0
        self.last_progress = 0
        self.states: set = set()
        self.violations: dict[str, Violation] = {}  # the first of each kind
        self.longest_stall = 0  # passes in a row without a real token while unstarved work waited
        self.coverage: collections.Counter = collections.Counter()  # what the events and passes reached

    # -- events between passes -------------------------------------------------------------------
    def _request(self, rank: int):
        e, rng = self.engines[rank], self.rng
        limit = min(e.config.max_request_tokens, 40)
        prompt = rng.randint(1, limit - 1)
        max_tokens = rng.randint(1, min(limit - prompt, 12))
        greedy = rng.random() < 0.8
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7,
                                temperature=0.0 if greedy else 0.8, seed=None if greedy else rng.randint(0, 99))
        self.n += 1
        return e.make_request([rng.randrange(TOKENS) for _ in range(prompt)], params, f"s{self.seed}-{self.n}")

    def _events(self, arrivals: bool) -> dict[int, list]:
        rng, k, new = self.rng, self.knobs, {}
        if arrivals and rng.random() < 0.15:
            cap = k.max_num_active_requests
            size = rng.choice([1, 2, max(1, cap - 1), cap, cap + 1, 2 * cap + 1])
            target = rng.randrange(k.ranks) if rng.random() < 0.6 else None
            self.coverage["burst above the cap on one rank" if size > cap and target is not None
                          else "burst"] += 1
            loads = [[e.num_active_real + len(e.pending) + len(new.get(r, [])), 0] for r, e in enumerate(self.engines)]
            for _ in range(size):
                rank = target if target is not None else pick_rank([tuple(x) for x in loads])
                loads[rank][0] += 1
                try:
                    req = self._request(rank)
                except InvalidRequestError as exc:
                    self._violate("error", f"validation refused a request drawn within its limit: {exc}")
                    return new
                new.setdefault(rank, []).append(req)
                self.live[req.request_id] = rank
        if arrivals and self.live and rng.random() < 0.03:
            rid = rng.choice(sorted(self.live))
            if self.engines[self.live[rid]].abort(rid):
                self.coverage["abort"] += 1
                self.finished[self.live[rid]] += 1
                del self.live[rid]
        for r in range(k.ranks):
            if self._starved(r) and (not arrivals or self.pass_no >= self.starved_until[r]):
                self.starved_until[r] = 0
                del self.engines[r].scheduler.capacity.admit  # the fault's override goes: it admits again
            elif arrivals and not self._starved(r) and rng.random() < 0.01:
                self.starved_until[r] = self.pass_no + rng.randint(1, 60)
                faults.apply("starve", self.engines[r])
                self.coverage["starve fault"] += 1
        if k.role == "context":
            if arrivals and rng.random() < 0.05:
                r = rng.randrange(k.ranks)
                held = sorted(self.engines[r].kv_hold.held)
                if held:
                    rid = rng.choice(held)
                    self.engines[r].kv_hold.lookup(rid)  # a transfer starts reading the blocks...
                    if rng.random() < 0.5:  # ...and completes, or is abandoned
                        self.completions.append((self.pass_no + rng.randint(1, k.lease), r, rid))
                    else:
                        self.coverage["transfer abandoned"] += 1
            for due in [c for c in self.completions if c[0] <= self.pass_no]:
                self.completions.remove(due)
                self.engines[due[1]].kv_hold.puller_complete(due[2])
        return new

    # -- checks after a pass ---------------------------------------------------------------------
    def _violate(self, kind: str, message: str) -> None:
        if kind not in self.violations:
            self.violations[kind] = Violation(self.seed, self.pass_no, kind, message, self.knobs,
                                       [r for r in range(self.knobs.ranks) if self._starved(r)])

    def _starved(self, r: int) -> bool:
        return self.starved_until[r] > 0

    def _check(self, results, gathered_before: int, work_before: list[bool]) -> None:
        k = self.knobs
        fleet_has_work = results[0].fleet_has_work
        ran = results[0].ran
        if any(x.ran != ran or x.fleet_has_work != fleet_has_work for x in results):
            self._violate("error", "ranks disagree on whether the pass ran")
        gathered = self.fleet.comm.gathered[gathered_before:]
        votes = gathered[1] if fleet_has_work else None
        tokens = 0
        runnable = [r for r, probe in enumerate(self.probes) if probe.scheduled_real]
        for r, (e, probe, exp, res) in enumerate(zip(self.engines, self.probes, self.expected, results)):
            for err in probe.errors:
                self._violate("leak", f"rank {r}: {err}")
            exp.iterations += 1
            exp.forward_steps += ran
            if fleet_has_work:
                exp.empty_batch_iterations += bool(probe.scheduled_empty)
                exp.forward_vetoed += (not ran) and any(size > 0 for size, _ in votes)
            for phase, ok, affordable in probe.allocs:
                outcome = ("committed" if ran else "rolled_back") if ok else \
                    ("unaffordable" if not affordable else "failed")
                exp.padding_dummies[(phase, outcome)] += 1
                self.coverage[f"{phase} dummy {outcome}"] += 1
            if fleet_has_work and probe.scheduled_empty and e.num_active_real >= k.max_num_active_requests:
                self.coverage["empty batch at the active-request cap"] += 1
            if ran:
                context, generation, qlen = probe.forward_batch
                dummies = [q for q, _ in context if q.is_dummy] + [q for q in generation if q.is_dummy]
                if len(dummies) > 1:
                    self._violate("leak", f"rank {r}: {len(dummies)} dummies in one batch")
                exp.prompt_tokens += sum(n for q, n in context if not q.is_dummy)
                decodes = [q for q in generation if not q.is_dummy]
                exp.spec_decode_draft_tokens += (qlen - 1) * len(decodes)
                if qlen > 1:
                    accepted = sum(len(probe.sampled[q]) - 1 for q in decodes)
                    exp.spec_decode_accepted_tokens += accepted
                    self.coverage["draft tokens accepted"] += accepted > 0
            for out in res.outputs:
                exp.generation_tokens += len(out.new_token_ids)
                if out.finished:
                    self.finished[r] += 1
                    self.live.pop(out.request_id, None)
            self._check_counters(r, e, exp, self.finished[r])
            self._check_kv(r, e)
            tokens += e.stats.prompt_tokens + e.stats.generation_tokens
            probe.reset()
        progressed = tokens > self._tokens
        self._tokens = tokens
        # P1: no rank with a real batch is ever vetoed (the seed's stall: one rank's empty batch
        # vetoes the forward of peers that could run)
        if fleet_has_work and not ran and runnable:
            self._violate("vetoed", f"rank(s) {runnable} had a real batch and were vetoed (votes {votes})")
        # P2: real work on a rank that is not starved progresses within the bound
        if progressed or not any(w and not self._starved(r) for r, w in enumerate(work_before)):
            self.last_progress = self.pass_no
        else:
            gap = self.pass_no - self.last_progress
            self.longest_stall = max(self.longest_stall, gap)
            if gap > self.bound:
                self._violate("stall", f"no real token for {gap} passes (bound {self.bound}) while rank(s) "
                                       f"{[r for r, w in enumerate(work_before) if w]} had work")
        self.states.add(self._state(votes, ran))

    @property
    def bound(self) -> int:
        """Passes in a row that may go without a real token while a rank that is not starved has
        work: none on aggregated ranks; on context ranks, until the held KV a waiting request needs
        is released — within two leases of the last real token (docs/adp.md)."""
        return 2 * self.knobs.lease - 1 if self.knobs.role == "context" else 0

    def _check_counters(self, r: int, e: LLMEngine, exp: RankStats, finished: int) -> None:
        s = e.stats
        for name in ("iterations", "forward_steps", "forward_vetoed", "empty_batch_iterations", "prompt_tokens",
                     "generation_tokens", "spec_decode_draft_tokens", "spec_decode_accepted_tokens"):
            if getattr(s, name) != getattr(exp, name):
                self._violate("accounting", f"rank {r}: {name} is {getattr(s, name)}, the probes saw "
                                            f"{getattr(exp, name)}")
        if s.padding_dummies != exp.padding_dummies:
            diff = {key: (s.padding_dummies[key], n) for key, n in exp.padding_dummies.items()
                    if s.padding_dummies[key] != n}
            self._violate("accounting", f"rank {r}: padding dummies (counted, seen): {diff}")
        if sum(s.requests_finished.values()) != finished:
            self._violate("accounting", f"rank {r}: {sum(s.requests_finished.values())} finished counted, "
                                        f"{finished} seen")

    def _check_kv(self, r: int, e: LLMEngine) -> None:
        kv, padding = e.kv, self.fleet.executors[r].padding
        if padding.dummy is not None or any(q.is_dummy for q in e.active):
            self._violate("leak", f"rank {r}: a dummy outlived its pass")
        held = [h.request for h in e.kv_hold.held.values()] if e.kv_hold else []
        owners = [q for q in e.active if not q.is_dummy] + held
        for q in owners:
            if len(q.block_table) != kv.blocks_for(q.num_computed_tokens):
                self._violate("leak", f"rank {r}: {q.request_id} ({q.state.value}) holds {len(q.block_table)} "
                                      f"blocks for {q.num_computed_tokens} computed tokens")
        tables = [b for q in owners for b in q.block_table]
        if len(tables) != len(set(tables)) or 0 in tables or kv.num_used_blocks != len(tables):
            self._violate("leak", f"rank {r}: {kv.num_used_blocks} blocks used, requests hold {len(tables)}")
        promised = sum(max(0, q.reserved_blocks - len(q.block_table)) for q in owners)
        if kv._unallocated_reservations != promised:
            self._violate("leak", f"rank {r}: {kv._unallocated_reservations} blocks promised, requests "
                                  f"are owed {promised}")
        if kv.num_free_blocks - promised < kv.padding_reserve_blocks:
            self._violate("leak", f"rank {r}: the padding reserve was taken")
        if e.kv_hold is not None:
            now = self.clock.now
            for rid, h in e.kv_hold.held.items():
                due = now >= h.deadline and (h.transfer_deadline is None or now >= h.transfer_deadline)
                if due or e.kv_hold.puller.at.get(rid, NEVER) <= now:
                    self._violate("leak", f"rank {r}: held KV of {rid} outlived its lease or its pull")
        if not e.active and not e.pending and not held and kv.num_used_blocks:
            self._violate("leak", f"rank {r}: idle with no held KV but {kv.num_used_blocks} blocks used")

    def _state(self, votes, ran) -> tuple:
        def bucket(n):
            return min(n, 3)

        ranks = []
        for r, e in enumerate(self.engines):
            waiting = sum(1 for q in e.active if q.state is RequestState.WAITING)
            running = e.num_active_real - waiting
            held = len(e.kv_hold.held) if e.kv_hold else 0
            free = e.kv.num_available_blocks
            ranks.append((bucket(len(e.pending)), bucket(waiting), bucket(running), bucket(held),
                          0 if free == 0 else 1 if free < e.kv.num_blocks // 2 else 2, self._starved(r),
                          None if votes is None else bucket(votes[r][0])))
        return self.knobs.role, self.knobs.draft_tokens > 0, ran, tuple(sorted(ranks))

    # -- the run ---------------------------------------------------------------------------------
    def _one_pass(self, arrivals: bool) -> None:
        new = self._events(arrivals)
        work = [e.num_active_real + len(e.pending) + len(new.get(r, [])) > 0 for r, e in enumerate(self.engines)]
        gathered_before = len(self.fleet.comm.gathered)
        self.clock.now = float(self.pass_no)
        results = self.fleet.step(new)
        self._check(results, gathered_before, work)
        self.pass_no += 1

    @property
    def fatal(self) -> bool:
        """Progress violations are recorded and the run goes on (to see how long a stall lasts);
        anything else ends it."""
        return any(kind not in ("vetoed", "stall") for kind in self.violations)

    def run(self) -> list[Violation]:
        self._tokens = 0
        try:
            for _ in range(self.passes):
                self._one_pass(arrivals=True)
                if self.fatal:
                    return list(self.violations.values())
            # No more events: everything must finish and every block return. P2 keeps checking
            # progress; this bounds the drain by each live request's worst case, one after another.
            drain = self.drain * (1 + len(self.live))
            for _ in range(drain):
                if self._idle():
                    break
                self._one_pass(arrivals=False)
                if self.fatal:
                    return list(self.violations.values())
            if not self._idle():
                self._violate("leak", f"{len(self.live)} requests still live {drain} passes after the "
                                      "events stopped")
        except Exception as exc:  # a crash inside a pass is a finding too
            self._violate("error", repr(exc))
        finally:
            self.fleet.close()
        return list(self.violations.values())

    def _idle(self) -> bool:
        return not self.live and all(not e.kv_hold or not e.kv_hold.held for e in self.engines) \
            and all(e.kv.num_used_blocks == 0 for e in self.engines)


@dataclass
class SearchReport:
    runs: int = 0
    passes: int = 0
    states: set = field(default_factory=set)
    violations: list[Violation] = field(default_factory=list)
    longest_stall: int = 0
    coverage: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0


def search(seeds, pad: bool = True, reserve: bool = True, passes: int = 400, budget_s: float | None = None,
           stop_when=lambda report: False) -> SearchReport:
    """Run the simulation for each seed (random knobs with the given padding switches) until the
    seeds or the budget run out, or `stop_when(report)` after a run that found something."""
    logging.getLogger("adpfleet.runtime.executor.padding").setLevel(logging.ERROR)  # once per rank is noise here
    report, start = SearchReport(), time.monotonic()
    for seed in seeds:
        if budget_s is not None and time.monotonic() - start > budget_s:
            break
        sim = Simulation(seed, random_knobs(random.Random(seed), pad, reserve), passes=passes)
        found = sim.run()
        report.runs += 1
        report.passes += sim.pass_no
        report.states |= sim.states
        report.longest_stall = max(report.longest_stall, sim.longest_stall)
        report.coverage += sim.coverage
        for e in sim.engines:
            if e.kv_hold is not None:
                report.coverage["hold expired at its lease"] += e.kv_hold.expired
                report.coverage["hold pulled"] += e.kv_hold.pulled
        report.violations += found
        if found and stop_when(report):
            break
    report.seconds = time.monotonic() - start
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deep", action="store_true", help="search for --minutes instead of the CI budget")
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--passes", type=int, default=400, help="passes of events per run (then a drain)")
    ap.add_argument("--no-padding", action="store_true", help="post-schedule padding off (must find the stall)")
    ap.add_argument("--no-padding-reserve", action="store_true")
    args = ap.parse_args(argv)
    budget = args.minutes * 60 if args.deep else 60.0
    seeds = range(args.seed, args.seed + 10 ** 9)
    report = search(seeds, pad=not args.no_padding, reserve=not args.no_padding_reserve, passes=args.passes,
                    budget_s=budget)
    kinds = {}
    for v in report.violations:
        kinds[v.kind] = kinds.get(v.kind, 0) + 1
    print(f"{report.runs} runs, {report.passes} passes, {len(report.states)} distinct abstract states, "
          f"{report.seconds:.0f} s; violations: {kinds or 'none'}; longest stall of unstarved work: "
          f"{report.longest_stall} passes")
    print("reached:", ", ".join(f"{k} {n}" for k, n in sorted(report.coverage.items())))
    for v in report.violations[:5]:
        print(v)
    return 1 if report.violations and not args.no_padding else 0


if __name__ == "__main__":
    sys.exit(main())
