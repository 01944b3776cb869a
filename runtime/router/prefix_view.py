"""What the router believes each (server, rank) holds, from the servers' own snapshots.

Every `interval` seconds the poller reads `GET /internal/prefix_cache` (`serving/rank_routing.py`)
of every context and aggregated server in the pool, with the fleet's internal token, and keeps one
`ServerView` per server: the chained block hashes each rank's cache holds, each rank's pending
tokens, the server's imbalance bound. Nothing here is guessed from where the router sent requests,
except the load of one rank: the larger of its pending tokens in the snapshot and the tokens of
the requests this router has in flight on it (`PrefixViews.routed`: prefill still expected plus
max_tokens, from the choice until the request ends). So a burst between two snapshots spreads
instead of piling on the rank the last one showed idle, requests on their way count, and the
requests of other routers count through the snapshot.

**Staleness.** The server's snapshot lags a rank's cache by at most one pass plus the pipe
(`executor/rank_cache_view.py`); the router's copy is at most `interval` + one poll's round trip
older. A block believed present and gone costs the request its prefill, never a wrong answer (the
rank looks the prefix up in its own cache at admission). **How often it is wrong** is measured:
each request sent to a rank for its prefix leaves the last block it was expected to find; the
rank's next snapshot either holds it (`held`) or not (`missing`, the view was wrong or the block
was evicted before the request used it) — `adpfleet_router_prefix_predictions_total{outcome}`.

A server whose snapshot cannot be had (refused, unreachable, not the expected JSON, another hash
scheme) has no view: it is routed by load only, and each outcome is counted
(`adpfleet_router_prefix_snapshots_total{outcome}`) and logged when a server's outcome changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from adpfleet.runtime.engine import block_hash
from adpfleet.runtime.engine.cache_events import STORED
from adpfleet.runtime.executor.rank_cache_view import RankCacheView
from adpfleet.runtime.router.metrics import RouterMetrics
from adpfleet.runtime.router.pool import Endpoint, ServerPool
from adpfleet.runtime.serving.rank_routing import SNAPSHOT_PATH

log = logging.getLogger("adpfleet.router")

PREFIX_ROLES = ("context", "aggregated")  # generation servers pull their KV: chosen by load
# A request's end re-polls the server it ended on (at most one round every MIN_GAP_S); every interval a
# round polls them all; a request routed by prefix waits for the round that covers the last end, at most
# FRESH_WAIT_S.
MIN_GAP_S, FRESH_WAIT_S = 0.02, 0.05
POLL_TIMEOUT_S = 2.0  # a server slower than this to answer is unreachable for the round
_HEX_HASH = re.compile(r"[0-9a-f]{64}")


class BadSnapshot(ValueError):
    pass


@dataclass
class ServerView:
    """One server's snapshot: the same view of its ranks its own ADP dispatcher keeps."""
    tokens_per_block: int
    bound: float
    cache: RankCacheView  # the blocks each rank holds
    pending: list[int]  # pending tokens by rank, as the server counted them
    expected: list[tuple[int, bytes]] = field(default_factory=list)  # (rank, last block a request expects)

    def hits(self, hashes: Sequence[bytes]) -> list[int]:
        """Per rank, how many leading blocks of `hashes` it holds."""
        return self.cache.hits(hashes)

    def holds(self, rank: int, block: bytes) -> bool:
        return rank < len(self.pending) and self.cache.hits([block])[rank] == 1

    def load(self, routed: Sequence[int] = ()) -> list[int]:
        """Per rank, the larger of the snapshot's pending tokens and what this router has in flight there."""
        routed = list(routed) + [0] * (len(self.pending) - len(routed))
        return [max(p, r) for p, r in zip(self.pending, routed)]


def parse_snapshot(body) -> ServerView:
    """A snapshot's JSON as a view; BadSnapshot saying what is wrong with it otherwise."""
    if not isinstance(body, dict):
        raise BadSnapshot("not a JSON object")
    if body.get("hash") != block_hash.SCHEME:
        raise BadSnapshot(f"hash scheme {str(body.get('hash'))[:40]!r}, not {block_hash.SCHEME!r}")
    tpb, bound, ranks = body.get("tokens_per_block"), body.get("imbalance_bound"), body.get("ranks")
    if type(tpb) is not int or tpb < 1:
        raise BadSnapshot("'tokens_per_block' is not a positive integer")
    if type(bound) not in (int, float) or not bound >= 1:
        raise BadSnapshot("'imbalance_bound' is not a number of at least 1")
    if not isinstance(ranks, list) or not ranks:
        raise BadSnapshot("'ranks' is not a non-empty list")
    cache, pending = RankCacheView(len(ranks)), []
    for i, rank in enumerate(ranks):
        if not isinstance(rank, dict) or rank.get("rank") != i:
            raise BadSnapshot(f"'ranks[{i}]' is not rank {i}")
        blocks, tokens = rank.get("blocks"), rank.get("pending_tokens")
        if type(tokens) is not int or tokens < 0:
            raise BadSnapshot(f"'ranks[{i}].pending_tokens' is not a count")
        if not isinstance(blocks, list) or not all(isinstance(b, str) and _HEX_HASH.fullmatch(b) for b in blocks):
            raise BadSnapshot(f"'ranks[{i}].blocks' is not a list of 64 hex digits each")
        cache.apply(i, [(STORED, b) for b in blocks])
        pending.append(tokens)
    return ServerView(tpb, float(bound), cache, pending)


