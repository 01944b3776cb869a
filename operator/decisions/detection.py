"""Stall verdicts from a server's own metrics (docs/remediation.md): keep a short window of scrapes
(`adapters/scrape.py` takes them), judge the window.

`judge(samples)` is a pure function of the scrapes of one server incarnation. A server is
**stalled** when, over the whole stall window, its ranks produced no real tokens (prompt +
generation, never dummies) while it had work at every scrape (requests running or waiting, or KV
transfers in flight), and that held at `confirmations` consecutive scrapes. The signature says how:

- `hung`: no rank's loop advanced over the last scrape interval (a frozen rank blocks every peer in
  the next collective, so every rank's `iterations` stops). A loop that has not advanced for the
  whole window is stalled even when its (frozen) counters show no work: an idle loop spins, and
  requests sent to a hung rank never reach its counters;
- `vetoed`: the loop spins but the `can_queue` vote vetoes the forward — the ranks involved are the
  ones whose empty-batch count keeps rising (docs/adp.md, the ADP stall);
- `transfer`: KV blocks stay held for transfers that never complete (the ranks involved hold
  them): either the loop runs without vetoes, or the ranks scheduling empty batches are the ones
  whose KV cache is full, mostly of blocks held for those transfers — the transfers are why they
  starve;
- anything else that spins without producing tokens is reported as `vetoed` with no starving rank.

A transfer stall is the holder's own only when the blocks it keeps are ones a pull has begun on (a
pull that hangs, or one that completed and was never freed) for the whole stretch. Blocks that no
generation server has begun to pull are the generation side's symptom: the server is **Blocked**,
never stalled, and `attribute` names the generation servers it waits on.

Never stalled: an idle server (no work), a server whose work started less than a window ago, a
server with fewer scrapes than the window needs (starting up, just restarted), a server whose work
is unknown (an engine that has not published its queue yet), and a server whose latest scrape
failed — that is `Unreachable`, its own state, never acted on as a stall.

Other engines are read through their dialect (adapters/dialects/). A field the engine does not
export is unknown (None), never 0: progress is also a change of the engine's step marks (vLLM counts
a prompt's tokens only when its prefill is done, so a long prefill shows as steps), and an engine
without loop counters can show only `hung` (work, and no step for the window). An engine whose ranks
step on their own (not `lockstep`: vLLM's DP engines) has each rank judged alone, and the server's
verdict is its worst rank's: summing ranks would hide one engine's hang behind its peer's progress.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

from adpfleet.contract.metrics import RankSample
from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.decisions.observed import ServerView
from adpfleet.operator.resource.vocabulary import ServerState, Signature

SCRAPE_JITTER = 0.25  # of a scrape interval: scrapes are not exactly evenly spaced
KV_FULL = 0.8  # a rank whose KV cache is this full (mostly held for transfers) starves for want of KV
MAX_SAMPLES = 512  # scrapes kept per server at most, whatever the window (a bound on memory)
PULLING_ROLE = "generation"  # the role whose servers pull the KV a context server holds


@dataclass(frozen=True)
class StallVerdict:
    """What one server is doing, with the metric values that show it. A stalled (or suspect)
    server always has a signature: there is no fallback to guess one later."""
    server: str
    role: str
    state: ServerState
    at: float
    reason: str
    signature: Signature | None = None  # set exactly when the server has no progress to show
    ranks: tuple[int, ...] = ()      # the ranks involved (starving, holding KV, or not advancing)
    since: float | None = None       # stalled: the scrape from which nothing moved
    evidence: Mapping[str, object] = field(default_factory=dict)
    # a server over several pods: the pod holding each involved rank (empty for a one-pod server,
    # whose ranks are all in the pod `server` names)
    pods: Mapping[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state is ServerState.STALLED and self.signature is None:
            raise ValueError(f"a stalled verdict needs a signature: {self.server} {self.reason}")

    @property
    def stalled(self) -> bool:
        return self.state is ServerState.STALLED

    def summary(self) -> str:
        """One line for Events, status and logs."""
        head = f"{self.server} ({self.role}) {self.state.value}"
        if self.signature:
            head += f" [{self.signature.value}" + (f", {self.ranks_text()}" if self.ranks else "") + "]"
        return f"{head}: {self.reason}"

    def ranks_text(self) -> str:
        """The involved ranks, and for a server over several pods the pod holding them (a worker's
        rank is found on the worker: `kubectl logs` of the leader does not show it):
        "ranks 1,2" or "ranks 0 on pod mn-generation-0-0 and 1 on pod mn-generation-0-1"."""
        if not self.pods:
            return f"ranks {','.join(map(str, self.ranks))}"
        by_pod: dict[str, list[int]] = {}
        for r in self.ranks:
            by_pod.setdefault(self.pods.get(r, "?"), []).append(r)
        return "ranks " + " and ".join(f"{','.join(map(str, rs))} on pod {pod}" for pod, rs in by_pod.items())


def judge(server: str, role: str, samples: Sequence[Scrape], *, window_seconds: float,
          interval_seconds: float, confirmations: int = 2) -> StallVerdict:
    """The verdict for the newest of `samples` (oldest first, one server incarnation or several:
    a counter reset or a change of the rank set starts a new incarnation and older scrapes are not
    compared with it).

    Confirmation: the no-progress test also held at the `confirmations - 1` scrapes before the
    newest, with no failed scrape in between. Each test needs a baseline scrape at least the window
    minus those confirming intervals (and a quarter interval of scrape jitter) old, so the first
    test's baseline — taken after the last token — is a full window old when the last confirmation
    comes: a stall is called after a whole window without tokens (less the jitter allowance), and at
    most about one scrape interval after that."""
    if not samples:
        return StallVerdict(server, role, ServerState.WARMING_UP, 0.0, "not scraped yet")
    latest = samples[-1]
    if not latest.ok:
        failures = 0
        for s in reversed(samples):
            if s.ok:
                break
            failures += 1
        return StallVerdict(server, role, ServerState.UNREACHABLE, latest.at,
                            f"scrape failed ({failures} in a row): {latest.error}",
                            evidence={"consecutive_failures": failures})
    if not latest.lockstep:
        return _worst([judge(server, role, [s.rank(r) for s in samples], window_seconds=window_seconds,
                             interval_seconds=interval_seconds, confirmations=confirmations)
                       for r in sorted(latest.ranks)])
    scrapes = _current_incarnation(samples)
    coverage = max(0.0, window_seconds - (max(0, confirmations - 1) + SCRAPE_JITTER) * interval_seconds)
    assessments = []
    for end in range(len(scrapes) - 1, -1, -1):  # newest first
        assessments.append(_assess(scrapes, end, coverage))
        if len(assessments) >= max(1, confirmations) or assessments[-1][0] is not ServerState.STALLED:
            break
    state, reason, base_index = assessments[0]
    confirmed = (len(assessments) >= max(1, confirmations) and all(a[0] is ServerState.STALLED for a in assessments)
                 and all(s.ok for s in samples[-len(assessments):]))  # consecutive: no failed scrape between
    if state is ServerState.STALLED and confirmed:
        # the evidence spans the whole confirmed stretch: from the oldest confirming test's baseline
        base_index = assessments[-1][2]
        reason = _no_progress(scrapes[base_index], latest)
    if state is ServerState.STALLED and not confirmed:
        state, reason = ServerState.SUSPECT, reason + f"; not yet confirmed ({_count_stalled(assessments)}/" \
                                                f"{confirmations} scrapes)"
    if state in (ServerState.STALLED, ServerState.SUSPECT) and base_index is not None:
        return _describe(server, role, state, reason, scrapes[base_index:], latest)
    return StallVerdict(server, role, state, latest.at, reason, evidence=_basic_evidence(latest))


# The server's verdict when its ranks are judged alone: the first of these states any rank is in.
_SEVERITY = (ServerState.STALLED, ServerState.BLOCKED, ServerState.SUSPECT, ServerState.PROGRESSING,
             ServerState.IDLE, ServerState.WARMING_UP)


def _worst(verdicts: list[StallVerdict]) -> StallVerdict:
    """The server's verdict from its ranks' own: the most severe, naming every rank in that state."""
    worst = min(verdicts, key=lambda v: _SEVERITY.index(v.state))
    alike = [v for v in verdicts if v.state is worst.state]
    return replace(worst, ranks=tuple(sorted({r for v in alike for r in v.ranks})),
                   pods={r: pod for v in alike for r, pod in v.pods.items()})


def _count_stalled(assessments) -> int:
    n = 0
    for a in assessments:
        if a[0] is not ServerState.STALLED:
            break
        n += 1
    return n


def _current_incarnation(samples: Sequence[Scrape]) -> list[Scrape]:
    """The successful scrapes since the server last (re)started, as far as its counters tell."""
    ok = [s for s in samples if s.ok]
    start = 0
    for i in range(1, len(ok)):
        before, after = ok[i - 1].ranks, ok[i].ranks
        if set(before) != set(after) or any(_went_back(before[r], after[r]) for r in after):
            start = i
    return ok[start:]


def _went_back(before: RankSample, after: RankSample) -> bool:
    """A counter that went down: the rank restarted in between (unknown counters tell nothing)."""
    for attr in ("iterations", "prompt_tokens", "generation_tokens"):
        a, b = getattr(before, attr), getattr(after, attr)
        if a is not None and b is not None and b < a:
            return True
    return False


def _assess(scrapes: list[Scrape], end: int, coverage: float) -> tuple[ServerState, str, int | None]:
    """Progress over the window that ends at scrapes[end]: (state, reason, baseline index)."""
    last = scrapes[end]
    base = None  # the newest earlier scrape at least `coverage` old: a window spans two scrapes or more
    for i in range(end - 1, -1, -1):
        if last.at - scrapes[i].at >= coverage:
            base = i
            break
    if last.work is None:
        unknown = ",".join(str(r) for r, s in last.ranks.items() if s.work is None)
        return ServerState.WARMING_UP, f"work of rank(s) {unknown} unknown (no queue gauges published yet)", None
    if last.work <= 0:
        # An idle loop spins (~50 passes/s). One that has not moved for a whole window is hung, and
        # its counters are the frozen snapshot of its last pass: work sent to it since is invisible.
        # (An engine without a loop counter, or whose idle loop does not step, is simply idle.)
        if base is not None and end > base and all(
                r in scrapes[base].ranks and _loop_stopped(scrapes[base].ranks[r], s)
                for r, s in last.ranks.items()) and not last.progressed_since(scrapes[base]):
            return ServerState.STALLED, _no_progress(scrapes[base], last), base
        return ServerState.IDLE, "no requests and no KV transfers", None
    # the stretch the verdict speaks for: from the baseline (or the oldest scrape) to `end`
    first = base if base is not None else 0
    work_from = first
    for i in range(end, first - 1, -1):
        if scrapes[i].work is None or scrapes[i].work <= 0:  # work not known to be pending is not pending
            work_from = i + 1
            break
    if last.progressed_since(scrapes[first]):
        moved = last.tokens - scrapes[first].tokens
        what = f"{moved:.0f} real tokens" if moved > 0 else "engine steps (no new tokens yet: a prompt in prefill)"
        return ServerState.PROGRESSING, f"{what} in the last {last.at - scrapes[first].at:.0f} s", None
    if work_from > first:
        return ServerState.SUSPECT, (f"no real tokens, work pending for {last.at - scrapes[work_from].at:.0f} s "
                               f"(less than the window)"), work_from
    if base is None:
        if end == 0:
            return ServerState.WARMING_UP, "one scrape so far", None
        return ServerState.SUSPECT, (f"no real tokens with work pending for {last.at - scrapes[0].at:.0f} s "
                               f"of the {coverage:.0f} s needed"), 0
    return ServerState.STALLED, _no_progress(scrapes[base], last), base


def _loop_stopped(before: RankSample, after: RankSample) -> bool:
    """The rank's loop passes did not advance (False when the engine has no loop counter)."""
    return before.iterations is not None and after.iterations is not None and after.iterations <= before.iterations


