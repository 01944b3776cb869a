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
admits, greedy and seeded sampled requests, aborts (also of prompts whose KV is held), `starve`
faults on a rank for a while, KV transfers pulled soon, late or never (until the lease), transfers
that start and are abandoned. Admission and the placement of pulled KV are head-of-line: the
first request that waits must not fit, and none is taken past it.

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

import torch

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import RequestState
from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams
from adpfleet.runtime.executor import faults
from adpfleet.runtime.executor.adp_router import place
from adpfleet.runtime.executor.kv_hold import KVHold
from adpfleet.runtime.metrics import RankStats
from lockstep import LockstepFleet, TableModel, cycle_table

TOKENS = 32  # prompts draw from the first TOKENS ids; the table model cycles among them
NEVER = float("inf")


@dataclass
class Knobs:
    """One random configuration of a fleet."""
    ranks: int
    role: str  # "aggregated", "context" or "generation"
    kv_blocks: int
    tokens_per_block: int
    max_num_tokens: int
    max_batch_size: int
    max_num_active_requests: int
    draft_tokens: int
    lease: int  # passes a held KV waits for its pull
    prefix_cache: bool = True
    pad_empty_batch: bool = True
    padding_reserve: bool = True

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model="tiny-dense", kv_blocks=self.kv_blocks, tokens_per_block=self.tokens_per_block,
                            max_num_tokens=self.max_num_tokens, max_batch_size=self.max_batch_size,
                            max_num_active_requests=self.max_num_active_requests,
                            draft_tokens=self.draft_tokens, padding_reserve=self.padding_reserve,
                            prefix_cache=self.prefix_cache)


def random_knobs(rng: random.Random, pad: bool = True, reserve: bool = True) -> Knobs:
    while True:
        draft = rng.choice([0, 0, 1, 2, 3])
        k = Knobs(ranks=rng.randint(2, 4), role=rng.choice(["aggregated", "context", "context", "generation"]),
                  kv_blocks=rng.randint(2, 24), tokens_per_block=rng.choice([1, 2, 4, 8]),
                  max_num_tokens=rng.randint(1 + draft, 48), max_batch_size=rng.randint(1, 8),
                  max_num_active_requests=rng.randint(1, 8), draft_tokens=draft,
                  lease=rng.choice([3, 10, 30]), prefix_cache=rng.random() < 0.85,
                  pad_empty_batch=pad, padding_reserve=reserve)
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
    kind: str  # "vetoed" (P1), "stall" (P2), "leak", "accounting", "cache", "order", "error"
    message: str
    knobs: Knobs
    starved: list[int]  # ranks under a `starve` fault at the time

    def __str__(self) -> str:
        return (f"seed {self.seed}, pass {self.passes}: {self.kind}: {self.message} (starved ranks: "
                f"{self.starved or 'none'})\n  {self.knobs}")


class PulledKV:
    """A prompt's KV as a generation rank receives it from a context server (the table model
    keeps one value per slot)."""

    def __init__(self, num_tokens: int):
        self.k = self.v = torch.zeros(1, num_tokens, 1, 1)

    def release(self) -> None:
        pass


