"""The KV transfer against hostile peers, both ways: a generation rank never trusts a header, a
context rank never lets a puller pin KV, threads or memory (real sockets, no rank processes)."""

import json
import socket
import threading
import time

import pytest
import torch

from adpfleet.runtime.executor import kv_transfer
from adpfleet.runtime.executor.kv_transfer import KVLayout, KVTransferError, fetch, proof

from rogue_kv import RogueKVPeer

BS, TOKENS = 4, 10
TABLE = [3, 1, 2]  # a paged cache: the request's blocks in any order
TOKEN = "fleet-internal-token"


@pytest.fixture
def held():
    """A context rank's caches and one held request; `held.done` counts ended transfers."""
    class Held:
        k = torch.randn(2, 5 * BS, 2, 8)
        v = torch.randn(2, 5 * BS, 2, 8)
        done = 0
        handles = {"req-1": (TABLE, TOKENS)}

        def lookup(self, handle):
            if handle not in self.handles:
                return None

            def on_done():
                self.done += 1
                self.handles.pop(handle, None)
            return self.handles[handle], on_done
    return Held()


@pytest.fixture
def server(held):
    s = kv_transfer.KVTransferServer("127.0.0.1", 0, held.k, held.v, held.lookup, BS, token=TOKEN,
                                     transfer_timeout_s=2.0, max_connections=4, max_unproven=6)
    yield s
    s.close()


def layout_of(held) -> KVLayout:
    return KVLayout.of(held.k)


def wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_pull_with_the_token_gets_exactly_the_held_positions_and_ends_the_transfer(server, held):
    payload = fetch(server.endpoint, "req-1", 5, layout_of(held), TOKENS, TOKEN)
    slots = torch.tensor([TABLE[p // BS] * BS + p % BS for p in range(TOKENS)])
    assert torch.equal(payload.k, held.k[:, slots]) and torch.equal(payload.v, held.v[:, slots])
    wait(lambda: held.done == 1)


@pytest.mark.parametrize("token", [None, "another-token"])
def test_a_pull_without_the_fleets_token_is_refused_and_leaves_the_kv_held(server, held, token):
    with pytest.raises(KVTransferError, match="unauthorized"):
        fetch(server.endpoint, "req-1", 5, layout_of(held), TOKENS, token)
    assert held.done == 0 and "req-1" in held.handles
    fetch(server.endpoint, "req-1", 5, layout_of(held), TOKENS, TOKEN)  # the real puller still can


def raw_pull(server, line: bytes, read_header=True):
    host, port = server.endpoint.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.sendall(line)
    header = conn.makefile("rb").readline() if read_header else None
    return conn, header


def test_an_unacknowledged_pull_ends_at_the_transfer_deadline_and_frees_the_kv(server, held):
    conn, header = raw_pull(server, b"ADPKV2 GET req-1 " + proof(TOKEN, "req-1").encode() + b"\n")
    assert json.loads(header)["status"] == "ok"
    time.sleep(0.5)
    assert held.done == 0  # still within its deadline: the blocks are being read
    wait(lambda: held.done == 1, timeout=2.0 + 2)  # the 2 s deadline passed: ended, freed
    conn.close()


def test_a_puller_that_closes_midway_ends_the_transfer_at_once(server, held):
    conn, _ = raw_pull(server, b"ADPKV2 GET req-1 " + proof(TOKEN, "req-1").encode() + b"\n")
    conn.close()
    wait(lambda: held.done == 1, timeout=1.5)


@pytest.mark.parametrize("line, message", [
    (b"GET req-1\n", "malformed request line"), (b"ADPKV2 GET req-1\r\nGET other x\n", "malformed"),
    (b"\xff" * 300 + b"\n", "malformed request line"), (b"ADPKV2 GET ../../etc x\n", "malformed handle"),
    (b"ADPKV2 GET " + b"h" * 129 + b" x\n", "malformed handle"), (b"ADPKV1 GET req-1\n", "malformed request line"),
])
def test_malformed_request_lines_are_refused_with_a_message(server, held, line, message):
    conn, header = raw_pull(server, line)
    reply = json.loads(header)
    assert reply["status"] == "error" and message in reply["message"]
    assert held.done == 0
    conn.close()


def reply(conn: socket.socket, within: float) -> dict:
    conn.settimeout(within)
    return json.loads(conn.makefile("rb").readline() or b"{}")


def test_unproven_connections_take_no_slot_are_capped_on_their_own_and_closed_at_their_deadline(server, held):
    """Issue 25: a connection took one of the rank's slots before its proof was read, so strangers
    without the token holding more connections than there are slots made every pull 'busy'."""
    host, port = server.endpoint.rsplit(":", 1)
    threads = threading.active_count()
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(6)]  # 6 unproven, 4 slots
    payload = fetch(server.endpoint, "req-1", 5, layout_of(held), TOKENS, TOKEN)  # the 7th: its proof came at once
    assert payload.k.shape[1] == TOKENS
    assert "busy" in reply(idle[0], 3)["message"]  # the oldest made room for it
    t0 = time.monotonic()
    for conn in idle[1:]:  # the others: closed once their time to prove the token passed
        assert "no whole request line" in reply(conn, kv_transfer.UNPROVEN_TIMEOUT_S + 3)["message"]
        conn.close()
    assert time.monotonic() - t0 < kv_transfer.UNPROVEN_TIMEOUT_S + 3
    idle[0].close()
    wait(lambda: threading.active_count() <= threads)


LAYOUT = KVLayout(2, 2, 8, "float32")


def header(**over):
    return {**LAYOUT.header(TOKENS), **over}


@pytest.mark.parametrize("case, bad, match", [
    ("more tokens than the prompt", header(tokens=TOKENS + 30, nbytes=LAYOUT.nbytes(TOKENS + 30)), "'tokens'"),
    ("2**40 bytes", header(nbytes=2**40), "'nbytes'"),
    ("another model's layers", header(layers=7), "'layers'"),
    ("another model's heads", header(kv_heads=4), "'kv_heads'"),
    ("another model's head_dim", header(head_dim=64), "'head_dim'"),
    ("another dtype", header(dtype="bfloat16"), "'dtype'"),
    ("an unknown dtype", header(dtype="float8"), "'dtype'"),
    ("strings for numbers", header(layers="2"), "'layers'"),
    ("true for 1", header(kv_heads=True), "'kv_heads'"),
    ("a refusal", {"status": "error", "message": "x" * 3000}, "refused: x{300}$"),  # quoted, truncated
    ("not an object", [1, 2], "not a JSON object"),
    ("not JSON", b"\x00garbage\n", "JSONDecodeError"),
    ("nested JSON", b"[" * 2000 + b"\n", "Error"),
    ("a header line that never ends", b"x" * 100000, "longer than"),
])
def test_a_header_that_does_not_fit_the_local_model_and_prompt_fails_the_pull(case, bad, match):
    rogue = RogueKVPeer(bad, b"\0" * LAYOUT.nbytes(TOKENS))
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match=match):
            fetch(rogue.endpoint, "h", 5, LAYOUT, TOKENS)
        assert time.monotonic() - t0 < 3  # refused from the header, not by the deadline
    finally:
        rogue.close()


def test_a_json_true_is_not_a_count_of_one():
    one_head = KVLayout(2, 1, 8, "float32")
    rogue = RogueKVPeer({**one_head.header(TOKENS), "kv_heads": True}, b"\0" * one_head.nbytes(TOKENS))
    try:
        with pytest.raises(KVTransferError, match="'kv_heads'"):
            fetch(rogue.endpoint, "h", 5, one_head, TOKENS)
    finally:
        rogue.close()


def test_a_handle_that_is_not_plain_never_reaches_the_peer():
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    try:
        with pytest.raises(KVTransferError, match="malformed handle"):
            fetch(f"127.0.0.1:{listener.getsockname()[1]}", "req-1\r\nGET other", 2, LAYOUT, TOKENS)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


@pytest.mark.parametrize("kind", ["short then closed", "stalled", "dripped"])
def test_a_peer_that_never_completes_fails_the_pull_by_its_deadline(kind):
    body = b"\0" * (LAYOUT.nbytes(TOKENS) // 2) if kind != "dripped" else b"\0" * LAYOUT.nbytes(TOKENS)
    rogue = RogueKVPeer(header(), body, stall_s=30 if kind == "stalled" else 0, drip=kind == "dripped")
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError):
            fetch(rogue.endpoint, "h", 1.5, LAYOUT, TOKENS)
        assert time.monotonic() - t0 < 3  # the deadline covers the whole pull, not each read
    finally:
        rogue.close()


@pytest.mark.parametrize("endpoint, handle", [("127.0.0.1:1", "a\r\nGET b"), ("127.0.0.1:notaport", "h"),
                                              ("evil host:80", "h"), ("127.0.0.1:99999", "h"), ("", "h")])
def test_endpoints_and_handles_that_are_not_plain_are_refused_before_any_connection(endpoint, handle):
    with pytest.raises(KVTransferError):
        fetch(endpoint, handle, 2, LAYOUT, TOKENS)


@pytest.mark.parametrize("endpoint, parsed", [
    ("10.0.0.3:8001", ("10.0.0.3", 8001)), ("[fd00::3]:8001", ("fd00::3", 8001)),
    ("ctx-0.fleet.svc:8001", ("ctx-0.fleet.svc", 8001)), ("127.0.0.1:65535", ("127.0.0.1", 65535)),
    ("127.0.0.1:0", None), ("127.0.0.1:65536", None), ("127.0.0.1:99999", None), ("127.0.0.1", None),
    ("fd00::3:8001", None), ("[nope]:1", None), ("a b:1", None), ("-host:1", None), ("h\r\n:1", None),
    ("x" * 400 + ":1", None),
])
def test_an_endpoint_is_host_and_tcp_port_and_nothing_else(endpoint, parsed):
    from adpfleet.runtime.executor.kv_endpoint import format_endpoint, parse_endpoint

    if parsed is None:
        with pytest.raises(ValueError):
            parse_endpoint(endpoint)
    else:
        assert parse_endpoint(endpoint) == parsed and format_endpoint(*parsed) == endpoint


# -- persistent connections -------------------------------------------------------------------------
def expected(held, handle):
    table, tokens = held.handles[handle]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(tokens)])
    return held.k[:, slots], held.v[:, slots]