def _no_progress(base: Scrape, last: Scrape) -> str:
    """Why a stretch from `base` to `last` is a stall, with its length."""
    if last.work <= 0:
        return (f"no rank's loop advanced for {last.at - base.at:.0f} s (an idle loop spins; its queue counters "
                f"are frozen)")
    return f"no real tokens for {last.at - base.at:.0f} s while having work"


def _describe(server: str, role: str, state: ServerState, reason: str, stretch: list[Scrape],
              latest: Scrape) -> StallVerdict:
    """Signature, ranks involved and evidence of a no-progress stretch (oldest..latest)."""
    moved = _Moved.over(stretch, latest)
    # an engine without loop counters shows no signature but `hung`: work, and no step
    hung = not moved.has_loop or (len(stretch) >= 2 and moved.stopped)
    signature, involved, how = _signature(moved, latest, hung=hung)
    if signature is Signature.TRANSFER and not _holds_pulled_kv(stretch, involved):
        # Every held block waits for a pull that no generation server has begun: the generation
        # side is not taking its work. Its stall, not this server's (attribute() names it).
        state = ServerState.BLOCKED
        waiting = sum(latest.ranks[r].kv_transfers_awaiting_pull for r in involved)
        how = f"{waiting:.0f} KV blocks held for pulls no generation server has begun"
    pods = {r: latest.rank_pods[r] for r in involved if r in latest.rank_pods} if latest.rank_pods else {}
    return StallVerdict(server, role, state, latest.at, f"{reason}; {how}", signature=signature,
                        ranks=involved, since=stretch[0].at, evidence=_evidence(moved, stretch, latest), pods=pods)


