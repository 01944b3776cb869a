"""The group link of a server over several pods against strangers and a peer gone wrong: real
sockets between a LeaderLink and a WorkerLink in this process (no rank processes). The messages
are data of a fixed schema, never a pickle; only holders of the token join; a silent or garbled
connection holds nothing but its own thread, until the handshake's deadline."""

import json
import multiprocessing.reduction
import pickle
import queue
import socket
import threading
import time

import pytest

from adpfleet.runtime.engine.request import RequestOutput
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import SamplingParams
from adpfleet.runtime.executor import node_link
from adpfleet.runtime.executor.link_messages import FROM_RANK, TO_RANK, LinkMessageError, decode, encode
from adpfleet.runtime.executor.node_link import LeaderLink, LinkRefused, NodeTopology, RemoteRank, WorkerLink
from adpfleet.runtime.metrics import RankStats

from servers import free_port

TOKEN = "group-link-token"
STORE_PORT = 12345


class Leader:
    """A LeaderLink of a 2-rank server over 2 pods (rank 1 in the worker), with what it reports."""

    def __init__(self, port: int):
        self.topology = NodeTopology(2, 0, "127.0.0.1", port, TOKEN, join_timeout_s=30)
        self.remote = {r: RemoteRank(r) for r in range(2)}
        self.lost: queue.SimpleQueue = queue.SimpleQueue()
        self.link = LeaderLink(self.topology, "127.0.0.1", 2, STORE_PORT, self.remote, on_lost=self.lost.put)


@pytest.fixture
def leader():
    lead = Leader(free_port())
    yield lead
    lead.link.close()


def join(leader: Leader, token: str = TOKEN) -> WorkerLink:
    return WorkerLink(NodeTopology(2, 1, "127.0.0.1", leader.topology.group_port, token, join_timeout_s=10))


def request() -> Request:
    req = Request("req-7", [256, 65, 66], SamplingParams(max_tokens=5, temperature=0.7, top_k=3, top_p=0.9, seed=-3,
                                                         stop=["\n"], stop_token_ids=[2], ignore_eos=True))
    req.remote_kv, req.first_token_id = ("10.0.0.3:8001", "ctx-req-7"), 65
    return req


def stats() -> RankStats:
    s = RankStats(iterations=9, busy_pass_seconds=0.25, kv_cache_capacity_blocks=64)
    s.padding_dummies[("post_schedule", "rolled_back")] = 2
    s.requests_finished["length"] = 4
    s.time_to_first_token.observe(0.03)
    return s


def test_every_pipe_message_crosses_the_link_as_data_never_as_a_pickle(leader, monkeypatch):
    """Issue 25: the link was multiprocessing's, whose recv() unpickles what the peer sent."""
    def no_unpickling(*args, **kwargs):
        raise AssertionError("the group link unpickled a message")
    monkeypatch.setattr(pickle, "loads", no_unpickling)
    monkeypatch.setattr(multiprocessing.reduction.ForkingPickler, "loads", no_unpickling)
    worker = join(leader)
    leader.link.wait_joined()
    assert worker.store_port == STORE_PORT
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    worker.serve(lambda rank, msg: delivered.put((rank, msg)), on_lost=lambda reason: None)
    down = [("add", request()), ("abort", "req-7"), ("transfer_done", "req-7"), ("fault", "freeze"), ("stop",)]
    for msg in down:
        leader.remote[1].send(msg)
    for msg in down:
        rank, got = delivered.get(timeout=10)
        assert rank == 1 and got[0] == msg[0]
        if msg[0] == "add":
            sent, came = msg[1], got[1]
            assert [getattr(came, f) for f in ("request_id", "prompt_token_ids", "params", "remote_kv",
                                               "first_token_id")] == \
                   [getattr(sent, f) for f in ("request_id", "prompt_token_ids", "params", "remote_kv",
                                               "first_token_id")]
            assert 0 <= time.monotonic() - came.arrival_time < 10  # its age crossed, not another clock's time
        else:
            assert got == msg
    up = [("ready", 1, "10.0.0.4:8002"), ("ready", 1, None), ("stats", stats()), ("error", "rank 1: boom"),
          ("out", [RequestOutput("req-7", [65, 66], "AB", True, "length", 3, 2),
                   RequestOutput("req-8", [], "", True, "error", 0, 0, error="KV transfer failed")])]
    for msg in up:
        worker.send_up(1, msg)
    assert [leader.remote[1].recv() for _ in up] == up
    worker.close()
    assert leader.lost.get(timeout=10) == "worker pod 1 left the group"


class CreatesMarker:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


@pytest.mark.parametrize("sent", ["a pickle", "another kind", "another rank's message", "a field of another type"])
def test_a_member_that_sends_what_the_link_does_not_carry_runs_nothing_and_loses_its_place(leader, tmp_path, sent):
    marker = tmp_path / "unpickled"
    worker = join(leader)  # it holds the token: what it sends is still only data
    leader.link.wait_joined()
    data = {"a pickle": pickle.dumps(CreatesMarker(marker)),
            "another kind": json.dumps({"rank": 1, "kind": "exec", "args": ["rm -rf /"]}).encode(),
            "another rank's message": json.dumps(encode(0, ("error", "I am rank 0"))).encode(),
            "a field of another type": json.dumps({"rank": 1, "kind": "ready", "args": [1, 8002]}).encode()}[sent]
    worker.link.sock.sendall(frame(data))
    reason = leader.lost.get(timeout=10)
    assert "worker pod 1 sent what the group link does not carry" in reason, reason
    assert not marker.exists()
    assert worker.link.sock.recv(1) == b""  # the leader closed its end
    with pytest.raises(EOFError):
        leader.remote[1].recv()  # its ranks are gone for the leader's group: the server dies, as for a lost pod


