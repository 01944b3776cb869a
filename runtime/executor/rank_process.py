"""One ADP rank as an OS process: joins the process group, owns its engine, runs the loop.

It talks to the server process over a pipe: it receives ("add", Request), ("abort", id),
("transfer_done", id) and ("stop",), and sends ("ready",), ("cache", events), ("out", outputs),
("stats", RankStats) and ("error", text). A stop is agreed through the fetch all-gather, so every rank leaves the
loop on the same pass and no peer is left waiting in a collective.

What fails one request fails that request only: its KV pull (any exception, on the pull's own
thread), its sampling or the placement of its pulled KV (caught by the engine where the request
is known) end it with an error output, and the loop goes on. Only what escapes a pass — a
collective that failed, a CUDA error, a bug that leaves the pass half done — ends the rank: its
state, and its peers' position in the lockstep, are then unknown, so the server is restarted.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.cpu_budget import sleep_between_regions, threads_per_rank
from adpfleet.runtime.executor import faults

if TYPE_CHECKING:
    from adpfleet.runtime.executor.kv_transfer import KVPuller

sleep_between_regions()  # in the server, before it spawns its ranks: their OpenMP reads the policy when it loads
IDLE_WAIT_S = 0.02  # how long an idle rank waits for new requests before the next lockstep pass
STATS_EVERY_S = 0.1  # an idle rank's stats are sent this often (a busy rank's after every pass)


@dataclass
class RankSpec:
    config: EngineConfig
    rank: int
    dp: int
    role: str = "aggregated"
    pad_empty_batch: bool = True
    master_port: int = 0
    collective_timeout_s: float = 60.0
    transfer: str = "ledger"  # context role: "ledger" (completions reported) or "simulated"
    transfer_latency_s: float = 0.05
    kv_lease_s: float = 60.0
    kv_host: str = "127.0.0.1"  # context role: where this rank serves its held KV
    kv_port: int = 0  # rank r listens on kv_port + r; 0: any free port
    kv_transfer_timeout_s: float = 30.0  # both ends: a transfer not done by then ends (and fails the request)
    kv_token: str | None = None  # the fleet's internal token: pullers prove they hold it (see kv_transfer)
    threads: int | None = None  # None: the pod's CPU budget (cgroup quota, affinity) shared by its dp ranks
    master_addr: str = "127.0.0.1"  # where the ranks dial rank 0's rendezvous store (the leader pod's address)
    # rank 0: its store's listening socket, on the one address the store serves, bound by the server before
    # it starts the ranks (a port it only picked could be taken by another process by the time rank 0 bound it)
    store_listener: socket.socket | None = None


def _build(spec: RankSpec):
    import torch

    from adpfleet.runtime.engine.llm_engine import LLMEngine
    from adpfleet.runtime.executor.adp_executor import ADPExecutor
    from adpfleet.runtime.executor.collectives import SingleRank, TorchCollectives
    from adpfleet.runtime.executor.kv_hold import KVHold, LedgerPuller, SimulatedPuller
    from adpfleet.runtime.model.parallel import ParallelContext

    torch.set_num_threads(spec.threads or threads_per_rank(spec.dp))  # dp: every rank on one node (at most)
    config = spec.config
    device = "cpu"
    if config.device == "cuda":
        device = f"cuda:{spec.rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
        config = EngineConfig(**{**vars(config), "device": device})
    if spec.dp > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=_rendezvous_store(spec),
                                rank=spec.rank, world_size=spec.dp,
                                timeout=timedelta(seconds=spec.collective_timeout_s))
        comm = TorchCollectives(spec.rank, spec.dp, device)
    else:
        comm = SingleRank()
    puller = None
    hold = None
    if spec.role == "context":
        puller = SimulatedPuller(spec.transfer_latency_s) if spec.transfer == "simulated" else LedgerPuller()
        hold = lambda kv: KVHold(kv, puller, spec.kv_lease_s)  # noqa: E731
    engine = LLMEngine(config, ParallelContext(spec.rank, spec.dp), kv_hold=hold)
    return engine, ADPExecutor(engine, comm, spec.pad_empty_batch), puller


def _rendezvous_store(spec: RankSpec):
    """The group's rendezvous store: rank 0 serves it on `store_listener`'s address alone (torch's own, from a
    tcp:// init method, listens on every interface), the other ranks dial it at `master_addr`."""
    from torch.distributed import TCPStore

    timeout = timedelta(seconds=spec.collective_timeout_s)
    if spec.rank != 0:
        return TCPStore(spec.master_addr, spec.master_port, spec.dp, False, timeout)
    return TCPStore(spec.master_addr, spec.master_port, spec.dp, True, timeout,
                    master_listen_fd=spec.store_listener.detach())


def _start_kv_server(spec: RankSpec, engine):
    from adpfleet.runtime.executor.kv_transfer import KVTransferServer

    k_cache, v_cache = engine.runner.kv_cache
    port = spec.kv_port + spec.rank if spec.kv_port else 0
    return KVTransferServer(spec.kv_host, port, k_cache, v_cache, engine.kv_hold.lookup,
                            spec.config.tokens_per_block, token=spec.kv_token,
                            transfer_timeout_s=spec.kv_transfer_timeout_s)


class _Arrivals:
    """Requests whose KV pull ended, from the pull threads to the loop. An arrival wakes a loop that
    waits for messages, so an idle rank places the KV at once rather than after IDLE_WAIT_S."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._woken, self._wake = socket.socketpair()
        self._woken.setblocking(False)
        self._wake.setblocking(False)

    def put(self, item) -> None:
        self._queue.put(item)
        try:
            self._wake.send(b"\0")
        except BlockingIOError:  # the loop has not read the earlier wake-ups: it is woken already
            pass

    def wait(self, conn, timeout: float) -> None:
        """Until a message on `conn` or an arrival, at most `timeout` seconds."""
        multiprocessing.connection.wait([conn, self._woken], timeout)
        try:
            while self._woken.recv(4096):
                pass
        except BlockingIOError:
            pass

    def empty(self) -> bool:
        return self._queue.empty()

    def get(self):
        return self._queue.get()


def _pull(request, puller: KVPuller, arrived: _Arrivals) -> None:
    """Generation role, on its own thread: fetch the prompt's KV (checked against this rank's
    model and the request's prompt), then hand the request to the loop."""
    from adpfleet.runtime.executor.kv_endpoint import FAILED

    endpoint, handle = request.remote_kv
    try:
        request.kv_payload = puller.pull(endpoint, handle, request.num_prompt_tokens)
        arrived.put((request, None))
    except Exception as e:  # noqa: BLE001 - whatever the peer did, it fails this request, never the rank
        arrived.put((request, f"{FAILED} (from {endpoint}): {e}"))


def run_rank(spec: RankSpec, conn) -> None:
    # The kubelet's SIGTERM (a terminal's SIGINT) reaches the whole process group: a rank leaves when
    # its server stops it (the stop is agreed by every rank), or when its server is gone.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        _RankLoop(spec, conn).run()
    except (EOFError, BrokenPipeError):  # the server is gone: nothing left to serve
        sys.exit(1)
    except BaseException as e:  # report, then exit non-zero so the server sees a dead rank
        try:
            conn.send(("error", f"rank {spec.rank}: {e!r}\n{traceback.format_exc()}"))
        except Exception:
            pass
        logging.getLogger(__name__).error("rank %d failed: %r", spec.rank, e)
        os._exit(1)  # skip atexit hooks that could block on a broken process group
    finally:
        _leave_group()


class _RankLoop:
    """The rank's engine and loop, and what the loop keeps between passes. A pass: the server's
    messages, the requests whose KV arrived, one lockstep step, then outputs and stats to the server."""

    def __init__(self, spec: RankSpec, conn):
        from adpfleet.runtime.executor.kv_transfer import KVLayout, KVPuller
        from adpfleet.runtime.model.parallel import CALLS

        self.spec, self.conn = spec, conn
        self.model_collectives = CALLS  # the model's own collectives, counted by model/parallel.py
        self.engine, self.executor, _ = _build(spec)
        self.kv_server = _start_kv_server(spec, self.engine) if spec.role == "context" else None
        self.kv_puller = KVPuller(KVLayout.of(self.engine.runner.kv_cache[0]), spec.kv_transfer_timeout_s,
                                  spec.kv_token)
        self.arrived = _Arrivals()  # generation role: requests whose KV came
        self.stop = False  # the server asked to stop: the next pass proposes it to the peers
        self.frozen = False  # an injected freeze: no more passes
        self.busy = False  # the fleet had work on the last pass: do not wait for messages
        self.last_stats = 0.0

    def run(self) -> None:
        self.conn.send(("ready", self.spec.rank, self.kv_server.endpoint if self.kv_server else None))
        while True:
            new = self._receive()
            if self.frozen:  # injected: stop stepping; the peers wait in their next collective
                time.sleep(0.1)
                continue
            failed = self._take_arrivals()
            result = self._step(new, failed)
            self._report(result)
            if result.stop:
                return

    def _receive(self) -> list:
        """The server's messages since the last pass (an idle rank waits a little for them); returns
        the new requests that need no KV pull."""
        new = []
        if not (self.busy or self.stop or not self.arrived.empty()):
            self.arrived.wait(self.conn, IDLE_WAIT_S)
        while self.conn.poll(0):
            msg = self.conn.recv()
            if msg[0] == "add" and msg[1].remote_kv is not None:
                self.engine.begin_pull(msg[1])  # an abort from now on cancels it
                threading.Thread(target=_pull, args=(msg[1], self.kv_puller, self.arrived), name="kv-pull",
                                 daemon=True).start()
            elif msg[0] == "add":
                new.append(msg[1])
            else:
                self._control(msg)
        return new

    def _control(self, msg) -> None:
        """A message that is not a new request: an abort, a finished transfer, the stop, a fault."""
        engine = self.engine
        if msg[0] == "abort":
            engine.abort(msg[1])
        elif msg[0] == "transfer_done" and engine.kv_hold is not None:
            engine.kv_hold.release(msg[1])
        elif msg[0] == "stop":
            self.stop = True
        elif msg[0] == "fault":
            try:
                faults.apply(msg[1], engine, self.kv_server)
                self.frozen |= msg[1] == "freeze"
            except ValueError as e:  # a fault that does not apply here is refused, not fatal
                logging.getLogger(__name__).warning("fault refused: %s", e)

    def _take_arrivals(self) -> list:
        """Requests whose KV pull ended are pending in the engine (placed at its next fetch), dropped if
        aborted during the pull, or end with their error, returned as outputs."""
        failed = []
        while not self.arrived.empty():
            out = self.engine.end_pull(*self.arrived.get())
            if out is not None:
                failed.append(out)
        return failed

    def _step(self, new: list, failed: list):
        """One lockstep pass of the executor, timed and counted in the rank's stats."""
        engine, executor = self.engine, self.executor
        started = time.perf_counter()
        result = executor.step(new, stop=self.stop, emit=lambda outputs: self.conn.send(("out", outputs)))
        result.outputs = failed + result.outputs
        if result.fleet_has_work:
            engine.stats.busy_passes += 1
            engine.stats.busy_pass_seconds += time.perf_counter() - started
        engine.stats.control_collective_calls = executor.comm.calls
        engine.stats.collective_calls = executor.comm.calls + self.model_collectives["collectives"]
        self.busy = result.fleet_has_work
        return result

    def _report(self, result) -> None:
        """The pass's cache events and outputs, and the rank's stats when they may have changed (or are due)."""
        if events := self.engine.kv.events.take():  # ahead of the outputs: the server's dispatcher
            self.conn.send(("cache", events))       # knows a pass's blocks before any client sees it
        if result.outputs:
            self.conn.send(("out", result.outputs))
        now = time.monotonic()
        # every pass with work: a rank about to block in a collective (a peer froze) leaves its
        # true pass count behind, so the operator can tell which ranks stopped first (hung)
        if result.outputs or self.busy or now - self.last_stats >= STATS_EVERY_S or result.stop:
            self.conn.send(("stats", self.engine.stats))
            self.last_stats = now


def _leave_group() -> None:
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