@dataclass(frozen=True)
class _Moved:
    """How each rank's counters moved over a stretch (from its oldest scrape; `iterations_recent`:
    over its last interval), and the KV held for transfers at its start and end; a rank whose engine
    does not export a counter is absent from its dict."""
    ranks: list[int]
    iterations_recent: dict[int, float]
    iterations: dict[int, float]
    vetoed: dict[int, float]
    steps: dict[int, float]
    empty: dict[int, float]
    held: dict[int, float]
    held_before: dict[int, float]

    @classmethod
    def over(cls, stretch: list[Scrape], latest: Scrape) -> "_Moved":
        base = stretch[0]
        prev = stretch[-2] if len(stretch) >= 2 else base
        ranks = sorted(latest.ranks)

        def delta(attr: str, a: Scrape = base) -> dict[int, float]:
            """Each rank's change of `attr`, for the ranks where it is known at both ends."""
            return {r: now - then for r in ranks if r in a.ranks
                    for now, then in [(getattr(latest.ranks[r], attr), getattr(a.ranks[r], attr))]
                    if now is not None and then is not None}
        return cls(ranks, delta("iterations", prev), delta("iterations"), delta("forward_vetoed"),
                   delta("forward_steps"), delta("empty_batch_iterations"),
                   _known(latest, ranks, "kv_transfers_in_flight"), _known(base, ranks, "kv_transfers_in_flight"))

    @property
    def has_loop(self) -> bool:
        """The engine counts its loop passes (adpfleet does; vLLM does not)."""
        return bool(self.iterations)

    @property
    def stopped(self) -> bool:
        """No rank's loop advanced in the last interval."""
        return max(self.iterations_recent.values(), default=0) <= 0


