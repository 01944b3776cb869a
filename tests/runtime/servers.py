"""Real `adpfleet serve` and `adpfleet router` processes for tests: start, wait healthy, stop.

`trio()` starts the aggregated + context + generation servers that the disaggregation, router,
fuzzing and hostile-client tests share (through the `server_trio` fixture, or directly when they
need flags of their own).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import WaitTimeout, wait_for

ROLES = ("aggregated", "context", "generation")
TEST_DRAIN_TIMEOUT_S = 2  # `adpfleet serve --drain-timeout` of a test's server, unless the test names one


class Process:
    """A child process in its own session, reachable at `url`, killed with its group."""

    def __init__(self, cmd: list[str], port: int, log_path: Path | None = None, env: dict | None = None,
                 host: str = "127.0.0.1", headers: dict | None = None, cwd: Path | None = None):
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.headers = headers or {}  # what a client of this process sends (e.g. its API key)
        self.log_path = log_path
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd)

    def wait_healthy(self, timeout: float = 120) -> "Process":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode} before becoming healthy; "
                                   f"log: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} not healthy within {timeout:g} s; log: {self.tail()}")
            time.sleep(0.05)

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(15)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class Server(Process):
    """`adpfleet serve --host H --port P *args` on `port`, or a free one."""

    def __init__(self, *args: str, host: str = "127.0.0.1", log_path=None, env=None, headers=None,
                 port: int | None = None):
        port = port or free_port(host)
        # A context server's KV listens on --port + 1 by default, which nothing reserved: any free
        # port instead, unless the test names one.
        kv = () if "--kv-port" in args else ("--kv-port", "0")
        # stop() (SIGTERM) drains first; a test that leaves requests in flight or KV held (a stalled,
        # starved or faulted server) would have it wait out the default 25 s drain, past stop()'s own
        # 15 s. A test of the drain names its own --drain-timeout.
        drain = () if "--drain-timeout" in args else ("--drain-timeout", str(TEST_DRAIN_TIMEOUT_S))
        super().__init__([sys.executable, "-m", "adpfleet", "serve", "--host", host, "--port", str(port), *kv, *drain,
                          *args],
                         port, log_path, env, host, headers)


class RouterProcess(Process):
    """`adpfleet router *args` on a free port; logs to `log_dir`."""

    def __init__(self, log_dir: Path, *args: str, env: dict | None = None, headers: dict | None = None):
        port = free_port()
        super().__init__([sys.executable, "-m", "adpfleet", "router", "--host", "127.0.0.1", "--port", str(port),
                          *args], port, log_dir / f"router-{port}.log", env=env, headers=headers)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_usable(self, timeout: float = 30, **servers: int) -> "RouterProcess":
        """Until the router counts `servers` ({role: n}) usable: its health probes passed, so a
        request is placed at once instead of waiting in its queue (whose timeout may be short)."""
        wait_for(lambda: all(self.metric("adpfleet_router_servers", role=role, usable="true") == n
                             for role, n in servers.items()),
                 timeout=timeout, what=f"the router to see usable servers {servers}")
        return self

    def metric(self, name: str, **labels) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            m = re.fullmatch(r"([^{]+)(?:\{(.*)\})?", key)
            if m.group(1) != name:
                continue
            have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(have.get(k) == str(v) for k, v in labels.items()):
                total += value
        return total


def serve(role: str, log_dir: Path, *extra: str, dp: int = 1, env=None, headers=None, port: int | None = None) -> Server:
    """A real `adpfleet serve --role ROLE` (model tiny, 64 KV blocks)."""
    return Server("--role", role, "--model", "tiny", "--dp", str(dp), "--kv-blocks", "64", *extra,
                  log_path=log_dir / f"serve-{role}-{time.monotonic_ns()}.log", env=env, headers=headers, port=port)


@contextlib.contextmanager
def trio(log_dir: Path, *extra: str, dp: int = 2, env=None, headers=None, per_role: dict | None = None):
    """{role: Server} for the aggregated, context and generation roles, healthy, stopped on exit.
    `per_role` adds flags to one role only."""
    servers = {role: serve(role, log_dir, *extra, *(per_role or {}).get(role, ()), dp=dp, env=env, headers=headers)
               for role in ROLES}
    try:
        for s in servers.values():
            s.wait_healthy(180)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def metric(server: Process, name: str, **labels) -> float:
    """The sum of a metric's samples on `server` whose labels include `labels`."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def wait_until(cond, timeout: float) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds pass (False): the suite's wait_for."""
    try:
        wait_for(cond, timeout=timeout, what="the condition", interval=0.1)
        return True
    except WaitTimeout:
        return False


def listening(server: Process) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket a server's processes (its ranks included) listen on."""
    root = psutil.Process(server.proc.pid)
    return {(c.laddr.ip, c.laddr.port) for p in [root, *root.children(recursive=True)]
            for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def rank_processes(server: Process) -> list[psutil.Process]:
    """A server's rank processes: the children of its multiprocessing forkserver (rank_group.py)."""
    forkservers = [p for p in psutil.Process(server.proc.pid).children()
                   if "multiprocessing.forkserver" in " ".join(p.cmdline())]
    return [rank for f in forkservers for rank in f.children()]
