"""One ADP rank as an OS process: joins the process group, owns its engine, runs the loop.

It talks to the server process over a pipe: it receives ("add", Request), ("abort", id),
("transfer_done", id) and ("stop",), and sends ("ready",), ("out", outputs), ("stats", RankStats)
and ("error", text). A stop is agreed through the fetch all-gather, so every rank leaves the
loop on the same pass and no peer is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.model.parallel import CALLS

IDLE_WAIT_S = 0.02  # how long an idle rank waits for new requests before the next lockstep pass
STATS_EVERY_S = 0.1


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
    threads: int = 1


def _build(spec: RankSpec):
    import torch

    from adpfleet.runtime.engine.llm_engine import LLMEngine
    from adpfleet.runtime.executor.adp_executor import ADPExecutor
    from adpfleet.runtime.executor.collectives import SingleRank, TorchCollectives
    from adpfleet.runtime.executor.kv_hold import KVHold, LedgerPuller, SimulatedPuller
    from adpfleet.runtime.model.parallel import ParallelContext

    torch.set_num_threads(spec.threads)
    config = spec.config
    device = "cpu"
    if config.device == "cuda":
        device = f"cuda:{spec.rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
        config = EngineConfig(**{**vars(config), "device": device})
    if spec.dp > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                init_method=f"tcp://127.0.0.1:{spec.master_port}", rank=spec.rank,
                                world_size=spec.dp, timeout=timedelta(seconds=spec.collective_timeout_s))
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


def run_rank(spec: RankSpec, conn) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{spec.rank} %(levelname)s %(name)s: %(message)s")
    try:
        engine, executor, puller = _build(spec)
        conn.send(("ready", spec.rank))
        stop = False
        busy = False
        last_stats = 0.0
        while True:
            new = []
            wait = 0 if busy or stop else IDLE_WAIT_S
            while conn.poll(wait):
                wait = 0
                msg = conn.recv()
                if msg[0] == "add":
                    new.append(msg[1])
                elif msg[0] == "abort":
                    engine.abort(msg[1])
                elif msg[0] == "transfer_done" and puller is not None and hasattr(puller, "complete"):
                    puller.complete(msg[1])
                elif msg[0] == "stop":
                    stop = True
            started = time.perf_counter()
            result = executor.step(new, stop=stop)
            if result.fleet_has_work:
                engine.stats.busy_passes += 1
                engine.stats.busy_pass_seconds += time.perf_counter() - started
            engine.stats.control_collective_calls = executor.comm.calls
            engine.stats.collective_calls = executor.comm.calls + CALLS["collectives"]
            busy = result.fleet_has_work
            if result.outputs:
                conn.send(("out", result.outputs))
            now = time.monotonic()
            if result.outputs or now - last_stats >= STATS_EVERY_S or result.stop:
                conn.send(("stats", engine.stats))
                last_stats = now
            if result.stop:
                break
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


def _leave_group() -> None:
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
