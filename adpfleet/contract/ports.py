"""Ports a server listens on, as the operator's pods, Services and NetworkPolicies expect them."""

from __future__ import annotations

SERVER_HTTP_PORT = 8000  # OpenAI API, /health, /metrics
SERVER_KV_PORT = 8001    # KV-cache transfers (context servers; the runtime's default: HTTP port + 1)
SERVER_GROUP_PORT = 29400  # a server over several pods: where its workers join the leader (torch's own is 29500)
ROUTER_HTTP_PORT = 8000
