"""The real vLLM (PyPI's CPU build, in its own environment) serves the tests' random Llama: the
official `openai` client completes against it, its API key is enforced, and a frozen engine looks
the way the operator must catch it — /health 200, work in the gauges, every progress counter flat.

One server for the session (the `vllm_server` fixture); the freeze lasts about two seconds.
"""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import openai
import pytest
from servers import metric
from vllm_servers import ENGINE_CORE

from adpfleet.cluster.testing import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_openai_client_completes_with_and_without_streaming(vllm_server):
    client = vllm_server.client(timeout=60)
    completion = client.completions.create(model="tiny", prompt="the fleet server", max_tokens=8,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 8 and completion.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="the fleet server", max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) and chunks[-1].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "the pod"}],
                                          max_tokens=4)
    assert chat.choices[0].message.role == "assistant"


def test_a_request_without_the_api_key_is_refused_but_health_and_metrics_are_open(vllm_server):
    with pytest.raises(openai.AuthenticationError):
        vllm_server.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=1)
    assert httpx.get(vllm_server.url + "/health", timeout=10).status_code == 200
    assert 'vllm:num_requests_running{engine="0",model_name="tiny"}' in httpx.get(vllm_server.url + "/metrics",
                                                                                   timeout=10).text


def test_a_frozen_engine_core_answers_health_with_work_and_no_progress(vllm_server):
    client = vllm_server.client(timeout=120)
    stream = client.completions.create(model="tiny", prompt="the engine", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # the request is running
    reader = threading.Thread(target=_read_until_closed, args=(chunks,), daemon=True)
    reader.start()
    try:
        with vllm_server.frozen(ENGINE_CORE) as frozen:
            assert [p.cmdline()[0] for p in frozen] == [ENGINE_CORE]
            settled = _settled_progress(vllm_server)
            time.sleep(FLAT_FOR_S)  # flatness is a claim about time: it needs some to pass
            assert _progress(vllm_server) == settled
            assert httpx.get(vllm_server.url + "/health", timeout=5).status_code == 200
            assert metric(vllm_server, "vllm:num_requests_running", engine="0") == 1
        wait_for(lambda: _progress(vllm_server)[0] > settled[0], timeout=30, what="tokens after the thaw")
    finally:
        stream.close()
        reader.join(30)


def _read_until_closed(chunks) -> None:
    with contextlib.suppress(httpx.HTTPError, openai.APIError):  # the test closes the stream at its end
        for _ in chunks:
            pass


FLAT_FOR_S = 1.5  # the tiny model makes ~100 steps a second here: 1.5 s of none is no accident


def _progress(server) -> tuple[float, float]:
    """(generation tokens, engine steps) of engine 0."""
    return (metric(server, "vllm:generation_tokens_total", engine="0"),
            metric(server, "vllm:iteration_tokens_total_count", engine="0"))


def _settled_progress(server) -> tuple[float, float]:
    """Progress once two scrapes half a second apart agree: what the engine sent before it froze
    has reached the API server's counters."""
    seen = [_progress(server)]

    def agrees() -> bool:
        time.sleep(0.5)
        seen.append(_progress(server))
        return seen[-1] == seen[-2]
    wait_for(agrees, timeout=10, what="the counters to settle after the freeze")
    return seen[-1]
