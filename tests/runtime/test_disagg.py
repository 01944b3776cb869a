"""Context + generation servers (2 ADP ranks each): the same tokens as aggregated, KV handed over
and freed, failures explicit."""


import httpx
import openai
import pytest

from servers import Server, metric, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

PROMPTS = ["Disaggregated serving", "x", "The prompt runs on one server and decodes on another. " * 3]


@pytest.fixture(scope="module")
def fleet(server_trio):
    return server_trio


def post(server, path, body, timeout=60):
    return httpx.post(server.url + path, json=body, timeout=timeout)


def disaggregated(fleet, path, body):
    ctx = post(fleet["context"], path, {**body, "stream": False})
    assert ctx.status_code == 200, ctx.text
    c = ctx.json()
    assert "disaggregated_params" in c and c["choices"][0]["finish_reason"] is None
    gen = post(fleet["generation"], path, {**body, "disaggregated_params": c["disaggregated_params"]})
    assert gen.status_code == 200, gen.text
    return c, gen.json()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_context_then_generation_equals_aggregated_token_for_token(fleet, prompt):
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    agg = post(fleet["aggregated"], "/v1/completions", body).json()
    ctx, gen = disaggregated(fleet, "/v1/completions", body)
    assert gen["choices"][0]["text"] == agg["choices"][0]["text"]
    assert ctx["choices"][0]["text"] == agg["choices"][0]["text"][:len(ctx["choices"][0]["text"])]
    assert gen["usage"] == agg["usage"] and gen["choices"][0]["finish_reason"] == "length"


def test_chat_through_context_and_generation_equals_aggregated(fleet):
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    agg = post(fleet["aggregated"], "/v1/chat/completions", body).json()
    _, gen = disaggregated(fleet, "/v1/chat/completions", body)
    assert gen["choices"][0]["message"]["content"] == agg["choices"][0]["message"]["content"]
    assert gen["object"] == "chat.completion" and gen["usage"]["completion_tokens"] == 16


def test_pulled_kv_is_freed_on_the_context_server(fleet):
    disaggregated(fleet, "/v1/completions", {"prompt": "free me " * 20, "max_tokens": 4, "temperature": 0})
    assert wait_until(lambda: metric(fleet["context"], "adpfleet_kv_cache_blocks_used") == 0, 10)
    assert metric(fleet["context"], "adpfleet_kv_transfers_in_flight") == 0
    assert wait_until(lambda: metric(fleet["generation"], "adpfleet_kv_cache_blocks_used") == 0, 10)


def test_the_context_server_keeps_the_prefixes_it_computed_and_the_generation_server_caches_none(fleet):
    system = "Shared instructions for every session of this fleet. " * 4
    hits = metric(fleet["context"], "adpfleet_prefix_cache_hits_total")
    for question in ("first?", "second?"):
        disaggregated(fleet, "/v1/completions", {"prompt": system + question, "max_tokens": 4, "temperature": 0})
    assert metric(fleet["context"], "adpfleet_prefix_cache_hits_total") - hits >= len(system) // 16 * 16 - 16
    assert metric(fleet["context"], "adpfleet_prefix_cache_blocks") > 0
    assert metric(fleet["generation"], "adpfleet_prefix_cache_blocks") == 0
    assert metric(fleet["generation"], "adpfleet_prefix_cache_queries_total") == 0


def test_a_request_that_ends_at_its_first_token_needs_no_generation_server(fleet):
    r = post(fleet["context"], "/v1/completions", {"prompt": "one", "max_tokens": 1}).json()
    assert r["choices"][0]["finish_reason"] == "length" and "disaggregated_params" not in r
    assert wait_until(lambda: metric(fleet["context"], "adpfleet_kv_cache_blocks_used") == 0, 10)


def test_an_unreachable_context_server_fails_the_generation_request_explicitly(fleet):
    params = {"ctx_request_id": "gone", "first_token_id": 65, "prompt_token_ids": [256, 65, 66],
              "kv_endpoint": "127.0.0.1:1", "kv_handle": "gone"}
    r = post(fleet["generation"], "/v1/completions", {"prompt": "ignored", "max_tokens": 4,
                                                      "disaggregated_params": params})
    assert r.status_code == 502 and r.json()["error"]["type"] == "kv_transfer_failed"
    assert httpx.get(fleet["generation"].url + "/health").status_code == 200


@pytest.mark.parametrize("host", ["10.1.2.3", "169.254.169.254", "example.com"])
def test_a_direct_request_may_name_only_an_allowed_kv_peer(fleet, host):
    params = {"ctx_request_id": "x", "first_token_id": 65, "prompt_token_ids": [256, 65, 66],
              "kv_endpoint": f"{host}:8001", "kv_handle": "h"}
    r = post(fleet["generation"], "/v1/completions", {"prompt": "x", "max_tokens": 4, "disaggregated_params": params})
    assert r.status_code == 403 and r.json()["error"]["param"] == "disaggregated_params"
    assert "not an allowed KV peer" in r.json()["error"]["message"]


def test_a_handle_pulled_twice_is_refused_the_second_time(fleet):
    body = {"prompt": "only once", "max_tokens": 4, "temperature": 0}
    ctx, _ = disaggregated(fleet, "/v1/completions", body)
    again = post(fleet["generation"], "/v1/completions", {**body, "disaggregated_params": ctx["disaggregated_params"]})
    assert again.status_code == 502 and "no held KV" in again.json()["error"]["message"]


def test_role_mismatches_are_bad_requests(fleet):
    r = post(fleet["generation"], "/v1/completions", {"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregated_params"


def test_openai_client_chat_streaming_on_an_aggregated_server(fleet):
    client = openai.OpenAI(base_url=fleet["aggregated"].url + "/v1", api_key="unused", max_retries=0)
    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10 == full.usage.completion_tokens


def test_kv_that_is_never_pulled_is_freed_when_its_lease_expires(tmp_path):
    ctx = Server("--model", "tiny", "--role", "context", "--kv-blocks", "64", "--kv-lease", "1",
                 log_path=tmp_path / "context.log")
    try:
        ctx.wait_healthy()
        r = post(ctx, "/v1/completions", {"prompt": "nobody pulls me " * 10, "max_tokens": 8}).json()
        assert "disaggregated_params" in r
        assert metric(ctx, "adpfleet_kv_transfers_in_flight") > 0
        assert wait_until(lambda: metric(ctx, "adpfleet_kv_cache_blocks_used") == 0, 10)
        assert metric(ctx, "adpfleet_kv_transfers_in_flight") == 0
    finally:
        ctx.stop()
