"""Hostile and careless clients against real servers and the router (issue 13's probes).

One fleet with every guard on — API key (from the environment on the servers, from a file on the
router), the internal token, fault injection, short read and transfer timeouts, a small waiting
queue — and an aggregated server on a model directory whose chat template refuses some
conversations. Every probe must get a 4xx with a message (or its documented answer), and the
server must be alive and serving afterwards; aborted or unacknowledged transfers give their KV
back; slow clients leave no thread or socket behind.
"""

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import psutil
import pytest

from adpfleet.runtime.executor.kv_transfer import MAX_CONNECTIONS, MAX_UNPROVEN, UNPROVEN_TIMEOUT_S, KVLayout, proof
from adpfleet.runtime.model.tiny import tiny_config

from chat_model import save_chat_model
from rogue_kv import RogueKVPeer, SilentCrowd
from servers import RouterProcess, Server, metric, rank_processes, trio, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

KEY, TOKEN = "sk-hostile-api-key", "hostile-internal-token"
AUTH, INTERNAL = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {TOKEN}"}
READ_TIMEOUT_S, TRANSFER_TIMEOUT_S, MAX_WAITING = 2, 3, 6
TINY = tiny_config("tiny")
LAYOUT = KVLayout(TINY.num_hidden_layers, TINY.num_key_value_heads, TINY.head_dim, "float32")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile")
    (logs / "token").write_text(TOKEN + "\n")
    (logs / "key").write_text(KEY + "\n")
    model = save_chat_model(logs / "chat-model")
    flags = ("--internal-token-file", str(logs / "token"), "--fault-injection", "--read-timeout", str(READ_TIMEOUT_S),
             "--max-waiting-requests", str(MAX_WAITING), "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S),
             "--kv-lease", "300")  # a lease far away: KV that comes back came back because its transfer ended
    with trio(logs, *flags, dp=1, env={"ADPFLEET_API_KEY": KEY}, headers=AUTH,
              per_role={"aggregated": ["--model", str(model)]}) as servers:
        router = RouterProcess(logs, "--context", servers["context"].url, "--generation", servers["generation"].url,
                               "--api-key-file", str(logs / "key"), "--internal-token-file", str(logs / "token"),
                               "--read-timeout", str(READ_TIMEOUT_S), "--health-interval", "0.5", headers=AUTH)
        try:
            router.wait_healthy()
            yield {**servers, "router": router}
        finally:
            router.stop()


def post(target, body=None, path="/v1/completions", headers=AUTH, raw=None, timeout=60):
    kw = {"content": raw, "headers": {**headers, "content-type": "application/json"}} if raw is not None else \
        {"json": body, "headers": headers}
    return httpx.post(target.url + path, timeout=timeout, **kw)


def disaggregated_params(fleet, prompt="pull me " * 8):
    r = post(fleet["context"], {"prompt": prompt, "max_tokens": 8, "ignore_eos": True})  # never done at token 1
    assert r.status_code == 200, r.text
    return r.json()["disaggregated_params"]


def serves(fleet, name):
    """The target is healthy and answers a normal request (a whole disaggregated one for the
    context and generation roles, so that no KV is left held)."""
    target = fleet[name]
    assert httpx.get(target.url + "/health", timeout=10).status_code == 200
    if name in ("context", "generation"):
        params = disaggregated_params(fleet, "still serving")
        r = post(fleet["generation"], {"prompt": "x", "max_tokens": 3, "disaggregated_params": params},
                 headers=INTERNAL)
    else:
        r = post(target, {"prompt": "still serving", "max_tokens": 3})
    assert r.status_code == 200, r.text
    return True