def test_a_wrong_token_is_refused_and_the_real_worker_still_joins(leader):
    with pytest.raises(LinkRefused, match="proof does not match this server's internal token"):
        join(leader, token="another-token")
    join(leader)
    leader.link.wait_joined()


def test_a_worker_refuses_a_leader_that_cannot_prove_the_token():
    fake = socket.create_server(("127.0.0.1", 0))

    def play_leader():
        conn, _ = fake.accept()
        with conn:
            conn.sendall(frame(json.dumps({"link": node_link.LINK_VERSION, "challenge": "c" * 32}).encode()))
            conn.recv(4096)
            conn.sendall(frame(json.dumps({"rendezvous": 29500, "proof": "0" * 64}).encode()))
            conn.recv(1)
    threading.Thread(target=play_leader, daemon=True).start()
    with pytest.raises(LinkRefused, match="the leader's proof does not match"):
        WorkerLink(NodeTopology(2, 1, "127.0.0.1", fake.getsockname()[1], TOKEN, join_timeout_s=10))
    fake.close()


def test_a_server_over_several_pods_needs_the_token():
    with pytest.raises(ValueError, match="--internal-token-file"):
        NodeTopology(2, 0, token=None).validate(2)
    NodeTopology(1, 0, token=None).validate(2)  # one pod: no link to guard


def closed_within(conn: socket.socket, seconds: float) -> bool:
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def drip(conn: socket.socket, every_s: float, times: int) -> None:
    """A frame that says 100 bytes follow, then one byte every `every_s`: every read succeeds."""
    def run():
        try:
            conn.sendall((100).to_bytes(4, "big"))
            for _ in range(times):
                time.sleep(every_s)
                conn.send(b" ")
        except OSError:
            pass
    threading.Thread(target=run, daemon=True).start()


DEADLINE_S = 2.5  # the handshake's, in this test: long enough to tell 'at once' from 'by the deadline'


def test_strangers_that_hold_the_group_port_keep_no_worker_out_and_are_closed_at_the_deadline(monkeypatch):
    """Issue 25: one silent connection held the leader's only accept thread in its handshake (no
    deadline), and the real worker never joined."""
    monkeypatch.setattr(node_link, "HANDSHAKE_TIMEOUT_S", DEADLINE_S)
    threads = threading.active_count()
    leader = Leader(free_port())
    address = ("127.0.0.1", leader.topology.group_port)
    strangers = [socket.create_connection(address, timeout=5) for _ in range(node_link.MAX_UNPROVEN + 2)]
    worker = None
    try:
        dripping, garbled = strangers[-2], strangers[-1]
        garbled.sendall(frame(b"[1, 2]"))
        drip(dripping, every_s=0.3, times=30)
        t0 = time.monotonic()
        worker = join(leader)
        leader.link.wait_joined()
        assert closed_within(strangers[0], 1) and closed_within(strangers[1], 1)  # at once: room for the newer ones
        assert closed_within(garbled, 1)  # refused as soon as it spoke
        for conn in strangers[2:-1]:  # the silent and the dripping: by the deadline
            assert closed_within(conn, DEADLINE_S + 3), "a stranger outlived the handshake's deadline"
        assert time.monotonic() - t0 < DEADLINE_S + 3
    finally:
        if worker is not None:
            worker.close()
        leader.link.close()
        for conn in strangers:
            conn.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


@pytest.mark.parametrize("obj, kinds, match", [
    ({"rank": 1, "kind": "add", "args": [{"request_id": "r"}]}, TO_RANK, "add[0]: missing"),
    ({"rank": 1, "kind": "stop", "args": [], "code": "x"}, TO_RANK, "unknown code"),
    ({"rank": -1, "kind": "stop", "args": []}, TO_RANK, "'rank'"),
    ({"rank": 1, "kind": "stats", "args": [{}]}, TO_RANK, "'kind' 'stats' is not one of"),  # the wrong way
    ({"rank": 1, "kind": "out", "args": [[{"request_id": 5}]]}, FROM_RANK, "out[0][0]"),
    ({"rank": 1, "kind": "ready", "args": [True, None]}, FROM_RANK, "ready[0] must be a int"),
    ([1, 2], FROM_RANK, "the message must be a JSON object"),
])
def test_a_message_off_the_schema_is_refused_naming_where(obj, kinds, match):
    with pytest.raises(LinkMessageError, match=match.replace("[", r"\[").replace("]", r"\]")):
        decode(obj, kinds)


def test_rank_stats_cross_whole():
    s = stats()
    assert decode(json.loads(json.dumps(encode(1, ("stats", s)))), FROM_RANK) == (1, ("stats", s))