def test_a_puller_reuses_its_connection_and_each_pull_gets_its_own_kv(server, held):
    held.handles.update({"req-2": ([0, 4, 2], 12), "req-3": ([4], 3)})
    want = {h: expected(held, h) for h in held.handles}
    puller = kv_transfer.KVPuller(layout_of(held), 5, TOKEN)
    try:
        for handle in ("req-1", "req-2", "req-3"):
            payload = puller.pull(server.endpoint, handle, want[handle][0].shape[1])
            assert torch.equal(payload.k, want[handle][0]) and torch.equal(payload.v, want[handle][1])
            payload.release()  # its buffer takes the next pull
            assert payload.k is None  # a released payload reads nothing
        assert server.accepted == 1  # three pulls, one connection
        assert puller.buffers.allocated == 1
        wait(lambda: held.done == 3)
        with pytest.raises(KVTransferError, match="no held KV"):  # a handle is still pulled once
            puller.pull(server.endpoint, "req-1", TOKENS)
    finally:
        puller.close()


class SlowlyGivenBack(threading.BoundedSemaphore):
    """Slots whose release takes a while, as on a loaded machine: the moment between a connection's
    end and its slot's return, when a new connection must not be told "busy"."""

    def release(self, n=1):
        time.sleep(0.2)
        super().release(n)


def test_a_connection_waiting_between_pulls_gives_its_slot_to_a_new_one(held):
    held.handles.update({"req-2": ([0, 4, 2], 12), "req-3": ([4], 3)} | {f"busy-{i}": ([0], 4) for i in range(3)})
    server = kv_transfer.KVTransferServer("127.0.0.1", 0, held.k, held.v, held.lookup, BS, token=TOKEN,
                                          transfer_timeout_s=30.0, max_connections=4)
    server._slots = SlowlyGivenBack(4)
    puller = kv_transfer.KVPuller(layout_of(held), 5, TOKEN)
    busy = [raw_pull(server, f"ADPKV2 GET busy-{i} {proof(TOKEN, f'busy-{i}')}\n".encode())[0]
            for i in range(3)]  # three slots held by pulls not yet acknowledged
    try:
        puller.pull(server.endpoint, "req-1", TOKENS)  # the fourth of 4 slots, kept open
        wait(lambda: server._waiting)  # acknowledged: it waits for its next pull
        fetch(server.endpoint, "req-2", 5, layout_of(held), 12, TOKEN)  # not "busy": the waiting one made room
        payload = puller.pull(server.endpoint, "req-3", 3)  # its connection was closed: a new one
        assert torch.equal(payload.k, held.k[:, 16:19]) and server.accepted == 6
    finally:
        puller.close()
        for conn in busy:
            conn.close()
        server.close()


