"""Reading a server's /metrics: the only network stall detection does, and what it yields.

`scrape` fetches one server's exposition and returns a `Scrape`: the per-rank samples
(`parse_metrics`), or, for every failure — refused, timed out, an HTTP error, a body that is not
an adpfleet exposition — the reason, so the server is judged Unreachable, never stalled.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Mapping, Sequence

import aiohttp

from adpfleet.operator.resource import names

MAX_METRICS_BYTES = 4 * 1024 * 1024  # a server's /metrics is a few KiB; more is not a server of ours
TIMEOUT_FRACTION = 0.8     # of a scrape interval: a scrape is over before the next one is due ...
MIN_TIMEOUT_SECONDS = 1.0  # ... but gets at least this long ...
MAX_TIMEOUT_SECONDS = 5.0  # ... and at most this long (a slow /metrics is a sick server)
KEEPALIVE_SECONDS = 75.0   # an idle connection to a server is kept this long (longer than most scrape intervals)


def timeout_for(interval_seconds: float) -> float:
    """How long one scrape of a fleet scraped every `interval_seconds` may take."""
    return min(max(MIN_TIMEOUT_SECONDS, interval_seconds * TIMEOUT_FRACTION), MAX_TIMEOUT_SECONDS)


# metric name -> RankSample field; every server exports all of them for every rank (docs/adp.md lists them)
_REQUIRED = {
    "adpfleet_iterations_total": "iterations",
    "adpfleet_forward_steps_total": "forward_steps",
    "adpfleet_forward_vetoed_total": "forward_vetoed",
    "adpfleet_empty_batch_iterations_total": "empty_batch_iterations",
    "adpfleet_prompt_tokens_total": "prompt_tokens",
    "adpfleet_generation_tokens_total": "generation_tokens",
    "adpfleet_requests_running": "requests_running",
    "adpfleet_requests_waiting": "requests_waiting",
    "adpfleet_kv_transfers_in_flight": "kv_transfers_in_flight",
}
_OPTIONAL = {
    "adpfleet_kv_cache_blocks_used": "kv_cache_blocks_used",
    "adpfleet_kv_cache_capacity_blocks": "kv_cache_capacity_blocks",
    "adpfleet_kv_transfers_awaiting_pull": "kv_transfers_awaiting_pull",
    "adpfleet_last_progress_timestamp_seconds": "last_progress_timestamp",
    # latency histograms: only their sums and counts (means over an interval), never the buckets
    "adpfleet_time_to_first_token_seconds_sum": "ttft_sum",
    "adpfleet_time_to_first_token_seconds_count": "ttft_count",
    "adpfleet_inter_token_latency_seconds_sum": "itl_sum",
    "adpfleet_inter_token_latency_seconds_count": "itl_count",
}
_WANTED = {**_REQUIRED, **_OPTIONAL}
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_RANK = re.compile(r'(?:^|,)\s*rank\s*=\s*"([^"]*)"')


class ScrapeError(ValueError):
    """The text is not a server's /metrics: what is wrong, in one line."""


@dataclass(frozen=True)
class RankSample:
    """One rank's counters and gauges at one scrape."""
    iterations: float = 0.0
    forward_steps: float = 0.0
    forward_vetoed: float = 0.0
    empty_batch_iterations: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests_running: float = 0.0
    requests_waiting: float = 0.0
    kv_transfers_in_flight: float = 0.0
    kv_cache_blocks_used: float = 0.0
    kv_cache_capacity_blocks: float = 0.0
    kv_transfers_awaiting_pull: float = 0.0  # of the held blocks, those no generation server has begun to pull
    last_progress_timestamp: float | None = None
    ttft_sum: float = 0.0   # adpfleet_time_to_first_token_seconds: sum and count of observations
    ttft_count: float = 0.0
    itl_sum: float = 0.0    # adpfleet_inter_token_latency_seconds
    itl_count: float = 0.0

    @property
    def tokens(self) -> float:
        """Real tokens processed or produced: the only measure of progress."""
        return self.prompt_tokens + self.generation_tokens

    @property
    def work(self) -> float:
        return self.requests_running + self.requests_waiting + self.kv_transfers_in_flight

    @property
    def kv_pulled_held(self) -> float:
        """Held blocks whose pull began (under way, or done and not freed): the holder's own part."""
        return max(0.0, self.kv_transfers_in_flight - self.kv_transfers_awaiting_pull)


def parse_metrics(text: str) -> dict[int, RankSample]:
    """Per-rank samples from a server's Prometheus text. Raises `ScrapeError` for anything that is
    not a complete adpfleet server exposition (garbage, HTML, truncated, a metric missing).

    A scrape of every rank of every server every few seconds is most of the operator's work at
    scale, so the labels and values of only the families it uses are parsed. Every line's shape is
    still checked (garbage is refused, not skipped): by one regular expression over the whole text
    in the common case, and line by line, to name the bad line, when that does not match."""
    if len(text) > MAX_METRICS_BYTES:
        raise ScrapeError(f"/metrics is {len(text)} bytes, more than {MAX_METRICS_BYTES}: not an adpfleet server")
    if _EXPOSITION.fullmatch(text) is not None:
        wanted = ((m.group(1), m.group(2) or "", float(m.group(3))) for m in _WANTED_SAMPLE.finditer("\n" + text))
    else:
        wanted = _wanted_line_by_line(text)
    values: dict[int, dict[str, float]] = {}
    seen: dict[int, set[str]] = {}
    for name, labels, value in wanted:
        attr = _WANTED[name]
        match = _RANK.search(labels)
        try:
            rank = int(match.group(1)) if match else None
        except ValueError:
            rank = None
        if rank is None:
            raise ScrapeError(f"{name} has no integer 'rank' label: {{{labels}}}")
        if math.isnan(value) or math.isinf(value) or (value < 0 and attr != "last_progress_timestamp"):
            raise ScrapeError(f"{name}{{rank={rank}}} is {value}")
        values.setdefault(rank, {})[attr] = value
        seen.setdefault(rank, set()).add(name)
    if not values:
        raise ScrapeError("no adpfleet_* series: not an adpfleet server (or no rank is alive)")
    for rank, exported in seen.items():
        missing = sorted(set(_REQUIRED) - exported)
        if missing:
            raise ScrapeError(f"rank {rank} lacks {', '.join(missing)}")
    return {rank: RankSample(**fields) for rank, fields in sorted(values.items())}


