"""The context server's KV hold: a finished prompt keeps its KV blocks until a generation server
has pulled them, or until its lease expires.

`reap()` runs at one fixed point of every executor pass (step 7), whether the forward ran, was
vetoed, or the fleet was idle: no release waits for a forward. (Upstream reaps only after a
forward, so while every pass is vetoed nothing is released and a rank starved by held blocks
stays starved — one way the ADP stall lasts forever.)

Every hold ends within two leases of its start: pulled, or expired `lease_s` after it began, or
at once when the request needs no transfer after all (`release`: it ended at its first token, or
it was aborted — a client gone, the router cancelling). A
transfer may start reading the blocks only while the lease runs; it delays the expiry (the
blocks must not be reused under it), but by at most `lease_s` from its own start, so neither an
abandoned transfer nor a string of retried ones can pin the KV for longer.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from adpfleet.runtime.engine.kv_cache import KVCacheManager
from adpfleet.runtime.engine.request import Request


class SimulatedPuller:
    """Stands in for the generation servers: a held request counts as pulled `latency_s` after
    it was first held. (The network transfer itself replaces this in the serving layer.)"""

    def __init__(self, latency_s: float = 0.05):
        self.latency_s = latency_s

    def pulled(self, request_id: str, held_since: float, now: float) -> bool:
        return now - held_since >= self.latency_s


class LedgerPuller:
    """Pulled when a completion has been reported (by the transfer server, or a test)."""

    def __init__(self):
        self.completed: set[str] = set()

    def complete(self, request_id: str) -> None:
        self.completed.add(request_id)

    def pulled(self, request_id: str, held_since: float, now: float) -> bool:
        return request_id in self.completed


@dataclass
class Held:
    request: Request
    since: float
    deadline: float
    transfer_deadline: float | None = None  # a transfer is reading its blocks: not freed before this


class KVHold:
    def __init__(self, kv: KVCacheManager, puller, lease_s: float = 60.0, clock=time.monotonic):
        self.kv, self.puller, self.lease_s, self.clock = kv, puller, lease_s, clock
        self.held: dict[str, Held] = {}
        self.pulled = 0
        self.expired = 0
        self.released = 0  # needed no transfer after all (released at once)
        self._lock = threading.Lock()  # the transfer server's threads read `held` too

    def hold(self, request: Request) -> None:
        now = self.clock()
        with self._lock:
            self.held[request.request_id] = Held(request, now, now + self.lease_s)

    def release(self, request_id: str) -> bool:
        """The request needs no transfer after all (it finished on the context server, or it was
        aborted): its blocks are freed at once, unless a transfer is reading them — then no other
        starts, and they go when that one ends (its `on_done`) or by its deadline. On the loop's
        thread. False when it is not held."""
        now = self.clock()
        with self._lock:
            h = self.held.get(request_id)
            if h is None:
                return False
            if h.transfer_deadline is not None and now < h.transfer_deadline:
                h.deadline = now  # lookup refuses it from now on; reap frees it when the transfer ends
                return True
            del self.held[request_id]
            if hasattr(self.puller, "completed"):
                self.puller.completed.discard(request_id)
            self.released += 1
        self.kv.free(h.request)
        return True

    def puller_complete(self, request_id: str) -> None:
        if hasattr(self.puller, "complete"):
            with self._lock:
                self.puller.complete(request_id)
                if request_id in self.held:
                    self.held[request_id].transfer_deadline = None

    def lookup(self, request_id: str):
        """For the transfer server: (block table, token count) of a held prompt, and what to call
        when its transfer ends, however it ended (a handle is pulled once: the blocks are freed at
        the next reap; runtime/executor/kv_transfer.py). None when not held, or when its lease has
        run out."""
        now = self.clock()
        with self._lock:
            h = self.held.get(request_id)
            if h is None or now >= h.deadline:  # gone, or its lease ran out: too late to start
                return None
            h.transfer_deadline = now + self.lease_s
            req = h.request
            where = (list(req.block_table), req.num_computed_tokens)
        return where, lambda: self.puller_complete(request_id)

    @property
    def blocks_in_flight(self) -> int:
        """Distinct blocks: held prompts may share a cached prefix."""
        return len({block for h in self.held.values() for block in h.request.block_table})

    @property
    def blocks_awaiting_pull(self) -> int:
        """Held blocks no generation server is pulling or has pulled: the generation side's part of
        the held KV. The rest (a pull under way, or done and not yet freed) is this server's part;
        stall detection tells the two apart (docs/remediation.md, the transfer signature)."""
        completed = getattr(self.puller, "completed", ())
        now = self.clock()
        with self._lock:
            return len({block for rid, h in self.held.items()
                        if (h.transfer_deadline is None or now >= h.transfer_deadline) and rid not in completed
                        for block in h.request.block_table})

    def reap(self) -> list[str]:
        """Free the KV of every pulled or expired request; returns their ids."""
        now = self.clock()
        done = []
        with self._lock:
            for rid, h in list(self.held.items()):
                if self.puller.pulled(rid, h.since, now):
                    self.pulled += 1
                elif now >= h.deadline and (h.transfer_deadline is None or now >= h.transfer_deadline):
                    self.expired += 1
                else:
                    continue
                self.kv.free(h.request)
                del self.held[rid]
                done.append(rid)
            if hasattr(self.puller, "completed"):
                self.puller.completed.difference_update(done)
        return done