def test_a_slot_on_its_way_back_is_not_busy(held):
    held.handles.update({"req-2": ([0, 4, 2], 12)})
    want = expected(held, "req-2")[0]
    server = kv_transfer.KVTransferServer("127.0.0.1", 0, held.k, held.v, held.lookup, BS, token=TOKEN,
                                          max_connections=1)
    server._slots = SlowlyGivenBack(1)
    try:
        fetch(server.endpoint, "req-1", 5, layout_of(held), TOKENS, TOKEN)  # the one slot, ending with the fetch
        wait(lambda: held.done == 1 and not server._waiting)  # the server saw it end; the slot not back yet
        payload = fetch(server.endpoint, "req-2", 5, layout_of(held), 12, TOKEN)
        assert torch.equal(payload.k, want)
    finally:
        server.close()


CONTEXT_KV_SERVER = """
import sys, time, torch
from adpfleet.runtime.executor.kv_transfer import KVTransferServer
torch.manual_seed(int(sys.argv[2]))
k, v = torch.randn(2, 20, 2, 8), torch.randn(2, 20, 2, 8)
server = KVTransferServer("127.0.0.1", int(sys.argv[1]), k, v, lambda h: (([3, 1, 2], 10), lambda: None), 4,
                          token=sys.argv[3])
print(server.endpoint, flush=True)
time.sleep(600)
"""


def context_kv_server(port: int, seed: int):
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", CONTEXT_KV_SERVER, str(port), str(seed), TOKEN],
                            stdout=subprocess.PIPE, text=True)
    torch.manual_seed(seed)
    k, v = torch.randn(2, 20, 2, 8), torch.randn(2, 20, 2, 8)
    slots = torch.tensor([TABLE[p // BS] * BS + p % BS for p in range(TOKENS)])
    return proc, proc.stdout.readline().strip(), (k[:, slots], v[:, slots])


@pytest.mark.parametrize("seen", ["closed before the pull", "found closed by the pull"])
def test_a_pooled_connection_to_a_restarted_context_server_is_dropped_and_the_pull_retried(seen, monkeypatch):
    if seen == "found closed by the pull":  # the peer's close is still in flight when the connection is taken
        monkeypatch.setattr(kv_transfer.KVPuller, "_pooled", lambda self, peer: self._idle.get(peer, [(None,)]).pop()[0]
                            if self._idle.get(peer) else None)
    puller = kv_transfer.KVPuller(LAYOUT, 5, TOKEN)
    first, endpoint, want = context_kv_server(0, seed=1)
    try:
        assert torch.equal(puller.pull(endpoint, "a", TOKENS).k, want[0])
        first.kill()
        first.wait()
        again, endpoint_again, want = context_kv_server(int(endpoint.rsplit(":", 1)[1]), seed=2)
        assert endpoint_again == endpoint
        try:
            for handle in ("b", "c"):  # the new server's KV, on one new connection that stays
                payload = puller.pull(endpoint, handle, TOKENS)
                assert torch.equal(payload.k, want[0]) and torch.equal(payload.v, want[1])
            assert [len(conns) for conns in puller._idle.values()] == [1]
        finally:
            again.kill()
            again.wait()
    finally:
        first.kill()
        first.wait()
        puller.close()


def test_a_connection_closed_to_make_room_as_its_pull_arrives_leaves_the_handle_for_the_retry(server, held):
    held.handles.update({"req-2": ([0, 4, 2], 12)})
    puller = kv_transfer.KVPuller(layout_of(held), 5, TOKEN)
    try:
        puller.pull(server.endpoint, "req-1", TOKENS)
        wait(lambda: server._waiting)
        with server._lock:  # what a new connection at the cap does, caught just before the shutdown
            server._waiting.clear()
        want = expected(held, "req-2")
        payload = puller.pull(server.endpoint, "req-2", 12)  # its line reaches a connection that is closing
        assert torch.equal(payload.k, want[0]) and torch.equal(payload.v, want[1])
        assert server.accepted == 2  # the retry's new connection
    finally:
        puller.close()


def test_a_finished_pull_wakes_an_idle_rank_loop_at_once():
    import multiprocessing

    from adpfleet.runtime.executor.rank_process import _Arrivals

    arrivals = _Arrivals()
    ours, _theirs = multiprocessing.Pipe()
    threading.Timer(0.2, arrivals.put, args=(("request", None),)).start()
    t0 = time.monotonic()
    arrivals.wait(ours, timeout=30)  # the loop's wait for messages from the server
    assert time.monotonic() - t0 < 10 and not arrivals.empty() and arrivals.get() == ("request", None)
    t0 = time.monotonic()
    arrivals.wait(ours, timeout=0.3)  # the wake-up was consumed: nothing new, the full timeout
    assert time.monotonic() - t0 >= 0.25
