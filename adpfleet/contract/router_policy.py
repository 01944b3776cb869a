"""How the router chooses servers: the words `adpfleet router --policy` and the CRD's `router.policy`
accept (the router's `runtime/router/policy.py` says what each does)."""

from __future__ import annotations

CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN = "cache-aware", "least-loaded", "round-robin"
ROUTER_POLICIES = (CACHE_AWARE, LEAST_LOADED, ROUND_ROBIN)
DEFAULT_ROUTER_POLICY = CACHE_AWARE
