"""What one tick of the stall loop reads of its fleet (`Look`), and the spec it was read with, made
into its model once per change (`SpecCache`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

from adpfleet.operator.adapters.dialects import Dialect, dialect_for
from adpfleet.operator.decisions import groups
from adpfleet.operator.decisions.observed import FleetObservation, ServerPod
from adpfleet.operator.resource.models import FleetSpec


@dataclass(frozen=True)
class Look:
    """What one tick reads of the fleet."""
    obs: FleetObservation
    spec: FleetSpec
    pods: list[ServerPod]    # every server pod of the fleet
    judged: list[ServerPod]  # the Running, Ready ones with an address, not being scaled down: the ones scraped

    @property
    def interval(self) -> float:
        return float(self.spec.monitoring.scrape_interval_seconds)

    @property
    def window(self) -> float:
        return float(self.spec.remediation.stall_window_seconds)

    @property
    def dialect(self) -> Dialect:
        """How the fleet's servers' /metrics read: its engine's (adpfleet's or vLLM's names)."""
        return dialect_for(self.spec.engine)


@dataclass
class SpecCache:
    """The spec as last read, and its model. Comparing is far cheaper than validating, which every
    tick and every status overlay would otherwise do."""
    source: dict | None = None
    spec: FleetSpec | None = None

    def read(self, obs: FleetObservation) -> FleetSpec | None:
        """`obs`'s spec; None while it cannot be read (the reconciler reports it)."""
        source = obs.spec or {}
        if self.spec is None or self.source != source:
            try:
                spec = FleetSpec.model_validate(source)
            except Exception:  # noqa: BLE001 - the reconciler reports an invalid spec
                return None
            self.source, self.spec = copy.deepcopy(source), spec
        return self.spec

    def look(self, obs: FleetObservation) -> Look | None:
        """The tick's view of the fleet; None while the spec cannot be read."""
        spec = self.read(obs)
        if spec is None:
            return None
        # A server a scale-down is draining is on its way out: never judged (its queue empties on purpose),
        # never a remediation's concern.
        # a server over several pods is one server, judged on the scrapes of all its pods (groups.py)
        pods = [p for role in spec.roles() for p in groups.servers(obs.role_pods(role)) if not p.leaving]
        judged = [p for p in pods if p.phase == "Running" and p.ready and not p.terminating and p.ip]
        return Look(obs, spec, pods, judged)
