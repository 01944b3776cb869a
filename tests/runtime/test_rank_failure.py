"""A dead rank makes the server unhealthy and exit non-zero; no peer waits forever."""

import os
import signal
import time

import httpx
import psutil
import pytest

from servers import Server, rank_processes

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_makes_the_server_unhealthy_and_exit_nonzero(tmp_path, fault):
    server = Server("--model", "tiny", "--dp", "2", "--collective-timeout", "10", log_path=tmp_path / "server.log")
    try:
        server.wait_healthy()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        ranks = rank_processes(server)
        assert len(ranks) == 2
        family = psutil.Process(server.proc.pid).children(recursive=True)  # the forkserver's too
        os.kill(ranks[1].pid, fault)
        faulted = time.monotonic()
        deadline = faulted + 40  # a hung rank is declared after the 10 s collective timeout
        saw_unhealthy = False
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                saw_unhealthy |= httpx.get(server.url + "/health", timeout=2).status_code == 503
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        took = time.monotonic() - faulted
        assert server.proc.poll() is not None, "the server did not exit within 40 s of the fault"
        # the 10 s collective timeout, 1 s of grace, 2 s for the ranks of a dead group to exit
        # (rank_group.DEAD_GROUP_EXIT_S; none can agree on a stop), and a margin for a loaded machine
        assert took < 25, f"the server exited {took:.0f} s after the fault"
        assert server.proc.returncode != 0
        assert wait_gone(family, 10), "a rank process (or the forkserver) outlived its server"
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


def test_a_request_that_fails_inside_its_rank_fails_alone_and_the_rank_keeps_serving():
    from adpfleet.runtime.engine.request import Request
    from adpfleet.runtime.engine.sampling import SamplingParams
    from adpfleet.runtime.executor.offline import OfflineRanks

    ranks = OfflineRanks(1, "tiny", kv_blocks=16)
    try:
        # past the server's validation, as an unforeseen input would be: torch refuses the seed in the rank
        ranks.group.submit(Request("doomed", [256, 100, 101], SamplingParams(max_tokens=4, temperature=1.0,
                                                                            seed=2**64)))
        ok = ranks.submit("bystander", max_tokens=4, ignore_eos=True)
        assert ranks.wait(["doomed", ok], 120)
        assert ranks.done["doomed"].finish_reason == "error" and "sampling failed" in ranks.done["doomed"].error
        assert ranks.done[ok].finish_reason == "length"
        assert ranks.group.health() == (True, "ok") and ranks.group.procs[0].is_alive()
        again = ranks.submit("after", max_tokens=2, ignore_eos=True)
        assert ranks.wait([again], 60) and ranks.done[again].finish_reason == "length"
    finally:
        ranks.close()
