"""Alertmanager's webhook (payload version 4) into the operator: the second input of the one
remediation decision path.

`POST /alerts` with `Authorization: Bearer <token>` (the token is read from a Secret and compared
in constant time) and a JSON body as Alertmanager sends it. Answers:

- 401 without a token or with a wrong one; 503 while the token Secret cannot be read (Alertmanager
  retries 5xx, so alerts are not lost while the Secret is being created);
- 415 for a body that is not `application/json`, 413 for one over 1 MiB, 400 (with what is wrong
  and where) for invalid JSON or a payload that is not version 4;
- 404 when nothing was queued because every actionable alert names a fleet the operator does not
  run, or a pod that is not one of that fleet's server pods; 503 (Retry-After) when the inbox is full;
- 202 once every actionable alert is queued (or was already: a firing alert is identified by its
  fingerprint and startsAt, so Alertmanager's repeats and retries are acted on once).

Actionable alerts are the firing stall alerts (`AdpfleetServerStalled`, `AdpfleetRankStarving`)
with `namespace`, `fleet` and `pod` labels; everything else (resolved alerts, the operator's own
alerts) is acknowledged and ignored. What the operator keeps of an alert is bounded whatever the
sender chose: the fleet and the pod must exist (the stall loop keys its Events by the pod), the
fingerprint and startsAt are short (as Alertmanager's are), the summary is cut, no other label is
kept, and the seen set holds a fixed-size digest per alert; the checks are linear in the alerts.
Queuing (`inbox.py`) is all the receiver does: the fleet's stall loop takes the alert, re-checks
the pod with fresh scrapes and goes through the same policy as its own detection (mode, cooldown,
budget).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Collection, Mapping, Protocol

from aiohttp import web

from adpfleet.operator.adapters.kube import KubeApi
from adpfleet.operator.inbox import AlertInbox, StallAlert

log = logging.getLogger("adpfleet.operator.alerts")

ALERTS_PATH = "/alerts"
ACTIONABLE = ("AdpfleetServerStalled", "AdpfleetRankStarving")
MAX_BODY_BYTES = 1024 * 1024
SEEN_LIMIT = 10_000          # remembered (fingerprint, startsAt) pairs
SEEN_TTL_SECONDS = 24 * 3600.0
TOKEN_TTL_SECONDS = 10.0     # the token Secret is re-read this often
SUMMARY_LIMIT = 512          # characters of an alert's summary annotation kept
ID_LIMIT = 64                # characters of a fingerprint or startsAt (Alertmanager's are 16 and ~30)
RETRY_AFTER_NO_TOKEN = "10"  # seconds Alertmanager is told to wait: the token Secret is being created
RETRY_AFTER_FULL = "5"       # ... the inbox is being drained by the fleets' loops


class PayloadError(ValueError):
    """The body is not an Alertmanager version 4 payload: what is wrong and where."""


@dataclass(frozen=True)
class ParsedPayload:
    actionable: list[StallAlert]
    ignored: list[str]  # "<alertname> (<fingerprint>): why"


def parse_payload(body: object, now: float) -> ParsedPayload:
    """The actionable alerts of a decoded webhook body. Raises `PayloadError` when the body does
    not have the version 4 shape (the whole request is refused, nothing is queued)."""
    if not isinstance(body, dict):
        raise PayloadError(f"the body must be a JSON object (Alertmanager webhook), not {type(body).__name__}")
    version = body.get("version")
    if version != "4":
        raise PayloadError(f"version must be \"4\" (Alertmanager webhook payload version 4), got {version!r}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts must be a list")
    actionable, ignored = [], []
    for i, alert in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(alert, dict):
            raise PayloadError(f"{where} must be an object")
        labels = alert.get("labels")
        if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in labels.items()):
            raise PayloadError(f"{where}.labels must be an object of strings")
        for name in ("status", "startsAt", "fingerprint"):
            if not isinstance(alert.get(name), str) or not alert[name]:
                raise PayloadError(f"{where}.{name} must be a non-empty string")
        annotations = alert.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise PayloadError(f"{where}.annotations must be an object")
        alertname = labels.get("alertname", "")
        tag = f"{alertname[:ID_LIMIT] or '(no alertname)'} ({alert['fingerprint'][:ID_LIMIT]})"
        if alert["status"] != "firing":
            ignored.append(f"{tag}: {alert['status']}, not firing")
            continue
        if alertname not in ACTIONABLE:
            ignored.append(f"{tag}: not a stall alert")
            continue
        missing = [n for n in ("namespace", "fleet", "pod") if not labels.get(n)]
        if missing:
            ignored.append(f"{tag}: lacks label(s) {', '.join(missing)}; the rule must keep namespace, fleet, pod")
            continue
        long = [n for n in ("fingerprint", "startsAt") if len(alert[n]) > ID_LIMIT]
        if long:
            ignored.append(f"{tag}: {' and '.join(long)} longer than {ID_LIMIT} characters (not Alertmanager's)")
            continue
        actionable.append(StallAlert(alertname=alertname, namespace=labels["namespace"], fleet=labels["fleet"],
                                     pod=labels["pod"], fingerprint=alert["fingerprint"],
                                     starts_at=alert["startsAt"], received_at=now,
                                     summary=str(annotations.get("summary", ""))[:SUMMARY_LIMIT]))
    return ParsedPayload(actionable, ignored)


class SeenAlerts:
    """(fingerprint, startsAt) pairs already queued: bounded in count and in age, each held as a
    16-byte digest (the sender chooses the strings)."""

    def __init__(self, limit: int = SEEN_LIMIT, ttl: float = SEEN_TTL_SECONDS):
        self.limit, self.ttl = limit, ttl
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def __contains__(self, key: tuple[str, str]) -> bool:
        return _digest(key) in self._seen

    def add(self, key: tuple[str, str], now: float) -> None:
        digest = _digest(key)
        self._seen[digest] = now
        self._seen.move_to_end(digest)
        while self._seen and (len(self._seen) > self.limit or now - next(iter(self._seen.values())) > self.ttl):
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.blake2b("\0".join(key).encode("utf-8", "surrogatepass"), digest_size=16).digest()


class TokenSource(Protocol):
    async def get(self) -> str | None:
        """The expected bearer token, or None when it cannot be read now."""


@dataclass
class StaticToken:
    value: str | None

    async def get(self) -> str | None:
        return self.value


@dataclass
class SecretToken:
    """The bearer token from a Secret, re-read every `ttl` seconds (a rotated token needs no restart)."""
    api: KubeApi
    namespace: str
    name: str
    key: str = "token"
    ttl: float = TOKEN_TTL_SECONDS
    _value: str | None = None
    _read_at: float | None = None

    async def get(self) -> str | None:
        now = time.monotonic()
        if self._value is None or self._read_at is None or now - self._read_at > self.ttl:
            self._value = await self.api.secret_value(self.namespace, self.name, self.key)
            self._read_at = now
        return self._value


def token_source(api: KubeApi, reference: str) -> TokenSource:
    """The webhook's token from `NAMESPACE/NAME[:KEY]` ('' = not configured: every request 503)."""
    if not reference:
        return StaticToken(None)
    where, _, key = reference.partition(":")
    namespace, _, name = where.partition("/")
    if not namespace or not name:
        raise ValueError(f"--alerts-token-secret must be NAMESPACE/NAME[:KEY], got {reference!r}")
    return SecretToken(api, namespace, name, key or "token")


