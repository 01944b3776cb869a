"""The router's pure parts: server selection, retry policy, pod → server, SSE handling."""

import asyncio
import json
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adpfleet.runtime.router import sse
from adpfleet.runtime.router.discovery import KubeDiscovery, PodSet, endpoint_from_pod, static_endpoints
from adpfleet.runtime.router.retry import (Failure, failure_from_status, final_error, is_client_error, retry_after,
                                            servers_to_avoid, should_retry)
from adpfleet.runtime.router.pool import Endpoint, ServerPool, normalize_url

G1, G2, G3 = (Endpoint("generation", f"http://10.0.0.{i}:8000") for i in (1, 2, 3))
C1 = Endpoint("context", "http://10.0.1.1:8000")
A1 = Endpoint("aggregated", "http://10.0.2.1:8000")


# -- selection -------------------------------------------------------------------------------
def test_pick_takes_the_server_with_fewest_requests_in_flight():
    pool = ServerPool()
    pool.set_endpoints([G1, G2, G3])
    for ep in (G1, G1, G2, G3):
        pool.acquire(ep)
    pool.release(G3)
    assert pool.pick("generation", now=0) == G3


def test_ties_are_broken_round_robin():
    pool = ServerPool()
    pool.set_endpoints([G1, G2, G3])
    assert [pool.pick("generation", now=0) for _ in range(6)] == [G1, G2, G3, G1, G2, G3]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40))
