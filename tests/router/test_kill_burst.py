"""A generation server killed during a burst of concurrent requests: every request completes or
gets an explicit error, none hangs past its deadline."""

import asyncio
import time

import openai

from router_harness import FakeServer, wait_until

DEADLINE_S = 20


def streamed(i: int) -> bool:
    """Two streamed requests, then two not: the pool's round robin between two servers alternates,
    so each gets both kinds (every other request streamed would give one server all the streams)."""
    return i % 4 < 2


async def one_request(client: openai.AsyncOpenAI, i: int, max_tokens: int) -> tuple[str, str, float]:
    """('complete', text, seconds) or ('error', message, seconds); anything else raises."""
    t0 = time.monotonic()
    stream = streamed(i)
    try:
        if stream:
            text = ""
            async for chunk in await client.completions.create(model=None, prompt=f"burst {i}", max_tokens=max_tokens,
                                                               stream=True, extra_body={"ignore_eos": True}):
                text += chunk.choices[0].text if chunk.choices else ""
        else:
            text = (await client.completions.create(model=None, prompt=f"burst {i}", max_tokens=max_tokens,
                                                    extra_body={"ignore_eos": True})).choices[0].text
        return "complete", text, time.monotonic() - t0
    except (openai.APITimeoutError, openai.APIConnectionError):
        raise  # a hang or a dropped connection is exactly what must not happen
    except openai.APIError as e:  # an explicit error: a status (503/504) or an error event in the stream
        return "error", str(e), time.monotonic() - t0


async def burst_and_kill(router_url: str, victim, n: int, max_tokens: int, kill_when) -> list:
    client = openai.AsyncOpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0,
                                timeout=DEADLINE_S + 30)
    tasks = [asyncio.create_task(one_request(client, i, max_tokens)) for i in range(n)]
    waited_until = time.monotonic() + DEADLINE_S
    while not await asyncio.to_thread(kill_when):
        assert time.monotonic() < waited_until, "the victim never had the requests it should be killed under"
        await asyncio.sleep(0.02)
    victim.kill()
    results = await asyncio.gather(*tasks)
    await client.close()
    return results


def check(results, router, n, max_tokens, words_per_token=1):
    for outcome, detail, seconds in results:
        assert seconds < DEADLINE_S + 2, f"a request took {seconds:.1f} s, past its {DEADLINE_S} s deadline"
        if outcome == "complete":
            assert len(detail.split()) == max_tokens * words_per_token or words_per_token == 0
        else:
            assert "incomplete" in detail or "503" in detail or "504" in detail, detail
    counted = sum(v for k, v in router.metrics().items() if k.startswith("adpfleet_router_requests_total"))
    assert counted == n
    wait_until(lambda: router.metric("adpfleet_router_in_flight") == 0, timeout=5, what="router in-flight back to 0")


def test_killing_a_fake_generation_server_during_a_burst(log_dir, start_router):
    ctx = FakeServer("context", log_dir)
    gens = [FakeServer("generation", log_dir) for _ in range(2)]
    try:
        for s in (ctx, *gens):
            s.wait_healthy()
            s.configure(token_delay=0.05)
        router = start_router("--context", ctx.url, "--generation", gens[0].url, "--generation", gens[1].url,
                              "--request-timeout", str(DEADLINE_S)).wait_usable(context=1, generation=2)
        n, max_tokens = 16, 40
        results = asyncio.run(burst_and_kill(router.url, gens[0], n, max_tokens,
                                             kill_when=lambda: gens[0].streams_open() >= 1))
        check(results, router, n, max_tokens)
        errors = [r[0] for r in results].count("error")
        # non-streamed requests are always retried; only streams that already had tokens end with an error
        assert all(results[i][0] == "complete" for i in range(n) if not streamed(i)), results
        assert errors <= n // 2
        assert errors + router.metric("adpfleet_router_retries_total") >= 2  # the victim's requests were handled
    finally:
        for s in (ctx, *gens):
            s.kill()
