"""The server process's handle on its ADP ranks: spawn them, route requests, collect outputs,
watch their health.

Requests are placed by the ADP dispatcher (`adp_dispatcher.py`: by prefix, within the lockstep
imbalance bound, or on the rank the router named), which learns what each rank caches from the
`cache` events the rank sends after every pass, ahead of that pass's outputs.

A rank that exits, reports an error, or stops reporting for longer than the collective timeout
makes the whole server unhealthy: ranks share collectives, so the unit of restart is the server.

A server over several pods (`node_link`): the leader's group holds every rank, its own as
processes and the workers' as `RemoteRank`s behind the link; a worker's group holds only its own
ranks and relays everything they say to the leader.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import threading
import time
from collections.abc import Callable

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.request import Request, RequestOutput
from adpfleet.runtime.executor.adp_dispatcher import ADPDispatcher
from adpfleet.runtime.executor.node_link import LeaderLink, NodeTopology, RemoteRank, WorkerLink
from adpfleet.runtime.executor.rank_process import RankSpec, run_rank
from adpfleet.runtime.metrics import RankStats

log = logging.getLogger(__name__)

# A dead group (a rank exited, erred or hung) cannot agree on a stop: the stop travels through the
# fetch all-gather, which a missing peer never completes. Its ranks get this long to exit, then
# are killed, so a server with a hung rank exits (and its pod restarts) without waiting out a
# graceful stop that cannot happen.
DEAD_GROUP_EXIT_S = 2.0


def _start_forkserver_deaf_to_sigterm() -> None:
    """Start the forkserver ignoring SIGTERM (a disposition it inherits across exec; a blocked mask is
    not: the exec resets it). A pod's deletion sends SIGTERM to its whole process group: the
    forkserver would die of it, every rank's sentinel (a socket to the forkserver) would read EOF, and
    the draining server would take its ranks for dead and fail the requests it was finishing. The
    server's own handler is back as soon as the forkserver is started (a SIGTERM in between, while
    the server is still starting, is ignored; the kubelet's SIGKILL after the grace period remains).
    The forkserver ends when the server does (its end of the forkserver's pipe closes)."""
    from multiprocessing import forkserver
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        forkserver.ensure_running()
        return
    handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, handler)


def _dialable(host: str) -> str:
    """Where a process on this host reaches what listens on `host`."""
    return "127.0.0.1" if host in ("", "0.0.0.0") else host