class PrefixViews:
    """The views of every server that answered its last poll, and the poller that refreshes them."""

    def __init__(self, pool: ServerPool, metrics: RouterMetrics, http: httpx.AsyncClient, headers: dict,
                 interval: float):
        self.pool, self.metrics, self.http, self.headers, self.interval = pool, metrics, http, headers, interval
        self.views: dict[Endpoint, ServerView] = {}
        self.routed: dict[Endpoint, list[int]] = {}  # tokens of this router's requests in flight, by rank
        self._outcome: dict[Endpoint, str] = {}  # the last outcome per server, to log changes only
        self._wake = asyncio.Event()  # a request ended on a server: poll it now, not at the interval
        self._ended: set[Endpoint] = set()  # servers a request ended on since the last round began
        self._rounds = [0, 0]  # poll rounds started, finished
        self._needed = 0  # the round that covers the last request ended
        self._round_done = asyncio.Event()

    async def poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        full_at = loop.time()  # when the next round polls every server, ends or not
        while True:
            self._wake.clear()
            every = loop.time() >= full_at
            only, self._ended = (None if every else self._ended), set()
            if every:
                full_at = loop.time() + self.interval
            self._rounds[0] += 1
            try:
                await self.poll_once(only)
            except Exception:  # noqa: BLE001 - a bug here must not freeze the view for good
                log.exception("polling the prefix-cache snapshots failed")
            self._rounds[1] += 1
            self._round_done.set()
            self._round_done = asyncio.Event()
            await asyncio.sleep(MIN_GAP_S)
            with contextlib.suppress(TimeoutError):  # woken by an end, or the full round is due
                await asyncio.wait_for(self._wake.wait(), max(0.0, full_at - loop.time()))

    def request_ended(self, ep: Endpoint) -> None:
        """A request ended on `ep` (its blocks are in its next snapshot): poll it again at once,
        and let `fresh` wait for that poll."""
        self._ended.add(ep)
        self._needed = self._rounds[0] + 1
        self._wake.set()

    async def fresh(self, limit: float = FRESH_WAIT_S) -> None:
        """Until a poll has started since the last request ended, for at most `limit` seconds: the
        next turn of a conversation, sent as the last one's answer ended, finds its blocks."""
        deadline = asyncio.get_running_loop().time() + limit
        while self._rounds[1] < self._needed:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._round_done.wait(), remaining)

    async def poll_once(self, only: set[Endpoint] | None = None) -> None:
        """Polls every server that takes requests by prefix, or those of them in `only`."""
        servers = [ep for ep in self.pool.endpoints() if ep.role in PREFIX_ROLES]
        for gone in self.views.keys() - set(servers):
            del self.views[gone]
        for gone in self.routed.keys() - set(servers):
            if not any(self.routed[gone]):
                del self.routed[gone]
        await asyncio.gather(*(self._poll(ep) for ep in servers if only is None or ep in only))

    async def _poll(self, ep: Endpoint) -> None:
        try:
            resp = await self.http.get(ep.url + SNAPSHOT_PATH, headers=self.headers, timeout=POLL_TIMEOUT_S)
            if resp.status_code != 200:
                outcome, why = "refused", f"HTTP {resp.status_code}"
            else:
                self._replace(ep, parse_snapshot(resp.json()))
                outcome, why = "ok", ""
        except httpx.HTTPError as e:
            outcome, why = "unreachable", repr(e)
        except ValueError as e:  # not JSON (json.JSONDecodeError), or BadSnapshot
            outcome, why = "bad_snapshot", str(e)[:200]
        if outcome != "ok":
            self.views.pop(ep, None)  # routed by load until it answers again
        self.metrics.prefix_snapshots.labels(outcome).inc()
        if self._outcome.get(ep) != outcome:
            level = logging.INFO if outcome == "ok" else logging.WARNING
            log.log(level, "prefix-cache snapshot of %s %s: %s%s", ep.role, ep.url, outcome,
                    f" ({why}); routed by load until it answers" if why else "")
            self._outcome[ep] = outcome

    def _replace(self, ep: Endpoint, view: ServerView) -> None:
        old = self.views.get(ep)
        if old is not None:
            self._check_predictions(old, view)
        self.views[ep] = view

    def _check_predictions(self, old: ServerView, new: ServerView) -> None:
        for rank, block in old.expected:
            self.metrics.prefix_predictions.labels("held" if new.holds(rank, block) else "missing").inc()

    def sent(self, ep: Endpoint, rank: int, tokens: int, expected_block: bytes | None) -> None:
        """The router sends `tokens` of work to (ep, rank), expecting it to hold `expected_block`."""
        routed = self.routed.setdefault(ep, [])
        routed += [0] * (rank + 1 - len(routed))
        routed[rank] += tokens
        view = self.views.get(ep)
        if view is not None and expected_block is not None:
            view.expected.append((rank, expected_block))

    def ended(self, ep: Endpoint, rank: int, tokens: int) -> None:
        """A request `sent` ended (answered, failed or abandoned)."""
        routed = self.routed.get(ep)
        if routed is not None and rank < len(routed):
            routed[rank] = max(0, routed[rank] - tokens)


def snapshot_headers(internal_headers: Callable[[str | None], dict], api_key: str | None) -> dict:
    """What the poller sends: the internal token, else (a fleet sharing one API key) that key."""
    return internal_headers(f"Bearer {api_key}" if api_key else None)
