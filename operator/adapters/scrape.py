"""Reading a server's /metrics: the only network stall detection does, and what it yields.

`scrape` fetches one server's exposition and returns a `Scrape`: the per-rank samples as its
engine's dialect reads them (adapters/dialects/: adpfleet's unless told), or, for every failure —
refused, timed out, an HTTP error, a body that is not that engine's exposition — the reason, so the
server is judged Unreachable, never stalled.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Mapping, Sequence

import aiohttp

from adpfleet.contract.metrics import RankSample
from adpfleet.operator.adapters.dialects import ADPFLEET, Dialect
from adpfleet.operator.adapters.dialects.exposition import MAX_METRICS_BYTES, ScrapeError
from adpfleet.operator.resource import names
TIMEOUT_FRACTION = 0.8     # of a scrape interval: a scrape is over before the next one is due ...
MIN_TIMEOUT_SECONDS = 1.0  # ... but gets at least this long ...
MAX_TIMEOUT_SECONDS = 5.0  # ... and at most this long (a slow /metrics is a sick server)
KEEPALIVE_SECONDS = 75.0   # an idle connection to a server is kept this long (longer than most scrape intervals)


def timeout_for(interval_seconds: float) -> float:
    """How long one scrape of a fleet scraped every `interval_seconds` may take."""
    return min(max(MIN_TIMEOUT_SECONDS, interval_seconds * TIMEOUT_FRACTION), MAX_TIMEOUT_SECONDS)


@dataclass(frozen=True)
class Scrape:
    """One scrape of one server: `ranks` when it succeeded, `error` when it did not. `at` is the
    operator's wall clock (seconds) when the scrape was taken."""
    at: float
    ranks: Mapping[int, RankSample] | None = None
    error: str | None = None
    refused: bool = False  # the connection could not be made: nothing listens at the address
    # a server over several pods (one scrape per pod, merged): the pod each rank was scraped from.
    # None for a one-pod server, whose ranks are all its pod's.
    rank_pods: Mapping[int, str] | None = None
    lockstep: bool = True  # its engine's ranks step together (judged as one) or each alone (its dialect's)

    @property
    def ok(self) -> bool:
        return self.ranks is not None

    def total(self, attr: str) -> float:
        """The ranks' sum of a field, over the ranks that know it (None is unknown, not 0)."""
        return sum(v for v in (getattr(r, attr) for r in self.ranks.values()) if v is not None)

    @property
    def tokens(self) -> float:
        return sum(r.tokens for r in self.ranks.values())

    @property
    def work(self) -> float | None:
        """The ranks' work; None while any rank's is unknown."""
        works = [r.work for r in self.ranks.values()]
        return None if None in works else sum(works)

    def progressed_since(self, before: "Scrape") -> bool:
        """Whether any rank did real work since `before` (a rank that is new since then did not)."""
        return any(r in before.ranks and s.progressed_since(before.ranks[r]) for r, s in self.ranks.items())

    def rank(self, rank: int) -> "Scrape":
        """This scrape of one rank alone (a failed one as it is), judged as a whole: how a rank that
        steps on its own is judged."""
        if not self.ok:
            return self
        ranks = {rank: self.ranks[rank]} if rank in self.ranks else {}
        pods = {rank: self.rank_pods[rank]} if self.rank_pods and rank in self.rank_pods else None
        return replace(self, ranks=ranks, rank_pods=pods, lockstep=True)


def metrics_url(pod_ip: str, port: int = names.SERVER_HTTP_PORT) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/metrics"


