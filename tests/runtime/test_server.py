"""The HTTP surface through the official openai client, and bad input over HTTP."""

import json
import socket

import httpx
import openai
import pytest

from servers import Server, metric, wait_until


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--model", "tiny", "--kv-blocks", "64", log_path=tmp_path_factory.mktemp("srv") / "server.log")
    try:
        yield s.wait_healthy()
    finally:
        s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_completion_is_deterministic_and_reports_usage(client):
    a = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    b = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].finish_reason == "length"
    assert (a.usage.prompt_tokens, a.usage.completion_tokens, a.usage.total_tokens) == (6, 12, 18)


def test_seeded_sampling_repeats_and_different_seeds_differ(client):
    def draw(seed):
        return client.completions.create(model="tiny", prompt="abc", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert draw(7) == draw(7)
    assert len({draw(s) for s in range(4)}) > 1


def test_streaming_concatenates_to_the_full_text_and_ends_with_usage(client):
    full = client.completions.create(model="tiny", prompt="stream me", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(model="tiny", prompt="stream me", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_a_stream_has_a_chunk_per_token_even_while_its_text_is_held_back(client):
    full = client.completions.create(model="tiny", prompt="stream me", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # a stop string that begins with the first character: the detokenizer holds it back until the
    # next token shows the stop string did not come. The chunk goes out anyway, its text empty (as
    # vLLM streams): a client's first chunk is its first token
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt="stream me", max_tokens=20, temperature=0, stream=True, stop=[full[0] + "\u2603"],
        extra_body={"ignore_eos": True})]
    assert len(chunks) == 20 and chunks[0].text == "" and "".join(c.text for c in chunks) == full


def test_stop_string_truncates_and_finishes(client):
    base = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[3:5]
    assert stop and stop not in base[:3]
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.text == base[:base.index(stop)] and out.finish_reason == "stop"


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x" * 5000}, 400, "prompt"),
    ({"prompt": 12}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "logprobs": 1}, 400, "logprobs"),
    ({"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_an_openai_error_naming_the_parameter(server, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "still up", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_metrics_expose_every_counter_from_startup(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("adpfleet_iterations_total", "adpfleet_forward_steps_total", "adpfleet_forward_vetoed_total",
                 "adpfleet_empty_batch_iterations_total", "adpfleet_padding_dummies_total",
                 "adpfleet_prompt_tokens_total", "adpfleet_generation_tokens_total",
                 "adpfleet_requests_finished_total", "adpfleet_kv_cache_capacity_blocks",
                 "adpfleet_prefix_cache_queries_total", "adpfleet_prefix_cache_hits_total",
                 "adpfleet_prefix_cache_blocks"):
        assert f"\n{name}{{" in text, name
    assert 'adpfleet_kv_cache_capacity_blocks{role="aggregated",rank="0"} 64.0' in text


def test_faults_are_refused_unless_enabled(server):
    """This server runs without --fault-injection (test_faults.py injects them into servers with it)."""
    assert httpx.post(server.url + "/faults", json={"kind": "freeze"}).status_code == 404


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_its_request_and_frees_its_kv(server, stream):
    aborted = metric(server, "adpfleet_requests_finished_total", finish_reason="abort")
    body = {"prompt": "long", "max_tokens": 1000, "ignore_eos": True, "stream": stream}  # fits the 1,024-token KV
    with httpx.Client(timeout=60) as client:
        if stream:
            with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        else:  # hang up while the request is running (not after a guessed time: the tiny model is fast)
            url, payload = httpx.URL(server.url), json.dumps(body).encode()
            with socket.create_connection((url.host, url.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                assert wait_until(lambda: metric(server, "adpfleet_requests_running") >= 1, 15)
    assert wait_until(lambda: metric(server, "adpfleet_requests_finished_total", finish_reason="abort") == aborted + 1, 15)
    assert wait_until(lambda: metric(server, "adpfleet_kv_cache_blocks_used") == 0, 10)


def test_the_next_turn_of_a_chat_is_prefilled_from_the_prefix_cache(server, client):
    """The whole conversation is sent again; only what the cache does not hold runs (greedy output
    identical with the cache on and off: tests/runtime/test_parity.py)."""
    messages = [{"role": "system", "content": "You answer in the style of a ship's log. " * 4},
                {"role": "user", "content": "Where are we?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    hits, queried = (metric(server, f"adpfleet_prefix_cache_{n}_total") for n in ("hits", "queries"))
    prompt_tokens = metric(server, "adpfleet_prompt_tokens_total")
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And now?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    hit = metric(server, "adpfleet_prefix_cache_hits_total") - hits
    assert metric(server, "adpfleet_prefix_cache_queries_total") - queried == second.usage.prompt_tokens
    assert hit >= first.usage.prompt_tokens // 16 * 16 - 16  # turn 1's prompt, all but its last block at most
    assert metric(server, "adpfleet_prompt_tokens_total") - prompt_tokens == second.usage.prompt_tokens - hit
    assert metric(server, "adpfleet_prefix_cache_blocks") > 0


def test_only_the_ranks_load_torch_not_the_server_process(server):
    """The server process routes and answers HTTP; its ranks run the model. torch in the server
    process cost every start an import (about 5 s of 25 on 2 busy cores) and ~0.5 GB."""
    from servers import rank_processes

    def loads_torch(pid: int) -> bool:
        with open(f"/proc/{pid}/maps") as maps:
            return "libtorch" in maps.read()
    assert not loads_torch(server.proc.pid)
    assert [loads_torch(rank.pid) for rank in rank_processes(server)] == [True]
