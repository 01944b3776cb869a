"""What a router and a server's ADP dispatcher say to each other over HTTP.

In: **the rank hint**, the header `X-Data-Parallel-Rank: R` on a completion request — vLLM's and
SGLang's name for it (a router such as Dynamo's, which scores (worker, dp_rank), sends it). The
server places the request on rank R as it is, bypassing its own placement (the router bounds
the lockstep imbalance at its own level). A value that is not a decimal rank of this server
(`abc`, `-1`, `2` on a 2-rank server, two headers) is refused with 400 naming the header.
vLLM refuses an out-of-range rank but silently drops a malformed one; a router whose pin is
dropped loses its cache affinity without anyone noticing, so adpfleet refuses both. Pinning a
rank is a routing decision: on a server with the fleet's internal token only the router (that
token) may make it — anyone else is refused with 403 — so a client holding the API key cannot
pin every request on one rank and slow every pass of every rank.

Out: **`GET /internal/prefix_cache`**, the dispatcher's view of each rank (its cached blocks'
chained hashes, its requests and pending tokens), under the same rule: the internal token when
the server has one (block hashes tell whoever can guess a prompt whether someone sent it).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from adpfleet.runtime.serving.auth import INTERNAL, Credentials
from adpfleet.runtime.serving.limits import Refused

RANK_HEADER = "X-Data-Parallel-Rank"
SNAPSHOT_PATH = "/internal/prefix_cache"


def router_only(principal: str | None, credentials: Credentials, what: str) -> None:
    """With an internal token, `what` is the router's alone; without, whoever may call the server."""
    if credentials.internal_token is not None and principal != INTERNAL:
        raise Refused(403, f"{what} is accepted only from the router (the fleet's internal token)", code="forbidden")


def rank_hint(request: Request, dp: int, credentials: Credentials) -> int | None:
    """The rank the router named, or None; Refused (400 or 403) naming the header otherwise."""
    values = request.headers.getlist(RANK_HEADER)
    if not values:
        return None
    router_only(request.state.principal, credentials, f"'{RANK_HEADER}'")
    value = values[0].strip()
    if len(values) > 1 or not (value.isascii() and value.isdigit() and len(value) < 10) or int(value) >= dp:
        shown = ", ".join(v[:20] for v in values)
        raise Refused(400, f"'{RANK_HEADER}' must be one rank of this server, 0..{dp - 1}; got {shown!r}",
                      RANK_HEADER, code="invalid_rank")
    return int(value)


def add_snapshot_route(app: FastAPI, group, credentials: Credentials) -> None:
    """`GET /internal/prefix_cache`: what the server's ADP dispatcher believes each rank holds."""

    @app.get(SNAPSHOT_PATH)
    async def prefix_cache(request: Request):
        try:
            router_only(request.state.principal, credentials, SNAPSHOT_PATH)
        except Refused as r:
            return r.response()
        return group.prefix_cache_snapshot()
