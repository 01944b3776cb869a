"""One reconcile pass of one fleet: observe → desired → plan → act → status → events.

Reads come from the kopf indexes (memory), so a pass that finds nothing to change makes no API
request at all: it computes the same status as the one stored and leaves it alone. A pass that acts
first creates the fleet's internal token Secret (409: it exists). The operator never reads a
Secret: the kubelet resolves the ones the pods name (API key, internal token, model credentials),
and a missing one shows in the pod's status (CreateContainerConfigError), which becomes the fleet's
Degraded condition. The only requests a pass may make without changing anything are checking that
the claims the model names exist and that the PodGroup API a role's gang scheduling names is served,
only when it is about to create server pods, and reading the log of a server's running download (its
progress), only while one runs.

The pass is the status's one writer. Another controller that owns part of the status (the stall
controller: Stalled, Remediating, recentRemediations) is composed in as a `StatusPart`: its
`overlay` is laid over what the pass computed, and it hears through `stored` which status the API
server now holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import ValidationError

from adpfleet.operator.adapters.dialects import Dialect, dialect_for
from adpfleet.operator.adapters.kube import ApiResult, KubeApi, now_rfc3339
from adpfleet.model_uri import parse_progress
from adpfleet.operator.decisions import conditions, gang, groups, security
from adpfleet.operator.decisions import scale_target
from adpfleet.operator.decisions.conditions import MODEL_UNAVAILABLE, Problem
from adpfleet.operator.decisions.desired import DesiredFleet, desired_fleet
from adpfleet.operator.decisions.history import history_from_status, restarts_in_progress
from adpfleet.operator.decisions.model_status import CLAIM_NOT_FOUND, model_report
from adpfleet.operator.decisions.observed import FETCHING, FleetObservation, ServerPod
from adpfleet.operator.decisions.rollout import (ApplyObject, ChildAction, CreateServer, DeleteObject, DeleteServer,
                                                 Drain, DrainServer, ObjectsPlan, RolePlan, UndrainServer, Wording,
                                                 plan_objects, plan_role, vacancies)
from adpfleet.operator.decisions.scale_target import CreateRoleObject, SetRoleReplicas
from adpfleet.operator.decisions.security import SecurityConfig
from adpfleet.operator.resource import names
from adpfleet.operator.resource.model_source import ModelSource
from adpfleet.operator.resource.models import FleetSpec, fleet_name_problem
from adpfleet.operator.resource.names import FleetKey, FleetRef
from adpfleet.operator.resource.vocabulary import ConditionType, Reason
from adpfleet.operator.telemetry import OperatorMetrics

EXPECTATION_SECONDS = 60.0   # how long an action's effect may take to show up in the watch cache
MIN_RECHECK_SECONDS = 1.0    # a pass that waits for a drain's timeout looks again no sooner than this
CLAIM_RECHECK_SECONDS = 30.0   # a missing claim or PodGroup API (neither has a watch) is looked at again this often
PROGRESS_SECONDS = 5.0         # a running download's progress is read from its log this often (fetch-model logs it every 5 s)
PROGRESS_LOG_LINES = 20        # ... from this many of its last lines
MAX_BACKOFF_SECONDS = 300.0

PassAction = ChildAction | CreateRoleObject | SetRoleReplicas  # what a pass may do
# What holds server creations back: the problem, what they wait for, the roles held (None: all).
Hold = tuple[Problem, str, tuple[str, ...] | None]


class StatusPart(Protocol):
    """A share of the fleet's status that another controller owns; the pass writes it."""

    def overlay(self, key: FleetKey, obs: FleetObservation, status: dict) -> dict:
        """`status` with this part laid over it."""

    def stored(self, key: FleetKey, status: dict) -> None:
        """The API server now holds `status` (the pass wrote it, or found it already there)."""


