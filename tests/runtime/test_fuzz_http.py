"""No malformed input gets a 5xx or hurts a server: property-based bodies against a real server
and the router in front of real context and generation servers, and bytes against a context
server's KV port."""

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgets import examples
from servers import RouterProcess, metric

pytestmark = pytest.mark.slow

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False, allow_infinity=False),
                      st.text(max_size=20))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                          max_leaves=8)
small_tokens = st.one_of(st.integers(-3, 3), json_value)  # never ask for long generations
COMMON = {"model": st.one_of(st.just("tiny"), json_value), "temperature": json_value, "top_p": json_value,
          "top_k": json_value, "seed": json_value, "stop": json_value, "stream": json_value,
          "stream_options": json_value, "n": json_value, "ignore_eos": json_value, "stop_token_ids": json_value,
          "logit_bias": json_value, "disaggregated_params": json_value}
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 400), max_size=5), json_value)},
    optional={**COMMON, "max_tokens": small_tokens, "echo": json_value, "logprobs": json_value,
              "best_of": json_value, "x_unknown_field": json_value})
messages = st.lists(st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "tool"]), json_value),
                                           "content": st.one_of(st.text(max_size=20), json_value)}), max_size=3)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.one_of(messages, json_value), "max_tokens": st.integers(1, 3)},
    optional={**COMMON, "max_completion_tokens": small_tokens, "logprobs": json_value})


@pytest.fixture(scope="module")
def router(server_trio, tmp_path_factory):
    r = RouterProcess(tmp_path_factory.mktemp("fuzz-router"), "--context", server_trio["context"].url,
                      "--generation", server_trio["generation"].url)
    try:
        yield r.wait_healthy()
    finally:
        r.stop()


@pytest.fixture(scope="module", params=["server", "router"])
def target(request, server_trio):
    """An aggregated server, and the router in front of a context and a generation server."""
    return server_trio["aggregated"] if request.param == "server" else request.getfixturevalue("router")


def check(server, path, body):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(completion_bodies)
def test_completions_never_answer_5xx(target, body):
    check(target, "/v1/completions", body)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat_bodies)
def test_chat_never_answers_5xx(target, body):
    check(target, "/v1/chat/completions", body)


@settings(max_examples=examples(50), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=40))
def test_arbitrary_bytes_never_answer_5xx(target, raw):
    r = httpx.post(target.url + "/v1/completions", content=raw, timeout=30)
    assert r.status_code < 500


@pytest.mark.parametrize("raw", [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                                 b'{"prompt": "x", "max_tokens": 1e999}', b'{"prompt": "\\ud800"}'])
def test_non_standard_json_numbers_and_lone_surrogates_are_bad_requests(target, raw):
    r = httpx.post(target.url + "/v1/completions", content=raw, timeout=30)
    assert r.status_code == 400, r.text


@pytest.fixture(scope="module")
def kv_port(server_trio):
    """A context rank's KV port, and the held KV a real request left there (pulled at the end)."""
    ctx, gen = server_trio["context"], server_trio["generation"]
    params = httpx.post(ctx.url + "/v1/completions", json={"prompt": "fuzz " * 10, "max_tokens": 4, "ignore_eos": True},
                        timeout=60).json()["disaggregated_params"]
    host, port = params["kv_endpoint"].rsplit(":", 1)
    yield host, int(port)
    assert httpx.get(ctx.url + "/health").status_code == 200
    r = httpx.post(gen.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "disaggregated_params": params},
                   timeout=60)
    assert r.status_code == 200, r.text  # the held KV survived the fuzzing and is still pulled whole


request_lines = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda magic, handle, proof: b" ".join([magic, b"GET", handle, proof]) + b"\n",
              st.sampled_from([b"ADPKV2", b"ADPKV1", b""]), st.binary(max_size=60), st.binary(max_size=80)))


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request_lines)
def test_bytes_to_the_kv_port_get_a_refusal_or_nothing_and_never_kv(server_trio, kv_port, line):
    used = metric(server_trio["context"], "adpfleet_kv_cache_blocks_used")
    with socket.create_connection(kv_port, timeout=10) as conn:
        try:
            conn.sendall(line)
            conn.shutdown(socket.SHUT_WR)  # no more is coming: the rank answers now, not at its timeout
            reply = conn.makefile("rb").readline()
        except ConnectionResetError:
            reply = b""
    if reply:
        assert json.loads(reply)["status"] == "error"
    assert metric(server_trio["context"], "adpfleet_kv_cache_blocks_used") == used
