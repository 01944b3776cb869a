"""Credentials, KV peers and request limits as specifications (no processes: an ASGI app in memory)."""

import json
import tracemalloc

import pytest
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from adpfleet.runtime.serving import limits
from adpfleet.runtime.serving.auth import ANONYMOUS, INTERNAL, USER, BearerAuth, Credentials, KVPeers, load_secret
from adpfleet.runtime.serving.limits import MAX_JSON_DEPTH, Refused, WaitingQueue, _json_values, parse_json_object
from budgets import examples

BOTH = Credentials(api_key="user-key", internal_token="fleet-token")


@pytest.mark.parametrize("header, principal", [
    ("Bearer user-key", USER), ("bearer user-key", USER), ("Bearer fleet-token", INTERNAL),
    (None, None), ("", None), ("Bearer", None), ("Bearer user-ke", None), ("Bearer user-key2", None),
    ("Basic user-key", None), ("user-key", None), ("Bearer fleet-toke", None),
])
def test_a_credential_is_a_bearer_secret_equal_to_one_of_the_two(header, principal):
    assert BOTH.principal(header) == principal


def test_without_secrets_everyone_is_anonymous_and_nothing_is_required():
    assert not Credentials().required and Credentials().principal(None) == ANONYMOUS
    assert Credentials(internal_token="t").required and Credentials(api_key="k").principal(None) is None


def test_the_router_sends_its_token_or_else_the_clients_own_header():
    assert BOTH.upstream_headers("Bearer user-key") == {"Authorization": "Bearer fleet-token"}
    assert Credentials(api_key="k").upstream_headers("Bearer k") == {"Authorization": "Bearer k"}
    assert Credentials().upstream_headers(None) == {}


def test_secrets_come_from_the_flag_then_the_file_then_the_environment(tmp_path, monkeypatch):
    (tmp_path / "key").write_text("from-file\n")
    monkeypatch.setenv("X_KEY", "from-env")
    assert load_secret("--k", "from-flag", str(tmp_path / "key"), "X_KEY") == "from-flag"
    assert load_secret("--k", None, str(tmp_path / "key"), "X_KEY") == "from-file"
    assert load_secret("--k", None, None, "X_KEY") == "from-env"
    assert load_secret("--k", None, None, "X_UNSET") is None
    for bad, match in (("  \n", "empty"), ("key with\ttab", "printable"), ("kéy", "printable")):
        with pytest.raises(ValueError, match=match):
            load_secret("--k", bad)
    with pytest.raises(ValueError, match="missing"):
        load_secret("--k", None, str(tmp_path / "missing"))


def endpoint(request: Request):  # FastAPI needs the annotation to inject the request
    return {"principal": request.state.principal}


@pytest.fixture
def guarded():
    app = FastAPI()
    for path in ("/health", "/metrics", "/v1/models", "/faults", "/anything"):
        app.add_api_route(path, endpoint, methods=["GET"])
    app.add_middleware(BearerAuth, credentials=BOTH)
    return TestClient(app)


@pytest.mark.parametrize("path", ["/v1/models", "/faults", "/anything", "/docs", "/openapi.json"])
def test_every_path_but_health_and_metrics_is_denied_without_a_credential(guarded, path):
    r = guarded.get(path)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in r.json()["error"]["message"]


def test_open_paths_and_the_principal_reach_the_application(guarded):
    assert guarded.get("/health").json() == {"principal": None}
    assert guarded.get("/metrics").status_code == 200
    assert guarded.get("/v1/models", headers={"Authorization": "Bearer user-key"}).json() == {"principal": USER}
    assert guarded.get("/faults", headers={"Authorization": "Bearer fleet-token"}).json() == {"principal": INTERNAL}


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1", True), ("127.9.8.7", True), ("::1", True), ("localhost", True), ("LOCALHOST", True),
    ("10.0.0.3", False), ("::2", False), ("localhost.evil.example", False), ("169.254.169.254", False),
])
def test_by_default_only_loopback_is_a_kv_peer(host, allowed):
    assert KVPeers().allows(host) is allowed