class DrainPart(Protocol):
    """Knows which servers a scale-down drained have finished their requests (it scrapes them)."""

    def finished(self, key: FleetKey, leaving: list[ServerPod], role: str, dialect: Dialect) -> frozenset[str]:
        """The uids among `leaving` (all of `role`'s) that have nothing in flight, as their /metrics
        read in `dialect`; watches the others."""


class StatusWrite(enum.Enum):
    """What became of the status a pass computed."""
    UNCHANGED = "unchanged"  # the stored status already said it: no request
    WRITTEN = "written"
    GONE = "gone"            # 404: the fleet is being deleted
    REFUSED = "refused"      # the API server refused the patch: an Event, and the pass failed


@dataclass
class FleetMemory:
    """What one fleet's loop remembers between passes. Lost on restart by design: the caches are
    complete before the first pass, so a restarted operator needs none of it."""
    # Actions whose effect the watch has not shown yet, so the next pass does not repeat them.
    # pod name -> (action, deadline, node rank, pods per server)
    created: dict[str, tuple[CreateServer, float, int, int]] = field(default_factory=dict)
    deleted: dict[str, tuple[DeleteServer, float]] = field(default_factory=dict)  # pod uid -> (action, deadline)
    # The status this loop last wrote, and the resourceVersion it was written over: while the
    # cached fleet is still at that version, it has not caught up with the write.
    written_status: tuple[str, dict] | None = None
    status_refused: str | None = None  # the last refusal reported (one Event per distinct refusal)
    failures: int = 0
    vacated: dict[str, tuple[int, ...]] = field(default_factory=dict)  # role -> slots to refill first
    members: dict[str, tuple[ServerPod, ...]] = field(default_factory=dict)  # a group's uid (its leader's) -> its pods
    pod_groups: dict[str, frozenset[gang.PodGroupRef]] = field(default_factory=dict)  # a server's uid -> its PodGroups


@dataclass(frozen=True)
class PassResult:
    requeue_after: float | None  # None: wait for the next event (or the resync period)
    actions: int
    failed: bool


def with_expectations(pods: list[ServerPod], memory: FleetMemory, now: float, templates: DesiredFleet,
                      fleet_uid: str, role: str) -> list[ServerPod]:
    """`role`'s cached pods corrected by actions the watch has not reported yet."""
    by_name = {p.name for p in pods}
    out = []
    for pod in pods:
        if pod.uid in memory.deleted:
            if pod.terminating:
                del memory.deleted[pod.uid]
            else:
                pod = dataclasses.replace(pod, terminating=True)
        out.append(pod)
    role_uids = {p.uid for p in pods}
    for uid, (action, deadline) in list(memory.deleted.items()):
        if action.role == role and (now > deadline or uid not in role_uids):
            del memory.deleted[uid]
    for name, (action, deadline, node_rank, size) in list(memory.created.items()):
        if action.role != role:
            continue
        if name in by_name or now > deadline:
            del memory.created[name]
            continue
        out.append(ServerPod(name=name, uid="", role=action.role, index=action.index,
                             template_hash=templates.servers[action.role].template_hash, owner_uid=fleet_uid,
                             phase="Pending", ready=False, terminating=False, unschedulable=False, problem=None,
                             node_rank=node_rank, pods_per_server=size))
    return out


