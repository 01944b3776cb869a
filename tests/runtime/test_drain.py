"""SIGTERM drains a server (runtime/serving/drain.py): it stops admitting, lets what runs finish,
hands back what cannot within its drain timeout, and exits 0 with its ranks — what the kubelet
needs for a deleted, scaled-down or rolled pod to end Succeeded without cutting a stream."""

import json
import os
import signal
import threading
import time

import httpx
import pytest

from servers import Server, metric, wait_until

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


class Stream:
    """A streamed completion read on a thread: its chunks as they come, and how it ended."""

    def __init__(self, url: str, max_tokens: int):
        self.tokens, self.events, self.error = 0, [], None
        self.done = threading.Event()
        body = {"prompt": "a long answer", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        threading.Thread(target=self._read, args=(url, body), daemon=True).start()

    def _read(self, url, body):
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        self.events.append(event)
                        self.tokens += bool(event.get("choices") and event["choices"][0].get("text"))
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.done.set()

    @property
    def completion_tokens(self):
        return next((e["usage"]["completion_tokens"] for e in self.events if e.get("usage")), None)

    @property
    def finish_reason(self):
        return next((e["choices"][0]["finish_reason"] for e in reversed(self.events)
                     if e.get("choices") and e["choices"][0].get("finish_reason")), None)


def group_gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
        return False
    except ProcessLookupError:
        return True


def test_sigterm_stops_admitting_finishes_the_stream_in_flight_and_exits_0_with_its_ranks(tmp_path):
    s = Server("--model", "tiny", "--dp", "2", "--drain-timeout", "60", log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        stream = Stream(s.url, max_tokens=1200)
        assert wait_until(lambda: stream.tokens >= 20, 60)
        os.killpg(s.proc.pid, signal.SIGTERM)  # as the kubelet does: the whole process group
        assert wait_until(lambda: httpx.get(s.url + "/health", timeout=2).status_code == 503, 10)
        assert httpx.get(s.url + "/health").json()["status"] == "draining"
        refused = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_draining"
        assert metric(s, "adpfleet_requests_running") == 1  # the ranks still run it (they ignored SIGTERM)
        assert not stream.done.is_set()
        assert stream.done.wait(90), "the stream did not finish"
        assert stream.error is None and stream.finish_reason == "length" and stream.completion_tokens == 1200
        assert s.proc.wait(30) == 0
        assert wait_until(lambda: group_gone(s.proc.pid), 10), "a rank outlived its server"
        log = (tmp_path / "s.log").read_text()
        assert "exited (exit code" not in log, log[-2000:]  # no rank died on the signal
    finally:
        s.stop()


def test_what_the_drain_timeout_cuts_short_is_handed_back_with_an_explicit_error(tmp_path):
    s = Server("--model", "tiny", "--drain-timeout", "1", log_path=tmp_path / "s.log")
    try:
        s.wait_healthy()
        stream = Stream(s.url, max_tokens=4000)
        assert wait_until(lambda: stream.tokens >= 5, 60)
        start = time.monotonic()
        os.killpg(s.proc.pid, signal.SIGTERM)
        assert stream.done.wait(30)
        assert stream.finish_reason != "length" and "shutting down" in json.dumps(stream.events[-1])
        assert s.proc.wait(30) == 0 and time.monotonic() - start < 15
    finally:
        s.stop()


def test_the_draining_server_keeps_the_read_timeout_and_lingering_close_of_every_server():
    """GracefulServer is uvicorn as `limits.uvicorn_config` makes it (read timeout, lingering close:
    docs/security.md), with the drain gate in front of the app."""
    from adpfleet.runtime.serving.drain import HAND_BACK_S, DrainGate, GracefulServer
    from adpfleet.runtime.serving.limits import ReadTimeoutProtocol

    app = object()
    server = GracefulServer(app, engine=None, host="127.0.0.1", port=0, read_timeout=7.0, drain_timeout_s=3)
    config = server.config
    assert config.http.func is ReadTimeoutProtocol and config.http.keywords == {"read_timeout": 7.0}
    assert isinstance(config.app, DrainGate) and config.app.app is app and config.app.drain is server.drain
    assert config.timeout_graceful_shutdown == HAND_BACK_S and server.drain.timeout_s == 3