async def scrape(session: aiohttp.ClientSession, url: str, timeout: float, clock=time.time,
                 dialect: Dialect = ADPFLEET) -> Scrape:
    """One GET of `url` on `session`'s kept-alive connections, read in `dialect` (the server's
    engine's: `dialects.dialect_for(engine)`), as a `Scrape` (never an exception)."""
    try:
        async with asyncio.timeout(timeout):
            body = await _get(session, url)
        if isinstance(body, str):
            return Scrape(at=clock(), error=body)
        at = clock()
        return Scrape(at=at, ranks=dialect.parse(body.decode("utf-8", errors="replace")), lockstep=dialect.lockstep)
    except TimeoutError:
        return Scrape(at=clock(), error=f"GET {url}: timed out after {timeout:g} s")
    except ScrapeError as e:
        return Scrape(at=clock(), error=f"GET {url}: {e}")
    except aiohttp.ClientConnectorError as e:
        return Scrape(at=clock(), error=f"GET {url}: {type(e).__name__}: {e.os_error or e}", refused=True)
    except aiohttp.ClientError as e:
        return Scrape(at=clock(), error=f"GET {url}: {type(e).__name__}: {e}".rstrip(": "))
    except OSError as e:
        return Scrape(at=clock(), error=f"GET {url}: {e}")


async def _get(session: aiohttp.ClientSession, url: str) -> bytes | str:
    """The body of a 200, or what was wrong. A kept-alive connection the server closed while it sat
    idle (uvicorn closes them after 5 s, about one scrape interval) is not the server failing:
    aiohttp (3.9 on) retries such a GET once on a new connection."""
    async with session.get(url, allow_redirects=False) as response:
        if response.status != 200:
            return f"GET {url}: HTTP {response.status}"
        if (response.content_length or 0) > MAX_METRICS_BYTES:
            return f"GET {url}: more than {MAX_METRICS_BYTES} bytes"
        chunks, size = [], 0  # read with a bound: the dialect would refuse it anyway
        async for chunk in response.content.iter_any():
            size += len(chunk)
            if size > MAX_METRICS_BYTES:
                return f"GET {url}: more than {MAX_METRICS_BYTES} bytes"
            chunks.append(chunk)
        return b"".join(chunks)


# (url, timeout, dialect) -> Scrape: an HttpScraper, or a test's script
Scraper = Callable[[str, float, Dialect], Awaitable[Scrape]]


async def scrape_pods(scraper: Scraper, pods: Sequence[tuple[str, str]], timeout: float,
                      dialect: Dialect = ADPFLEET) -> Scrape:
    """One scrape of a server from its pods, (name, ip) each, read in its engine's `dialect`: of its
    one pod as it is, or of every pod of a server over several pods as one (each pod exports its own
    ranks, numbered server-wide), keeping the pod each rank came from; a pod that cannot be scraped
    fails the whole, naming it."""
    if len(pods) == 1:
        return await scraper(metrics_url(pods[0][1]), timeout, dialect)
    parts = await asyncio.gather(*(scraper(metrics_url(ip), timeout, dialect) for _, ip in pods))
    failed = next(((name, part) for (name, _), part in zip(pods, parts) if not part.ok), None)
    if failed:
        return replace(failed[1], error=f"pod {failed[0]}: {failed[1].error}")
    return Scrape(at=min(part.at for part in parts),
                  ranks={r: sample for part in parts for r, sample in part.ranks.items()},
                  rank_pods={r: name for (name, _), part in zip(pods, parts) for r in part.ranks},
                  lockstep=all(part.lockstep for part in parts))


class HttpScraper:
    """Scrapes servers over kept-alive connections, one per server, reused from scrape to scrape:
    `await scraper(url, timeout, dialect)` is a `Scrape`, never an exception.

    aiohttp, not httpx: httpx's pool scans every pooled connection for each request, so with one
    connection per server a scrape's CPU grew with the fleet (docs/operator.md, Numbers: 300
    servers scraped every 5 s)."""

    def __init__(self, clock=time.time):
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use: an aiohttp session belongs to the running loop
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_SECONDS),
                trust_env=False, skip_auto_headers=("User-Agent", "Accept-Encoding"),  # plain text: no gzip to undo
                headers={"Accept": "text/plain"})
        return self._session

    async def __call__(self, url: str, timeout: float, dialect: Dialect = ADPFLEET) -> Scrape:
        return await scrape(self._client(), url, timeout, self.clock, dialect)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