class RankProbe:
    """Wraps one rank's fetch, scheduling, forward, sampling and dummy allocation to see each pass,
    and records what each KV block was written with: per slot, the tokens its K/V were computed
    from (the prefix through that slot's token), as the attention of a real model would make them.
    Checks what can only be seen at the moment it happens (probe errors are (kind, message))."""

    def __init__(self, engine: LLMEngine, padding, coverage: collections.Counter):
        self.engine, self.padding, self.coverage = engine, padding, coverage
        self.content: dict[int, list] = {}  # block -> per slot, the prefix its K/V were computed from
        self.writes: collections.Counter = collections.Counter()  # block -> passes that wrote it
        self.reset()
        self._fetch, self._place, self._schedule = engine.fetch, engine._place_prefilled, engine.schedule_batch
        self._forward, self._sample, self._allocate = engine.runner.forward, engine.runner.sample, padding._allocate
        engine.fetch, engine._place_prefilled, engine.schedule_batch = self.fetch, self.place_prefilled, self.schedule
        engine.runner.forward, engine.runner.sample, padding._allocate = self.forward, self.sample, self.allocate_dummy

    def reset(self) -> None:
        self.scheduled_empty = None
        self.scheduled_real = False
        self.forward_batch = None
        self.sampled = {}
        self.allocs = []
        self.errors = []
        self.placed = []  # outputs of pulled KV placed by the fetch: a first token made elsewhere
        self.placed_requests = []
        self.admitted = []  # (request, tokens found in the prefix cache)

    # -- the wrapped phases ----------------------------------------------------------------------
    def fetch(self):
        queue = self.engine.active + list(self.engine.pending)  # in arrival order
        outputs = self._fetch()
        self.placed += outputs
        self.coverage["pulled KV placed"] += len(outputs)
        # placement is head-of-line, as admission: the first pulled request still waiting must not
        # fit (cached blocks counting as free), and none behind it was placed past it
        waited = [q for q in self.engine.active if q.kv_payload is not None and q.state is RequestState.WAITING]
        if waited and self._fits_without_cache(waited[0]):
            self.errors.append(("cache", f"pulled {waited[0].request_id} was not placed although its KV fits "
                                         "the blocks that are free or only cached"))
        self._check_order(queue, self.placed_requests, "placed")
        return outputs

    def place_prefilled(self, req):
        self.placed_requests.append(req)
        out = self._place(req)
        if req.block_table:  # still live (its first token did not finish it)
            self._write(req, 0, req.prompt_token_ids)
        return out

    def schedule(self):
        e, kv = self.engine, self.engine.kv
        waiting = [q for q in e.active if q.state is RequestState.WAITING and q.remote_kv is None]
        full_cache = not kv._free and bool(kv._evictable)
        batch = self._schedule()
        self.admitted = [(q, q.num_computed_tokens) for q in waiting if q.state is not RequestState.WAITING]
        self._check_hits()
        self.coverage["admitted from a full cache"] += full_cache and bool(self.admitted)
        waited = [q for q in waiting if q.state is RequestState.WAITING]
        starved = "admit" in vars(e.scheduler.capacity)  # a `starve` fault admits nothing, by design
        if waited and not starved and self._fits_without_cache(waited[0]):
            self.errors.append(("cache", f"{waited[0].request_id} was not admitted although it fits the blocks "
                                         "that are free or only cached"))
        self._check_order(waiting, [q for q, _ in self.admitted], "admitted")
        self.scheduled_empty = batch.is_empty
        self.scheduled_real = any(not q.is_dummy for q in batch.requests)
        return batch

    def forward(self, batch, pad_to=None):
        self.forward_batch = (list(batch.context), list(batch.generation), batch.decode_query_len)
        for q, chunk in zip(batch.requests, self.engine.runner.chunks(batch)):
            self._write(q, chunk.start_pos, chunk.token_ids)
        return self._forward(batch, pad_to)

    def sample(self, batch, logits):
        self.sampled = self._sample(batch, logits)
        return self.sampled

    def allocate_dummy(self, dummy, num_tokens):
        if self.padding.dummy is not None:
            self.errors.append(("leak", f"a second dummy ({dummy.dummy_phase}) while one is live"))
        kv = self.engine.kv
        need = kv.blocks_for(num_tokens)
        affordable, fits, from_cache = need <= kv.available_for(dummy), need <= self._capacity_without_cache(), \
            need > len(kv._free)
        ok = self._allocate(dummy, num_tokens)
        if fits and not ok:
            self.errors.append(("cache", f"the {dummy.dummy_phase} dummy ({need} blocks) was not allocated "
                                         "although it fits the blocks that are free or only cached"))
        self.coverage[f"{dummy.dummy_phase} dummy from the cache"] += ok and from_cache
        self.allocs.append((dummy.dummy_phase, ok, affordable))
        return ok

    # -- what it records and checks ----------------------------------------------------------------
    def _write(self, req, start: int, tokens: list[int]) -> None:
        """`tokens` of `req` computed at positions start..: each slot's K/V come from the
        request's tokens before `start` and the tokens of this query up to its own."""
        bs, before = self.engine.kv.tokens_per_block, tuple(req.all_token_ids[:start])
        for j in range(len(tokens)):
            p = start + j
            block = req.block_table[p // bs]
            self.content.setdefault(block, [None] * bs)[p % bs] = before + tuple(tokens[:j + 1])
            self.writes[block] += 1

    def _check_hits(self) -> None:
        """A prefix hit hands the request blocks whose K/V were computed from its own tokens."""
        kv, bs = self.engine.kv, self.engine.kv.tokens_per_block
        for q, hit in self.admitted:
            if not hit:
                continue
            self.coverage["prefix hit"] += 1
            self.coverage["hit on a block another request holds"] += any(kv._refs[b] > 1 for b in q.block_table)
            self.coverage["hit up to the last token's block"] += hit == (q.num_prompt_tokens - 1) // bs * bs
            tokens = q.all_token_ids
            wrong = [p for p in range(hit) if self.content.get(q.block_table[p // bs], [None] * bs)[p % bs]
                     != tuple(tokens[:p + 1])]
            if wrong:
                self.errors.append(("cache", f"the prefix hit of {q.request_id} gave it K/V of other tokens at "
                                             f"positions {wrong}"))

    def _check_order(self, queue, taken, what: str) -> None:
        """Head-of-line: of `queue` (arrival order), none `taken` this pass came after one still waiting."""
        taken = set(taken)
        waits = [i for i, q in enumerate(queue) if q.state is RequestState.WAITING and q not in taken]
        passed = [q.request_id for i, q in enumerate(queue) if q in taken and waits and i > waits[0]]
        if passed:
            self.errors.append(("order", f"{passed} {what} past {queue[waits[0]].request_id}, which waits"))

    def _capacity_without_cache(self) -> int:
        """The blocks free and not promised were no block cached: counted from the requests' own
        tables and reservations, not from the manager's counts."""
        e = self.engine
        owners = e.active + ([h.request for h in e.kv_hold.held.values()] if e.kv_hold else [])
        blocks = {b for q in owners for b in q.block_table}
        promised = sum(max(0, q.reserved_blocks - len(q.block_table)) for q in owners)
        return e.kv.num_blocks - len(blocks) - promised

    def _fits_without_cache(self, req) -> bool:
        e = self.engine
        need = e.kv.blocks_for(e.scheduler.capacity.kv_tokens(req))
        return need <= self._capacity_without_cache() - e.kv.padding_reserve_blocks


class Simulation:
    def __init__(self, seed: int, knobs: Knobs | None = None, passes: int = 400, drain: int | None = None):
        self.seed = seed
        self.rng = random.Random(seed)
        self.knobs = knobs or random_knobs(self.rng)
        self.passes = passes
        self.drain = drain or 2 * self.knobs.lease + 100
        self.table = cycle_table(self.rng, 320, TOKENS)
        # shared-prefix workloads: a few system prompts, and conversations that continue
        self.system_prompts = [[self.rng.randrange(TOKENS) for _ in range(self.rng.randint(4, 40))] for _ in range(3)]
        self.conversations: collections.deque[list[int]] = collections.deque(maxlen=16)  # finished: prompt + answer
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
        self.coverage: collections.Counter = collections.Counter()  # what the events and passes reached
        self.probes = [RankProbe(e, x.padding, self.coverage) for e, x in zip(self.engines, self.fleet.executors)]
        self._chains: dict[tuple, bytes] = {}  # a prefix -> the hash of its last block (block_hash.py)
        self._verified: dict[tuple, int] = {}  # (rank, hash, block) -> the block's writes when it was checked
        self.expected = [RankStats() for _ in self.engines]  # the counters as the probes saw them
        self.finished = [0] * k.ranks
        self.live: dict[str, int] = {}  # request id -> rank
        self.requests: dict[str, object] = {}  # request id -> the live request
        self.starved_until = [0] * k.ranks
        self.completions: list[tuple[int, int, str]] = []  # (pass, rank, request id) of started transfers
        self.n = 0
        self.pass_no = 0
        self.last_progress = 0
        self.states: set = set()
        self.violations: dict[str, Violation] = {}  # the first of each kind
        self.longest_stall = 0  # passes in a row without a real token while unstarved work waited

    # -- events between passes -------------------------------------------------------------------
    def _request(self, rank: int):
        e, rng = self.engines[rank], self.rng
        limit = min(e.config.max_request_tokens, 40)
        prompt = self._prompt(rng.randint(1, limit - 1))
        max_tokens = rng.randint(1, min(limit - len(prompt), 12))
        greedy = rng.random() < 0.8
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7,
                                temperature=0.0 if greedy else 0.8, seed=None if greedy else rng.randint(0, 99))
        self.n += 1
        req = e.make_request(prompt, params, f"s{self.seed}-{self.n}")
        if self.knobs.role == "generation":  # its prompt ran on a context server: it comes with its KV
            req.remote_kv, req.first_token_id, req.kv_payload = ("sim", req.request_id), self.table[prompt[-1]], \
                PulledKV(len(prompt))
        self.requests[req.request_id] = req
        return req

    def _prompt(self, length: int) -> list[int]:
        """At most `length` tokens: random, or sharing a prefix: one of the run's system prompts,
        or a finished conversation (prompt and answer), each maybe cut short, then a few more."""
        rng = self.rng
        kind = rng.random()
        if kind < 0.4:
            return [rng.randrange(TOKENS) for _ in range(length)]
        head = rng.choice(self.conversations) if kind > 0.75 and self.conversations else rng.choice(self.system_prompts)
        if rng.random() < 0.3:
            head = head[:rng.randint(1, len(head))]
        return (head + [rng.randrange(TOKENS) for _ in range(rng.choice([0, 1, rng.randint(2, 8)]))])[:length]

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
                # the server's rule with nothing cached and one unit per request: the least-loaded rank
                rank = target if target is not None else place([n for n, _ in loads], [1] * k.ranks, [0] * k.ranks)
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
                self._finished(rid)
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
            if arrivals and rng.random() < 0.02:
                self._abort_held(rng.randrange(k.ranks))
            for due in [c for c in self.completions if c[0] <= self.pass_no]:
                self.completions.remove(due)
                self.engines[due[1]].kv_hold.puller_complete(due[2])
        return new

    def _abort_held(self, r: int) -> None:
        """The client of a held prompt left (or the router cancelled): its KV goes at once, unless a
        transfer is reading it (then when that transfer ends)."""
        hold = self.engines[r].kv_hold
        if not hold.held:
            return
        rid = self.rng.choice(sorted(hold.held))
        h = hold.held[rid]
        reading = h.transfer_deadline is not None and self.clock.now < h.transfer_deadline
        if not self.engines[r].abort(rid) or (rid in hold.held) != reading:
            self._violate("leak", f"rank {r}: the abort of held {rid} did not free it at once (a transfer "
                                  f"reading it: {reading})")
        self.coverage["held KV aborted"] += 1

    # -- checks after a pass ---------------------------------------------------------------------
    def _violate(self, kind: str, message: str) -> None:
        if kind not in self.violations:
            self.violations[kind] = Violation(self.seed, self.pass_no, kind, message, self.knobs,
                                       [r for r in range(self.knobs.ranks) if self._starved(r)])

    def _starved(self, r: int) -> bool:
        return self.starved_until[r] > 0

    def _check(self, results, gathered_before: int, work_before: list[bool]) -> None:
        fleet_has_work = results[0].fleet_has_work
        ran = results[0].ran
        if any(x.ran != ran or x.fleet_has_work != fleet_has_work for x in results):
            self._violate("error", "ranks disagree on whether the pass ran")
        gathered = self.fleet.comm.gathered[gathered_before:]
        votes = gathered[1] if fleet_has_work else None
        tokens = 0
        placed = any(probe.placed for probe in self.probes)  # a pulled request's KV placed is progress too
        runnable = [r for r, probe in enumerate(self.probes) if probe.scheduled_real]
        for r, (e, probe, res) in enumerate(zip(self.engines, self.probes, results)):
            for kind, err in probe.errors:
                self._violate(kind, f"rank {r}: {err}")
            self._account(r, res, ran, votes)
            self._check_counters(r, e, self.expected[r], self.finished[r])
            self._check_kv(r, e)
            self._check_cache(r, e)
            tokens += e.stats.prompt_tokens + e.stats.generation_tokens
            probe.reset()
        progressed = tokens > self._tokens or placed
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

    def _account(self, r: int, res, ran: bool, votes) -> None:
        """The counters as rank r's probe saw this pass."""
        e, probe, exp = self.engines[r], self.probes[r], self.expected[r]
        exp.iterations += 1
        exp.forward_steps += ran
        if votes is not None:  # the fleet had work
            exp.empty_batch_iterations += bool(probe.scheduled_empty)
            exp.forward_vetoed += (not ran) and any(size > 0 for size, _ in votes)
            if probe.scheduled_empty and e.num_active_real >= self.knobs.max_num_active_requests:
                self.coverage["empty batch at the active-request cap"] += 1
        for phase, ok, affordable in probe.allocs:
            outcome = ("committed" if ran else "rolled_back") if ok else \
                ("unaffordable" if not affordable else "failed")
            exp.padding_dummies[(phase, outcome)] += 1
            self.coverage[f"{phase} dummy {outcome}"] += 1
        if e.kv.prefix_cache:
            exp.prefix_cache_queries += sum(q.num_prompt_tokens for q, _ in probe.admitted)
            exp.prefix_cache_hits += sum(hit for _, hit in probe.admitted)
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
            if not any(out is first for first in probe.placed):  # a pulled request's first token came with it
                exp.generation_tokens += len(out.new_token_ids)
            if out.finished:
                self.finished[r] += 1
                self._finished(out.request_id)

    def _finished(self, request_id: str) -> None:
        self.live.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is not None and req.finish_reason in ("stop", "length"):
            self.conversations.append(req.all_token_ids)  # the next turn may continue it

    @property
    def bound(self) -> int:
        """Passes in a row that may go without a real token while a rank that is not starved has
        work: none on aggregated ranks; on context ranks, until the held KV a waiting request needs
        is released — within two leases of the last real token (docs/adp.md)."""
        return 2 * self.knobs.lease - 1 if self.knobs.role == "context" else 0

    def _check_counters(self, r: int, e: LLMEngine, exp: RankStats, finished: int) -> None:
        s = e.stats
        for name in ("iterations", "forward_steps", "forward_vetoed", "empty_batch_iterations", "prompt_tokens",
                     "generation_tokens", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
                     "prefix_cache_queries", "prefix_cache_hits"):
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
        self._check_blocks(r, kv, owners)
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

    def _check_blocks(self, r: int, kv, owners) -> None:
        """Every block is exactly one of: free (uncached), free and cached (evictable), or held, and
        held as many times as requests hold it; only cached blocks are shared."""
        refs = collections.Counter(b for q in owners for b in q.block_table)
        free, evictable = list(kv._free), list(kv._evictable)
        if 0 in refs or 0 in free or 0 in evictable or 0 in kv._hash_of:
            self._violate("leak", f"rank {r}: the null block was handed out")
        both = (set(free) | set(evictable)) & set(refs)
        if both:
            self._violate("leak", f"rank {r}: block(s) {sorted(both)} both free and referenced")
        if len(free) + len(evictable) + len(refs) != kv.num_blocks or len(set(free) | set(evictable)) != \
                len(free) + len(evictable) or kv.num_used_blocks != len(refs):
            self._violate("leak", f"rank {r}: {len(free)} free + {len(evictable)} cached free + {len(refs)} held "
                                  f"blocks of {kv.num_blocks} ({kv.num_used_blocks} counted used)")
        miscounted = {b: (kv._refs[b], refs[b]) for b in range(1, kv.num_blocks + 1) if kv._refs[b] != refs[b]}
        if miscounted:
            self._violate("leak", f"rank {r}: reference counts (counted, held) {miscounted}")
        if any(b not in kv._hash_of for b in evictable) or any(b in kv._hash_of for b in free):
            self._violate("cache", f"rank {r}: the free list and the evictable blocks disagree with the cache")
        shared = [b for b, n in refs.items() if n > 1 and b not in kv._hash_of]
        if shared:
            self._violate("cache", f"rank {r}: block(s) {shared} shared by requests but not cached")

    def _check_cache(self, r: int, e: LLMEngine) -> None:
        """A cached block's K/V were computed from exactly the tokens its hash names: from its
        chained-hash prefix, every slot of it, at its position. Nothing is cached with the cache
        off, nor on a generation rank (its KV was pulled, see docs/adp.md)."""
        kv, probe, bs = e.kv, self.probes[r], e.kv.tokens_per_block
        if kv._cached and (not kv.prefix_cache or self.knobs.role == "generation"):
            self._violate("cache", f"rank {r}: {len(kv._cached)} blocks cached with the cache off or pulled")
        if {b: key for key, b in kv._cached.items()} != kv._hash_of:
            self._violate("cache", f"rank {r}: the hash -> block and block -> hash maps disagree")
        self.coverage["prefix cache full (no uncached free block)"] += not kv._free and bool(kv._evictable)
        for key, b in kv._cached.items():
            if self._verified.get((r, key, b)) == probe.writes[b]:
                continue  # neither entered again nor written since it was checked
            slots = probe.content.get(b) or [None]
            prefix = slots[-1]
            if (prefix is None or len(prefix) % bs or self._chain(prefix, bs) != key
                    or any(slots[j] != prefix[:len(prefix) - bs + j + 1] for j in range(bs))):
                self._violate("cache", f"rank {r}: cached block {b} holds K/V of {slots}, not of the tokens of "
                                       "its hash")
            self._verified[(r, key, b)] = probe.writes[b]

    def _chain(self, prefix: tuple, tokens_per_block: int) -> bytes:
        if prefix not in self._chains:
            self._chains[prefix] = block_hash.block_hashes(prefix, tokens_per_block)[-1]
        return self._chains[prefix]

    def _state(self, votes, ran) -> tuple:
        def bucket(n):
            return min(n, 3)

        ranks = []
        for r, e in enumerate(self.engines):
            waiting = sum(1 for q in e.active if q.state is RequestState.WAITING)
            running = e.num_active_real - waiting
            held = len(e.kv_hold.held) if e.kv_hold else 0
            free = e.kv.num_available_blocks
            cached = 0 if not e.kv._evictable else 1 if e.kv._free else 2  # 2: every free block is cached
            ranks.append((bucket(len(e.pending)), bucket(waiting), bucket(running), bucket(held),
                          0 if free == 0 else 1 if free < e.kv.num_blocks // 2 else 2, cached, self._starved(r),
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
        report.coverage[f"{sim.knobs.role} role"] += 1
        for e in sim.engines:
            report.coverage["cached block evicted"] += e.kv.evictions
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
