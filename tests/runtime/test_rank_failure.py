"""A dead rank makes the server unhealthy and exit non-zero; no peer waits forever."""

import os
import signal
import time

import httpx
import psutil
import pytest

from servers import Server

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def rank_processes(server: Server) -> list[psutil.Process]:
    kids = psutil.Process(server.proc.pid).children(recursive=True)
    return [p for p in kids if "multiprocessing" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_makes_the_server_unhealthy_and_exit_nonzero(tmp_path, fault):
    server = Server("--model", "tiny", "--dp", "2", "--collective-timeout", "10", log_path=tmp_path / "server.log")
    try:
        server.wait_healthy()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        ranks = rank_processes(server)
        assert len(ranks) == 2
        os.kill(ranks[1].pid, fault)
        deadline = time.monotonic() + 40  # a hung rank is declared after the 10 s collective timeout
        saw_unhealthy = False
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                saw_unhealthy |= httpx.get(server.url + "/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        assert server.proc.poll() is not None, "the server did not exit within 40 s of the fault"
        assert server.proc.returncode != 0
        assert wait_gone(ranks, 10), "a rank process outlived its server"
        assert saw_unhealthy, "/health never reported the dead rank"
    finally:
        server.stop()


def wait_gone(procs, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs):
            return True
        time.sleep(0.1)
    return False