class RankGroup:
    def __init__(self, config: EngineConfig, dp: int = 1, role: str = "aggregated",
                 pad_empty_batch: bool = True, collective_timeout_s: float = 60.0,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 on_dead: Callable[[str], None] | None = None, topology: NodeTopology | None = None,
                 link_host: str = "127.0.0.1", **spec_overrides):
        self.dp, self.role = dp, role
        self.topology = topology or NodeTopology()
        self.topology.validate(dp)
        self.local_ranks = self.topology.ranks_of(self.topology.node_rank, dp)
        self.collective_timeout_s = collective_timeout_s
        self.on_output = on_output or (lambda out: None)
        self.on_dead = on_dead or (lambda reason: None)
        self.stats: dict[int, RankStats] = {r: RankStats(kv_cache_capacity_blocks=config.kv_blocks) for r in range(dp)}
        self.dispatcher = ADPDispatcher(dp, config.tokens_per_block)
        self.ready: set[int] = set()
        self.kv_endpoints: dict[int, str | None] = {}  # context role: where each rank serves held KV
        self.dead: str | None = None
        self._closing = False
        self._last_seen = [time.monotonic()] * dp
        self._lock = threading.Lock()
        self.leader_link: LeaderLink | None = None
        self.worker_link: WorkerLink | None = None
        # ranks in other pods: the leader sees them behind the link, a worker not at all
        self.procs: list = [RemoteRank(r) for r in range(dp)]
        self.conns: list = list(self.procs)
        # rank 0's rendezvous store takes connections with no credential: it listens where its
        # ranks dial it and nowhere else (loopback for a one-pod server, the leader's host for several)
        store_host = link_host if self.topology.nodes > 1 else "127.0.0.1"
        master = _dialable(store_host)
        listener = None
        if self.topology.leader:
            # bound here and handed to rank 0 (multiprocessing passes the socket): no other process can
            # take the port between its choice and rank 0's bind (a CI run: EADDRINUSE, the server exited)
            listener = socket.create_server((store_host, 0), backlog=max(64, dp))
            port = listener.getsockname()[1]
            if self.topology.nodes > 1:
                self.leader_link = LeaderLink(self.topology, link_host, dp, port, self.procs,
                                              on_lost=self._lost)
                self.leader_link.wait_joined()
        else:
            self.worker_link = WorkerLink(self.topology)
            master, port = self.topology.leader_host, self.worker_link.store_port
        # Ranks fork from one forkserver per server process that imported torch and the rank's code
        # once (spawned, each rank imported them afresh: a 2-rank group is ready in ~0.45x the time).
        # It never touches CUDA, so each rank initialises its own, as under spawn.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed", "adpfleet.runtime.executor.rank_process",
                                    "adpfleet.runtime.engine.llm_engine", "adpfleet.runtime.executor.adp_executor"])
        _start_forkserver_deaf_to_sigterm()
        for rank in self.local_ranks:
            parent, child = ctx.Pipe()
            spec = RankSpec(config, rank, dp, role, pad_empty_batch, port, collective_timeout_s,
                            master_addr=master, store_listener=listener if rank == 0 else None,
                            **spec_overrides)
            proc = ctx.Process(target=run_rank, args=(spec, child), name=f"adpfleet-rank{rank}", daemon=True)
            proc.start()
            if rank == 0 and listener is not None:
                listener.close()  # rank 0 has its own copy now
            child.close()
            self.procs[rank] = proc
            self.conns[rank] = parent
        watched = self.local_ranks if self.worker_link else range(dp)
        for rank in watched:
            threading.Thread(target=self._read, args=(rank,), name=f"rank{rank}-reader", daemon=True).start()
        if self.worker_link:
            self.worker_link.serve(self._from_leader, on_lost=self._lost)
        threading.Thread(target=self._watch, args=(watched,), name="rank-watchdog", daemon=True).start()

    @property
    def watched(self) -> int:
        """How many ranks this process answers for: all of the server's on the leader, its own on a worker."""
        return len(self.local_ranks) if self.worker_link else self.dp

    def _from_leader(self, rank: int, msg) -> None:
        """A worker: the leader's message for one of this pod's ranks."""
        if msg[0] == "stop":
            self._closing = True
        if rank in self.local_ranks:
            try:
                self.conns[rank].send(msg)
            except (BrokenPipeError, OSError):
                pass

    def _lost(self, reason: str) -> None:
        if not self._closing:
            self._die(reason)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, request: Request, rank: int | None = None) -> int:
        """Place `request` on `rank`, else on the rank its router named, else where the dispatcher says."""
        if self.dead:
            raise RuntimeError(self.dead)
        with self._lock:
            rank = self.dispatcher.assign(request, request.data_parallel_rank if rank is None else rank)
            self.conns[rank].send(("add", request))
        return rank

    def abort(self, request_id: str) -> None:
        with self._lock:
            rank = self.dispatcher.release(request_id)
            if rank is not None and not self.dead:
                self.conns[rank].send(("abort", request_id))

    def transfer_done(self, request_id: str, rank: int) -> None:
        with self._lock:
            if not self.dead:
                self.conns[rank].send(("transfer_done", request_id))

    def inject_fault(self, kind: str, rank: int) -> None:
        if not 0 <= rank < self.dp:
            raise ValueError(f"rank {rank} does not exist (this server has {self.dp})")
        with self._lock:
            self.conns[rank].send(("fault", kind))

    def _progress(self, out: RequestOutput) -> None:
        with self._lock:
            if out.finished:
                self.dispatcher.release(out.request_id)
            else:
                self.dispatcher.progress(out.request_id, out.completion_tokens)

    def _learn_cache(self, rank: int, events) -> None:
        try:
            with self._lock:
                self.dispatcher.view.apply(rank, events)
        except ValueError as e:  # a rank that says what no rank says is broken: the server with it
            self._die(str(e))

    def prefix_cache_snapshot(self) -> dict:
        with self._lock:
            return self.dispatcher.snapshot()

    # -- state -----------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if self.dead:
            return False, self.dead
        if len(self.ready) < self.watched:
            return False, f"starting: {len(self.ready)}/{self.watched} ranks ready"
        return True, "ok"

    def rank_stats(self, whole_server: bool = False) -> list[tuple[int, RankStats]]:
        """Stats of this pod's live ranks (every pod exports its own), or of the whole server's:
        a dead rank's series disappear with it."""
        ranks = range(self.dp) if whole_server else self.local_ranks
        return [(r, self.stats[r]) for r in ranks if self.procs[r].is_alive()]

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready) < self.watched:
            if self.dead:
                raise RuntimeError(self.dead)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.ready)}/{self.watched} ranks ready after {timeout}s")
            time.sleep(0.05)

    def close(self, timeout: float = 20) -> None:
        self._closing = True
        if self.leader_link:
            self.leader_link.close()
        stoppable = self.local_ranks if self.worker_link else range(self.dp)
        for rank in stoppable:  # a worker's ranks are stopped by their leader; this is its own ending
            try:
                self.conns[rank].send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + (min(timeout, DEAD_GROUP_EXIT_S) if self.dead else timeout)
        for rank in self.local_ranks:
            proc = self.procs[rank]
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self.worker_link:
            self.worker_link.close()

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
            if self.worker_link:  # the leader owns the requests: it hears everything this rank says
                try:
                    self.worker_link.send_up(rank, msg)
                except (BrokenPipeError, OSError):
                    self._lost("the leader pod left the group")
            kind = msg[0]
            if kind == "ready":
                self.kv_endpoints[rank] = msg[2]
                self.ready.add(rank)
            elif kind == "stats":
                self.stats[rank] = msg[1]
            elif kind == "cache" and not self.worker_link:
                self._learn_cache(rank, msg[1])
            elif kind == "out" and not self.worker_link:
                for out in msg[1]:
                    out.rank = rank
                    self._progress(out)
                    self.on_output(out)
            elif kind == "error":
                log.error("%s", msg[1])
                self._die(msg[1].splitlines()[0])

    def _watch(self, ranks: range) -> None:
        while not self.dead and not self._closing:
            time.sleep(0.5)
            now = time.monotonic()
            for rank in ranks:
                if rank in self.ready and now - self._last_seen[rank] > self.collective_timeout_s:
                    self._die(f"rank {rank} has not reported for {now - self._last_seen[rank]:.0f}s (hung)")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.dead:
                return
            self.dead = reason
            orphans = list(self.dispatcher.placed)
            self.dispatcher.placed.clear()
        log.error("server unhealthy: %s", reason)
        for rid in orphans:
            self.on_output(RequestOutput(rid, [], "", True, "error", 0, 0))
        self.on_dead(reason)
