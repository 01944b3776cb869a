"""A server whose ranks span several pods, on loopback: one leader process and one worker process
with one rank each make one 2-rank server, and with two ranks each one 4-rank server (docs/adp.md,
servers over several pods). Every rank runs one intra-op thread (the engine's default)."""

import concurrent.futures
import multiprocessing
import multiprocessing.connection
import socket
import threading
import time
from typing import NamedTuple

import httpx
import pytest

from adpfleet.runtime.executor.node_link import HANDSHAKE_TIMEOUT_S

from servers import Server, free_port, listening

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PROMPTS = [f"the quick brown fox {i}" for i in range(6)]
TIMEOUT = "15"  # the collective timeout: a pod that loses its group exits within it
TOKEN = "multinode-internal-token"  # a server over several pods needs one (and then so do its clients)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def token_file(tmp_path):
    path = tmp_path / "internal-token"
    path.write_text(TOKEN + "\n")
    return path


def two_pods(tmp_path, *extra: str, dp: int = 2, before_worker=lambda group_port: None) -> tuple[Server, Server]:
    """A leader and a worker, the worker started once `before_worker(group_port)` returned."""
    group_port = free_port()
    common = ("--model", "tiny", "--dp", str(dp), "--nodes", "2", "--group-port", str(group_port),
              "--collective-timeout", TIMEOUT, "--internal-token-file", str(token_file(tmp_path)), *extra)
    leader = Server(*common, "--node-rank", "0", log_path=tmp_path / "leader.log")
    try:
        before_worker(group_port)
    except BaseException:
        leader.stop()
        raise
    worker = Server(*common, "--node-rank", "1", log_path=tmp_path / "worker.log",
                    env={"ADPFLEET_LEADER_ADDRESS": "127.0.0.1"})  # the address a pod gets from its env
    return leader, worker


def greedy(url: str) -> list[list[str]]:
    def one(prompt):
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                       "ignore_eos": True}, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: both ranks get requests
        return list(pool.map(one, PROMPTS))


def samples(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{")}


class Group(NamedTuple):
    leader: Server
    worker: Server
    stranger: socket.socket  # connected to the leader's group port before the worker started, silent since


def connect_when_listening(port: int, timeout: float = 60) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on the group port {port}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A 2-pod server that formed while a stranger held a connection to its group port open and
    silent (issue 25: that held the leader's only accept thread, and the worker never joined)."""
    tmp = tmp_path_factory.mktemp("group")
    stranger = []
    leader, worker = two_pods(tmp, before_worker=lambda port: stranger.append(connect_when_listening(port)))
    try:
        leader.wait_healthy()
        worker.wait_healthy()
        yield Group(leader, worker, stranger[0])
    finally:
        stranger[0].close()
        worker.stop()
        leader.stop()


def closed_by_peer(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        while conn.recv(4096):
            pass  # (the leader's greeting)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_a_silent_stranger_on_the_group_port_neither_keeps_the_group_from_forming_nor_stays(group):
    assert httpx.get(group.worker.url + "/health", timeout=10).json()["status"] == "ok"
    assert closed_by_peer(group.stranger, HANDSHAKE_TIMEOUT_S + 10)


def test_every_port_of_a_group_listens_on_the_host_it_was_given(group):
    """Issue 25: rank 0's rendezvous store listened on every interface whatever --host said. (gloo's
    own ports listen on the address the machine's hostname resolves to: the pod's IP in a pod.)"""
    allowed = {"127.0.0.1"} | {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    for pod, ports in ((group.leader, 3), (group.worker, 2)):  # HTTP, gloo's, and the leader's rank 0's store
        addresses = listening(pod)
        assert len(addresses) >= ports and {ip for ip, _ in addresses} <= allowed, (pod.url, addresses)


def test_two_pods_of_one_rank_answer_token_identically_to_one_pod_of_two_ranks(group, tmp_path):
    leader, worker, _ = group
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
    worker = group.worker
    health = httpx.get(worker.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["node_rank"] == 1
    r = httpx.post(worker.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=10)
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
                    "--join-timeout", "3", "--internal-token-file", str(token_file(tmp_path)),
                    log_path=tmp_path / "leader.log")
    try:
        wait_exit(leader, 60)
        assert leader.proc.returncode != 0 and "did not join within 3 s" in leader.tail()
    finally:
        leader.stop()


def test_a_worker_whose_leader_never_comes_exits_nonzero(tmp_path):
    worker = Server("--model", "tiny", "--dp", "2", "--nodes", "2", "--node-rank", "1", "--group-port",
                    str(free_port()), "--join-timeout", "3", "--internal-token-file", str(token_file(tmp_path)),
                    log_path=tmp_path / "worker.log")
    try:
        wait_exit(worker, 60)
        assert worker.proc.returncode != 0 and "could not join the leader" in worker.tail()
    finally:
        worker.stop()


@pytest.mark.parametrize("flags, message", [
    (("--dp", "3", "--nodes", "2"), "does not divide evenly"),
    (("--dp", "2", "--nodes", "2", "--node-rank", "2"), "--node-rank must be in 0..1"),
    (("--dp", "2", "--nodes", "2", "--node-rank", "1"), "--internal-token-file"),  # a worker without the token
])
def test_a_share_of_ranks_that_cannot_be_is_refused_at_start(tmp_path, flags, message):
    server = Server("--model", "tiny", *flags, log_path=tmp_path / "server.log")
    try:
        wait_exit(server, 60)
        assert server.proc.returncode != 0 and message in server.tail()
    finally:
        server.stop()


class CreatesMarker:
    """A pickle that creates `path` when it is unpickled (any call would do: os.system, a shell)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_leader_without_the_internal_token_refuses_to_start_and_runs_no_strangers_pickle(tmp_path):
    """Issue 25: without a token the link's key was a constant anyone could read in the source, and
    the leader unpickled what came: a stranger ran code in it."""
    marker, port = tmp_path / "a-stranger-was-here", free_port()
    leader = Server("--model", "tiny", "--dp", "2", "--nodes", "2", "--group-port", str(port), "--join-timeout", "10",
                    log_path=tmp_path / "leader.log")
    done = threading.Event()

    def stranger():
        while not done.is_set():
            try:
                with multiprocessing.connection.Client(("127.0.0.1", port), authkey=b"adpfleet-group-link") as conn:
                    conn.send(CreatesMarker(marker))
            except (OSError, EOFError, multiprocessing.AuthenticationError):
                time.sleep(0.05)
    attacker = threading.Thread(target=stranger, daemon=True)
    attacker.start()
    try:
        wait_exit(leader, 60)
    finally:
        done.set()
        attacker.join(10)
        leader.stop()
    assert not marker.exists()
    assert leader.proc.returncode != 0 and "--internal-token-file" in leader.tail()