# The fast path's grammar: a strict subset of what the line-by-line path accepts (so both agree on
# every text it matches): `name{labels} value [timestamp]` with single spaces' worth of separators,
# the value in Prometheus's own forms, no '}' after the labels (the labels end at the line's last '}').
_VALUE_RE = r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|Inf)|NaN"
_SAMPLE_RE = r"[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^\n]*\})? +(?:" + _VALUE_RE + r")(?: +[^\s}]+)? *"
_EXPOSITION = re.compile(r"(?:(?:#[^\n]*|" + _SAMPLE_RE + r")?\n)*(?:#[^\n]*|" + _SAMPLE_RE + r")?")
# a wanted sample at a line's start ("\n" + text: a literal "\n" to search for is faster than ^ in MULTILINE)
_WANTED_SAMPLE = re.compile(r"\n(" + "|".join(map(re.escape, _WANTED)) + r")(?:\{([^\n]*)\})? +(" + _VALUE_RE + ")")


def _wanted_line_by_line(text: str):
    """(name, labels, value) of the wanted families' samples, checking every line's shape; raises
    `ScrapeError` naming the first line that is not Prometheus text."""
    for number, line in enumerate(text.split("\n"), 1):
        if not line or line[0] == "#":
            continue
        name, labels, rest = _split_line(line)
        value = _value(rest) if name is not None else None
        if value is None:
            raise ScrapeError(f"not Prometheus text: line {number}: {line[:80]!r}")
        if name in _WANTED:
            yield name, labels, value


def _split_line(line: str) -> tuple[str | None, str, str]:
    """(metric name, label text, the rest) of one sample line; name None when it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace >= 0 and (space < 0 or brace < space):
        close = line.rfind("}")
        if close < brace:
            return None, "", ""
        name, labels, rest = line[:brace], line[brace + 1:close], line[close + 1:]
    elif space > 0:
        name, labels, rest = line[:space], "", line[space:]
    else:
        return None, "", ""
    return (name if _NAME.match(name) else None), labels, rest


def _value(rest: str) -> float | None:
    """The sample value (an optional timestamp may follow it)."""
    parts = rest.split()
    if not 1 <= len(parts) <= 2:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None


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

    @property
    def ok(self) -> bool:
        return self.ranks is not None

    def total(self, attr: str) -> float:
        return sum(getattr(r, attr) for r in self.ranks.values())

    @property
    def tokens(self) -> float:
        return sum(r.tokens for r in self.ranks.values())

    @property
    def work(self) -> float:
        return sum(r.work for r in self.ranks.values())


def metrics_url(pod_ip: str, port: int = names.SERVER_HTTP_PORT) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/metrics"


async def scrape(session: aiohttp.ClientSession, url: str, timeout: float, clock=time.time) -> Scrape:
    """One GET of `url` on `session`'s kept-alive connections, as a `Scrape` (never an exception)."""
    try:
        async with asyncio.timeout(timeout):
            body = await _get(session, url)
        if isinstance(body, str):
            return Scrape(at=clock(), error=body)
        at = clock()
        return Scrape(at=at, ranks=parse_metrics(body.decode("utf-8", errors="replace")))
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
        chunks, size = [], 0  # read with a bound: parse_metrics would refuse it anyway
        async for chunk in response.content.iter_any():
            size += len(chunk)
            if size > MAX_METRICS_BYTES:
                return f"GET {url}: more than {MAX_METRICS_BYTES} bytes"
            chunks.append(chunk)
        return b"".join(chunks)


Scraper = Callable[[str, float], Awaitable[Scrape]]  # (url, timeout) -> Scrape: an HttpScraper, or a test's script


async def scrape_pods(scraper: Scraper, pods: Sequence[tuple[str, str]], timeout: float) -> Scrape:
    """One scrape of a server from its pods, (name, ip) each: of its one pod as it is, or of every pod
    of a server over several pods as one (each pod exports its own ranks, numbered server-wide),
    keeping the pod each rank came from; a pod that cannot be scraped fails the whole, naming it."""
    if len(pods) == 1:
        return await scraper(metrics_url(pods[0][1]), timeout)
    parts = await asyncio.gather(*(scraper(metrics_url(ip), timeout) for _, ip in pods))
    failed = next(((name, part) for (name, _), part in zip(pods, parts) if not part.ok), None)
    if failed:
        return replace(failed[1], error=f"pod {failed[0]}: {failed[1].error}")
    return Scrape(at=min(part.at for part in parts),
                  ranks={r: sample for part in parts for r, sample in part.ranks.items()},
                  rank_pods={r: name for (name, _), part in zip(pods, parts) for r in part.ranks})


class HttpScraper:
    """Scrapes servers over kept-alive connections, one per server, reused from scrape to scrape:
    `await scraper(url, timeout)` is a `Scrape`, never an exception.

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

    async def __call__(self, url: str, timeout: float) -> Scrape:
        return await scrape(self._client(), url, timeout, self.clock)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
