"""The server process's handle on its ADP ranks: spawn them, route requests, collect outputs,
watch their health.

A rank that exits, reports an error, or stops reporting for longer than the collective timeout
makes the whole server unhealthy: ranks share collectives, so the unit of restart is the server.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Callable

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import RequestOutput
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.executor.adp_router import pick_rank
from adpfleet.runtime.executor.rank_process import RankSpec, run_rank
from adpfleet.runtime.metrics import RankStats

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    def __init__(self, config: EngineConfig, dp: int = 1, role: str = "aggregated",
                 pad_empty_batch: bool = True, collective_timeout_s: float = 60.0,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 on_dead: Callable[[str], None] | None = None, **spec_overrides):
        self.dp, self.role = dp, role
        self.collective_timeout_s = collective_timeout_s
        self.on_output = on_output or (lambda out: None)
        self.on_dead = on_dead or (lambda reason: None)
        self.stats: dict[int, RankStats] = {r: RankStats(kv_cache_capacity_blocks=config.kv_blocks) for r in range(dp)}
        self.loads = [[0, 0] for _ in range(dp)]
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (rank, tokens)
        self.ready: set[int] = set()
        self.kv_endpoints: dict[int, str | None] = {}  # context role: where each rank serves held KV
        self.dead: str | None = None
        self._closing = False
        self._last_seen = [time.monotonic()] * dp
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.procs, self.conns = [], []
        for rank in range(dp):
            parent, child = ctx.Pipe()
            spec = RankSpec(config, rank, dp, role, pad_empty_batch, port, collective_timeout_s, **spec_overrides)
            proc = ctx.Process(target=run_rank, args=(spec, child), name=f"adpfleet-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
            threading.Thread(target=self._read, args=(rank,), name=f"rank{rank}-reader", daemon=True).start()
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request: Request, rank: int | None = None) -> int:
        if self.dead:
            raise RuntimeError(self.dead)
        with self._lock:
            rank = pick_rank([tuple(x) for x in self.loads]) if rank is None else rank
            tokens = request.num_prompt_tokens + request.params.max_tokens
            self.owner[request.request_id] = (rank, tokens)
            self.loads[rank][0] += 1
            self.loads[rank][1] += tokens
            self.conns[rank].send(("add", request))
        return rank

    def abort(self, request_id: str) -> None:
        with self._lock:
            owner = self.owner.get(request_id)
            if owner and not self.dead:
                self.conns[owner[0]].send(("abort", request_id))
        self._release(request_id)

    def transfer_done(self, request_id: str, rank: int) -> None:
        with self._lock:
            if not self.dead:
                self.conns[rank].send(("transfer_done", request_id))

    def inject_fault(self, kind: str, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} does not exist (this server has {self.dp})")
        with self._lock:
            self.conns[rank].send(("fault", kind))

    def _release(self, request_id: str) -> None:
        with self._lock:
            owner = self.owner.pop(request_id, None)
            if owner:
                self.loads[owner[0]][0] -= 1
                self.loads[owner[0]][1] -= owner[1]

    # -- state -----------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self.dead:
            return False, self.dead
        if len(self.ready) < self.dp:
            return False, f"starting: {len(self.ready)}/{self.dp} ranks ready"
        return True, "ok"

    def rank_stats(self) -> list[tuple[int, RankStats]]:
        """Stats of the live ranks only: a dead rank's series disappear with it."""
        return [(r, s) for r, s in sorted(self.stats.items()) if self.procs[r].is_alive()]

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready) < self.dp:
            if self.dead:
                raise RuntimeError(self.dead)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.ready)}/{self.dp} ranks ready after {timeout}s")
            time.sleep(0.05)

    def close(self, timeout: float = 20) -> None:
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    # -- threads ---------------------------------------------------------------------------------
    def _read(self, rank: int) -> None:
        conn = self.conns[rank]
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                self.procs[rank].join(5)
                self._die(f"rank {rank} exited (exit code {self.procs[rank].exitcode})")
                return
            self._last_seen[rank] = time.monotonic()
            kind = msg[0]
            if kind == "ready":
                self.kv_endpoints[rank] = msg[2]
                self.ready.add(rank)
            elif kind == "stats":
                self.stats[rank] = msg[1]
            elif kind == "out":
                for out in msg[1]:
                    out.rank = rank
                    if out.finished:
                        self._release(out.request_id)
                    self.on_output(out)
            elif kind == "error":
                log.error("%s", msg[1])
                self._die(msg[1].splitlines()[0])

    def _watch(self) -> None:
        while not self.dead and not self._closing:
            time.sleep(0.5)
            now = time.monotonic()
            for rank in range(self.dp):
                if rank in self.ready and now - self._last_seen[rank] > self.collective_timeout_s:
                    self._die(f"rank {rank} has not reported for {now - self._last_seen[rank]:.0f}s (hung)")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead:
                return
            self.dead = reason
            orphans = list(self.owner)
            self.owner.clear()
        log.error("server unhealthy: %s", reason)
        for rid in orphans:
            self.on_output(RequestOutput(rid, [], "", True, "error", 0, 0))
        self.on_dead(reason)
