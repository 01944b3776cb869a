"""The autoscaling controller: the built-in policy's loop, fed by the stall loop's scrapes.

    every scrape interval, for each role with autoscaling on:
      this tick's scrapes of its serving servers ─► role_load ─► the role's history
      autoscaling.decide(history, policy, desired now, settled since, ...) ─► decision
      a change ─► the role's InferenceFleetRole: spec.replicas and the decision (why), one patch

The servers are scraped once per tick for stall detection and for this (`stall.py` calls
`observe`). The decision goes where `kubectl scale` and an HPA write, so the reconcile pass has one
input for a role's count whoever set it; it reports the change (status lastScale, an Event, a
metric). History lives in memory: after a restart the stabilisation windows fill again before
anything moves, which only delays.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from adpfleet.operator.adapters.kube import KubeApi, now_rfc3339
from adpfleet.operator.adapters.scrape import Scrape
from adpfleet.operator.decisions import autoscaling, scale_target
from adpfleet.operator.decisions.autoscaling import RoleLoad, ScaleDecision
from adpfleet.operator.decisions.history import history_from_status, restarts_in_progress
from adpfleet.operator.decisions.observed import FleetObservation
from adpfleet.operator.decisions.scale_target import SetRoleReplicas
from adpfleet.contract.roles import SERVER_ROLES
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetKey, FleetRef
from adpfleet.operator.telemetry import ScalingMetrics

log = logging.getLogger("adpfleet.operator.scaling")

SIGNALS = tuple(autoscaling.SIGNALS) + ("running_per_rank", "transfer_share")
KEEP_SLACK_SECONDS = 10.0  # history kept beyond the longest window: the scrape just older than it
# vLLM's own default of requests one engine runs at once (--max-num-seqs) for an API server: on a CPU
# (vLLM 0.32, engine/arg_utils.py); on a GPU it is 256 or more by the GPU: the lowest is taken
VLLM_MAX_NUM_SEQS = {"cpu": 128, "cuda": 256}


@dataclass
class RoleMemory:
    history: deque = field(default_factory=lambda: deque(maxlen=4096))  # RoleLoad, oldest first
    settled: tuple[int, float] | None = None  # (desired count, since when) while the role is settled
    applied: int | None = None  # a count this controller wrote that the watch has not shown yet
    last: ScaleDecision | None = None


@dataclass
class FleetScaling:
    """One fleet's memory between ticks (the reconcile loop's is reconciler.FleetMemory)."""
    roles: dict[str, RoleMemory] = field(default_factory=lambda: {r: RoleMemory() for r in SERVER_ROLES})
    before: dict[str, Scrape] = field(default_factory=dict)  # the previous tick's scrapes (histogram means)


class ScalingController:
    def __init__(self, api: KubeApi, metrics: ScalingMetrics, wake_reconcile: Callable[[FleetKey], None], *,
                 clock: Callable[[], float] = time.time):
        self.api = api
        self.metrics = metrics
        self.wake_reconcile = wake_reconcile
        self.clock = clock
        self.fleets: dict[FleetKey, FleetScaling] = {}

    # ---- stall.ScrapeListener ----

    def wanted(self, spec: FleetSpec) -> bool:
        return any(spec.role(role).autoscaling.enabled for role in spec.roles())

    def forget(self, key: FleetKey) -> None:
        if self.fleets.pop(key, None) is not None:
            self.metrics.forget(key, SERVER_ROLES, SIGNALS)

    async def observe(self, key: FleetKey, ref: FleetRef, obs: FleetObservation, spec: FleetSpec,
                      scrapes: dict[str, Scrape]) -> None:
        memory = self.fleets.setdefault(key, FleetScaling())
        now = self.clock()
        loads = {}
        for role in spec.roles():
            pods = {p.name for p in obs.role_pods(role) if p.name in scrapes}
            loads[role] = autoscaling.role_load(now, {n: scrapes[n] for n in pods},
                                                {n: memory.before[n] for n in pods if n in memory.before})
        memory.before = dict(scrapes)
        if loads.get("generation") is not None and loads.get("context") is not None:
            loads["generation"] = autoscaling.with_context_peer(loads["generation"], loads["context"])
        in_remediation = set(restarts_in_progress(history_from_status(obs.status),
                                                  [p.view for r in spec.roles() for p in obs.role_pods(r)], spec, now))
        for role in spec.roles():
            policy = spec.role(role).autoscaling
            if not policy.enabled:
                continue
            role_memory = memory.roles[role]
            load = loads[role]
            if load is not None:
                role_memory.history.append(load)
                self._show(key, role, load)
            _trim(role_memory.history, now, max(policy.scale_up.stabilization_window_seconds,
                                                policy.scale_down.stabilization_window_seconds) + KEEP_SLACK_SECONDS)
            current = scale_target.replicas_of(spec, role, obs.role_object(role))
            if role_memory.applied is not None and role_memory.applied != current:
                continue  # our last change is not in the cache yet: decide on what it brings
            role_memory.applied = None
            settled_since = self._settled(role_memory, obs, role, current, in_remediation, now)
            decision = autoscaling.decide(role, list(role_memory.history), policy, current, now,
                                          settled_since=settled_since,
                                          batch_capacity=batch_capacity(spec, role))
            self.metrics.desired.labels(*key, role).set(decision.desired)
            role_memory.last = decision
            if decision.changes:
                await self._apply(key, ref, obs, role, decision)

    # ---- pieces ----

    def _settled(self, memory: RoleMemory, obs: FleetObservation, role: str, current: int,
                 in_remediation: set[str], now: float) -> float | None:
        """Since when `role` has had exactly `current` servers, all Ready, none starting, leaving or
        being remediated; None while it has not."""
        pods = [p for p in obs.role_pods(role)]
        live = [p for p in pods if not p.terminating and not p.leaving]
        settled = (len(live) == current and len(pods) == current and all(p.ready for p in live)
                   and not any(p.name in in_remediation for p in pods))
        if not settled:
            memory.settled = None
            return None
        if memory.settled is None or memory.settled[0] != current:
            memory.settled = (current, now)
        return memory.settled[1]

    async def _apply(self, key: FleetKey, ref: FleetRef, obs: FleetObservation, role: str,
                     decision: ScaleDecision) -> None:
        obj = obs.role_object(role)
        if obj is None or obj.terminating:
            return  # the reconcile creates it; the next tick decides again
        note = scale_target.decision(now_rfc3339(), decision.current, decision.desired, decision.reason,
                                     decision.message(), scale_target.SOURCE_POLICY)
        action = SetRoleReplicas(role, obj.name, obj.uid, decision.desired, note, None, decision.reason.value)
        outcome = await self.api.patch_role_object(ref.namespace, obj.name, action.patch())
        if not outcome.ok:
            log.warning("could not scale %s: %s", obj.name, outcome.message)
            return
        self.metrics.decisions.labels(role, decision.reason.value).inc()
        log.info("%s/%s: %s (%s)", ref.namespace, ref.name, decision.message(), decision.reason.value)
        memory = self.fleets[key].roles[role]
        memory.settled, memory.applied = None, decision.desired  # until the change has taken effect
        self.wake_reconcile(key)

    def _show(self, key: FleetKey, role: str, load: RoleLoad) -> None:
        for name in SIGNALS:
            value = getattr(load, name)
            if value is not None:
                self.metrics.signal.labels(*key, role, name).set(value)


def _trim(history: deque, now: float, keep_seconds: float) -> None:
    while history and now - history[0].at > keep_seconds:
        history.popleft()


def batch_capacity(spec: FleetSpec, role: str) -> int:
    """Requests one rank of `role` runs at once: adpfleet's engine.maxBatchSize, or a vLLM engine's
    --max-num-seqs (from vllm.args, or vLLM's default for the device)."""
    if spec.engine != "vllm":
        return spec.role(role).engine.max_batch_size
    args = spec.vllm.args
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith("--max-num-seqs=") else \
            args[i + 1] if arg == "--max-num-seqs" and i + 1 < len(args) else None
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return VLLM_MAX_NUM_SEQS[spec.role(role).engine.device]
