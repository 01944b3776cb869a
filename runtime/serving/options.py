"""`adpfleet serve`'s options, read once from its flags: the credentials, the KV peers, and every
limit one client meets (docs/security.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from adpfleet.contract.env import FAULT_INJECTION_ENV
from adpfleet.runtime.serving.auth import Credentials, KVPeers
from adpfleet.runtime.serving.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_WAITING_REQUESTS,
                                             DEFAULT_READ_TIMEOUT_S)

DEFAULT_REQUEST_TIMEOUT_S = 300.0


@dataclass
class ServerOptions:
    """What the server allows, and whom: the security and resource flags of `adpfleet serve`."""
    credentials: Credentials = field(default_factory=Credentials)
    kv_peers: KVPeers = field(default_factory=KVPeers)
    fault_injection: bool = False
    enable_docs: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S

    read_timeout: float = DEFAULT_READ_TIMEOUT_S

    @classmethod
    def from_args(cls, args) -> "ServerOptions":
        """From `adpfleet serve`'s flags; an unset limit keeps its default here."""
        limits = {name: value for name in ("max_request_bytes", "max_waiting_requests", "request_timeout",
                                           "read_timeout") if (value := getattr(args, name)) is not None}
        options = cls(Credentials.from_args(args), KVPeers(args.kv_peer) if args.kv_peer else KVPeers(),
                      args.fault_injection or os.environ.get(FAULT_INJECTION_ENV) == "1", args.enable_docs, **limits)
        for flag, value in (("--max-request-bytes", options.max_request_bytes),
                            ("--max-waiting-requests", options.max_waiting_requests),
                            ("--request-timeout", options.request_timeout), ("--read-timeout", options.read_timeout),
                            ("--kv-transfer-timeout", args.kv_transfer_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        return options
