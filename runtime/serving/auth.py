"""Who may call a server or the router, and whom a generation server may pull KV from.

Two secrets, each optional, each given by a flag, a file (a mounted Secret) or the environment:

- the **API key** (`--api-key`, `--api-key-file`, `ADPFLEET_API_KEY`): what clients send, as
  `Authorization: Bearer <key>` (vLLM's `--api-key`, the OpenAI clients' `api_key`);
- the **internal token** (`--internal-token-file`, `ADPFLEET_INTERNAL_TOKEN`): held by the fleet
  alone. The router sends it to the servers instead of the client's key; a generation server proves
  it to a context server's KV port (`kv_transfer.proof`); and only a request that carries it may
  hand a generation server `disaggregated_params` — the router, which checked them, vouches for
  them. It is a separate secret so that a client holding the API key can neither inject KV handles
  nor pull another client's KV, and so that the two are rotated independently.

When either is set, every path except OPEN_PATHS needs one of them: /v1/*, /faults, and the
OpenAPI pages when they are enabled (default deny). /health and /metrics stay open, as in vLLM and
KServe: kubelet probes and Prometheus scrapes carry no credentials, and neither path shows request
content (metrics have no request ids in their labels). Keep them off the public network instead
(docs/security.md).

A request that names a KV endpoint itself — without the internal token — may name only an allowed
KV peer (`--kv-peer`, default loopback), so a generation server is never a port scanner.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastapi.responses import JSONResponse

from adpfleet.contract.env import API_KEY_ENV, INTERNAL_TOKEN_ENV

OPEN_PATHS = frozenset({"/health", "/metrics"})
INTERNAL, USER, ANONYMOUS = "internal", "user", "anonymous"  # the principal a request runs as
LOOPBACK_PEERS = ("127.0.0.0/8", "::1/128", "localhost")


def load_secret(what: str, value: str | None = None, file: str | None = None, env: str | None = None) -> str | None:
    """A secret from its flag, else its file, else its environment variable; None when none is
    given. Surrounding whitespace (a Secret file's trailing newline) is not part of it."""
    source = what
    if value is None and file is not None:
        try:
            value = Path(file).read_text()
        except OSError as e:
            raise ValueError(f"{what} file {file}: {e.strerror or e}") from None
        source = f"{what} file {file}"
    elif value is None and env is not None:
        value = os.environ.get(env)
        source = env
    if value is None:
        return None
    value = value.strip()
    if not value:
        raise ValueError(f"{source} is empty")
    if not value.isascii() or not value.isprintable():
        raise ValueError(f"{source} must be printable ASCII (it is sent in an HTTP header)")
    return value


@dataclass(frozen=True)
class Credentials:
    api_key: str | None = None
    internal_token: str | None = None

    @classmethod
    def from_args(cls, args) -> "Credentials":
        return cls(load_secret("--api-key", getattr(args, "api_key", None), getattr(args, "api_key_file", None),
                               API_KEY_ENV),
                   load_secret("--internal-token", None, getattr(args, "internal_token_file", None),
                               INTERNAL_TOKEN_ENV))

    @property
    def required(self) -> bool:
        return self.api_key is not None or self.internal_token is not None

    def principal(self, authorization: str | None) -> str | None:
        """INTERNAL, USER, ANONYMOUS (no secret configured) or None (not allowed)."""
        if not self.required:
            return ANONYMOUS
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return None
        given = given.strip()
        # both compared every time, in constant time: the answer's timing says nothing of either
        internal = self.internal_token is not None and hmac.compare_digest(given.encode(), self.internal_token.encode())
        user = self.api_key is not None and hmac.compare_digest(given.encode(), self.api_key.encode())
        return INTERNAL if internal else USER if user else None

    def upstream_headers(self, client_authorization: str | None) -> dict:
        """What the router sends to servers: the internal token, else the client's own header (a
        fleet that shares one API key between router and servers)."""
        if self.internal_token is not None:
            return {"Authorization": f"Bearer {self.internal_token}"}
        return {"Authorization": client_authorization} if client_authorization else {}


class BearerAuth:
    """ASGI middleware: a request without a valid credential gets 401 (OpenAI's shape), unless its
    path is open; the principal goes into `request.state.principal`."""

    def __init__(self, app, credentials: Credentials):
        self.app, self.credentials = app, credentials

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        principal = self.credentials.principal(header)
        if principal is None and scope["path"] not in OPEN_PATHS:
            reply = JSONResponse(
                {"error": {"message": "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                status_code=401, headers={"WWW-Authenticate": "Bearer"})
            return await reply(scope, receive, send)
        scope.setdefault("state", {})["principal"] = principal
        return await self.app(scope, receive, send)


@dataclass
class KVPeers:
    """Hosts a request may name as its KV endpoint without the internal token: IP networks
    (`10.0.0.0/8`, `fd00::/8`, single addresses) and literal host names (never resolved here: a
    name that resolves elsewhere tomorrow must not widen the list)."""
    entries: list[str] = field(default_factory=lambda: list(LOOPBACK_PEERS))

    def __post_init__(self):
        self.networks, self.names = [], set()
        for entry in self.entries:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                if not entry or "/" in entry or ":" in entry:
                    raise ValueError(f"--kv-peer {entry!r} is neither an IP network nor a host name") from None
                self.names.add(entry.lower())

    def allows(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.lower() in self.names
        return any(address in net for net in self.networks)