class Reconciler:
    def __init__(self, api: KubeApi, metrics: OperatorMetrics, clock=time.monotonic,
                 status_part: StatusPart | None = None, drains: DrainPart | None = None, wall_clock=time.time,
                 security_config: SecurityConfig = SecurityConfig()):
        self.api = api
        self.metrics = metrics
        self.clock = clock
        self.wall_clock = wall_clock  # annotations and the drain deadlines they carry are wall-clock times
        self.status_part = status_part
        self.security = security_config
        self.drains = drains

    async def reconcile(self, obs: FleetObservation, memory: FleetMemory, logger: logging.Logger) -> PassResult:
        fleet = FleetRef(obs.name, obs.namespace, obs.uid)
        if memory.written_status and memory.written_status[0] == obs.resource_version:
            obs = dataclasses.replace(obs, status=memory.written_status[1])  # the cache lags our own write
        # 1. the spec, or why it cannot be used (then that is all the status says)
        spec, invalid = self._usable_spec(obs)
        if spec is None:
            status = conditions.fleet_status(obs, {}, None, [], None, [invalid], now_rfc3339())
            written = await self._store_status(fleet, obs, status, memory, logger)
            return PassResult(None, 0, written is StatusWrite.REFUSED)
        # 2. desired and observed into a plan per role, the router's objects and the roles' scale targets
        desired = self._desired(fleet, spec, obs)
        role_pods, plans = self._roles(obs, memory, desired, spec)
        objects_plan = plan_objects(desired.objects, list(obs.objects), obs.uid)
        scale_actions = self._scale_actions(fleet, spec, obs)
        # 3. server creations held while what they need is missing (a claim, a PodGroup API)
        holds = await self._holds(spec, obs.namespace, plans)
        plans = _hold_creations(plans, holds)
        # 4. act, in order
        actions = _in_order(objects_plan.actions, scale_actions, plans)
        failures = await self._act_all(fleet, obs, desired, actions, memory, logger)
        # 5. the status describes the fleet as these actions left it (a deleted pod is terminating, a
        #    created one pending), so it does not announce a state that is already gone
        if actions:
            role_pods, plans = self._roles(obs, memory, desired, spec)
            plans = [dataclasses.replace(p, actions=()) for p in _hold_creations(plans, holds)]  # the next pass's
        problems = [problem for problem, _, _ in holds] + failures
        written, downloading = await self._report(fleet, obs, spec, desired, role_pods, plans, objects_plan,
                                                  scale_actions, problems, memory, logger)
        # 6. when to look again
        failed = bool(failures) or written is StatusWrite.REFUSED
        return PassResult(self._requeue(memory, plans, holds, downloading, failed), len(actions), failed)

    # ---- the steps ----

    def _usable_spec(self, obs: FleetObservation) -> tuple[FleetSpec | None, Problem | None]:
        spec, invalid = _read_spec(obs)
        if spec is not None and self.security.require_api_key and spec.auth.api_key_secret is None:
            return None, Problem(Reason.INVALID_SPEC, "spec.auth.apiKeySecret is required: this operator runs with "
                                                      "--require-api-key (the chart's security.requireApiKey)")
        return spec, invalid

    def _desired(self, fleet: FleetRef, spec: FleetSpec, obs: FleetObservation) -> DesiredFleet:
        """The fleet's objects from its spec, each role's server count from its InferenceFleetRole."""
        desired = desired_fleet(fleet, spec, self.security)
        return dataclasses.replace(desired, replicas={
            role: scale_target.replicas_of(spec, role, obs.role_object(role)) for role in spec.roles()})

    def _scale_actions(self, fleet: FleetRef, spec: FleetSpec, obs: FleetObservation) -> list[PassAction]:
        taken = {o.name for o in obs.role_objects if o.owner_uid != obs.uid}
        return [a for role in spec.roles() for a in scale_target.plan_role_object(
            fleet, spec, role, obs.role_object(role), names.role_object_name(fleet.name, role) in taken,
            now_rfc3339())]

    async def _holds(self, spec: FleetSpec, namespace: str, plans: list[RolePlan]) -> list[Hold]:
        missing = await self._check_claims(spec, namespace, plans)  # (problem, what creations wait for)
        return ([(*missing, None)] if missing else []) + await self._check_pod_group_apis(spec, plans)

    async def _act_all(self, fleet: FleetRef, obs: FleetObservation, desired: DesiredFleet, actions: list[PassAction],
                       memory: FleetMemory, logger: logging.Logger) -> list[Problem]:
        """Carry `actions` out (the internal token Secret first when a pod needs it), each reported:
        what could not be done as a Warning Event and a problem, what was done as one Event per kind
        of change and reason, naming every object (a new fleet of six servers and a router is three
        Events, not eleven)."""
        failures = await self._ensure_token(fleet, obs, actions, logger)
        done: dict[tuple[Wording, str], list[str]] = {}  # (how the action is said, why) -> what was done
        for action in actions:
            outcome = await self._act(fleet, desired, action, memory)
            self.metrics.actions.labels(type(action).__name__).inc()
            what = action.describe(fleet.name)
            if outcome.ok:
                logger.info("%s %s (%s)", action.wording.past, what, action.why)
                done.setdefault((action.wording, action.why), []).append(what)
            else:
                message = f"could not {action.wording.verb} {what}: {outcome.message}"
                logger.warning(message)
                await self.api.record_event(fleet, "Warning", action.wording.failure, message)
                failures.append(Problem(action.wording.failure, message))
        for (wording, why), what in done.items():
            await self.api.record_event(fleet, "Normal", wording.reason, f"{wording.past} {', '.join(what)} ({why})")
        return failures

    async def _ensure_token(self, fleet: FleetRef, obs: FleetObservation, actions: list[PassAction],
                            logger: logging.Logger) -> list[Problem]:
        """Before any pod that needs it (or when a pod cannot find it: deleted to rotate it), the
        internal token Secret: created, never read; 409 means it is there."""
        token_name = security.internal_token_secret_name(fleet.name)
        if not (any(isinstance(a, (CreateServer, ApplyObject)) for a in actions) or
                any(token_name in (p.problem or "") for p in obs.pods)):
            return []
        token = await self.api.create_secret(security.internal_token_secret(fleet))
        if token.ok:
            return []
        message = f"could not create Secret {token_name}: {token.message}"
        logger.warning(message)
        await self.api.record_event(fleet, "Warning", "CreateFailed", message)
        return [Problem("CreateFailed", message)]

    async def _report(self, fleet: FleetRef, obs: FleetObservation, spec: FleetSpec, desired: DesiredFleet,
                      role_pods: dict[str, list[ServerPod]], plans: list[RolePlan], objects_plan: ObjectsPlan,
                      scale_actions: list[PassAction], problems: list[Problem], memory: FleetMemory,
                      logger: logging.Logger) -> tuple[StatusWrite, str | None]:
        """The fleet's status (and each role's) from what the pass saw and did, written when it
        changed; and which servers wait for their model's download (read from their logs)."""
        own_pods = {role: [p for p in role_pods[role] if p.owner_uid == obs.uid] for role in spec.roles()}
        live = [p for role in spec.roles() for p in own_pods[role] if not p.terminating]
        progress = await self._download_progress(fleet, spec.model, live)
        model = model_report(spec.model.parsed, live, progress,
                             claim_missing=any(p.reason == MODEL_UNAVAILABLE for p in problems))  # a held claim
        problems = problems + model.problems + conditions.pod_problems(
            [p for role in spec.roles() for p in own_pods[role]], security.secret_fields(fleet.name, spec))
        counts = {role: conditions.role_counts(desired.replicas[role], desired.servers[role].template_hash,
                                               own_pods[role]) for role in spec.roles()}
        pending = {a.role: a for a in scale_actions if isinstance(a, SetRoleReplicas)}
        last_scales = await self._store_role_statuses(fleet, obs, spec, counts, pending, logger)
        for role, c in counts.items():
            c["servers"] = f"{c['ready']}/{c['desired']}"
            if last_scales.get(role):
                c["lastScale"] = last_scales[role]
        router = conditions.router_counts(spec.router.enabled, spec.router.replicas, list(obs.objects))
        status = conditions.fleet_status(obs, counts, router, plans, objects_plan.waiting_for, problems,
                                         now_rfc3339(), downloading=model.downloading)
        status["model"] = model.status
        newest = max((r for r in last_scales.values() if r), key=lambda r: r["time"], default=None)
        if newest:
            status["lastScale"] = newest
        return await self._store_status(fleet, obs, status, memory, logger), model.downloading

    def _requeue(self, memory: FleetMemory, plans: list[RolePlan], holds: list[Hold], downloading: str | None,
                 failed: bool) -> float | None:
        """When to look again though no event may come (None: at the next event or resync): a
        failed pass backs off; a hold, a download, unconfirmed actions and drains are looked at."""
        requeue = CLAIM_RECHECK_SECONDS if holds else None  # a claim and a PodGroup API have no watch
        if downloading:
            requeue = min(requeue or PROGRESS_SECONDS, PROGRESS_SECONDS)
        if failed:
            memory.failures += 1
            requeue = min(MAX_BACKOFF_SECONDS, 2.0 ** memory.failures)
        else:
            memory.failures = 0
        if requeue is None and (memory.created or memory.deleted):
            requeue = EXPECTATION_SECONDS / 4  # look again even if the watch stays silent
        drains_end = min((p.recheck_at for p in plans if p.recheck_at is not None), default=None)
        if drains_end is not None:  # a drain times out without any event to say so
            wait = max(MIN_RECHECK_SECONDS, drains_end - self.wall_clock())
            requeue = wait if requeue is None else min(requeue, wait)
        return requeue

    def _roles(self, obs: FleetObservation, memory: FleetMemory, desired: DesiredFleet,
               spec: FleetSpec) -> tuple[dict[str, list[ServerPod]], list[RolePlan]]:
        """Each role's pods as the watch and this loop's own recent actions show them (pods of an
        earlier fleet of the same name count as terminating: they hold their names), and its plan."""
        now = self.clock()
        wall = self.wall_clock()
        foreign = [dataclasses.replace(p, terminating=True) for p in obs.foreign_pods()]
        # a server over several pods is one server from here on (groups.py)
        role_pods = {role: groups.servers(with_expectations(obs.role_pods(role), memory, now, desired, obs.uid, role) +
                                          [p for p in foreign if p.role == role]) for role in spec.roles()}
        memory.members = {p.uid: p.members for role in spec.roles() for p in role_pods[role] if p.members}
        memory.pod_groups = {p.uid: refs for role in spec.roles() for p in role_pods[role]
                             if (refs := frozenset(m.pod_group for m in p.pods if m.pod_group))}
        # servers a remediation is restarting are never a scale-down's choice
        views = [p.view for role in spec.roles() for p in obs.role_pods(role)]
        protected = frozenset(restarts_in_progress(history_from_status(obs.status), views, spec, wall))
        key = (obs.namespace, obs.name)
        plans = []
        for role in spec.roles():
            memory.vacated[role] = vacancies(memory.vacated.get(role, ()), desired.replicas[role], role_pods[role])
            leaving = [p for p in role_pods[role] if p.leaving and not p.terminating]
            finished = self.drains.finished(key, leaving, role, dialect_for(spec.engine)) \
                if self.drains is not None else frozenset()
            drain = Drain(wall, float(spec.role(role).drain_timeout_seconds), finished, protected)
            plans.append(plan_role(role, desired.replicas[role], desired.servers[role].template_hash,
                                   role_pods[role], drain, memory.vacated[role]))
        return role_pods, plans

    # ---- pieces ----

    async def _check_claims(self, spec: FleetSpec, namespace: str,
                            plans: list[RolePlan]) -> tuple[Problem, str] | None:
        """The first PersistentVolumeClaim the servers need that is missing, and what their creation
        waits for; looked at only when servers are about to be created. Secrets are not looked at: the
        kubelet resolves them, and a missing one shows in the pod's status (docs/security.md)."""
        if not any(isinstance(a, CreateServer) for p in plans for a in p.actions):
            return None
        for claim, field_ in _claims_needed(spec.model):
            outcome = await self.api.claim_exists(namespace, claim)
            if outcome.code == 404:  # (unreadable: the pods are created, and the scheduler says what it sees)
                return Problem(MODEL_UNAVAILABLE, f"{CLAIM_NOT_FOUND}: PersistentVolumeClaim {claim!r} ({field_}) "
                                                  f"does not exist in namespace {namespace}; create it"), \
                    f"PersistentVolumeClaim {claim}"
        return None

    async def _check_pod_group_apis(self, spec: FleetSpec,
                                    plans: list[RolePlan]) -> list[tuple[Problem, str, tuple[str, ...]]]:
        """Per role about to create servers whose gang scheduling names a PodGroup API the API
        server does not serve: the problem, and what its creations wait for. Its pods would wait
        forever for a scheduler that is not there, and their PodGroup cannot be made."""
        out = []
        for plan in plans:
            settings = spec.role(plan.role).gang_scheduling
            if settings is None or not any(isinstance(a, CreateServer) for a in plan.actions):
                continue
            api = gang.api_of(settings)
            outcome = await self.api.api_served(api.group, api.version, gang.POD_GROUP_PLURAL)
            if outcome.code == 404:  # (unreadable: created, and the PodGroup's apply says what went wrong)
                out.append((Problem(gang.POD_GROUP_API_MISSING,
                                    f"spec.{plan.role}.gangScheduling: the API server does not serve {api.resource} "
                                    f"({api.api_version} PodGroup, provider {api.provider}): {api.install}, or "
                                    f"remove gangScheduling; no {plan.role} server is created until then"),
                            f"the {api.api_version} PodGroup API", (plan.role,)))
        return out

    async def _store_role_statuses(self, fleet: FleetRef, obs: FleetObservation, spec: FleetSpec, counts: dict,
                                   pending: dict[str, SetRoleReplicas], logger: logging.Logger) -> dict[str, dict]:
        """Each InferenceFleetRole's status, written when it changed; a new lastScale is an Event and
        a metric. Role -> its lastScale (None when it has none)."""
        out: dict[str, dict] = {}
        for role in spec.roles():
            obj = obs.role_object(role)
            if obj is None or obj.terminating:
                out[role] = None
                continue
            status = scale_target.role_status(spec, role, obj, fleet.name, counts[role], now_rfc3339(),
                                              pending.get(role))
            out[role] = status.get("lastScale")
            if all(obj.status.get(k) == v for k, v in status.items()):
                continue
            outcome = await self.api.patch_role_status(fleet.namespace, obj.name, status)
            if not outcome.ok:
                logger.warning("could not write the status of %s %s: %s", names.ROLE_KIND, obj.name, outcome.message)
                out[role] = obj.status.get("lastScale")
                continue
            record = status.get("lastScale")
            if record and record != obj.status.get("lastScale"):
                up = record["desired"] > record["previous"]
                self.metrics.scale_changes.labels(role, record["reason"]).inc()
                await self.api.record_event(fleet, "Normal", "ScaledUp" if up else "ScaledDown",
                                            f"{record['message']} ({record['reason']}, {record['source']})")
        return out

    async def _download_progress(self, fleet: FleetRef, model: ModelSource,
                                 pods: list[ServerPod]) -> dict[str, tuple[int, int]]:
        """Pod name -> (bytes done, total) of each running download, from the last progress line in
        its init container's log (the pod's status does not carry it)."""
        if not model.parsed.downloads:
            return {}
        fetching = [p.name for p in pods if p.model == FETCHING]
        logs = await asyncio.gather(*(self.api.container_log(fleet.namespace, name, names.FETCH_CONTAINER,
                                                             PROGRESS_LOG_LINES) for name in fetching))
        return {name: found for name, text in zip(fetching, logs) if (found := parse_progress(text or ""))}

    async def _act(self, fleet: FleetRef, desired: DesiredFleet, action: PassAction, memory: FleetMemory) -> ApiResult:
        if isinstance(action, CreateRoleObject):
            return await self.api.create_role_object(action.manifest)
        if isinstance(action, SetRoleReplicas):
            return await self.api.patch_role_object(fleet.namespace, action.name, action.patch())
        if isinstance(action, DrainServer):
            return await self.api.set_leaving(fleet.namespace, action.name, action.uid, now_rfc3339())
        if isinstance(action, UndrainServer):
            return await self.api.set_leaving(fleet.namespace, action.name, action.uid, None)
        if isinstance(action, CreateServer):  # all pods of a server over several pods, leader first
            template = desired.servers[action.role]
            group = template.pod_group(action.index)
            if group is not None:  # its PodGroup first: the scheduler holds pods whose group is missing
                api = gang.api_of(template.gang)
                outcome = await self.api.apply_custom(api.group, api.version, gang.POD_GROUP_PLURAL, group)
                if not outcome.ok:
                    return dataclasses.replace(outcome, message=f"{gang.POD_GROUP_KIND} {group['metadata']['name']} "
                                                                f"({api.api_version}): {outcome.message}")
            manifests = template.pods(action.index)
            for node_rank, manifest in enumerate(manifests):
                outcome = await self.api.create_pod(manifest)
                if not outcome.ok:  # a partial group is broken: the next pass replaces it whole
                    return outcome
                memory.created[manifest["metadata"]["name"]] = (action, self.clock() + EXPECTATION_SECONDS,
                                                                node_rank, len(manifests))
            return outcome
        if isinstance(action, DeleteServer):  # all pods of a server over several pods
            members = memory.members.get(action.uid)
            targets = [(p.name, p.uid) for p in members if p.uid and not p.terminating] if members else \
                [(action.name, action.uid)]
            outcome = ApiResult(True)
            for name, uid in targets:
                result = await self.api.delete_pod(fleet.namespace, name, uid)
                if result.ok:
                    memory.deleted[uid] = (action, self.clock() + EXPECTATION_SECONDS)
                elif outcome.ok:
                    outcome = result
            for ref in sorted(memory.pod_groups.get(action.uid, ()), key=lambda r: (r.provider, r.name)):
                # the server's PodGroup goes with it (a server made again in the slot gets a new one)
                result = await self.api.delete_custom(ref.api.group, ref.api.version, gang.POD_GROUP_PLURAL,
                                                      fleet.namespace, ref.name)
                if not result.ok and outcome.ok:
                    outcome = dataclasses.replace(result, message=f"{gang.POD_GROUP_KIND} {ref.name} "
                                                                  f"({ref.api.api_version}): {result.message}")
            return outcome
        if isinstance(action, ApplyObject):
            return await self.api.apply(action.manifest)
        if isinstance(action, DeleteObject):
            return await self.api.delete_object(action.kind, fleet.namespace, action.name, action.uid)
        raise TypeError(f"unknown action {action!r}")

    async def _store_status(self, fleet: FleetRef, obs: FleetObservation, status: dict, memory: FleetMemory,
                            logger: logging.Logger) -> StatusWrite:
        key = (fleet.namespace, fleet.name)
        if self.status_part is not None:
            status = self.status_part.overlay(key, obs, status)
        written = await self._write_status(fleet, obs, status, memory, logger)
        if self.status_part is not None and written in (StatusWrite.UNCHANGED, StatusWrite.WRITTEN):
            self.status_part.stored(key, status)
        return written

    async def _write_status(self, fleet: FleetRef, obs: FleetObservation, status: dict, memory: FleetMemory,
                            logger: logging.Logger) -> StatusWrite:
        before = obs.status or {}
        if before.keys() <= status.keys() and all(before.get(k) == v for k, v in status.items()):
            return StatusWrite.UNCHANGED
        outcome = await self.api.patch_fleet_status(fleet.namespace, fleet.name, merge_patch(before, status))
        if outcome.code == 404:
            return StatusWrite.GONE
        if not outcome.ok:
            # Retried by the next pass (with back-off); said once as an Event, since the status
            # that would have said it is what was refused.
            message = f"the API server refused the fleet's status: {outcome.message}"
            logger.warning(message)
            if memory.status_refused != message:
                memory.status_refused = message
                await self.api.record_event(fleet, "Warning", "StatusUpdateFailed", message)
            return StatusWrite.REFUSED
        memory.status_refused = None
        memory.written_status = (obs.resource_version, status)
        for type_, cond in conditions.transitions(before, status):
            await self._condition_event(fleet, type_, cond, before)
        return StatusWrite.WRITTEN

    async def _condition_event(self, fleet: FleetRef, type_: str, cond: dict, before: dict) -> None:
        had = {c.get("type"): c for c in before.get("conditions") or []}.get(type_)
        if type_ == ConditionType.DEGRADED and cond["status"] == "True":
            await self.api.record_event(fleet, "Warning", cond["reason"], cond["message"])
        elif type_ == ConditionType.DEGRADED and had and had.get("status") == "True":
            await self.api.record_event(fleet, "Normal", "Recovered", f"no longer degraded ({had.get('reason')})")
        elif type_ == ConditionType.READY and had and had.get("status") == cond["status"]:
            return  # the same readiness for another reason (all servers Ready, or the minimum)
        elif type_ == ConditionType.READY and cond["status"] == "True":
            await self.api.record_event(fleet, "Normal", "FleetReady", cond["message"])
        elif type_ == ConditionType.READY and had and had.get("status") == "True":
            await self.api.record_event(fleet, "Warning", "FleetNotReady", cond["message"])


