"""Scraping a server's /metrics: the only network the stall detection does. Every failure —
refused, timed out, an HTTP error, a body that is not an adpfleet exposition — comes back as a
failed `Scrape` with the reason (the server is then Unreachable, never stalled)."""

from __future__ import annotations

import asyncio
import time

import httpx

from adpfleet.operator.detection import MAX_METRICS_BYTES, Scrape, ScrapeError, parse_metrics
from adpfleet.operator.resource import names


def metrics_url(pod_ip: str, port: int = names.SERVER_HTTP_PORT) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}/metrics"


async def scrape(client: httpx.AsyncClient, url: str, timeout: float, clock=time.time) -> Scrape:
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("GET", url, timeout=timeout) as response:
                if response.status_code != 200:
                    return Scrape(at=clock(), error=f"GET {url}: HTTP {response.status_code}")
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > MAX_METRICS_BYTES:
                        return Scrape(at=clock(), error=f"GET {url}: more than {MAX_METRICS_BYTES} bytes")
                    chunks.append(chunk)
        at = clock()
        return Scrape(at=at, ranks=parse_metrics(b"".join(chunks).decode("utf-8", errors="replace")))
    except TimeoutError:
        return Scrape(at=clock(), error=f"GET {url}: timed out after {timeout:g} s")
    except ScrapeError as e:
        return Scrape(at=clock(), error=f"GET {url}: {e}")
    except httpx.HTTPError as e:
        return Scrape(at=clock(), error=f"GET {url}: {type(e).__name__}: {e}".rstrip(": "))
    except OSError as e:
        return Scrape(at=clock(), error=f"GET {url}: {e}")
