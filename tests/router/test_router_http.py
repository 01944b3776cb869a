"""The router over HTTP against fake servers that follow the disaggregation contract: the
official openai client, the contract bodies, bad input, retries, deadlines, disconnects, metrics."""

import concurrent.futures
import threading
import time

import httpx
import openai
import pytest

from router_harness import FakeServer, free_port, wait_until


def disagg_router(start_router, fakes, *flags):
    """A router over the context server and both generation servers."""
    return start_router("--context", fakes["ctx"].url, "--generation", fakes["gen1"].url, "--generation",
                        fakes["gen2"].url, *flags)


@pytest.fixture
def disagg(fresh_fakes, start_router):
    return disagg_router(start_router, fresh_fakes)


def client(router, timeout=30):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def direct(server, timeout=30):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def all_received(fakes, *names):
    return [b for n in names for b in fakes[n].received()]


def assert_names_no_address(text: str, *servers) -> None:
    """What the router tells a client names roles, never where the servers are: no host, no port
    of theirs (in a URL or a KV endpoint), nor the foreign KV host of the test below. The servers'
    own words (which name them) stay in the router's log."""
    leaked = [a for a in ("127.0.0.", "10.9.8.7", *(f":{s.port}" for s in servers)) if a in text]
    assert not leaked, f"{leaked} in what the client got: {text!r}"


# -- answers ---------------------------------------------------------------------------------
def test_a_completion_through_context_and_generation_equals_the_aggregated_answer(disagg, fresh_fakes):
    out = client(disagg).completions.create(model="fake", prompt="the quick brown fox", max_tokens=7)
    ref = direct(fresh_fakes["agg"]).completions.create(model="fake", prompt="the quick brown fox", max_tokens=7)
    assert out.choices[0].text == ref.choices[0].text and len(out.choices[0].text.split()) == 7
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (4, 7, 11)


def test_context_gets_a_non_streamed_body_and_generation_the_original_plus_the_context_params(disagg, fresh_fakes):
    list(client(disagg).completions.create(model="fake", prompt="abc", max_tokens=5, stream=True,
                                           stream_options={"include_usage": True}, temperature=0))
    [ctx_body] = fresh_fakes["ctx"].received()
    assert ctx_body == {"model": "fake", "prompt": "abc", "max_tokens": 5, "stream": False, "temperature": 0}
    [gen_body] = all_received(fresh_fakes, "gen1", "gen2")
    params = gen_body.pop("disaggregated_params")
    assert gen_body == {"model": "fake", "prompt": "abc", "max_tokens": 5, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0}
    assert set(params) == {"ctx_request_id", "first_token_id", "prompt_token_ids", "kv_endpoint", "kv_handle"}