def test_pick_always_returns_a_least_loaded_server(ops):
    pool = ServerPool()
    pool.set_endpoints([G1, G2, G3])
    held = []
    for op in ops:
        if op == 0 and held:  # release some earlier request
            pool.release(held.pop(len(held) // 2))
            continue
        loads = pool.in_flight()
        ep = pool.pick("generation", now=0)
        assert loads[ep] == min(loads.values())
        pool.acquire(ep)
        held.append(ep)
    assert sum(pool.in_flight().values()) == len(held)


def test_servers_a_request_failed_on_are_avoided_while_others_exist():
    pool = ServerPool()
    pool.set_endpoints([G1, G2])
    pool.acquire(G2)
    assert pool.pick("generation", now=0, avoid={G1}) == G2
    assert pool.pick("generation", now=0, avoid={G1, G2}) == G1  # all avoided: still an answer


def test_a_failed_server_cools_down_then_is_used_again():
    pool = ServerPool(cooldown_s=5)
    pool.set_endpoints([G1, G2])
    pool.report_failure(G1, now=100)
    assert pool.usable("generation", now=101) == [G2]
    assert {pool.pick("generation", now=101) for _ in range(4)} == {G2}
    assert pool.usable("generation", now=105) == [G1, G2]


def test_a_server_failing_its_probe_is_unusable_until_it_passes():
    pool = ServerPool()
    pool.set_endpoints([C1, G1, A1])
    assert pool.report_probe(G1, False) is False
    assert pool.mode(now=0) == "aggregated"
    assert pool.report_probe(G1, True) is True  # usable again: waiting requests look
    assert pool.report_probe(G1, True) is False
    assert pool.mode(now=0) == "disaggregated"


def test_no_usable_server_means_no_mode_and_the_request_waits():
    pool = ServerPool(cooldown_s=5)
    pool.set_endpoints([C1, G1])
    pool.report_probe(G1, False)
    assert pool.mode(now=0) is None and pool.recovery_in(now=0) is None  # only a probe can bring it back
    pool.report_probe(G1, True)
    pool.report_failure(G1, now=10)
    assert pool.mode(now=11) is None and pool.recovery_in(now=11) == 4   # its cool-down ends in 4 s
    assert pool.mode(now=15) == "disaggregated" and pool.recovery_in(now=15) is None


def test_a_removed_server_is_never_picked_but_keeps_its_in_flight_count_until_released():
    pool = ServerPool()
    pool.set_endpoints([G1, G2])
    pool.acquire(G1)
    pool.set_endpoints([G2])
    assert {pool.pick("generation", now=0) for _ in range(3)} == {G2}
    assert pool.in_flight()[G1] == 1 and pool.endpoints() == [G2]
    pool.release(G1)
    assert G1 not in pool.in_flight()


def test_no_server_of_a_role_means_no_pick_and_no_mode():
    pool = ServerPool()
    pool.set_endpoints([C1])
    assert pool.pick("generation", now=0) is None and pool.mode(now=0) is None


@pytest.mark.parametrize("url, expected", [("10.0.0.1:8000", "http://10.0.0.1:8000"),
                                          ("http://h:1/", "http://h:1"), (" https://h ", "https://h")])
def test_server_urls_are_normalized(url, expected):
    assert normalize_url(url) == expected


@pytest.mark.parametrize("url", ["", "ftp://h:1"])
def test_bad_server_urls_are_refused(url):
    with pytest.raises(ValueError):
        normalize_url(url)


def test_static_endpoints_keep_roles():
    assert static_endpoints(["c:1"], ["g:1", "g:2"], ["a:1"]) == [
        Endpoint("context", "http://c:1"), Endpoint("generation", "http://g:1"),
        Endpoint("generation", "http://g:2"), Endpoint("aggregated", "http://a:1")]


# -- retry policy ----------------------------------------------------------------------------
@pytest.mark.parametrize("status, retried", [(400, False), (404, False), (422, False), (429, True), (499, False),
                                             (500, True), (502, True), (503, True)])
def test_only_non_4xx_failures_and_429_are_retried(status, retried):
    assert is_client_error(status) is not retried


def test_a_refusal_of_the_routers_own_params_is_the_fleets_failure_not_the_clients():
    refused = json.dumps({"error": {"message": "'disaggregated_params.kv_endpoint': 10.0.1.1 is not an allowed KV "
                                               "peer of this server", "type": "invalid_request_error",
                                    "param": "disaggregated_params"}}).encode()
    assert not is_client_error(403, refused) and is_client_error(400, b'{"error": {"param": "max_tokens"}}')
    f = failure_from_status(G1, 403, refused)
    assert f.reason == "server_error" and should_retry(f, 1, 3, False, 10)
    assert "10.0.1.1" in f.describe() and "10.0.1.1" not in f.public() and "internal token" in f.public()


def test_a_429_is_an_overloaded_server_and_every_attempt_429_is_a_429_for_the_client():
    body = json.dumps({"error": {"message": "at its limit of 8 waiting requests", "type": "invalid_request_error"}})
    f = failure_from_status(G1, 429, body.encode())
    assert f.reason == "overloaded" and "limit of 8" in f.describe() and "limit of 8" not in f.public()
    assert should_retry(f, 1, 3, False, 10)
    status, err = final_error([f, failure_from_status(G2, 429, b"")], deadline_passed=False)
    assert status == 429 and err["error"]["code"] == "overloaded"
    status, _ = final_error([f, Failure("connect_error", "refused", G2)], deadline_passed=False)
    assert status == 503  # not every server was merely full


def test_kv_transfer_failure_is_recognized_from_the_error_type():
    body = json.dumps({"error": {"message": "pull timed out", "type": "kv_transfer_failed"}}).encode()
    f = failure_from_status(G1, 502, body)
    assert f.reason == "kv_transfer_failed" and "pull timed out" in f.describe() and "pull timed out" not in f.public()
    assert failure_from_status(G1, 502, b"<html>bad gateway").reason == "server_error"


def test_a_failed_kv_pull_avoids_both_sides_next_time():
    f = Failure("kv_transfer_failed", "x", G1)
    assert servers_to_avoid(f, C1) == {G1, C1}
    assert servers_to_avoid(Failure("connect_error", "x", G1), C1) == {G1}


@pytest.mark.parametrize("reason, attempt, token_sent, left, expected", [
    ("server_error", 1, False, 10, True),
    ("connect_error", 2, False, 10, True),
    ("server_error", 3, False, 10, False),       # attempts used up
    ("server_error", 1, True, 10, False),        # the client already has tokens
    ("server_error", 1, False, 0, False),        # deadline passed
    ("deadline", 1, False, 10, False),
    ("no_server", 1, False, 10, False),
    ("queue_full", 1, False, 10, False),
    ("queue_bytes", 1, False, 10, False),
    ("attempt_timeout", 1, False, 10, True),
    ("kv_transfer_failed", 1, False, 10, True),
    ("overloaded", 1, False, 10, True),
])
def test_should_retry(reason, attempt, token_sent, left, expected):
    assert should_retry(Failure(reason, "x", G1), attempt, 3, token_sent, left) is expected


def test_final_error_names_every_attempt_by_role_and_uses_504_for_the_deadline():
    failures = [Failure("connect_error", "refused", G1, detail="ConnectError('10.0.0.1:8000')"),
                Failure("server_error", "HTTP 503", C1)]
    status, body = final_error(failures, deadline_passed=False)
    assert status == 503 and body["error"]["code"] == "upstream_unavailable"
    message = body["error"]["message"]
    assert "attempt 1: generation server: refused" in message and "attempt 2: context server: HTTP 503" in message
    assert "10.0." not in message and G1.url in failures[0].describe() and "ConnectError" in failures[0].describe()
    assert not retry_after(status, failures)
    status, body = final_error(failures + [Failure("deadline", "late", G1)], deadline_passed=True)
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"


@pytest.mark.parametrize("reason, status", [("no_server", 503), ("queue_full", 503), ("queue_bytes", 429)])
def test_a_request_no_server_could_take_gets_retry_after_naming_its_attempts(reason, status):
    failures = [Failure("connect_error", "refused", G1), Failure(reason, "no usable server")]
    got, body = final_error(failures, deadline_passed=False)
    assert got == status and body["error"]["code"] == reason and retry_after(got, failures)
    assert body["error"]["message"].startswith("no usable server")
    assert "attempt 1: generation server: refused" in body["error"]["message"]
    assert retry_after(429, [Failure("overloaded", "full", G1)])


# -- discovery -------------------------------------------------------------------------------
def pod(name="p", role="generation", ip="127.0.0.5", ready=True, drain=None, deleting=False):
    meta = {"name": name, "namespace": "ns", "labels": {"adpfleet.io/role": role} if role else {}}
    if drain is not None:
        meta["annotations"] = {"adpfleet.io/drain": drain}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip, "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def test_a_ready_pod_with_a_role_is_a_server_at_its_ip_and_the_server_port():
    assert endpoint_from_pod(pod(), 8000) == Endpoint("generation", "http://127.0.0.5:8000")
    assert endpoint_from_pod(pod(ip="fd00::5"), 9) == Endpoint("generation", "http://[fd00::5]:9")


@pytest.mark.parametrize("kwargs", [dict(ready=False), dict(ip=None), dict(drain="true"), dict(drain="True"),
                                    dict(deleting=True), dict(role=None), dict(role="router")])
def test_pods_that_must_not_get_new_work_are_no_server(kwargs):
    assert endpoint_from_pod(pod(**kwargs), 8000) is None


def test_a_drain_annotation_other_than_true_is_ignored():
    assert endpoint_from_pod(pod(drain="false"), 8000) is not None


def test_pod_events_add_modify_and_remove_servers():
    pods = PodSet(8000)
    assert pods.replace([pod("a", ip="127.0.0.2"), pod("b", role="context", ip="127.0.0.3")])
    assert pods.endpoints() == [Endpoint("context", "http://127.0.0.3:8000"),
                                Endpoint("generation", "http://127.0.0.2:8000")]
    assert not pods.apply("MODIFIED", pod("a", ip="127.0.0.2"))       # nothing the router cares about
    assert pods.apply("MODIFIED", pod("a", ip="127.0.0.2", drain="true"))
    assert pods.endpoints() == [Endpoint("context", "http://127.0.0.3:8000")]
    assert pods.apply("DELETED", pod("b", role="context", ip="127.0.0.3"))
    assert pods.endpoints() == []
    assert pods.apply("ADDED", pod("c", ip="127.0.0.4"))
    assert not pods.replace([pod("c", ip="127.0.0.4")])


class FakeCore:
    """list_namespaced_pod as the discovery calls it: lists answer `lists` in turn; the first
    watch reports 410 Gone, later watches stay silent until the discovery stops."""

    def __init__(self, *lists):
        self.lists, self.watches = list(lists), 0
        self.stopped = threading.Event()

    def list_namespaced_pod(self, namespace, label_selector, watch=False, **kw):
        class Resp:
            def __init__(self, data=b"", lines=()):
                self.data, self.lines = data, lines

            def stream(self, amt=None, decode_content=False):
                yield from self.lines
                stopped.wait(10)

            def release_conn(self):
                pass
        stopped = self.stopped
        if not watch:
            items = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
            return Resp(json.dumps({"metadata": {"resourceVersion": "7"}, "items": items}).encode())
        self.watches += 1
        if self.watches == 1:
            gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}
            return Resp(lines=[json.dumps(gone).encode() + b"\n"])
        return Resp()


def test_a_watch_error_such_as_410_gone_makes_discovery_list_again():
    seen = []
    core = FakeCore([pod("a", ip="127.0.0.2")], [pod("a", ip="127.0.0.2"), pod("b", ip="127.0.0.3")])
    d = KubeDiscovery("ns", "sel", 8000, seen.append, core_api=core, retry_s=0.01).start()
    try:
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        core.stopped.set()
        d.stop()
    assert [len(s) for s in seen[:2]] == [1, 2], seen
    assert core.watches >= 1


# -- SSE -------------------------------------------------------------------------------------
async def _lines(*lines):
    for line in lines:
        yield line


def _collect(*lines):
    async def go():
        return [e async for e in sse.events(_lines(*lines))]
    return asyncio.run(go())


def test_sse_events_are_grouped_and_relayed_byte_for_byte():
    events = _collect(": keep-alive", "", 'data: {"choices": [{"text": "a"}]}', "", "data: [DONE]", "")
    assert [e.raw for e in events] == [b'data: {"choices": [{"text": "a"}]}\n\n', b"data: [DONE]\n\n"]
    assert events[0].has_output and events[1].is_done


def test_sse_lines_end_at_cr_or_lf_only_wherever_the_chunks_are_cut():
    stream = 'data: {"text": "a\u2028b\x85c\u2029d\x0be\x0cf\x1cg"}\r\n\r\ndata: x\rdata: y\n\ndata: [DONE]\n\n'
    want = ['data: {"text": "a\u2028b\x85c\u2029d\x0be\x0cf\x1cg"}', "", "data: x", "data: y", "", "data: [DONE]", ""]
    for cut in range(1, len(stream)):  # a CRLF split between two chunks is one line end, not two
        assert list(sse.iter_lines([stream[:cut], stream[cut:]])) == want, cut
    assert list(sse.iter_lines(["data: a\r", "data: b"])) == ["data: a", "data: b"]  # the last line, unended
    assert list(sse.iter_lines(["data: ", "a", "\u2028", "b\r", "", "\n", "\r"])) == ["data: a\u2028b", ""]


def test_an_event_the_stream_ended_in_is_dropped_not_relayed_half():
    events = _collect('data: {"choices": [{"text": "a"}]}', "", 'data: {"choices": [{"te')
    assert [e.raw for e in events] == [b'data: {"choices": [{"text": "a"}]}\n\n']


def test_a_chat_role_delta_is_not_output_but_tokens_content_usage_and_finish_are():
    def out(body):
        return sse.Event(b"", json.dumps(body)).has_output
    assert not out({"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]})
    assert not out({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})  # vLLM's
    assert out({"choices": [{"delta": {"role": "assistant", "content": "x"}, "finish_reason": None}]})
    assert out({"choices": [{"delta": {"content": "x"}, "finish_reason": None}]})
    # a token whose text the server holds back (an unfinished UTF-8 sequence, a possible stop string)
    assert out({"choices": [{"delta": {"content": ""}, "finish_reason": None}]})
    assert out({"choices": [{"text": "", "finish_reason": None}]})
    assert not out({"choices": ["x", {"delta": "y"}]}) and not out({"choices": []})
    assert out({"choices": [{"text": "", "finish_reason": "stop"}]})
    assert out({"choices": [], "usage": {"prompt_tokens": 1}})


def test_an_error_event_is_recognized():
    assert sse.Event(b"", '{"error": {"message": "boom"}}').error == {"message": "boom"}
    assert sse.Event(b"", '{"choices": []}').error is None


def test_a_finished_chat_result_becomes_the_chunks_a_stream_would_have_sent():
    result = {"id": "x", "created": 1, "model": "m", "usage": {"prompt_tokens": 2, "completion_tokens": 1},
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}]}
    chunks = [c.decode() for c in sse.stream_of(result, chat=True, include_usage=True)]
    first = json.loads(chunks[0][len("data: "):])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert json.loads(chunks[1][len("data: "):])["usage"]["completion_tokens"] == 1
    assert chunks[-1] == "data: [DONE]\n\n"
