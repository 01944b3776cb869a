"""Synthetic servers for status-only pods: one process answering `GET /metrics` on every pod's own
address, so the operator's stall detection and autoscaling can be run at scale without an engine.

    python -m adpfleet.cluster.synthetic_metrics --kubeconfig K --namespace NS --control-port P

Status-only pods (the node agent's `adpfleet.io/node-agent: status-only`) are Ready and have a
loopback address but run nothing. This watches the namespace's server pods (label
`adpfleet.io/role`) and, on one asyncio event loop, listens on `<podIP>:8000` for each, answering
`/metrics` in the runtime's exposition (docs/adp.md's metrics: the per-rank counters, gauges and the latency
histograms, the same families and about the same size as a real server's), and `/health`.

Each pod's ranks make progress at a steady rate with the load it was given (a drained pod finishes
its requests within a second and gets no more); a control endpoint on 127.0.0.1 changes that per
pod, per role or per fleet:

    POST /load  {"fleet": F, "role": R, "pod": P, "waiting": 1.5, "running": 4, "kv": 0.6,
                 "ttft": 0.2, "itl": 0.02}          (every key optional; the matching pods take it)
    POST /stall {"pod": P, "signature": "vetoed" | "hung"}   (tokens stop; vetoed: the loop spins)
                                                              (any other signature's word reads as hung)
    GET  /pods  -> {pod: {"ip", "since", "stalled_at"}}

The exposition is the runtime's own, written by the contract (adpfleet/contract/exposition.py) from
these servers' made-up counters; the signatures are the contract's words. This module may not import
the runtime or the operator (it is development infrastructure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from adpfleet.contract.exposition import render
from adpfleet.contract.metrics import (COUNTERS, FINISH_REASONS, GAUGES, HISTOGRAMS, IMBALANCE_BUCKETS,
                                       LATENCY_BUCKETS, PADDING_OUTCOMES, PADDING_PHASES, Histogram)
from adpfleet.contract.signatures import Signature

log = logging.getLogger("adpfleet.cluster.synthetic_metrics")

PORT = 8000
RANKS = 2
ITERATIONS_PER_SECOND = 50.0
TOKENS_PER_SECOND = 40.0
KV_BLOCKS = 64
FINISH_SECONDS = 1.0  # how long a drained server takes to finish its requests


@dataclass
class Load:
    waiting: float = 0.0
    running: float = 2.0
    kv: float = 0.3
    ttft: float = 0.2
    itl: float = 0.02


@dataclass
class SyntheticServer:
    """One pod's ranks. Counters grow with time from `since`; a stall freezes the tokens (vetoed: the
    loop keeps spinning with every forward vetoed and rank 1 scheduling empty batches; hung:
    everything stops)."""
    pod: str
    fleet: str
    role: str
    ip: str
    since: float = field(default_factory=time.time)
    load: Load = field(default_factory=Load)
    stalled_at: float | None = None
    signature: Signature = Signature.VETOED
    drained_at: float | None = None  # the router stopped sending it requests (the drain annotation)
    server: asyncio.AbstractServer | None = None

    def working(self, now: float) -> Load:
        """Its load now: a drained server finishes what it has within FINISH_SECONDS and gets no more."""
        if self.drained_at is not None and self.stalled_at is None and now - self.drained_at >= FINISH_SECONDS:
            return Load(waiting=0.0, running=0.0, kv=0.0, ttft=self.load.ttft, itl=self.load.itl)
        return self.load

    def render(self, now: float) -> bytes:
        progress_until = now if self.stalled_at is None else self.stalled_at
        moving = progress_until - self.since
        spinning = (now if self.signature == Signature.VETOED or self.stalled_at is None else self.stalled_at) \
            - self.since
        load = self.working(now)
        ranks = [(r, self._rank(r, load, moving, spinning - moving, progress_until)) for r in range(RANKS)]
        return render(self.role, ranks).encode()

    def _rank(self, rank: int, load: Load, moving: float, stalled_for: float, progress_until: float):
        """One rank's counters: tokens and forwards while moving; while stalled, vetoed passes on every
        rank, empty batches on rank 1 (the starving one), and work that stays."""
        stats = SimpleNamespace(**{f.field: 0.0 for f in (*COUNTERS, *GAUGES)},
                                **{f.field: Histogram() for f in HISTOGRAMS})  # what no line below sets: empty
        tokens = TOKENS_PER_SECOND * moving
        stats.iterations = ITERATIONS_PER_SECOND * (moving + stalled_for)
        stats.forward_steps = ITERATIONS_PER_SECOND * moving
        stats.forward_vetoed = ITERATIONS_PER_SECOND * stalled_for
        stats.empty_batch_iterations = ITERATIONS_PER_SECOND * stalled_for if rank == 1 else 0.0
        stats.prompt_tokens, stats.generation_tokens = tokens * 4, tokens
        stats.padding_dummies = {(p, o): 0.0 for p in PADDING_PHASES for o in PADDING_OUTCOMES}
        stats.requests_finished = {k: tokens / 32 if k == "length" else 0.0 for k in FINISH_REASONS}
        stats.requests_running = load.running if self.stalled_at is None else max(1.0, load.running)
        stats.requests_waiting = load.waiting
        stats.kv_cache_blocks_used, stats.kv_cache_capacity_blocks = round(load.kv * KV_BLOCKS), KV_BLOCKS
        stats.last_progress_timestamp = progress_until
        stats.time_to_first_token = _histogram(load.ttft, TOKENS_PER_SECOND / 32 * moving)
        stats.inter_token_latency = _histogram(load.itl, TOKENS_PER_SECOND * moving)
        stats.pass_imbalance = Histogram(IMBALANCE_BUCKETS)
        return stats


def _histogram(mean: float, count: float) -> Histogram:
    """`count` observations all of `mean` seconds."""
    buckets = [0.0] * len(LATENCY_BUCKETS)
    first = next((i for i, bound in enumerate(LATENCY_BUCKETS) if bound >= mean), None)
    if first is not None:
        buckets[first] = count
    return Histogram(LATENCY_BUCKETS, buckets, count * mean, count)


class Farm:
    """Every synthetic server of a namespace, on one event loop."""

    def __init__(self, default: Load | None = None):
        self.servers: dict[str, SyntheticServer] = {}
        self.default = default or Load()
        self.loads: list[tuple[dict, Load]] = []  # (selector, load) in the order given: later wins

    async def add(self, pod: str, fleet: str, role: str, ip: str, drained: bool = False) -> None:
        old = self.servers.get(pod)
        if old is not None and old.ip == ip:
            if drained and old.drained_at is None:
                old.drained_at = time.time()
            elif not drained:
                old.drained_at = None
            return
        if old is not None:
            await self.remove(pod)
        server = SyntheticServer(pod, fleet, role, ip, load=self._load_for(pod, fleet, role),
                                 drained_at=time.time() if drained else None)
        try:
            server.server = await asyncio.start_server(lambda r, w: self._serve(server, r, w), ip, PORT,
                                                       reuse_address=True, backlog=64)
        except OSError as e:
            log.warning("cannot listen on %s:%d for %s: %s", ip, PORT, pod, e)
            return
        self.servers[pod] = server

    async def remove(self, pod: str) -> None:
        server = self.servers.pop(pod, None)
        if server is not None and server.server is not None:
            server.server.close()

    def _load_for(self, pod: str, fleet: str, role: str) -> Load:
        load = Load(**vars(self.default))
        for selector, given in self.loads:
            if _matches(selector, pod, fleet, role):
                load = Load(**{**vars(load), **{k: v for k, v in vars(given).items() if v is not None}})
        return load

    def set_load(self, selector: dict, values: dict) -> int:
        given = Load(**{k: None for k in vars(Load())})
        for key in vars(given):
            if key in values:
                setattr(given, key, float(values[key]))
        self.loads.append((selector, given))
        n = 0
        for s in self.servers.values():
            if _matches(selector, s.pod, s.fleet, s.role):
                s.load = self._load_for(s.pod, s.fleet, s.role)
                n += 1
        return n

    def stall(self, pod: str, signature: str) -> float:
        server = self.servers[pod]
        server.stalled_at, server.signature = time.time(), Signature(signature)
        return server.stalled_at

    async def _serve(self, server: SyntheticServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                request = await reader.readline()
                if not request:
                    return
                close = False
                while True:
                    header = await reader.readline()
                    if header in (b"\r\n", b"\n", b""):
                        break
                    if header.lower().startswith(b"connection:") and b"close" in header.lower():
                        close = True
                path = request.split(b" ")[1] if request.count(b" ") >= 2 else b"/"
                if path.startswith(b"/metrics"):
                    body, status = server.render(time.time()), b"200 OK"
                elif path.startswith(b"/health"):
                    body, status = b'{"status":"ok"}', b"200 OK"
                else:
                    body, status = b"not found", b"404 Not Found"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain; version=0.0.4\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
                if close:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()


def _matches(selector: dict, pod: str, fleet: str, role: str) -> bool:
    return all(selector.get(k) in (None, v) for k, v in (("pod", pod), ("fleet", fleet), ("role", role)))


class PodFollower:
    """Keeps the farm's servers in step with the namespace's server pods (a list+watch in a thread)."""

    def __init__(self, farm: Farm, loop: asyncio.AbstractEventLoop, kubeconfig: str, namespace: str):
        self.farm, self.loop = farm, loop
        self.kubeconfig, self.namespace = kubeconfig, namespace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="pod-follower")

    def start(self) -> "PodFollower":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, config, watch

        core = client.CoreV1Api(config.new_client_from_config(self.kubeconfig))
        while not self._stop.is_set():
            try:
                listed = core.list_namespaced_pod(self.namespace, label_selector="adpfleet.io/role")
                for pod in listed.items:
                    self._apply("ADDED", pod)
                version = listed.metadata.resource_version
                for event in watch.Watch().stream(core.list_namespaced_pod, self.namespace,
                                                  label_selector="adpfleet.io/role", resource_version=version,
                                                  timeout_seconds=60):
                    self._apply(event["type"], event["object"])
                    if self._stop.is_set():
                        return
            except Exception as e:  # noqa: BLE001 - list again
                log.warning("pod watch failed, listing again: %s", e)
                time.sleep(1)

    def _apply(self, kind: str, pod) -> None:
        labels = pod.metadata.labels or {}
        name, ip = pod.metadata.name, pod.status.pod_ip
        if kind == "DELETED" or pod.metadata.deletion_timestamp is not None or not ip:
            asyncio.run_coroutine_threadsafe(self.farm.remove(name), self.loop)
        else:
            drained = (pod.metadata.annotations or {}).get("adpfleet.io/drain") == "true"
            asyncio.run_coroutine_threadsafe(self.farm.add(name, labels.get("adpfleet.io/fleet", ""),
                                                           labels.get("adpfleet.io/role", ""), ip, drained), self.loop)


async def control_server(farm: Farm, port: int) -> asyncio.AbstractServer:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readline()
            length = 0
            while True:
                header = await reader.readline()
                if header in (b"\r\n", b"\n", b""):
                    break
                if header.lower().startswith(b"content-length:"):
                    length = int(header.split(b":")[1])
            body = json.loads(await reader.readexactly(length)) if length else {}
            method, path = request.split(b" ")[:2]
            if path == b"/load":
                out = {"pods": farm.set_load({k: body.get(k) for k in ("pod", "fleet", "role")}, body)}
            elif path == b"/stall":
                out = {"stalled_at": farm.stall(body["pod"], body.get("signature", Signature.VETOED))}
            else:
                out = {p: {"ip": s.ip, "since": s.since, "stalled_at": s.stalled_at}
                       for p, s in farm.servers.items()}
            data, status = json.dumps(out).encode(), b"200 OK"
        except Exception as e:  # noqa: BLE001 - the caller hears what was wrong
            data, status = json.dumps({"error": repr(e)}).encode(), b"400 Bad Request"
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", port)


async def main_async(args) -> None:
    farm = Farm(Load(waiting=args.waiting, running=args.running, kv=args.kv))
    loop = asyncio.get_running_loop()
    follower = PodFollower(farm, loop, args.kubeconfig, args.namespace).start()
    control = await control_server(farm, args.control_port)
    print(f"synthetic metrics: control on 127.0.0.1:{args.control_port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        follower.stop()
        control.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--control-port", type=int, required=True)
    p.add_argument("--waiting", type=float, default=0.0)
    p.add_argument("--running", type=float, default=2.0)
    p.add_argument("--kv", type=float, default=0.3)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        asyncio.run(main_async(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