def _signature(moved: _Moved, latest: Scrape, *, hung: bool) -> tuple[Signature, tuple[int, ...], str]:
    """(signature, ranks involved, how the stretch shows it), in the module docstring's order."""
    ranks, vetoed, empty, held = moved.ranks, moved.vetoed, moved.empty, moved.held
    if hung and not moved.has_loop:
        return Signature.HUNG, tuple(r for r in ranks if (latest.ranks[r].work or 0) > 0), \
            "no engine step while having work"
    if hung:
        loops = {r: latest.ranks[r].iterations for r in moved.iterations}
        return Signature.HUNG, tuple(r for r in ranks if loops.get(r) == min(loops.values())), \
            "no rank's loop advanced in the last interval"
    if max(vetoed.values(), default=0) > 0 and max(vetoed.values()) >= max(moved.steps.values(), default=0):
        involved = tuple(r for r in ranks if empty.get(r, 0) > 0)
        # the starving ranks' KV is (nearly) full, and mostly of blocks held for transfers
        starved_by_transfers = involved and all(
            held.get(r, 0) > 0 and held[r] >= 0.5 * latest.ranks[r].kv_cache_blocks_used
            and latest.ranks[r].kv_cache_blocks_used >= KV_FULL * latest.ranks[r].kv_cache_capacity_blocks > 0
            for r in involved)
        if starved_by_transfers:  # the empty batches come from KV held for transfers that never complete
            return Signature.TRANSFER, involved, (
                f"forwards vetoed {max(vetoed.values()):.0f} times: rank(s) {','.join(map(str, involved))} "
                f"schedule empty batches, their KV held for transfers that do not complete "
                f"({sum(held[r] for r in involved):.0f} blocks)")
        return Signature.VETOED, involved, f"forwards vetoed {max(vetoed.values()):.0f} times" + (
            f", rank(s) {','.join(map(str, involved))} scheduling empty batches" if involved else "")
    if any(v > 0 for v in held.values()) and all(moved.held_before.get(r, 0) > 0 or v == 0 for r, v in held.items()):
        return Signature.TRANSFER, tuple(r for r, v in held.items() if v > 0), \
            f"{sum(held.values()):.0f} KV blocks held for transfers that do not complete"
    return Signature.VETOED, tuple(r for r in ranks if empty.get(r, 0) > 0), "the loop runs but produces no real tokens"


