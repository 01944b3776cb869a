"""What the scheduler reserves for one pod: Kubernetes' PodRequests, for the operator's PodGroups
(Volcano's minResources) and the local node's own scheduler alike."""

from __future__ import annotations

from decimal import Decimal

from adpfleet.contract import quantity


def pod_requests(pod_spec: dict) -> dict[str, Decimal]:
    """The containers' requests (a limit stands for a missing request: defaulting copies it, and
    extended resources have only limits), sidecars (init containers that keep running) added, no
    less than any init container needs while it runs beside the sidecars started before it, plus the
    pod's `overhead` (its RuntimeClass's)."""
    total: dict[str, Decimal] = {}
    for container in pod_spec.get("containers") or []:
        add_requests(total, _requests(container))
    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for container in pod_spec.get("initContainers") or []:
        if container.get("restartPolicy") == "Always":
            add_requests(sidecars, _requests(container))
            continue
        running = dict(sidecars)
        add_requests(running, _requests(container))
        for k, v in running.items():
            init_peak[k] = max(init_peak.get(k, Decimal(0)), v)
    add_requests(total, sidecars)
    for k, v in init_peak.items():
        total[k] = max(total.get(k, Decimal(0)), v)
    add_requests(total, {k: quantity.parse(v) for k, v in (pod_spec.get("overhead") or {}).items()})
    return total


def _requests(container: dict) -> dict[str, Decimal]:
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {k: quantity.parse(v) for k, v in merged.items()}


def add_requests(into: dict[str, Decimal], amounts: dict[str, Decimal]) -> None:
    """Adds `amounts` to `into`, resource by resource (a group's or a node's pods together)."""
    for k, v in amounts.items():
        into[k] = into.get(k, Decimal(0)) + v
