"""The Alertmanager webhook receiver: authentication, bad input, idempotency, bounded memory."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import tracemalloc
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from adpfleet.operator.inbox import AlertInbox, StallAlert
from adpfleet.operator.alerts import (ALERTS_PATH, AlertReceiver, ParsedPayload, SeenAlerts, StaticToken,
                                      parse_payload, PayloadError)
from adpfleet.operator.main import fleet_pods
from budgets import examples

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PODS = {("prod", "llama"): {f"llama-{role}-{i}" for role in ("context", "generation") for i in range(3000)}}


def alert(pod="llama-context-0", fingerprint="a1b2c3", starts_at="2024-05-01T10:00:00Z", status="firing",
          alertname="AdpfleetServerStalled", **labels):
    return {"status": status, "labels": {"alertname": alertname, "namespace": "prod", "fleet": "llama", "pod": pod,
                                         "role": "context", "severity": "critical", **labels},
            "annotations": {"summary": "llama-context-0 makes no progress"}, "startsAt": starts_at,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prometheus/graph", "fingerprint": fingerprint}


def payload(*alerts):
    return {"version": "4", "groupKey": "{}:{alertname=\"AdpfleetServerStalled\"}", "truncatedAlerts": 0,
            "status": "firing", "receiver": "adpfleet-operator", "groupLabels": {}, "commonLabels": {},
            "commonAnnotations": {}, "externalURL": "http://alertmanager:9093", "alerts": list(alerts)}


class Harness:
    def __init__(self, token=TOKEN, inbox_limit=100):
        self.inbox = AlertInbox(limit=inbox_limit)
        self.counts: dict[str, int] = {}
        self.receiver = AlertReceiver(StaticToken(token), self.inbox, lambda ns, name: PODS.get((ns, name)),
                                      count=lambda result, n: self.counts.__setitem__(result,
                                                                                      self.counts.get(result, 0) + n))

    async def post(self, client, body, headers=AUTH, raw=None, content_type="application/json"):
        data = raw if raw is not None else json.dumps(body)
        resp = await client.post(ALERTS_PATH, data=data, headers={**headers, "Content-Type": content_type})
        return resp.status, await resp.json()


def run(scenario, **harness_kw):
    """Run `scenario(harness, client)` against a real aiohttp server on loopback."""
    async def main():
        h = Harness(**harness_kw)
        app = web.Application()
        app.add_routes(h.receiver.routes())
        async with TestClient(TestServer(app)) as client:
            return await scenario(h, client)
    return asyncio.run(main())


def test_a_firing_stall_alert_is_queued_for_its_fleet():
    async def scenario(h, client):
        status, body = await h.post(client, payload(alert()))
        assert (status, body["queued"]) == (202, 1)
        taken = h.inbox.take("prod", "llama")
        assert [(a.pod, a.alertname, a.fingerprint) for a in taken] == [("llama-context-0", "AdpfleetServerStalled",
                                                                        "a1b2c3")]
        assert "AdpfleetServerStalled" in taken[0].source and h.inbox.take("prod", "llama") == []
    run(scenario)


@pytest.mark.parametrize("headers, status", [
    ({}, 401),
    ({"Authorization": "Bearer wrong"}, 401),
    ({"Authorization": f"Basic {TOKEN}"}, 401),
    ({"Authorization": "Bearer "}, 401),
    ({"Authorization": f"Bearer {TOKEN}x"}, 401),
    ({"Authorization": f"Bearer {TOKEN[:-1]}"}, 401),
    ({"Authorization": f"Bearer {TOKEN[:1]}"}, 401),
    ({"Authorization": f"bearer {TOKEN}"}, 202),
])
def test_the_bearer_token_is_required(headers, status):
    async def scenario(h, client):
        got, body = await h.post(client, payload(alert()), headers=headers)
        assert got == status
        if status == 401:
            assert "Bearer" in body["error"]["message"] or "wrong" in body["error"]["message"]
            assert len(h.inbox) == 0
    run(scenario)


def test_unauthenticated_requests_are_refused_before_the_body_is_looked_at():
    async def scenario(h, client):
        got, _ = await h.post(client, None, headers={}, raw="not json", content_type="text/plain")
        assert got == 401
    run(scenario)


def test_no_token_secret_yet_is_a_retryable_503():
    async def scenario(h, client):
        resp = await client.post(ALERTS_PATH, json=payload(alert()), headers=AUTH)
        assert resp.status == 503 and resp.headers["Retry-After"]
    run(scenario, token=None)


@pytest.mark.parametrize("raw, content_type, status, words", [
    ("{}", "text/plain", 415, "Content-Type must be application/json"),
    ("{not json", "application/json", 400, "not valid JSON"),
    ("\xff\xfe", "application/json", 400, "not valid JSON"),
    ("[]", "application/json", 400, "JSON object"),
    ('{"version": "3", "alerts": []}', "application/json", 400, "version must be \"4\""),
    ('{"version": "4"}', "application/json", 400, "alerts must be a list"),
    ('{"version": "4", "alerts": [1]}', "application/json", 400, "alerts[0] must be an object"),
    ('{"version": "4", "alerts": [{"labels": {"a": 1}}]}', "application/json", 400, "alerts[0].labels"),
    ('{"version": "4", "alerts": [{"labels": {}, "status": "firing", "startsAt": "x"}]}', "application/json", 400,
     "alerts[0].fingerprint"),
])
def test_malformed_payloads_are_a_400_that_says_what_is_wrong(raw, content_type, status, words):
    async def scenario(h, client):
        got, body = await h.post(client, None, raw=raw.encode("latin-1"), content_type=content_type)
        assert got == status and words in body["error"]["message"]
        assert len(h.inbox) == 0
    run(scenario)


def test_an_oversized_body_is_refused():
    async def scenario(h, client):
        got, body = await h.post(client, None, raw=b'{"version": "4", "alerts": [' + b" " * (2 * 1024 * 1024) + b"]}")
        assert got == 413
    run(scenario)


def _chunked(data: bytes, piece: int = 64 * 1024):
    """The body as a chunked upload (no Content-Length), arriving piece by piece."""
    async def pieces():
        for i in range(0, len(data), piece):
            yield data[i:i + piece]
            await asyncio.sleep(0)
    return pieces()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_large_valid_batch_is_read_whole_and_accepted(chunked):
    # 3,000 alerts in one notification (~0.9 MiB): most are resolved or not stall alerts, 50 are
    # actionable; the body arrives in many reads and must not be parsed from the first buffer only
    alerts = [alert(pod=f"llama-context-{i}", fingerprint=f"fp{i:05d}",
                    status="firing" if i < 50 else "resolved") for i in range(2500)]
    alerts += [alert(alertname="AdpfleetScrapeTargetDown", fingerprint=f"td{i:05d}") for i in range(500)]
    for a in alerts:
        del a["generatorURL"]
    raw = json.dumps(payload(*alerts), separators=(",", ":")).encode()  # compact, as Alertmanager sends
    assert 900_000 < len(raw) <= 1024 * 1024

    async def scenario(h, client):
        resp = await client.post(ALERTS_PATH, data=_chunked(raw) if chunked else raw,
                                 headers={**AUTH, "Content-Type": "application/json"})
        body = await resp.json()
        assert (resp.status, body["queued"], len(body["ignored"])) == (202, 50, 2950)
        assert len(h.inbox.take("prod", "llama")) == 50
    run(scenario)


def test_a_batch_of_600_stall_alerts_is_queued_whole():
    raw = json.dumps(payload(*[alert(pod=f"llama-context-{i}", fingerprint=f"fp{i:05d}")
                               for i in range(600)])).encode()
    assert len(raw) > 200_000

    async def scenario(h, client):
        resp = await client.post(ALERTS_PATH, data=_chunked(raw, piece=8 * 1024),
                                 headers={**AUTH, "Content-Type": "application/json"})
        assert resp.status == 202 and (await resp.json())["queued"] == 600
    run(scenario, inbox_limit=1000)


def test_a_chunked_body_over_the_limit_is_413():
    raw = b'{"version": "4", "alerts": [' + b" " * (5 * 512 * 1024) + b"]}"  # 2.5 MiB, no Content-Length

    async def scenario(h, client):
        resp = await client.post(ALERTS_PATH, data=_chunked(raw), headers={**AUTH, "Content-Type": "application/json"})
        body = await resp.json()
        assert resp.status == 413 and "more than 1048576 bytes" in body["error"]["message"]
        assert h.counts["malformed"] == 1 and len(h.inbox) == 0
    run(scenario)


def test_json_nested_too_deeply_is_a_400():
    async def scenario(h, client):
        got, body = await h.post(client, None, raw="[" * 1500 + "]" * 1500)
        assert got == 400 and "nested too deeply" in body["error"]["message"]
        got, body = await h.post(client, None, raw='{"version": "4", "alerts": ' + "[" * 1500 + "]" * 1500 + "}")
        assert got == 400
        assert (await h.post(client, payload(alert())))[0] == 202  # and it still serves
    run(scenario)


def test_an_unknown_fleet_is_a_404_and_nothing_is_queued():
    async def scenario(h, client):
        unknown = alert()
        unknown["labels"]["fleet"] = "nope"
        got, body = await h.post(client, payload(unknown))
        assert got == 404 and "no fleet prod/nope" in body["error"]["message"] and len(h.inbox) == 0
        # mixed with a known fleet: the known one is queued, the unknown one reported
        got, body = await h.post(client, payload(unknown, alert(fingerprint="other")))
        assert got == 202 and body["queued"] == 1 and "no fleet prod/nope" in body["ignored"][0]
    run(scenario)


def test_resolved_and_other_alerts_are_acknowledged_and_ignored():
    async def scenario(h, client):
        missing_pod = alert(fingerprint="m")
        del missing_pod["labels"]["pod"]
        got, body = await h.post(client, payload(alert(status="resolved"), alert(alertname="AdpfleetScrapeTargetDown",
                                                                                 fingerprint="x"), missing_pod))
        assert got == 202 and body["queued"] == 0 and len(body["ignored"]) == 3
        assert any("lacks label(s) pod" in why for why in body["ignored"])
    run(scenario)


def test_repeats_of_a_firing_alert_are_acted_on_once():
    async def scenario(h, client):
        for _ in range(50):  # Alertmanager's repeat_interval resends, retries, a flood
            got, _ = await h.post(client, payload(alert(), alert()))
            assert got == 202
        assert len(h.inbox.take("prod", "llama")) == 1
        # the same alert firing again later (a new startsAt) is a new stall
        got, body = await h.post(client, payload(alert(starts_at="2024-05-01T11:00:00Z")))
        assert body["queued"] == 1
        assert h.counts["duplicate"] == 99 and h.counts["accepted"] == 2
    run(scenario)


def test_a_flood_of_concurrent_duplicates():
    async def scenario(h, client):
        results = await asyncio.gather(*(h.post(client, payload(alert())) for _ in range(200)))
        assert {status for status, _ in results} == {202}
        assert len(h.inbox.take("prod", "llama")) == 1
    run(scenario)


def test_a_full_inbox_is_a_retryable_503_and_the_alert_is_not_marked_seen():
    async def scenario(h, client):
        assert (await h.post(client, payload(alert(fingerprint="1"), alert(fingerprint="2"))))[0] == 202
        got, body = await h.post(client, payload(alert(fingerprint="3")))
        assert got == 503 and "inbox is full" in body["error"]["message"]
        h.inbox.take("prod", "llama")
        assert (await h.post(client, payload(alert(fingerprint="3"))))[1]["queued"] == 1  # the retry gets in
    run(scenario, inbox_limit=2)


def test_the_inbox_wakes_the_fleet():
    inbox, woken = AlertInbox(), []
    inbox.on_put = woken.append
    inbox.put(parse_payload(payload(alert()), 0.0).actionable[0])
    assert woken == [("prod", "llama")]


def test_seen_alerts_are_bounded_in_count_and_age():
    seen = SeenAlerts(limit=3, ttl=100)
    for i in range(5):
        seen.add((str(i), "t"), float(i))
    assert len(seen) == 3 and ("0", "t") not in seen and ("4", "t") in seen
    seen.add(("late", "t"), 200.0)
    assert len(seen) == 1


def test_an_alert_naming_a_pod_that_is_not_the_fleets_is_not_queued():
    """The stall loop keys its Events by the pod an alert names: only pods that exist get there."""
    async def scenario(h, client):
        got, body = await h.post(client, payload(alert(pod="llama-context-99999")))
        assert got == 404 and "llama-context-99999 is not a server pod of llama" in body["error"]["message"]
        got, body = await h.post(client, payload(alert(pod="x" * 500_000, fingerprint="long")))
        assert got == 404 and len(body["error"]["message"]) < 1000 and len(h.inbox) == 0
    run(scenario)


def test_a_fingerprint_or_start_longer_than_alertmanagers_is_ignored_with_its_reason():
    long = parse_payload(payload(alert(fingerprint="f" * 100_000), alert(starts_at="2" * 65)), 0.0)
    assert long.actionable == [] and len(long.ignored) == 2 and all(len(why) < 200 for why in long.ignored)
    assert "fingerprint longer than 64" in long.ignored[0] and "startsAt longer than 64" in long.ignored[1]


KEY_READS = [0]


@dataclasses.dataclass(frozen=True)
class CountedAlert(StallAlert):
    @property
    def key(self) -> tuple[str, str]:
        KEY_READS[0] += 1
        return super().key


def test_sorting_out_duplicates_is_linear_in_the_alerts():
    """6,700 alerts in one body took ~3 s of the operator's event loop: each was compared with
    every fresh one before it."""
    h = Harness(inbox_limit=10_000)
    n = 6_700
    alerts = [CountedAlert("AdpfleetServerStalled", "prod", "llama", f"llama-context-{i % 3000}", f"fp{i}", "t", 0.0)
              for i in range(n)] * 2  # and each once more: duplicates within the body
    KEY_READS[0] = 0
    h.receiver._queue(ParsedPayload(alerts, []), 0.0)
    assert h.counts["accepted"] == n and h.counts["duplicate"] == n
    assert KEY_READS[0] <= 3 * len(alerts)


def test_the_seen_set_keeps_a_fixed_size_digest_whatever_the_sender_chose():
    seen = SeenAlerts()
    tracemalloc.start()
    for i in range(4):  # keys of 1 MiB each, made and dropped here: only what the set keeps stays
        seen.add((f"{i}" + "f" * (1 << 20), "t" * (1 << 20)), float(i))
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert kept < 4096 and (f"{3}" + "f" * (1 << 20), "t" * (1 << 20)) in seen and ("3", "t") not in seen


def test_the_pods_an_alert_may_name_are_the_fleets_own_server_pods():
    def pod(name, owner):
        return SimpleNamespace(name=name, role="context", index=0, owner_uid=owner)
    # a disaggregated fleet: no aggregated pods
    observed = SimpleNamespace(role_pods=lambda role: [pod(f"llama-{role}-0", "uid")] if role != "aggregated" else [])
    stall = SimpleNamespace(fleets={("prod", "llama"): SimpleNamespace(observe=lambda: observed)})
    assert fleet_pods(stall, "prod", "llama") == {"llama-context-0", "llama-generation-0"}
    assert fleet_pods(stall, "prod", "other") is None


@settings(max_examples=examples(300), deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=20))
def test_any_json_either_parses_or_is_a_payload_error(body):
    try:
        parse_payload(body, 0.0)
    except PayloadError:
        pass


@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(["version", "alerts", "status", "labels", "startsAt", "fingerprint", "annotations"]),
       st.none() | st.integers() | st.text(max_size=3) | st.lists(st.integers(), max_size=2))
def test_any_field_replaced_by_junk_either_parses_or_is_a_payload_error(field, junk):
    body = payload(alert())
    target = body if field in ("version", "alerts") else body["alerts"][0]
    target[field] = copy.deepcopy(junk)
    try:
        parse_payload(body, 0.0)
    except PayloadError:
        pass
