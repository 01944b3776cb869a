"""Fake servers for router tests (fake_server.py); real servers and the router are in servers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from adpfleet.cluster.testing import wait_for
from servers import Process, RouterProcess, free_port, serve  # noqa: F401 - the router tests' one import

HERE = Path(__file__).parent


def wait_until(check, *, timeout: float, what: str, interval: float = 0.05):
    """The suite's one poll-with-deadline (adpfleet.cluster.testing.wait_for), polling faster."""
    return wait_for(check, timeout=timeout, what=what, interval=interval)


FAKE_DEFAULTS = {"token_delay": 0.0, "fail_status": None, "hang": False, "kv_hang": False, "kv_timeout": 5.0,
                 "kv_fail": False, "kv_fail_in_stream": False, "healthy": True, "kv_host": None,
                 "refuse_params": False, "snapshot": None, "line_breaks_in_text": False}


class FakeServer(Process):
    def __init__(self, role: str, log_dir: Path, host: str = "127.0.0.1"):
        self.role = role
        port = free_port(host)
        super().__init__([sys.executable, str(HERE / "fake_server.py"), "--role", role, "--host", host,
                          "--port", str(port)], port, log_dir / f"fake-{role}-{port}.log", host=host)

    def configure(self, **settings) -> None:
        """Set fault knobs (token_delay, fail_status, hang, kv_hang, kv_timeout, kv_fail,
        kv_fail_in_stream, healthy, kv_host: the host its KV endpoint names, refuse_params: a generation
        server's 403 for the KV peer in disaggregated_params, snapshot: its GET /internal/prefix_cache,
        line_breaks_in_text: U+2028, U+0085 and U+2029 after each piece, unescaped); clears the
        received-request log."""
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
