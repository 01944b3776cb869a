"""Where a context rank's held KV can be pulled from, as a request carries it (torch-free: the
router checks it too). The endpoint and handle come from requests and go onto a socket: only
HOST:PORT and a plain handle pass."""

from __future__ import annotations

import ipaddress
import re

HANDLE_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
HANDLE = re.compile(HANDLE_PATTERN)
# How a failed pull is reported, so the server answers 502 and the router retries (here, torch-free: the
# server process reads it and never imports the transfer itself).
FAILED = "KV transfer failed"


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'10.0.0.3:8001', '[fd00::3]:8001' or 'ctx-0.fleet:8001' -> (host, port); ValueError naming
    what is wrong otherwise."""
    if not isinstance(endpoint, str) or len(endpoint) > 300:
        raise ValueError("a KV endpoint is HOST:PORT")
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a KV endpoint is HOST:PORT with a TCP port, got {endpoint[:80]!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise ValueError(f"the KV endpoint's host {host[:80]!r} is not an IPv6 address") from None
        return host[1:-1], int(port)
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", host):
            raise ValueError(f"the KV endpoint's host {host[:80]!r} is not an IP address or DNS name") from None
    return host, int(port)


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
