"""The servers the router may use, and which one gets the next request.

Pure bookkeeping, no I/O: discovery replaces the set of endpoints, the request path acquires and
releases them and reports failures, the health prober reports probe results. Callers pass `now`
so tests drive time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from adpfleet.contract.roles import SERVER_ROLES as ROLES


def normalize_url(url: str) -> str:
    """'10.0.0.3:8000' or 'http://10.0.0.3:8000/' -> 'http://10.0.0.3:8000'."""
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("a server URL is empty")
    if "://" not in url:
        url = "http://" + url
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"server URL {url!r}: only http:// and https:// are supported")
    return url


@dataclass(frozen=True, order=True)
class Endpoint:
    role: str
    url: str

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown server role {self.role!r}; expected one of {', '.join(ROLES)}")


@dataclass
class _State:
    in_flight: int = 0
    present: bool = True       # still discovered; a vanished server lingers only while requests run on it
    probe_ok: bool = True      # last active /health probe (optimistic until the first one)
    down_until: float = 0.0    # after a failed request the server is avoided for a cool-down


class ServerPool:
    """Least-loaded selection (fewest in-flight requests; ties round robin) among usable servers.

    Usable = discovered, last health probe passed, not cooling down after a failure. A request
    starts an attempt only when its mode has usable servers (it waits in the router's queue
    until then); within the role, `pick` prefers usable servers it has not failed on.
    """

    def __init__(self, cooldown_s: float = 5.0):
        self.cooldown_s = cooldown_s
        self._servers: dict[Endpoint, _State] = {}
        self._turn = dict.fromkeys(ROLES, 0)

    # -- discovery ---------------------------------------------------------------------------
    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        wanted = set(endpoints)
        for ep in wanted:
            state = self._servers.setdefault(ep, _State())
            state.present = True
        for ep, state in list(self._servers.items()):
            if ep not in wanted:
                state.present = False
                if state.in_flight == 0:
                    del self._servers[ep]

    def endpoints(self, role: str | None = None) -> list[Endpoint]:
        return sorted(ep for ep, s in self._servers.items() if s.present and role in (None, ep.role))

    # -- health ------------------------------------------------------------------------------
    def usable(self, role: str, now: float) -> list[Endpoint]:
        return sorted(ep for ep, s in self._servers.items()
                      if ep.role == role and s.present and s.probe_ok and now >= s.down_until)

    def mode(self, now: float) -> str | None:
        """'disaggregated' when a context and a generation server are usable, else 'aggregated'
        when an aggregated one is, else None (the request waits in the router's queue)."""
        if self.usable("context", now) and self.usable("generation", now):
            return "disaggregated"
        return "aggregated" if self.usable("aggregated", now) else None

    def recovery_in(self, now: float) -> float | None:
        """Seconds until the next cool-down of a server that passes its probe ends, or None."""
        ends = [s.down_until for s in self._servers.values() if s.present and s.probe_ok and s.down_until > now]
        return min(ends) - now if ends else None

    def report_failure(self, ep: Endpoint, now: float) -> None:
        if ep in self._servers:
            self._servers[ep].down_until = now + self.cooldown_s

    def report_probe(self, ep: Endpoint, ok: bool) -> bool:
        """True when this made the server usable again (waiting requests should look)."""
        state = self._servers.get(ep)
        if state is None:
            return False
        recovered = ok and not state.probe_ok
        state.probe_ok = ok
        return recovered

    # -- selection ---------------------------------------------------------------------------
    def pick(self, role: str, now: float, avoid: Iterable[Endpoint] = (), by_load: bool = True) -> Endpoint | None:
        """The least-loaded server of `role`, preferring (in this order) servers this request has
        not failed on (`avoid`), then healthy ones, then fewer in-flight requests (unless not
        `by_load`: round robin)."""
        avoid = set(avoid)
        candidates = [(ep, s) for ep, s in self._servers.items() if ep.role == role and s.present]
        if not candidates:
            return None

        def rank(item):
            ep, s = item
            return (ep in avoid, not (s.probe_ok and now >= s.down_until), s.in_flight if by_load else 0)

        best = min(rank(c) for c in candidates)
        tied = sorted(ep for ep, s in candidates if rank((ep, s)) == best)
        choice = tied[self._turn[role] % len(tied)]
        self._turn[role] += 1
        return choice

    def acquire(self, ep: Endpoint) -> None:
        self._servers.setdefault(ep, _State(present=False)).in_flight += 1

    def release(self, ep: Endpoint) -> None:
        state = self._servers.get(ep)
        if state is None:
            return
        state.in_flight -= 1
        if state.in_flight <= 0 and not state.present:
            del self._servers[ep]

    def in_flight(self) -> dict[Endpoint, int]:
        return {ep: s.in_flight for ep, s in self._servers.items()}
