"""Processes for router tests: fake servers (fake_server.py), real `adpfleet serve`, and the router."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from adpfleet.cluster.testing import wait_for

HERE = Path(__file__).parent


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(check, *, timeout: float, what: str, interval: float = 0.05):
    """The suite's one poll-with-deadline (adpfleet.cluster.testing.wait_for), polling faster."""
    return wait_for(check, timeout=timeout, what=what, interval=interval)


class Process:
    """A child process in its own session, reachable at `url`, killed with its group."""

    def __init__(self, cmd: list[str], port: int, log_path: Path | None, env: dict | None = None,
                 host: str = "127.0.0.1"):
        self.host, self.port = host, port
        self.url = f"http://{host}:{port}"
        self.log_path = log_path
        self.log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})

    def wait_healthy(self, timeout: float = 60) -> "Process":
        def healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}; log: {self.tail()}")
            return httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200
        deadline = time.monotonic() + timeout
        while True:
            try:
                if healthy():
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
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


FAKE_DEFAULTS = {"token_delay": 0.0, "fail_status": None, "hang": False, "kv_hang": False, "kv_timeout": 5.0,
                 "kv_fail": False, "kv_fail_in_stream": False, "healthy": True}


class FakeServer(Process):
    def __init__(self, role: str, log_dir: Path, host: str = "127.0.0.1"):
        self.role = role
        port = free_port(host)
        super().__init__([sys.executable, str(HERE / "fake_server.py"), "--role", role, "--host", host,
                          "--port", str(port)], port, log_dir / f"fake-{role}-{port}.log", host=host)

    def configure(self, **settings) -> None:
        """Set fault knobs (token_delay, fail_status, hang, kv_hang, kv_timeout, kv_fail,
        kv_fail_in_stream, healthy);
        clears the received-request log."""
        httpx.post(self.url + "/fake/config", json=settings, timeout=5, trust_env=False).raise_for_status()

    def stop(self) -> None:  # nothing to shut down gracefully, and hung requests would delay it
        self.kill()

    def reset(self) -> None:
        self.configure(**FAKE_DEFAULTS)

    def state(self) -> dict:
        return httpx.get(self.url + "/fake/state", timeout=5, trust_env=False).json()

    def received(self) -> list[dict]:
        return self.state()["received"]

    def streams_open(self) -> int:
        return self.state()["active"]


def serve(role: str, log_dir: Path, *extra: str, dp: int = 1) -> Process:
    """A real `adpfleet serve` (model tiny); a context server's KV ports are any free ones."""
    port = free_port()
    return Process([sys.executable, "-m", "adpfleet", "serve", "--role", role, "--model", "tiny", "--dp", str(dp),
                    "--kv-blocks", "64", "--kv-port", "0", "--host", "127.0.0.1", "--port", str(port), *extra], port,
                   log_dir / f"serve-{role}-{port}.log")


class RouterProcess(Process):
    def __init__(self, log_dir: Path, *args: str, env: dict | None = None):
        port = free_port()
        super().__init__([sys.executable, "-m", "adpfleet", "router", "--host", "127.0.0.1", "--port", str(port),
                          *args], port, log_dir / f"router-{port}.log", env=env)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {'name{labels}': value}."""
        text = httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

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