def test_kv_peers_are_networks_and_literal_names():
    peers = KVPeers(["10.0.0.0/8", "fd00::/8", "ctx-0.fleet.svc"])
    assert peers.allows("10.1.2.3") and peers.allows("fd00::5") and peers.allows("ctx-0.fleet.svc")
    assert not peers.allows("11.0.0.1") and not peers.allows("ctx-1.fleet.svc") and not peers.allows("127.0.0.1")
    with pytest.raises(ValueError, match="--kv-peer"):
        KVPeers(["10.0.0.0/33"])


@pytest.mark.parametrize("raw, param, match", [
    (b"[1]", None, "JSON object"),
    (b"{nope", None, "not valid JSON"),
    (b"\xff", None, "not valid JSON"),
    (b'{"a": ' + b"[" * 1500 + b"]" * 1500 + b"}", None, "nested deeper"),
    (b'{"stop": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "stop", "nested deeper"),
    (b'{"model": "\\ud800"}', "model", "not valid Unicode"),
    (b'{"messages": [{"content": "ok"}, {"content": "\\udfff"}]}', "messages", "not valid Unicode"),
    (b'{"\\ud800": 1}', "\\ud800", "not valid Unicode"),
    (b'{"temperature": NaN}', None, "NaN is not a JSON number"),
    (b'{"top_p": -Infinity}', None, "-Infinity is not a JSON number"),
    (b'{"max_tokens": 1e999}', None, "out of range"),
])
def test_bodies_that_are_not_one_reasonable_json_object_are_400s_naming_the_field(raw, param, match):
    with pytest.raises(Refused) as err:
        parse_json_object(raw)
    assert err.value.status == 400 and err.value.param == param and match in err.value.message


def test_nesting_up_to_the_limit_and_any_valid_text_pass():
    deep = b'{"stop": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    assert parse_json_object(deep).fields
    text = parse_json_object('{"prompt": "h\u00e9llo \U0001F600 \\ud83d\\ude00"}'.encode()).fields["prompt"]
    assert text.endswith("\U0001F600")


def small_values(n: int) -> bytes:
    """What the router's queue was attacked with (issue 25): a few MiB of tiny objects, ~100 bytes of
    Python objects for every 4 bytes of JSON."""
    return b'{"prompt": "x", "x": [' + b",".join([b'{"a":0}'] * n) + b"]}"


def allocated_while(fn) -> tuple[object, int]:
    """fn()'s result (or the Refused it raised) and the most memory it had allocated at once."""
    tracemalloc.start()
    try:
        try:
            result = fn()
        except Refused as r:
            result = r
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture
def value_limit(monkeypatch):
    """A small MAX_JSON_VALUES, so the bodies that test it are small too."""
    monkeypatch.setattr(limits, "MAX_JSON_VALUES", 2000)
    return 2000


def test_a_body_of_more_json_values_than_the_limit_is_a_413_naming_it_before_anything_is_built(value_limit):
    assert limits._json_values(small_values(value_limit // 2 - 1), value_limit) == value_limit + 1  # 2 values each
    n = 20 * value_limit
    raw = small_values(n)
    refused, peak = allocated_while(lambda: parse_json_object(raw))
    assert isinstance(refused, Refused) and refused.status == 413 and refused.code == "too_many_values"
    assert f"has {2 * n + 3} JSON values" in refused.message and f"at most {value_limit}" in refused.message
    assert peak < len(raw) + (1 << 20)  # counting takes at most a copy and a MiB; parsing, ~25 times the body


def test_a_body_at_the_value_limit_parses_and_its_footprint_is_what_it_takes(value_limit):
    raw = small_values(value_limit // 2 - 2)
    body = parse_json_object(raw)
    assert body.fields["prompt"] == "x" and len(body.fields["x"]) == value_limit // 2 - 2
    held, taken = allocated_while(lambda: json.loads(raw))
    assert taken <= body.footprint < 2 * taken and held  # shared keys and small ints are counted each time


@pytest.mark.parametrize("text", ["x" * 300_000, "\U0001F600" * 100_000 + "x" * 200_000])
def test_a_footprint_counts_the_characters_as_python_holds_them(text):
    body = parse_json_object(json.dumps({"prompt": text}, ensure_ascii=False).encode())
    width = 4 if not text.isascii() else 1  # one emoji makes every character of the string 4 bytes
    assert len(text) * width <= body.footprint < len(text) * width + 1000


def test_commas_and_brackets_inside_strings_are_no_values(value_limit):
    prompt = "a,[{" * value_limit + '\\" ,[{ \\\\'
    body = parse_json_object(json.dumps({"prompt": prompt, "stop": [","] * 10}).encode())
    assert body.fields["prompt"] == prompt
    hidden = b'{"prompt": "\\\\", "x": [' + b",".join([b"0"] * (value_limit + 1)) + b"]}"  # after a "\\"
    with pytest.raises(Refused) as err:
        parse_json_object(hidden)
    assert err.value.status == 413
    across = json.dumps({"p": "," * 3 * limits._COUNT_CHUNK + '"', "x": [0, 0]}).encode()  # strings span chunks
    assert _json_values(across, limit=-1) == 1 + 2 + 2


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet=',[{]}"\\ab\u00e9'),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet=',"{a'),
                                                                                      inner, max_size=4),
                           max_leaves=30)