def test_streaming_chunks_concatenate_to_the_full_text_and_end_with_usage(disagg):
    c = client(disagg)
    full = c.completions.create(model="fake", prompt="stream me", max_tokens=9).choices[0].text
    chunks = list(c.completions.create(model="fake", prompt="stream me", max_tokens=9, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices


def test_text_holding_what_splitlines_breaks_at_is_relayed_whole(disagg, fresh_fakes):
    """vLLM sends U+2028, U+0085 and U+2029 unescaped in its events' JSON; an SSE line ends only at
    CR or LF, so an event that holds them is still one line (it reached the client cut in two)."""
    for name in ("ctx", "gen1", "gen2"):
        fresh_fakes[name].configure(line_breaks_in_text=True)
    chunks = list(client(disagg).completions.create(model="fake", prompt="stream me", max_tokens=5, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert len(text.split()) == 5 and [text.count(c) for c in "\u2028\x85\u2029"] == [5, 5, 5], repr(text)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_completions_streamed_and_not(disagg, fresh_fakes):
    c = client(disagg)
    messages = [{"role": "user", "content": "hello there"}]
    out = c.chat.completions.create(model="fake", messages=messages, max_tokens=4)
    ref = direct(fresh_fakes["agg"]).chat.completions.create(model="fake", messages=messages, max_tokens=4)
    assert out.choices[0].message.content == ref.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 4
    chunks = list(c.chat.completions.create(model="fake", messages=messages, max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens


def test_stop_strings_truncate_as_the_servers_do(disagg, fresh_fakes):
    c = client(disagg)
    base = c.completions.create(model="fake", prompt="stop here", max_tokens=8).choices[0].text
    stop = base.split()[3]
    out = c.completions.create(model="fake", prompt="stop here", max_tokens=8, stop=[stop]).choices[0]
    assert out.text == base[:base.index(stop)] and out.finish_reason == "stop"
    streamed = list(c.completions.create(model="fake", prompt="stop here", max_tokens=8, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == out.text
    assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_finished_by_its_first_token_is_answered_by_the_context_server_alone(disagg, fresh_fakes, stream):
    c = client(disagg)
    first_word = c.completions.create(model="fake", prompt="one token", max_tokens=3).choices[0].text.split()[0]
    for f in fresh_fakes.values():
        f.reset()
    for kwargs in (dict(max_tokens=1), dict(max_tokens=5, stop=[first_word[1:3]])):
        if stream:
            chunks = list(c.completions.create(model="fake", prompt="one token", stream=True,
                                               stream_options={"include_usage": True}, **kwargs))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            assert chunks[-1].usage.completion_tokens == 1
        else:
            out = c.completions.create(model="fake", prompt="one token", **kwargs)
            text, finish = out.choices[0].text, out.choices[0].finish_reason
            assert out.usage.completion_tokens == 1 and "disaggregated_params" not in out.model_extra
        assert (text, finish) == ((" " + first_word, "length") if "stop" not in kwargs else (" " + first_word[0], "stop"))
    assert all_received(fresh_fakes, "gen1", "gen2") == []


def test_models_are_proxied_from_a_server(disagg):
    assert [m.id for m in client(disagg).models.list().data] == ["fake"]


def test_a_router_starts_without_httpxs_command_line_client(fresh_fakes, start_router):
    """httpx imports its CLI (rich, pygments) unless told not to: ~0.15-0.3 of the ~1.3 CPU-seconds of
    every router start (adpfleet/cli.py). The router's import log (Python's -X importtime) shows it did not."""
    router = start_router("--aggregated", fresh_fakes["agg"].url, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert client(router).completions.create(model="fake", prompt="x", max_tokens=2).usage.completion_tokens == 2
    imported = {line.rsplit("|", 1)[-1].strip() for line in router.tail(10_000_000).splitlines()
                if line.startswith("import time:")}
    assert "httpx" in imported and "fastapi" in imported  # the log is whole
    assert not imported & {"httpx._main", "rich", "pygments"}  # (click: uvicorn's own)


def test_an_aggregated_only_router_sends_requests_straight_to_the_aggregated_server(fresh_fakes, start_router):
    router = start_router("--aggregated", fresh_fakes["agg"].url)
    out = client(router).completions.create(model="fake", prompt="agg", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert fresh_fakes["agg"].received() == [{"model": "fake", "prompt": "agg", "max_tokens": 3}]
    assert httpx.get(router.url + "/health").json()["mode"] == "aggregated"


def test_requests_spread_over_generation_servers(disagg, fresh_fakes):
    c = client(disagg)
    for _ in range(4):
        c.completions.create(model="fake", prompt="spread", max_tokens=2)
    assert len(fresh_fakes["gen1"].received()) == 2 and len(fresh_fakes["gen2"].received()) == 2


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize("content, param, what", [
    (b"{not json", None, "not valid JSON"),
    (b"\xff\xfe", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"prompt": "x", "stream": "yes"}', "stream", "boolean"),
    (b'{"prompt": "x", "stream": true, "stream_options": "usage"}', "stream_options", "object"),
    (b'{"prompt": "x", "disaggregated_params": {}}', "disaggregated_params", "disaggregated_params"),
    (b'{"prompt": "x", "stop": ' + b"[" * 1500 + b"]" * 1500 + b"}", None, "nested deeper"),  # too deep to parse
    (b'{"prompt": "x", "stop": ' + b"[" * 100 + b"]" * 100 + b"}", "stop", "nested deeper"),
    (b'{"prompt": "x", "model": "\\ud800"}', "model", "not valid Unicode"),
])
def test_the_router_itself_refuses_bodies_it_cannot_route(disagg, fresh_fakes, content, param, what):
    r = httpx.post(disagg.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and what in err["message"] and err["type"] == "invalid_request_error"
    assert all_received(fresh_fakes, "ctx", "gen1", "gen2") == []


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
])
def test_server_4xx_answers_pass_through_unchanged_and_are_never_retried(disagg, fresh_fakes, body, status, param):
    r = httpx.post(disagg.url + "/v1/completions", json=body)
    ref = httpx.post(fresh_fakes["agg"].url + "/v1/completions", json=body)
    assert (r.status_code, r.json()) == (ref.status_code, ref.json()) == (status, ref.json())
    assert r.json()["error"]["param"] == param
    assert len(fresh_fakes["ctx"].received()) == 1 and disagg.metric("adpfleet_router_retries_total") == 0


def test_the_openai_client_sees_the_servers_4xx_as_its_own_error_class(disagg):
    with pytest.raises(openai.NotFoundError) as e:
        client(disagg).completions.create(model="gpt-4", prompt="x")
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(disagg).completions.create(model="fake", prompt="x", max_tokens=0)


def test_a_body_over_the_limit_is_413_before_it_is_read(fresh_fakes, start_router):
    router = start_router("--aggregated", fresh_fakes["agg"].url, "--max-request-bytes", "1000")
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and "1000" in r.json()["error"]["message"]
    chunked = httpx.post(router.url + "/v1/completions", content=iter([b'{"prompt": "', b"x" * 600, b"x" * 600, b'"}']))
    assert chunked.status_code == 413
    assert fresh_fakes["agg"].received() == []


def test_a_body_that_would_expand_too_far_or_overfill_the_queue_is_refused_naming_the_limit(start_router):
    """A body's values are counted before it is parsed (413), and the queue holds bodies up to
    --queue-max-bytes in all (429 with Retry-After): holding the API key no longer buys gigabytes."""
    router = start_router("--aggregated", f"http://127.0.0.1:{free_port()}", "--queue-max-bytes", "1000000",
                          "--queue-timeout", "2", healthy=False)
    wait_until(lambda: httpx.get(router.url + "/health").status_code == 503, timeout=10, what="no usable server")
    values = b'{"prompt": "x", "x": [' + b",".join([b"0"] * 300_000) + b"]}"
    r = httpx.post(router.url + "/v1/completions", content=values, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_values"
    assert "at most 262144" in r.json()["error"]["message"]
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
        httpx.post, router.url + "/v1/completions", json={"prompt": "x" * 600_000}, timeout=30)
    wait_until(lambda: router.metric("adpfleet_router_queue_bytes") > 600_000, timeout=10, what="the first waiting")
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "y" * 600_000}, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_bytes"
    assert "--queue-max-bytes" in r.json()["error"]["message"] and "1000000" in r.json()["error"]["message"]
    assert waiting.result(timeout=10).status_code == 503  # it waited its 2 s: no server came
    assert router.metric("adpfleet_router_queued_total", outcome="over_bytes") == 1
    assert router.metric("adpfleet_router_queue_bytes") == 0


@pytest.mark.parametrize("stream, failure, said", [
    (False, {"fail_status": 503}, "generation server: HTTP 503"),
    (False, {"refuse_params": True}, "generation server: HTTP 403: refused the disaggregated_params the router sent"),
    (True, {"kv_fail_in_stream": True}, "generation server: error event before any token: the KV transfer"),
])
def test_no_error_the_router_gives_names_a_server_address(disagg, fresh_fakes, stream, failure, said):
    """The servers' own messages name their address or the KV endpoint (as `adpfleet serve`'s
    do); the client gets the roles and what went wrong, the log gets the rest."""
    for name in ("gen1", "gen2"):
        fresh_fakes[name].configure(**failure)
    r = httpx.post(disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream}, timeout=30)
    assert r.status_code == 503 and said in r.json()["error"]["message"]
    assert_names_no_address(r.text, *fresh_fakes.values())
    assert fresh_fakes["gen1"].url in disagg.tail(100_000)


# -- failures before any token: retried --------------------------------------------------------
def test_a_generation_server_answering_429_is_retried_on_the_other_without_a_cooldown(disagg, fresh_fakes):
    fresh_fakes["gen1"].configure(fail_status=429)
    for stream in (False, True, False, True):
        out = client(disagg).completions.create(model="fake", prompt="full", max_tokens=3, stream=stream)
        assert len(("".join(ch.choices[0].text for ch in out) if stream else out.choices[0].text).split()) == 3
    assert disagg.metric("adpfleet_router_errors_total", reason="overloaded") >= 1
    assert disagg.metric("adpfleet_router_servers", role="generation", usable="true") == 2  # no cooldown


def test_when_every_server_is_full_the_client_gets_429_with_retry_after(disagg, fresh_fakes):
    for name in ("gen1", "gen2"):
        fresh_fakes[name].configure(fail_status=429)
    r = httpx.post(disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded" and "retry shortly" in r.json()["error"]["message"]
    with pytest.raises(openai.RateLimitError):
        client(disagg).completions.create(model="fake", prompt="x", max_tokens=3)


def test_a_kv_endpoint_on_another_host_than_its_context_server_is_never_passed_on(disagg, fresh_fakes):
    fresh_fakes["ctx"].configure(kv_host="10.9.8.7")  # a context server naming someone else's port
    r = httpx.post(disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 503 and "KV endpoint on another host" in r.json()["error"]["message"]
    assert_names_no_address(r.text, *fresh_fakes.values())
    assert "10.9.8.7" in disagg.tail(100_000)
    assert all_received(fresh_fakes, "gen1", "gen2") == []


def test_a_generation_server_answering_503_is_retried_on_the_other(disagg, fresh_fakes):
    fresh_fakes["gen1"].configure(fail_status=503)
    c = client(disagg)
    for stream in (False, True, False, True):
        out = c.completions.create(model="fake", prompt="retry", max_tokens=3, stream=stream)
        text = "".join(ch.choices[0].text for ch in out) if stream else out.choices[0].text
        assert len(text.split()) == 3
    assert disagg.metric("adpfleet_router_retries_total") >= 1
    assert disagg.metric("adpfleet_router_errors_total", reason="server_error") >= 1
    assert disagg.metric("adpfleet_router_requests_total", status="200") == 4


def test_every_answer_says_how_many_attempts_it_took_and_how_long_it_waited_for_a_server(fresh_fakes, start_router):
    """What a client (and bench/remediation.py) reads to tell a request the router retried
    invisibly, or held in its queue, from one that went through at once. The held request waits
    for the next health probe after gen2 comes back: a queue timeout of 1 s left that probe 0.5 s,
    which a busy machine missed (503 no_server)."""
    disagg = disagg_router(start_router, fresh_fakes, "--queue-timeout", "30")
    fresh_fakes["gen1"].configure(fail_status=503)
    attempts = []
    for stream in (False, True, False, True):
        r = httpx.post(disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": stream},
                       timeout=30)
        assert r.status_code == 200 and (r.text.rstrip().endswith("[DONE]") if stream else r.json()["choices"])
        attempts.append(int(r.headers["x-adpfleet-attempts"]))
        assert 0 <= float(r.headers["x-adpfleet-queued-seconds"]) < 0.5
    assert sorted(set(attempts)) == [1, 2], attempts  # the one sent to gen1 first took a second attempt
    assert attempts.count(2) == disagg.metric("adpfleet_router_retries_total")
    fresh_fakes["gen1"].configure(healthy=False)
    fresh_fakes["gen2"].configure(healthy=False)
    wait_until(lambda: httpx.get(disagg.url + "/health").status_code == 503, timeout=5, what="no usable generation")
    held = concurrent.futures.ThreadPoolExecutor(1).submit(
        httpx.post, disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True}, timeout=30)
    wait_until(lambda: disagg.metric("adpfleet_router_queue_waiting") == 1, timeout=5, what="the request waiting")
    time.sleep(0.5)  # it waits at least this long
    fresh_fakes["gen2"].configure(healthy=True)
    r = held.result(timeout=10)
    assert r.status_code == 200 and r.headers["x-adpfleet-attempts"] == "1", r.text
    assert float(r.headers["x-adpfleet-queued-seconds"]) >= 0.5


def test_a_failed_kv_pull_reruns_the_whole_pipeline(disagg, fresh_fakes):
    fresh_fakes["gen1"].configure(kv_fail=True)
    fresh_fakes["gen2"].configure(kv_fail=True)
    with pytest.raises(openai.APIStatusError) as e:
        client(disagg).completions.create(model="fake", prompt="kv", max_tokens=3)
    assert e.value.status_code == 503 and "the KV transfer from the context server failed" in e.value.message
    assert_names_no_address(e.value.message, *fresh_fakes.values())
    assert "kv_fail is set" in disagg.tail(100_000)  # what the server said: in the log
    assert len(fresh_fakes["ctx"].received()) == 3  # --max-attempts 3: the context step ran each time
    assert disagg.metric("adpfleet_router_errors_total", reason="kv_transfer_failed") == 3
    fresh_fakes["gen2"].configure(kv_fail=False)
    assert client(disagg).completions.create(model="fake", prompt="kv", max_tokens=3).usage.completion_tokens == 3


def test_a_failed_kv_pull_reported_as_the_streams_first_event_is_retried(disagg, fresh_fakes):
    fresh_fakes["gen1"].configure(kv_fail_in_stream=True)
    c = client(disagg)
    for _ in range(2):  # one of them lands on gen1 first
        text = "".join(ch.choices[0].text for ch in c.completions.create(model="fake", prompt="kv", max_tokens=3,
                                                                          stream=True))
        assert len(text.split()) == 3
    failed = disagg.metric("adpfleet_router_errors_total", reason="kv_transfer_failed")
    assert failed >= 1 and len(fresh_fakes["ctx"].received()) == 2 + failed  # each retry reran the context step


def test_a_dead_context_server_fails_the_kv_pull_and_the_request_gets_an_explicit_503(fresh_fakes, start_router,
                                                                                          log_dir):
    doomed = FakeServer("context", log_dir).wait_healthy()
    router = start_router("--context", doomed.url, "--generation", fresh_fakes["gen1"].url)
    doomed.configure(token_delay=0.5)   # the context step takes 0.5 s: kill it while it holds the KV
    try:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=httpx.post(router.url + "/v1/completions", timeout=30,
                                                                       json={"prompt": "x", "max_tokens": 4})))
        t.start()
        wait_until(lambda: doomed.received(), timeout=10, what="the context request")
        doomed.kill()
        t.join(30)
        r = result["r"]
        assert r.status_code == 503 and "context server" in r.json()["error"]["message"]
        assert_names_no_address(r.text, doomed, *fresh_fakes.values())
        assert doomed.url in router.tail(100_000)
    finally:
        doomed.kill()


def test_a_hung_generation_server_is_given_up_after_the_first_token_timeout(fresh_fakes, start_router):
    f = fresh_fakes
    router = start_router("--context", f["ctx"].url, "--generation", f["gen1"].url, "--generation", f["gen2"].url,
                          "--first-token-timeout", "1")
    f["gen1"].configure(hang=True)
    c = client(router)
    t0 = time.monotonic()
    for _ in range(2):  # one of the two lands on gen1 first (round robin), waits 1 s, then gen2
        assert c.completions.create(model="fake", prompt="hang", max_tokens=2, stream=True) is not None
    assert time.monotonic() - t0 < 8
    assert router.metric("adpfleet_router_errors_total", reason="attempt_timeout") >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_when_every_server_hangs_the_request_ends_with_504_at_its_deadline(fresh_fakes, start_router, stream):
    f = fresh_fakes
    router = start_router("--context", f["ctx"].url, "--generation", f["gen1"].url, "--request-timeout", "1.5")
    f["ctx"].configure(kv_hang=True)          # the transfer never completes...
    f["gen1"].configure(kv_timeout=3600)      # ...and the generation server waits for it forever
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": stream}, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert "generation server" in r.text and f["gen1"].url in router.tail(100_000)
    assert_names_no_address(r.text, *f.values())
    assert 1.4 < elapsed < 4
    wait_until(lambda: router.metric("adpfleet_router_in_flight") == 0, timeout=5, what="in-flight back to 0")


def test_no_usable_server_at_all_is_a_503_naming_the_problem(fresh_fakes, start_router, log_dir):
    gone = FakeServer("generation", log_dir).wait_healthy()
    router = start_router("--context", fresh_fakes["ctx"].url, "--generation", gone.url)
    gone.kill()
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"  # after --queue-timeout 1: come back later
    assert r.json()["error"]["code"] == "no_server" and "generation 0 of 1" in r.json()["error"]["message"]
    assert_names_no_address(r.text, gone, *fresh_fakes.values())
    assert gone.url in router.tail(100_000)
    wait_until(lambda: httpx.get(router.url + "/health").status_code == 503, timeout=5,
               what="router /health to turn 503")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_waits_while_no_generation_server_is_usable_and_goes_on_when_one_is(fresh_fakes, start_router,
                                                                                      stream):
    f = fresh_fakes
    router = start_router("--context", f["ctx"].url, "--generation", f["gen1"].url, "--queue-timeout", "30")
    f["gen1"].configure(healthy=False)
    wait_until(lambda: httpx.get(router.url + "/health").status_code == 503, timeout=5, what="gen1 unusable")
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
        lambda: "".join(ch.choices[0].text for ch in client(router).completions.create(
            model="fake", prompt="wait", max_tokens=3, stream=True)) if stream else
        client(router).completions.create(model="fake", prompt="wait", max_tokens=3).choices[0].text)
    wait_until(lambda: router.metric("adpfleet_router_queue_waiting") == 1, timeout=5, what="the request waiting")
    assert not waiting.done() and f["ctx"].received() == []  # nothing started while no pair was usable
    f["gen1"].configure(healthy=True)  # the next probe (0.5 s) makes it usable again
    assert len(waiting.result(timeout=10).split()) == 3
    assert router.metric("adpfleet_router_queued_total", outcome="placed") == 1
    assert router.metric("adpfleet_router_requests_total", status="200") == 1


# -- failures after tokens: explicit error -----------------------------------------------------
def test_a_server_dying_mid_stream_ends_the_stream_with_an_error_the_openai_client_raises(fresh_fakes, start_router,
                                                                                            log_dir):
    doomed = FakeServer("generation", log_dir).wait_healthy()
    router = start_router("--context", fresh_fakes["ctx"].url, "--generation", doomed.url)
    doomed.configure(token_delay=0.1)
    stream = client(router).completions.create(model="fake", prompt="x", max_tokens=100, stream=True)
    got = [next(stream).choices[0].text, next(stream).choices[0].text]
    doomed.kill()
    with pytest.raises(openai.APIError, match="incomplete") as e:
        for chunk in stream:
            got.append(chunk)
    assert len(got) < 100 and "generation server: connection lost" in e.value.message
    assert_names_no_address(e.value.message, doomed, *fresh_fakes.values())
    assert router.metric("adpfleet_router_requests_total", status="stream_error") == 1
    assert router.metric("adpfleet_router_errors_total", reason="stream_broken") == 1


def test_the_raw_stream_ends_with_an_error_event_then_done(fresh_fakes, start_router, log_dir):
    doomed = FakeServer("aggregated", log_dir).wait_healthy()
    router = start_router("--aggregated", doomed.url)
    doomed.configure(token_delay=0.1)
    with httpx.stream("POST", router.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        doomed.kill()
        rest = [line for line in lines if line]
    assert '"error"' in rest[-2] and '"stream_broken"' in rest[-2] and rest[-1] == "data: [DONE]"


# -- the client leaves ---------------------------------------------------------------------------
def test_a_client_leaving_a_stream_cancels_the_upstream_request(disagg, fresh_fakes):
    for g in ("gen1", "gen2"):
        fresh_fakes[g].configure(token_delay=0.2)
    with httpx.stream("POST", disagg.url + "/v1/completions", timeout=30,
                      json={"prompt": "x", "max_tokens": 100, "stream": True}) as r:
        lines = r.iter_lines()  # keep it: a dropped line iterator closes the response
        next(lines)
        assert fresh_fakes["gen1"].streams_open() + fresh_fakes["gen2"].streams_open() == 1
    wait_until(lambda: fresh_fakes["gen1"].streams_open() + fresh_fakes["gen2"].streams_open() == 0, timeout=5,
               what="the generation server's stream to be cancelled")
    wait_until(lambda: disagg.metric("adpfleet_router_in_flight") == 0, timeout=5, what="router in-flight 0")
    assert disagg.metric("adpfleet_router_requests_total", status="client_closed") == 1


def test_a_client_leaving_before_the_answer_releases_the_servers(disagg, fresh_fakes):
    fresh_fakes["ctx"].configure(token_delay=30)   # the context step takes 30 s
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=1)
    wait_until(lambda: disagg.metric("adpfleet_router_in_flight") == 0, timeout=5, what="router in-flight 0")
    assert disagg.metric("adpfleet_router_requests_total", status="client_closed") == 1


# -- health and metrics ----------------------------------------------------------------------
def test_health_follows_the_servers_health(disagg, fresh_fakes):
    assert httpx.get(disagg.url + "/health").json() == {"status": "ok", "mode": "disaggregated",
                                                        "servers": {"context": 1, "generation": 2, "aggregated": 0}}
    fresh_fakes["ctx"].configure(healthy=False)
    wait_until(lambda: httpx.get(disagg.url + "/health").status_code == 503, timeout=5, what="router unhealthy")
    fresh_fakes["ctx"].configure(healthy=True)
    wait_until(lambda: httpx.get(disagg.url + "/health").status_code == 200, timeout=5, what="router healthy")


def test_metrics_count_requests_and_in_flight_per_server(disagg, fresh_fakes):
    for g in ("gen1", "gen2"):
        fresh_fakes[g].configure(token_delay=0.2)
    with httpx.stream("POST", disagg.url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True},
                      timeout=30) as r:
        lines = r.iter_lines()
        next(lines)
        m = disagg.metrics()
        gen_in_flight = {k: v for k, v in m.items() if k.startswith("adpfleet_router_in_flight") and "generation" in k}
        assert sorted(gen_in_flight.values()) == [0, 1]
        assert m[f'adpfleet_router_in_flight{{role="context",server="{fresh_fakes["ctx"].url}"}}'] == 0
    client(disagg).completions.create(model="fake", prompt="x", max_tokens=2)
    assert disagg.metric("adpfleet_router_requests_total", status="200") == 1
    assert disagg.metric("adpfleet_router_errors_total", reason="deadline") == 0  # every reason exists at 0


# -- authentication --------------------------------------------------------------------------
def test_with_an_api_key_every_path_but_health_and_metrics_needs_it(fresh_fakes, start_router, log_dir):
    key_file = log_dir / "router-key"
    key_file.write_text("router-key\n")  # as a mounted Secret: the trailing newline is not part of it
    router = start_router("--aggregated", fresh_fakes["agg"].url, "--api-key-file", str(key_file))
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                         ("GET", "/docs"), ("GET", "/openapi.json")):
        for header in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer router-ke"},
                       {"Authorization": "Basic router-key"}):
            r = httpx.request(method, router.url + path, headers=header, json={"prompt": "x"})
            assert r.status_code == 401, (path, header)
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(router.url + "/health").status_code == 200 and httpx.get(router.url + "/metrics").status_code == 200
    assert httpx.get(router.url + "/docs", headers={"Authorization": "Bearer router-key"}).status_code == 404
    out = openai.OpenAI(base_url=router.url + "/v1", api_key="router-key", max_retries=0).completions.create(
        model="fake", prompt="with the key", max_tokens=3)
    assert len(out.choices[0].text.split()) == 3
    assert fresh_fakes["agg"].received()[-1]["prompt"] == "with the key"