def _known(scrape: Scrape, ranks: list[int], attr: str) -> dict[int, float]:
    """Each rank's `attr` where the engine exports it."""
    return {r: v for r in ranks if r in scrape.ranks for v in [getattr(scrape.ranks[r], attr)] if v is not None}


def _evidence(moved: _Moved, stretch: list[Scrape], latest: Scrape) -> dict[str, object]:
    base = stretch[0]
    evidence = {
        "window_seconds": round(latest.at - base.at, 1),
        "scrapes": len(stretch),
        "real_tokens_delta": latest.tokens - base.tokens,
        "iterations_delta": _by_rank(moved.iterations),
        "forward_steps_delta": _by_rank(moved.steps),
        "forward_vetoed_delta": _by_rank(moved.vetoed),
        "empty_batch_iterations_delta": _by_rank(moved.empty),
        **_basic_evidence(latest),
    }
    evidence = {k: v for k, v in evidence.items() if v != {}}  # counters the engine does not export
    progress_times = [latest.ranks[r].last_progress_timestamp for r in moved.ranks
                      if latest.ranks[r].last_progress_timestamp is not None]
    if progress_times:
        evidence["seconds_since_last_progress"] = round(latest.at - max(progress_times), 1)
    return evidence


def _holds_pulled_kv(stretch: list[Scrape], involved: tuple[int, ...]) -> bool:
    """Whether the ranks kept, at every scrape of the stretch, blocks whose pull had begun (a pull
    that hangs, or one that completed and was never freed): the holder's own transfer stall."""
    return all(sum(s.ranks[r].kv_pulled_held for r in involved if r in s.ranks) > 0 for s in stretch)