class AlertReceiver:
    """The webhook handler. `fleet_pods(namespace, name)`: the names of that fleet's server pods,
    or None when the operator does not run that fleet."""

    def __init__(self, token: TokenSource, inbox: AlertInbox, fleet_pods: Callable[[str, str], Collection[str] | None],
                 *, clock: Callable[[], float] = time.time, count: Callable[[str, int], None] | None = None):
        self.token = token
        self.inbox = inbox
        self.fleet_pods = fleet_pods
        self.clock = clock
        self.seen = SeenAlerts()
        self.count = count or (lambda result, n: None)

    def routes(self) -> list[web.RouteDef]:
        return [web.post(ALERTS_PATH, self.handle)]

    async def handle(self, request: web.Request) -> web.Response:
        refusal = await self._authenticate(request.headers.get("Authorization", ""))
        if refusal is not None:
            return refusal
        if request.content_type != "application/json":
            self.count("malformed", 1)
            return _error(415, f"Content-Type must be application/json, got {request.content_type or 'none'}")
        try:
            body = json.loads(await _read_body(request))
        except _Refused as e:
            self.count("malformed", 1)
            return _error(e.status, e.message)
        except (UnicodeDecodeError, ValueError) as e:
            self.count("malformed", 1)
            return _error(400, f"the body is not valid JSON: {e}")
        except RecursionError:
            self.count("malformed", 1)
            return _error(400, "the body is not an Alertmanager payload: JSON nested too deeply")
        now = self.clock()
        try:
            parsed = parse_payload(body, now)
        except PayloadError as e:
            self.count("malformed", 1)
            return _error(400, f"not an Alertmanager webhook payload: {e}")
        return self._queue(parsed, now)

    async def _authenticate(self, header: str) -> web.Response | None:
        try:
            expected = await self.token.get()
        except Exception as e:  # noqa: BLE001 - an API error reading the Secret: retry later
            log.warning("cannot read the webhook token: %s", e)
            expected = None
        if not expected:
            self.count("unauthorized", 1)
            return _error(503, "the webhook token is not available (the operator has no --alerts-token-secret, or the Secret cannot be read yet); retry later",
                          headers={"Retry-After": RETRY_AFTER_NO_TOKEN})
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            self.count("unauthorized", 1)
            return _error(401, "send Authorization: Bearer <token> (the token in the operator's webhook Secret)",
                          headers={"WWW-Authenticate": 'Bearer realm="adpfleet-alerts"'})
        if not hmac.compare_digest(given.strip().encode(), expected.encode()):
            self.count("unauthorized", 1)
            return _error(401, "wrong bearer token", headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        return None

    def _queue(self, parsed: ParsedPayload, now: float) -> web.Response:
        fresh, fresh_keys, duplicates, unknown = [], set(), 0, []
        pods: dict[tuple[str, str], Collection[str] | None] = {}  # each fleet's pods, looked up once
        for alert in parsed.actionable:
            fleet = (alert.namespace, alert.fleet)
            if fleet not in pods:
                pods[fleet] = self.fleet_pods(*fleet)
            if alert.key in fresh_keys or alert.key in self.seen:
                duplicates += 1
            elif pods[fleet] is None or alert.pod not in pods[fleet]:
                unknown.append(f"{alert.alertname} ({alert.fingerprint}): " + (
                    f"no fleet {alert.namespace[:253]}/{alert.fleet[:253]} is managed by this operator"
                    if pods[fleet] is None else f"{alert.pod[:253]} is not a server pod of {alert.fleet}"))
            else:
                fresh.append(alert)
                fresh_keys.add(alert.key)
        if len(fresh) > self.inbox.room():
            self.count("refused", len(fresh))
            return _error(503, f"the alert inbox is full ({len(self.inbox)} queued); retry later",
                          headers={"Retry-After": RETRY_AFTER_FULL})
        for alert in fresh:
            self.inbox.put(alert)
            self.seen.add(alert.key, now)
            log.info("queued %s for %s/%s pod %s", alert.alertname, alert.namespace, alert.fleet, alert.pod)
        self.count("accepted", len(fresh))
        self.count("duplicate", duplicates)
        self.count("ignored", len(parsed.ignored) + len(unknown))
        body = {"queued": len(fresh), "duplicates": duplicates, "ignored": parsed.ignored + unknown}
        if unknown and not fresh and not duplicates:
            return web.json_response({**body, "error": {"message": "; ".join(unknown)}}, status=404)
        return web.json_response(body, status=202)


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


async def _read_body(request: web.Request) -> bytes:
    """The whole body, however it arrives (`content.read(n)` alone returns only what is buffered
    now); `_Refused` 413 once it passes MAX_BODY_BYTES, chunked or not."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise _Refused(413, f"the body is {request.content_length} bytes, at most {MAX_BODY_BYTES}")
    chunks, size = [], 0
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _Refused(413, f"the body is more than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except _Refused:
        raise
    except Exception as e:  # noqa: BLE001 - the client went away mid-body
        raise _Refused(400, f"could not read the body: {e}") from None
    return b"".join(chunks)


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status, headers=headers)
