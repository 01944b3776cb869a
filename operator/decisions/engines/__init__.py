"""One renderer per engine a fleet can run (docs/operator.md, "vLLM fleets"): what its server container runs.

A renderer is a module with
- `server_container(spec, role) -> dict`: the engine's part of the `server` container (image,
  command, args, its own env and volume mounts, ports, probes); `desired.py` adds what every server
  shares (the downward API, scratch, the role's env, resources, security context, model mounts);
- `server_volumes(spec) -> list[dict]`: the volumes its own mounts name, added to the pod's;
- `credential_env(fleet, spec) -> list[dict]`: the env that carries the fleet's credentials into
  that container, added by `desired.py` after the renderer (security.py builds the values);
- `ROUTER_SENDS_INTERNAL_TOKEN`: whether the router authenticates to these servers with the
  fleet's internal token (else it forwards the client's API key, which the server checks itself).

Adding an engine is one module here, its name in `resource/engine.py`'s `EngineName`, and tests.
"""

from __future__ import annotations

from types import ModuleType

from adpfleet.operator.decisions.engines import adpfleet, vllm

RENDERERS: dict[str, ModuleType] = {"adpfleet": adpfleet, "vllm": vllm}


def renderer(engine: str) -> ModuleType:
    """The renderer of `engine` (a name the CRD's enum admitted)."""
    return RENDERERS[engine]
