"""The router in front of real `adpfleet serve` processes (model tiny): a disaggregated answer
equals the aggregated one, through the official openai client."""

import asyncio

import httpx
import openai
import pytest

from router_harness import RouterProcess, serve
from test_kill_burst import burst_and_kill, check

pytestmark = pytest.mark.slow
GREEDY = dict(model="tiny", temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def fleet(log_dir, server_trio):
    servers = {"ctx": server_trio["context"], "gen": server_trio["generation"], "agg": server_trio["aggregated"]}
    router = RouterProcess(log_dir, "--context", servers["ctx"].url, "--generation", servers["gen"].url)
    try:
        yield router.wait_healthy(), servers
    finally:
        router.stop()


@pytest.fixture
def via_router(fleet):
    return openai.OpenAI(base_url=fleet[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aggregated(fleet):
    return openai.OpenAI(base_url=fleet[1]["agg"].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_disaggregated_completion_equals_the_aggregated_one(via_router, aggregated):
    out = via_router.completions.create(prompt="Hello", max_tokens=12, **GREEDY)
    ref = aggregated.completions.create(prompt="Hello", max_tokens=12, **GREEDY)
    assert out.choices[0].text == ref.choices[0].text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (6, 12, 18)


def test_streamed_disaggregated_completion_equals_the_aggregated_text(via_router, aggregated):
    ref = aggregated.completions.create(prompt="stream me", max_tokens=20, **GREEDY).choices[0].text
    chunks = list(via_router.completions.create(prompt="stream me", max_tokens=20, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_through_the_router_equals_the_aggregated_chat(via_router, aggregated, stream):
    messages = [{"role": "user", "content": "Say something"}]
    ref = aggregated.chat.completions.create(messages=messages, max_tokens=10, **GREEDY)
    if stream:
        chunks = list(via_router.chat.completions.create(messages=messages, max_tokens=10, stream=True,
                                                         stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content
        assert chunks[-1].usage.total_tokens == ref.usage.total_tokens
    else:
        out = via_router.chat.completions.create(messages=messages, max_tokens=10, **GREEDY)
        assert out.choices[0].message.content == ref.choices[0].message.content
        assert out.usage.total_tokens == ref.usage.total_tokens


def test_stop_string_through_the_router(via_router, aggregated):
    base = aggregated.completions.create(prompt="Hello", max_tokens=12, **GREEDY).choices[0].text
    stop = base[3:5]
    assert stop and stop not in base[:3]
    out = via_router.completions.create(prompt="Hello", max_tokens=12, stop=[stop], **GREEDY).choices[0]
    assert out.text == base[:base.index(stop)] and out.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_one_is_answered_by_the_context_server(via_router, aggregated, stream):
    ref = aggregated.completions.create(prompt="one", max_tokens=1, **GREEDY)
    if stream:
        chunks = list(via_router.completions.create(prompt="one", max_tokens=1, stream=True,
                                                    stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.choices[0].text
        assert chunks[-1].usage.completion_tokens == 1
    else:
        out = via_router.completions.create(prompt="one", max_tokens=1, **GREEDY)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (ref.choices[0].text, "length")
        assert out.usage.completion_tokens == 1


@pytest.mark.parametrize("body", [{"prompt": "x", "max_tokens": "ten"}, {"prompt": "x", "model": "gpt-4"},
                                  {"prompt": "x", "temperature": -1}, {}, {"prompt": "x", "n": 2}])
def test_the_servers_bad_input_answers_pass_through_unchanged(fleet, body):
    router, servers = fleet
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    ref = httpx.post(servers["agg"].url + "/v1/completions", json=body, timeout=30)
    assert 400 <= r.status_code < 500
    assert (r.status_code, r.json()) == (ref.status_code, ref.json())
    assert r.json()["error"]["param"]


def test_killing_a_real_generation_server_during_a_burst(log_dir):
    ctx, *gens = servers = [serve("context", log_dir), serve("generation", log_dir), serve("generation", log_dir)]
    router = None
    try:
        for s in servers:
            s.wait_healthy(180)
        router = RouterProcess(log_dir, "--context", ctx.url, "--generation", gens[0].url, "--generation",
                               gens[1].url, "--request-timeout", "20").wait_healthy()
        victim = f'adpfleet_router_in_flight{{role="generation",server="{gens[0].url}"}}'
        n, max_tokens = 12, 48
        results = asyncio.run(burst_and_kill(router.url, gens[0], n, max_tokens,
                                             kill_when=lambda: router.metrics().get(victim, 0) >= 2))
        check(results, router, n, max_tokens, words_per_token=0)
        completed = [r for r in results if r[0] == "complete"]
        print(f"kill during burst: {len(completed)}/{n} completed, {n - len(completed)} explicit errors, "
              f"{router.metric('adpfleet_router_retries_total'):g} retries, "
              f"slowest {max(r[2] for r in results):.1f} s")
        assert all(results[i][0] == "complete" for i in range(1, n, 2)), results  # non-streamed: retried
        assert len(completed) >= n // 2
    finally:
        for p in [router, *servers]:
            if p is not None:
                p.stop()