def attribute(verdicts: Iterable[StallVerdict], servers: Iterable[ServerView]) -> list[StallVerdict]:
    """`verdicts` with each Blocked one naming the peers it waits on: the generation servers that
    are stalled or suspect (not completing their pulls), or that were replaced or are not Ready
    since the stretch began (the blocks were held for the pulls of the server they replaced)."""
    verdicts = list(verdicts)
    by_name = {v.server: v for v in verdicts}
    out = []
    for v in verdicts:
        if v.state is not ServerState.BLOCKED:
            out.append(v)
            continue
        peers = []
        for s in servers:
            if s.role != PULLING_ROLE:
                continue
            peer = by_name.get(s.name)
            if peer is not None and peer.state in (ServerState.STALLED, ServerState.SUSPECT):
                peers.append(f"{s.name} ({peer.state.value.lower()})")
            elif s.terminating or not s.ready or (s.created is not None and v.since is not None
                                                   and s.created >= v.since):
                peers.append(f"{s.name} (restarted or not Ready)")
        who = ("waiting on " + ", ".join(sorted(peers))) if peers else \
            "no generation server is stalled now; the blocks are freed when their lease expires"
        out.append(replace(v, reason=f"{v.reason}: the generation side's stall, not this server's ({who})"))
    return out


def _basic_evidence(latest: Scrape) -> dict[str, object]:
    return {
        "requests_running": _by_rank({r: s.requests_running for r, s in latest.ranks.items()}),
        "requests_waiting": _by_rank({r: s.requests_waiting for r, s in latest.ranks.items()}),
        "kv_transfers_in_flight": _by_rank({r: s.kv_transfers_in_flight for r, s in latest.ranks.items()}),
        "kv_cache_blocks_used": _by_rank({r: s.kv_cache_blocks_used for r, s in latest.ranks.items()}),
    }


def _by_rank(values: Mapping[int, float | None]) -> dict[str, float]:
    """Per-rank values for evidence; an unknown one is left out."""
    return {str(r): (int(v) if float(v).is_integer() else round(v, 3)) for r, v in sorted(values.items())
            if v is not None}


def evidence_text(evidence: Mapping[str, object], limit: int = 600) -> str:
    """Evidence as `key=value` pairs, short enough for a status record or an Event."""
    parts = []
    for key, value in evidence.items():
        if isinstance(value, Mapping):
            value = "/".join(f"r{r}:{v}" for r, v in value.items())
        parts.append(f"{key}={value}")
    text = " ".join(parts)
    return text if len(text) <= limit else text[:limit - 1] + "…"


class SampleWindows:
    """The recent scrapes of each server, keyed by server name and reset when the pod behind the
    name changes (a new uid is a new incarnation). Keeps only what `judge` can use."""

    def __init__(self) -> None:
        self._servers: dict[str, tuple[str, deque[Scrape]]] = {}

    def add(self, server: str, pod_uid: str, scrape: Scrape, *, keep_seconds: float, max_samples: int = MAX_SAMPLES) -> None:
        uid, samples = self._servers.get(server, (None, None))
        if uid != pod_uid or samples is None:
            samples = deque(maxlen=max_samples)
            self._servers[server] = (pod_uid, samples)
        samples.append(scrape)
        while len(samples) > 2 and scrape.at - samples[1].at >= keep_seconds:
            samples.popleft()  # keep one scrape older than keep_seconds: the window's baseline

    def samples(self, server: str) -> tuple[Scrape, ...]:
        return tuple(self._servers.get(server, ("", ()))[1])

    def reset(self, server: str) -> None:
        self._servers.pop(server, None)

    def retain(self, servers: Iterable[str]) -> None:
        keep = set(servers)
        for name in list(self._servers):
            if name not in keep:
                del self._servers[name]


def keep_seconds(window_seconds: float, interval_seconds: float, confirmations: int = 2) -> float:
    """How much history `judge` needs: the window, the confirmations, and a scrape of slack."""
    return window_seconds + (confirmations + 1) * interval_seconds
