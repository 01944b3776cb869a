"""A server whose ranks span several pods, on loopback: one leader process and one worker process
with one rank each make one 2-rank server, and with two ranks each one 4-rank server (docs/adp.md,
servers over several pods). Every rank runs one intra-op thread (the engine's default)."""

import concurrent.futures
import time

import httpx
import pytest

from servers import Server, free_port

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PROMPTS = [f"the quick brown fox {i}" for i in range(6)]
TIMEOUT = "15"  # the collective timeout: a pod that loses its group exits within it


def two_pods(tmp_path, *extra: str, dp: int = 2) -> tuple[Server, Server]:
    group_port = free_port()
    common = ("--model", "tiny", "--dp", str(dp), "--nodes", "2", "--group-port", str(group_port),
              "--collective-timeout", TIMEOUT, *extra)
    leader = Server(*common, "--node-rank", "0", log_path=tmp_path / "leader.log")
    worker = Server(*common, "--node-rank", "1", log_path=tmp_path / "worker.log",
                    env={"ADPFLEET_LEADER_ADDRESS": "127.0.0.1"})  # the address a pod gets from its env
    return leader, worker


def greedy(url: str) -> list[list[str]]:
    def one(prompt):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                       "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: both ranks get requests
        return list(pool.map(one, PROMPTS))


def samples(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{")}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("group")
    leader, worker = two_pods(tmp)
    try:
        leader.wait_healthy()
        worker.wait_healthy()
        yield leader, worker
    finally:
        worker.stop()
        leader.stop()


def test_two_pods_of_one_rank_answer_token_identically_to_one_pod_of_two_ranks(group, tmp_path):
    leader, worker = group
    split = greedy(leader.url)
    single = Server("--model", "tiny", "--dp", "2", log_path=tmp_path / "single.log")
    try:
        single.wait_healthy()
        assert greedy(single.url) == split
    finally:
        single.stop()
    # the worker's rank served some of them, and each pod exports its own rank, labelled with the pod
    leader_tokens = samples(leader.url, "adpfleet_generation_tokens_total")
    worker_tokens = samples(worker.url, "adpfleet_generation_tokens_total")
    assert list(leader_tokens) == ['adpfleet_generation_tokens_total{role="aggregated",rank="0",node_rank="0"}']
    assert list(worker_tokens) == ['adpfleet_generation_tokens_total{role="aggregated",rank="1",node_rank="1"}']
    assert min(*leader_tokens.values(), *worker_tokens.values()) > 0


def test_two_pods_of_two_ranks_answer_token_identically_to_one_pod_of_four_ranks(tmp_path):
    """The reference is a one-pod server of the same 4 ranks, not the 2-rank answers above: the MLP
    is sharded over the ranks, so its sums, and with them a greedy choice, may change with their count."""
    leader, worker = two_pods(tmp_path, dp=4)
    try:
        leader.wait_healthy()
        worker.wait_healthy()
        split = greedy(leader.url)
        leader_tokens = samples(leader.url, "adpfleet_generation_tokens_total")
        worker_tokens = samples(worker.url, "adpfleet_generation_tokens_total")
    finally:
        worker.stop()
        leader.stop()
    single = Server("--model", "tiny", "--dp", "4", log_path=tmp_path / "single.log")
    try:
        single.wait_healthy()
        assert greedy(single.url) == split
    finally:
        single.stop()
    # each pod runs its half of the ranks, and every rank served some of the requests
    assert list(leader_tokens) == [f'adpfleet_generation_tokens_total{{role="aggregated",rank="{r}",node_rank="0"}}'
                                   for r in (0, 1)]
    assert list(worker_tokens) == [f'adpfleet_generation_tokens_total{{role="aggregated",rank="{r}",node_rank="1"}}'
                                   for r in (2, 3)]
    assert min(*leader_tokens.values(), *worker_tokens.values()) > 0


def test_a_worker_pod_serves_health_and_metrics_but_sends_requests_to_its_leader(group):
    _, worker = group
    health = httpx.get(worker.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["node_rank"] == 1
    r = httpx.post(worker.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 421 and "leader" in r.json()["error"]["message"]


def wait_exit(server: Server, within: float) -> float:
    start = time.monotonic()
    while server.proc.poll() is None:
        assert time.monotonic() - start < within, f"{server.url} still running {within:g} s after its peer died"
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("killed", ["worker", "leader"])
def test_a_pod_whose_peer_dies_exits_nonzero_within_the_collective_timeout(tmp_path, killed):
    leader, worker = two_pods(tmp_path)
    try:
        leader.wait_healthy()
        worker.wait_healthy()
        victim, survivor = (worker, leader) if killed == "worker" else (leader, worker)
        victim.kill()
        wait_exit(survivor, float(TIMEOUT))
        assert survivor.proc.returncode != 0
        # its reason: the link dropped, or its rank's collective failed first
        assert "exiting: " in survivor.log_path.read_text(errors="replace")
    finally:
        worker.stop()
        leader.stop()


def test_a_leader_whose_worker_never_comes_exits_nonzero(tmp_path):
    leader = Server("--model", "tiny", "--dp", "2", "--nodes", "2", "--group-port", str(free_port()),
                    "--join-timeout", "3", log_path=tmp_path / "leader.log")
    try:
        wait_exit(leader, 60)
        assert leader.proc.returncode != 0 and "did not join within 3 s" in leader.tail()
    finally:
        leader.stop()


def test_a_worker_whose_leader_never_comes_exits_nonzero(tmp_path):
    worker = Server("--model", "tiny", "--dp", "2", "--nodes", "2", "--node-rank", "1", "--group-port",
                    str(free_port()), "--join-timeout", "3", log_path=tmp_path / "worker.log")
    try:
        wait_exit(worker, 60)
        assert worker.proc.returncode != 0 and "could not join the leader" in worker.tail()
    finally:
        worker.stop()


@pytest.mark.parametrize("flags, message", [
    (("--dp", "3", "--nodes", "2"), "does not divide evenly"),
    (("--dp", "2", "--nodes", "2", "--node-rank", "2"), "--node-rank must be in 0..1"),
])
def test_a_share_of_ranks_that_cannot_be_is_refused_at_start(tmp_path, flags, message):
    server = Server("--model", "tiny", *flags, log_path=tmp_path / "server.log")
    try:
        wait_exit(server, 60)
        assert server.proc.returncode != 0 and message in server.tail()
    finally:
        server.stop()