def refused(r, status=400, param="unset"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param != "unset":
        assert err["param"] == param, err
    return err


# -- 1, 5, 6: bad input is a 4xx; the rank, the server and the router go on ------------------------
NESTED = b'{"prompt": "x", "stop": ' + b"[" * 1500 + b"]" * 1500 + b"}"
PROBES = {
    "seed 2**64": ({"prompt": "x", "temperature": 1.0, "seed": 2**64}, "seed"),
    "seed below int64": ({"prompt": "x", "temperature": 1.0, "seed": -2**63 - 1}, "seed"),
    "1,500-deep JSON": (NESTED, None),
    "100-deep JSON": (b'{"prompt": "x", "stop": ' + b"[" * 100 + b"]" * 100 + b"}", "stop"),
    "model lone surrogate": (b'{"prompt": "x", "model": "\\ud800"}', "model"),
    "prompt lone surrogate": (b'{"prompt": "\\ud800"}', "prompt"),
    "100k stop strings": ({"prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}, "stop"),
    "10k-character stop string": ({"prompt": "x", "stop": ["x" * 10_000]}, "stop"),
    "100k stop token ids": ({"prompt": "x", "stop_token_ids": list(range(100_000))}, "stop_token_ids"),
    "not JSON": (b"{nope", None),
    "a JSON array": (b"[1, 2]", None),
}


@pytest.mark.parametrize("target", ["aggregated", "router"])
@pytest.mark.parametrize("probe", list(PROBES))
def test_bad_input_is_a_4xx_with_a_message_and_everything_serves_on(fleet, target, probe):
    body, param = PROBES[probe]
    r = post(fleet[target], raw=body) if isinstance(body, bytes) else post(fleet[target], {**body, "max_tokens": 2})
    refused(r, 400, param)
    assert serves(fleet, target)


@pytest.mark.parametrize("content, match", [("raise", "roles must alternate"), ("escape", "unsafe")])
def test_a_chat_template_that_raises_or_hits_the_sandbox_is_a_400(fleet, content, match):
    r = post(fleet["aggregated"], {"messages": [{"role": "user", "content": content}], "max_tokens": 2},
             path="/v1/chat/completions")
    assert match in refused(r, 400, "messages")["message"]
    ok = post(fleet["aggregated"], {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              path="/v1/chat/completions")
    assert ok.status_code == 200 and serves(fleet, "aggregated")


@pytest.mark.parametrize("target", ["aggregated", "router"])
def test_a_vanishing_temperature_is_greedy_not_a_crash(fleet, target):
    greedy = post(fleet[target], {"prompt": "cold", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    tiny = post(fleet[target], {"prompt": "cold", "max_tokens": 6, "temperature": 1e-45, "ignore_eos": True})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# -- 4, 9: authentication --------------------------------------------------------------------------
GUARDED = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
           ("POST", "/faults"), ("GET", "/docs"), ("GET", "/openapi.json")]
WRONG = {"none": {}, "wrong": {"Authorization": "Bearer nope"}, "prefix": {"Authorization": f"Bearer {KEY[:-1]}"},
         "basic": {"Authorization": f"Basic {KEY}"}, "empty": {"Authorization": "Bearer"}}


@pytest.mark.parametrize("target", ["aggregated", "context", "generation", "router"])
def test_every_path_but_health_and_metrics_needs_the_key(fleet, target):
    url = fleet[target].url
    for method, path in GUARDED:
        for name, header in WRONG.items():
            r = httpx.request(method, url + path, headers=header, json={"kind": "freeze"}, timeout=10)
            assert r.status_code == 401, (path, name, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    for path in ("/health", "/metrics"):  # kubelet probes and Prometheus scrapes carry no credential
        assert httpx.get(url + path, timeout=10).status_code == 200
    for path in ("/docs", "/openapi.json"):  # off unless --enable-docs
        assert httpx.get(url + path, headers=AUTH, timeout=10).status_code == 404
    assert serves(fleet, target)


def test_faults_need_the_key_and_only_then_reach_the_handler(fleet):
    url = fleet["aggregated"].url + "/faults"
    assert httpx.post(url, json={"kind": "freeze"}).status_code == 401  # never reachable without it
    assert "bad fault" in refused(httpx.post(url, json={"kind": "bogus"}, headers=AUTH))["message"]
    assert serves(fleet, "aggregated")


def test_the_router_speaks_to_its_servers_with_the_internal_token(fleet):
    client = openai.OpenAI(base_url=fleet["router"].url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt="through the fleet", max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="through the fleet", max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == out.choices[0].text
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.AuthenticationError):  # the router's clients hold the API key, not the token
        openai.OpenAI(base_url=fleet["router"].url + "/v1", api_key=TOKEN, max_retries=0).models.list()


# -- 2: a generation server trusts no KV peer ---------------------------------------------------------
def test_disaggregated_params_with_only_the_api_key_are_forbidden(fleet):
    params = disaggregated_params(fleet)
    r = post(fleet["generation"], {"prompt": "x", "max_tokens": 3, "disaggregated_params": params})
    assert "internal token" in refused(r, 403, "disaggregated_params")["message"]
    ok = post(fleet["generation"], {"prompt": "x", "max_tokens": 3, "disaggregated_params": params}, headers=INTERNAL)
    assert ok.status_code == 200  # the refusal did not consume the handle


PROMPT_IDS = [256, 65, 66, 67]
GOOD = LAYOUT.header(len(PROMPT_IDS))
ROGUES = {
    "more tokens than the prompt": ({**GOOD, "tokens": 40, "nbytes": LAYOUT.nbytes(40)}, LAYOUT.nbytes(40), "'tokens'"),
    "2**40 bytes": ({**GOOD, "nbytes": 2**40}, 0, "'nbytes'"),
    "another shape": ({**GOOD, "layers": 7}, GOOD["nbytes"], "'layers'"),
    "another dtype": ({**GOOD, "dtype": "bfloat16"}, GOOD["nbytes"], "'dtype'"),
    "not JSON": (b"\x00\xff garbage\n", 0, "JSONDecodeError"),
    "half the bytes, then closed": (GOOD, GOOD["nbytes"] // 2, "connection closed"),
    "half the bytes, then silence": (GOOD, -(GOOD["nbytes"] // 2), "within"),
}


@pytest.mark.parametrize("rogue", list(ROGUES))
def test_a_rogue_kv_peer_fails_only_its_request(fleet, rogue):
    header, nbytes, match = ROGUES[rogue]
    peer = RogueKVPeer(header, b"\0" * abs(nbytes), stall_s=3 * TRANSFER_TIMEOUT_S if nbytes < 0 else 0)
    params = {"ctx_request_id": "rogue", "first_token_id": 65, "prompt_token_ids": PROMPT_IDS,
              "kv_endpoint": peer.endpoint, "kv_handle": "rogue-1"}
    t0 = time.monotonic()
    r = post(fleet["generation"], {"prompt": "x", "max_tokens": 4, "disaggregated_params": params}, headers=INTERNAL)
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S + 5  # never hangs past the transfer deadline
    err = refused(r, 502)
    assert err["type"] == "kv_transfer_failed" and match in err["message"], err
    assert serves(fleet, "generation")
    assert wait_until(lambda: metric(fleet["generation"], "adpfleet_kv_cache_blocks_used") == 0, 10)


@pytest.mark.parametrize("field, value", [("kv_handle", "a\r\nGET other"), ("kv_handle", "x" * 200),
                                          ("kv_endpoint", "127.0.0.1:notaport"), ("kv_endpoint", "host with space:1"),
                                          ("kv_endpoint", "127.0.0.1:70000")])
def test_handles_and_endpoints_that_are_not_plain_are_refused_before_any_connection(fleet, field, value):
    params = {"ctx_request_id": "x", "first_token_id": 65, "prompt_token_ids": PROMPT_IDS,
              "kv_endpoint": "127.0.0.1:1", "kv_handle": "h", field: value}
    r = post(fleet["generation"], {"prompt": "x", "max_tokens": 2, "disaggregated_params": params}, headers=INTERNAL)
    assert field in refused(r, 400, "disaggregated_params")["message"]


# -- 3: the KV port: nothing pins KV or threads ---------------------------------------------------------
def kv_connect(params) -> socket.socket:
    host, port = params["kv_endpoint"].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def pull_line(params, token=TOKEN) -> bytes:
    return f"ADPKV2 GET {params['kv_handle']} {proof(token, params['kv_handle'])}\n".encode()


def kv_used(fleet) -> float:
    return metric(fleet["context"], "adpfleet_kv_cache_blocks_used")


def test_a_pull_without_the_token_is_refused_and_the_kv_stays_for_the_real_puller(fleet):
    params = disaggregated_params(fleet)
    with kv_connect(params) as conn:
        conn.sendall(f"ADPKV2 GET {params['kv_handle']} -\n".encode())
        assert "unauthorized" in json.loads(conn.makefile("rb").readline())["message"]
    assert kv_used(fleet) > 0
    r = post(fleet["generation"], {"prompt": "x", "max_tokens": 3, "disaggregated_params": params}, headers=INTERNAL)
    assert r.status_code == 200 and wait_until(lambda: kv_used(fleet) == 0, 10)


@pytest.mark.parametrize("how", ["never acknowledged", "closed after the header"])
def test_an_aborted_or_unacknowledged_pull_gives_the_kv_back(fleet, how):
    params = disaggregated_params(fleet)
    conn = kv_connect(params)
    conn.sendall(pull_line(params))
    assert json.loads(conn.makefile("rb").readline())["status"] == "ok"
    assert kv_used(fleet) > 0
    if how == "closed after the header":
        conn.close()
    t0 = time.monotonic()
    assert wait_until(lambda: kv_used(fleet) == 0, TRANSFER_TIMEOUT_S + 5), "the KV stayed held"
    assert time.monotonic() - t0 < TRANSFER_TIMEOUT_S + 5  # by the transfer deadline, not the 300 s lease
    conn.close()
    assert metric(fleet["context"], "adpfleet_kv_transfers_in_flight") == 0
    assert serves(fleet, "generation")


def rank_process(server) -> psutil.Process:
    [rank] = rank_processes(server)
    return rank


def test_idle_kv_connections_are_capped_closed_and_leave_no_thread(fleet):
    params = disaggregated_params(fleet)
    rank = rank_process(fleet["context"])
    threads = rank.num_threads()
    idle = [kv_connect(params) for _ in range(MAX_UNPROVEN + 10)]
    time.sleep(0.5)
    assert rank.num_threads() <= threads + MAX_UNPROVEN  # one thread per connection, at most the cap
    busy = 0
    for conn in idle:  # the oldest made room for the newer; the rest wait out their time to prove the token
        conn.settimeout(UNPROVEN_TIMEOUT_S + 5)
        busy += "busy" in json.loads(conn.makefile("rb").readline() or b"{}").get("message", "")
        conn.close()
    assert busy >= 10
    assert wait_until(lambda: rank.num_threads() <= threads, 10), (rank.num_threads(), threads)
    r = post(fleet["generation"], {"prompt": "x", "max_tokens": 3, "disaggregated_params": params}, headers=INTERNAL)
    assert r.status_code == 200 and wait_until(lambda: kv_used(fleet) == 0, 10)


def test_strangers_holding_more_connections_than_a_rank_has_slots_take_none_of_them(fleet):
    """Issue 25: a connection took one of a rank's slots before its proof was read, so strangers holding
    17 (and reopening each one the server closed) made every pull 'busy' and every request fail."""
    params = disaggregated_params(fleet)
    host, port = params["kv_endpoint"].rsplit(":", 1)
    with SilentCrowd((host, int(port)), 2 * MAX_CONNECTIONS + 8):
        for i in range(3):  # the whole way: router, context step, the pull, generation
            r = post(fleet["router"], {"prompt": f"through the crowd {i}", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
        r = post(fleet["generation"], {"prompt": "x", "max_tokens": 3, "disaggregated_params": params},
                 headers=INTERNAL)
        assert r.status_code == 200, r.text
    assert wait_until(lambda: kv_used(fleet) == 0, 10)


# -- 5: slow clients, big bodies, too many requests, the deadline ---------------------------------------
def open_sockets(proc: psutil.Process) -> int:
    return len(proc.net_connections(kind="tcp"))


@pytest.mark.parametrize("target", ["aggregated", "router"])
def test_slow_clients_are_cut_off_at_the_read_timeout_and_leave_nothing_behind(fleet, target):
    server = fleet[target]
    assert serves(fleet, target)
    proc = psutil.Process(server.proc.pid)
    threads, sockets = proc.num_threads(), open_sockets(proc)
    slow = []
    for i in range(60):
        conn = socket.create_connection((server.host, server.port), timeout=10)
        if i % 3 == 0:  # headers that never end
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE)
        elif i % 3 == 1:  # a body that never arrives
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE +
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        slow.append(conn)  # (and a third say nothing at all)
    t0 = time.monotonic()
    r = httpx.get(server.url + "/health", timeout=10)
    assert r.status_code == 200 and time.monotonic() - t0 < 1.0  # the server does not wait for them
    for conn in slow:
        conn.settimeout(READ_TIMEOUT_S + 5)
        try:
            while conn.recv(4096):
                pass  # (a 4xx, or nothing) until the server closes the connection
        except ConnectionResetError:
            pass
        conn.close()
    assert wait_until(lambda: open_sockets(proc) <= sockets and proc.num_threads() <= threads, 10), \
        (open_sockets(proc), sockets, proc.num_threads(), threads)
    assert serves(fleet, target)


AUTH_LINE = f"Authorization: Bearer {KEY}\r\n".encode()


def raw_request(server, head: bytes, body_chunks=(), timeout=10) -> tuple[int, dict]:
    """Send a request by hand (so a huge body need not be sent whole); the status and error."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as conn:
        conn.sendall(head)
        try:
            for chunk in body_chunks:
                conn.sendall(chunk)
        except OSError:
            pass  # the server answered and closed before the whole body: what it should do
        reply = conn.makefile("rb").read()
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply.partition(b"\r\n\r\n")[2] or b"{}")


@pytest.mark.parametrize("target", ["aggregated", "router"])
def test_a_body_over_the_limit_is_refused_without_being_read(fleet, target):
    server = fleet[target]
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE +
            b"Content-Type: application/json\r\nContent-Length: 41943040\r\nConnection: close\r\n\r\n")
    status, body = raw_request(server, head, [b'{"prompt": "' + b"x" * 65536])
    assert status == 413 and "41943040" in body["error"]["message"]
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH_LINE + b"Content-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
    chunk = b"x" * (1 << 20)
    status, body = raw_request(server, chunked, [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 6)
    assert status == 413 and "over the limit" in body["error"]["message"]
    assert serves(fleet, target)


def test_a_large_prompt_is_prepared_off_the_event_loop(fleet):
    server = fleet["aggregated"]
    big = {"messages": [{"role": "user", "content": "y" * (3 << 20)}], "max_tokens": 2}  # under the 4 MiB limit
    results = []
    workers = [threading.Thread(target=lambda: results.append(post(server, big, "/v1/chat/completions")))
               for _ in range(3)]
    for w in workers:
        w.start()
    slowest = 0.0
    while any(w.is_alive() for w in workers):
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    assert [r.status_code for r in results] == [400] * 3  # longer than the model's context
    assert "maximum context length" in results[0].json()["error"]["message"]
    assert slowest < 0.5, f"/health took {slowest:.2f} s while prompts were prepared"


async def burst(url: str, n: int, body: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
        return await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(n)))


@pytest.mark.parametrize("target", ["aggregated", "router"])
def test_beyond_the_waiting_limit_requests_are_429_with_retry_after(fleet, target):
    body = {"prompt": "queue", "max_tokens": 200, "ignore_eos": True}
    answers = asyncio.run(burst(fleet[target].url, 30, body))
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
    for r in answers:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "overloaded"
    server = fleet["aggregated" if target == "aggregated" else "context"]
    assert wait_until(lambda: metric(server, "adpfleet_requests_waiting") == 0, 10)
    assert serves(fleet, target)


DEADLINE_S = 0.5  # 4,000 tokens take several seconds on the tiny model: always past it


@pytest.fixture(scope="module")
def short_deadline(tmp_path_factory):
    s = Server("--model", "tiny", "--kv-blocks", "256", "--request-timeout", str(DEADLINE_S),
               log_path=tmp_path_factory.mktemp("deadline") / "server.log")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_is_aborted_and_its_kv_freed(short_deadline, stream):
    aborted = metric(short_deadline, "adpfleet_requests_finished_total", finish_reason="abort")
    body = {"prompt": "long", "max_tokens": 4000, "ignore_eos": True, "stream": stream}
    t0 = time.monotonic()
    r = httpx.post(short_deadline.url + "/v1/completions", json=body, timeout=60)
    assert time.monotonic() - t0 < DEADLINE_S + 3
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "deadline_exceeded"
    else:
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert wait_until(lambda: metric(short_deadline, "adpfleet_requests_finished_total",
                                     finish_reason="abort") == aborted + 1, 10)
    assert wait_until(lambda: metric(short_deadline, "adpfleet_kv_cache_blocks_used") == 0, 10)
    ok = httpx.post(short_deadline.url + "/v1/completions", json={"prompt": "short", "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200