def merge_patch(before: dict, after: dict) -> dict:
    """The JSON merge patch that turns `before` into `after`: every key `after` has, and null for each
    key it dropped, at any depth of nested objects (status.model loses its bytes once downloaded)."""
    patch = {k: merge_patch(before[k], v) if isinstance(v, dict) and isinstance(before.get(k), dict) else v
             for k, v in after.items()}
    patch.update({k: None for k in before if k not in after})
    return patch


def _claims_needed(model: ModelSource) -> list[tuple[str, str]]:
    """(PersistentVolumeClaim, the field naming it)."""
    uri = model.parsed
    out = [(uri.name, f"spec.model.uri {uri.uri}")] if uri.kind == "pvc" else []
    if uri.downloads and model.cache.claim_name:
        out.append((model.cache.claim_name, "spec.model.cache.claimName"))
    return out


def _hold_creations(plans: list[RolePlan], holds: list[Hold]) -> list[RolePlan]:
    """The plans without the server creations `holds` hold (of their roles; None: all), saying what they wait for."""
    for _, waiting_for, roles in holds:
        plans = [dataclasses.replace(p, actions=tuple(a for a in p.actions if not isinstance(a, CreateServer)),
                                     waiting_for=waiting_for)
                 if any(isinstance(a, CreateServer) for a in p.actions) and (roles is None or p.role in roles) else p
                 for p in plans]
    return plans


def _in_order(object_actions: tuple[ChildAction, ...], scale_actions: list[PassAction],
              plans: list[RolePlan]) -> list[PassAction]:
    """Router objects first (the ServiceAccount and Role before the Deployment that uses them), then
    the scale targets, drains, deletions (they free names and capacity), then creations."""
    actions: list[PassAction] = list(object_actions) + scale_actions
    actions += [a for p in plans for a in p.actions if isinstance(a, (DrainServer, UndrainServer))]
    actions += [a for p in plans for a in p.actions if isinstance(a, DeleteServer)]
    actions += [a for p in plans for a in p.actions if isinstance(a, CreateServer)]
    return actions


def _read_spec(obs: FleetObservation) -> tuple[FleetSpec | None, Problem | None]:
    """The spec, or the reason it cannot be used. The API server already enforces every rule; this
    catches a CRD older than the operator (or one installed without its validation)."""
    problem = fleet_name_problem(obs.name)
    if problem:
        return None, Problem(Reason.INVALID_SPEC, problem)
    try:
        return FleetSpec.model_validate(obs.spec or {}), None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return None, Problem(Reason.INVALID_SPEC, f"spec.{where}: {first['msg']}" + (
            f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""))
