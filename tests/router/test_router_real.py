"""The router in front of real `adpfleet serve` processes (model tiny): a disaggregated answer
equals the aggregated one, through the official openai client."""

import asyncio
import threading
import time

import httpx
import openai
import pytest

from router_harness import RouterProcess, free_port, serve, wait_until
from test_kill_burst import burst_and_kill, check, streamed

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
        assert all(results[i][0] == "complete" for i in range(n) if not streamed(i)), results  # non-streamed: retried
        assert len(completed) >= n // 2
    finally:
        for p in [router, *servers]:
            if p is not None:
                p.stop()


# -- the queue: a role with no usable server costs clients latency, not errors -----------------------
def queued_router(log_dir, ctx_url: str, gen_url: str, *flags: str) -> RouterProcess:
    """A router whose probe has already seen that `gen_url` does not answer: requests wait."""
    router = RouterProcess(log_dir, "--context", ctx_url, "--generation", gen_url, "--health-interval", "0.5", *flags)
    wait_until(lambda: httpx.get(router.url + "/health", timeout=2).status_code == 503, timeout=30,
               what="the router up, seeing no usable generation server")
    return router


def test_the_only_generation_server_restarting_costs_requests_latency_never_errors(fleet, log_dir):
    """Requests on it when it dies are retried; requests sent while it is down wait in the
    router's queue; once it is back every one of them completes, equal to the aggregated answer."""
    _, servers = fleet
    gen = serve("generation", log_dir).wait_healthy(180)
    router, restarted = None, []
    try:
        router = RouterProcess(log_dir, "--context", servers["ctx"].url, "--generation", gen.url,
                               "--health-interval", "0.5", "--queue-timeout", "120").wait_healthy()
        ref = httpx.post(servers["agg"].url + "/v1/completions", timeout=60,
                         json={"prompt": "restart", "max_tokens": 48, "temperature": 0, "ignore_eos": True}).json()

        async def one(i: int) -> tuple[int, str]:
            async with httpx.AsyncClient(timeout=180) as c:
                r = await c.post(router.url + "/v1/completions",
                                 json={"prompt": "restart", "max_tokens": 48, "temperature": 0, "ignore_eos": True})
                return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

        async def scenario():
            in_flight = [asyncio.create_task(one(i)) for i in range(3)]
            on_gen = f'adpfleet_router_in_flight{{role="generation",server="{gen.url}"}}'
            await asyncio.to_thread(wait_until, lambda: router.metrics().get(on_gen, 0) >= 1, timeout=60,
                                    what="requests on the generation server")
            gen.kill()
            await asyncio.to_thread(wait_until, lambda: httpx.get(router.url + "/health").status_code == 503,
                                    timeout=10, what="the router seeing the generation server down")
            while_down = [asyncio.create_task(one(i)) for i in range(3, 6)]
            await asyncio.to_thread(wait_until, lambda: router.metric("adpfleet_router_queue_waiting") >= 3,
                                    timeout=30, what="the requests sent while it is down waiting")
            assert not any(t.done() for t in while_down)
            restarted.append(serve("generation", log_dir, port=gen.port))  # the same URL, as a static fleet has
            await asyncio.to_thread(restarted[0].wait_healthy, 180)
            return await asyncio.gather(*in_flight, *while_down)

        results = asyncio.run(scenario())
        assert results == [(200, ref["choices"][0]["text"])] * 6
        assert router.metric("adpfleet_router_requests_total", status="200") == 6
        assert router.metric("adpfleet_router_requests_total") == 6
        assert router.metric("adpfleet_router_queued_total", outcome="placed") >= 3
        assert router.metric("adpfleet_router_queue_waiting") == 0
        assert router.metric("adpfleet_router_queue_wait_seconds_count") >= 3
    finally:
        for p in [router, gen, *restarted]:
            if p is not None:
                p.stop()


def test_a_full_queue_or_its_timeout_is_a_503_with_retry_after(fleet, log_dir):
    _, servers = fleet
    router = queued_router(log_dir, servers["ctx"].url, f"http://127.0.0.1:{free_port()}",
                           "--queue-size", "1", "--queue-timeout", "2")
    try:
        first: dict = {}

        def send_first():
            t0 = time.monotonic()
            first["r"] = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
            first["s"] = time.monotonic() - t0
        waiter = threading.Thread(target=send_first)
        waiter.start()
        wait_until(lambda: router.metric("adpfleet_router_queue_waiting") == 1, timeout=10, what="one request waiting")
        t0 = time.monotonic()
        full = httpx.post(router.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=30)
        assert time.monotonic() - t0 < 1.5  # refused at once, not after the queue timeout
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        waiter.join(30)
        r = first["r"]
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and 1.9 < first["s"] < 6
        assert r.json()["error"]["code"] == "no_server" and "queue timeout of 2 s" in r.json()["error"]["message"]
        assert router.metric("adpfleet_router_queued_total", outcome="full") == 1
        assert router.metric("adpfleet_router_queued_total", outcome="timeout") == 1
        assert router.metric("adpfleet_router_errors_total", reason="queue_full") == 1
        assert router.metric("adpfleet_router_errors_total", reason="no_server") == 1
        assert router.metric("adpfleet_router_requests_total", status="503") == 2
        assert servers["ctx"].proc.poll() is None
    finally:
        router.stop()