def values_built(value) -> int:
    """Array elements and object members in all of `value`; an empty array or object counts one."""
    children = value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else None
    if children is None:
        return 0
    return max(len(children), 1) + sum(map(values_built, children))


@settings(max_examples=examples(100), deadline=None)
@given(json_values)
def test_the_value_count_of_a_json_text_is_exact_outside_strings(value):
    raw = json.dumps(value, ensure_ascii=False).encode()
    assert _json_values(raw, limit=-1) == 1 + values_built(value)  # -1: never the quick count


def test_the_waiting_queue_refuses_beyond_its_limit_and_tickets_leave_once():
    queue = WaitingQueue(2)
    a, b = queue.enter(), queue.enter()
    with pytest.raises(Refused) as err:
        queue.enter()
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "1"}
    a.start()
    a.leave()  # started, then ended: counted once
    c = queue.enter()
    with pytest.raises(Refused):
        queue.enter()
    b.leave()
    c.leave()
    c.leave()
    assert queue.waiting == 0
    with pytest.raises(ValueError, match="--max-waiting-requests"):
        WaitingQueue(0)


def test_the_cli_help_states_the_runtimes_defaults():
    from adpfleet.cli import build_parser
    from adpfleet.runtime.serving.options import DEFAULT_REQUEST_TIMEOUT_S
    from adpfleet.runtime.serving import limits

    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help().replace("\n", " ")
    text = " ".join(text.split())
    assert f"(default {limits.DEFAULT_MAX_REQUEST_BYTES >> 20} MiB)" in text
    assert f"(default {limits.DEFAULT_READ_TIMEOUT_S:g})" in text
    assert f"(default {limits.DEFAULT_MAX_WAITING_REQUESTS})" in text
    assert f"default {DEFAULT_REQUEST_TIMEOUT_S:g})" in text


def test_a_worker_pod_guards_faults_and_sends_them_to_its_leader():
    from types import SimpleNamespace

    from adpfleet.runtime.server import build_worker_app
    from adpfleet.runtime.serving.options import ServerOptions

    engine = SimpleNamespace(group=SimpleNamespace(topology=SimpleNamespace(node_rank=1, nodes=2)),
                             health=lambda: (True, "ok"))
    worker = TestClient(build_worker_app(engine, "generation", ServerOptions(BOTH, fault_injection=True)))
    assert worker.post("/faults", json={"kind": "freeze", "rank": 1}).status_code == 401
    r = worker.post("/faults", json={"kind": "freeze", "rank": 1}, headers={"Authorization": "Bearer fleet-token"})
    assert r.status_code == 421 and "to its leader (node rank 0)" in r.json()["error"]["message"]
    # without fault injection there is no /faults at all, as on a leader
    quiet = TestClient(build_worker_app(engine, "generation", ServerOptions(BOTH)))
    assert quiet.post("/faults", json={}, headers={"Authorization": "Bearer fleet-token"}).status_code == 404
