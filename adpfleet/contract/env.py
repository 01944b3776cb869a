"""Environment variables the operator sets in a pod and the server in it reads (docs/security.md)."""

from __future__ import annotations

API_KEY_ENV = "ADPFLEET_API_KEY"                  # what clients send as `Authorization: Bearer`
INTERNAL_TOKEN_ENV = "ADPFLEET_INTERNAL_TOKEN"    # the fleet's own secret: router -> servers, KV pulls
FAULT_INJECTION_ENV = "ADPFLEET_FAULT_INJECTION"  # "1" is `serve --fault-injection`
LEADER_ADDRESS_ENV = "ADPFLEET_LEADER_ADDRESS"    # a server over several pods: the leader's DNS name
VLLM_API_KEY_ENV = "VLLM_API_KEY"                 # vLLM's own API key: a vLLM server gets the fleet's key there
VLLM_CACHE_ROOT_ENV = "VLLM_CACHE_ROOT"           # vLLM's cache root: vllm.cache's mount when the fleet gives one

# The credentials the operator sets from Secrets (either engine's name for the API key), and fault
# injection, which only spec.faultInjection turns on: neither a fleet's `env` nor a pod template may name them.
RESERVED_ENV = (API_KEY_ENV, INTERNAL_TOKEN_ENV, FAULT_INJECTION_ENV, VLLM_API_KEY_ENV)
