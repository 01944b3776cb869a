"""What to do next about a fleet's children: a pure function of desired and observed state.

Per role the rules, in order (the first that applies decides this pass):

1. A finished pod (Failed/Succeeded, e.g. evicted) is deleted; its slot is refilled next pass.
2. Scale up: first take back servers that a scale-down is still draining (they are serving, so
   un-draining them is immediate), then fill the free slots, all at once: first the slots of
   servers deleted while the role was short of them (a server deleted by hand or by remediation;
   still terminating: waited for), then the lowest free ones. So a server keeps its name
   (`<fleet>-<role>-<index>`), as in a StatefulSet, also when a roll has left it in a higher slot.
3. Servers a scale-down drained are deleted once drained: their in-flight requests finished (the
   stall loop's scrapes say so), their pod is not Ready, or the role's `drainTimeoutSeconds` passed.
4. Scale down: the excess goes, not-ready pods first, then outdated ones, then the highest slots.
   Ready pods go last, so a role that has a ready server keeps one. A not-ready pod is deleted at
   once; a Ready one is drained first (the router stops sending it requests; rule 3 deletes it),
   unless the drain timeout is 0. A server under remediation is never chosen.
5. Roll (a pod built from an older spec exists), one server at a time, new before old: create one
   surge pod from the current template; when it is Ready, delete one outdated pod; wait until that
   one is gone; repeat. When the surge pod cannot be scheduled (no room, e.g. GPUs), an outdated
   pod is deleted first to make room, but only if the role keeps a ready server.

Everything else (the router's objects) is applied when missing or when its template hash changed,
and deleted when no longer wanted.

Each action says how it is reported (`wording`: verb and past tense for messages, the Event reasons
for done and refused) and what it acts on (`describe`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from adpfleet.operator.decisions.observed import OwnedObject, ServerPod
from adpfleet.operator.resource import names


@dataclass(frozen=True)
class Wording:
    """How an action is reported: in log lines and messages, and as Event (and Degraded) reasons."""
    verb: str      # "could not create ..."
    past: str      # "created ..."
    reason: str    # the Event when it was done
    failure: str   # the Event and Degraded reason when the API refused it


@dataclass(frozen=True)
class CreateServer:
    role: str
    index: int
    why: str
    wording: ClassVar[Wording] = Wording("create", "created", "CreatedServer", "CreateServerFailed")

    def describe(self, fleet: str) -> str:
        return f"{self.role} server {names.server_name(fleet, self.role, self.index)}"


@dataclass(frozen=True)
class DeleteServer:
    role: str
    name: str
    uid: str
    why: str
    wording: ClassVar[Wording] = Wording("delete", "deleted", "DeletedServer", "DeleteServerFailed")

    def describe(self, fleet: str) -> str:
        return f"{self.role} server {self.name}"


@dataclass(frozen=True)
class ApplyObject:
    kind: str
    name: str
    manifest: dict = field(compare=False, hash=False, repr=False)
    why: str = ""
    wording: ClassVar[Wording] = Wording("apply", "applied", "Applied", "ApplyFailed")

    def describe(self, fleet: str) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True)
class DeleteObject:
    kind: str
    name: str
    uid: str
    why: str
    wording: ClassVar[Wording] = Wording("delete", "deleted", "Deleted", "DeleteFailed")

    def describe(self, fleet: str) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True)
class DrainServer:
    """Start a scale-down's drain: the router stops sending the server requests; deleted when drained."""
    role: str
    name: str
    uid: str
    why: str
    wording: ClassVar[Wording] = Wording("drain", "draining", "DrainingServer", "DrainServerFailed")

    def describe(self, fleet: str) -> str:
        return f"{self.role} server {self.name}"


@dataclass(frozen=True)
class UndrainServer:
    """Cancel a scale-down's drain: the server is wanted again."""
    role: str
    name: str
    uid: str
    why: str
    wording: ClassVar[Wording] = Wording("undrain", "kept", "KeptServer", "UndrainServerFailed")

    def describe(self, fleet: str) -> str:
        return f"{self.role} server {self.name}"


# What a pass does to one of the fleet's children (remediation's actions are vocabulary.Action).
ChildAction = CreateServer | DeleteServer | DrainServer | UndrainServer | ApplyObject | DeleteObject


@dataclass(frozen=True)
class Drain:
    """What the scale-down rules need to know about draining: `timeout` (the role's
    drainTimeoutSeconds; 0 deletes Ready servers at once), the uids of the leaving servers whose
    requests have finished, and the servers under remediation (never chosen)."""
    now: float = 0.0
    timeout: float = 0.0
    finished: frozenset[str] = frozenset()
    protected: frozenset[str] = frozenset()

    def done(self, pod: ServerPod) -> bool:
        return (pod.uid in self.finished or not pod.ready or pod.leaving_since is None
                or self.now >= pod.leaving_since + self.timeout)


@dataclass(frozen=True)
class RolePlan:
    role: str
    actions: tuple[ChildAction, ...] = ()
    waiting_for: str | None = None   # why nothing (more) can be done now, for Progressing's message
    phase: str | None = None         # Scaling | RollingUpdate | Replacing | None when converged
    recheck_at: float | None = None  # when waiting ends by itself (a drain's timeout), wall-clock seconds

    @property
    def converged(self) -> bool:
        return self.phase is None


def _removal_order(pod: ServerPod, template_hash: str) -> tuple:
    """Sort key: the first pods are the first to go."""
    return (pod.ready, pod.template_hash == template_hash, -pod.index)


def vacancies(previous: tuple[int, ...], desired: int, pods: list[ServerPod]) -> tuple[int, ...]:
    """The slots of servers deleted while the role had no more than it wanted (deleted by hand or by
    remediation, not by a scale-down or a roll, which leave the role whole): the names to give back
    first, oldest vacancy first. Forgotten once the role is whole again."""
    live = [p for p in pods if not p.terminating]
    if len(live) >= desired:
        return ()
    taken = {p.index for p in live}
    out = [i for i in previous if i not in taken]
    for p in sorted(pods, key=lambda p: p.index):
        if p.terminating and p.index not in taken and p.index not in out:
            out.append(p.index)
    return tuple(out)


def plan_role(role: str, desired: int, template_hash: str, pods: list[ServerPod], drain: Drain = Drain(),
              vacated: tuple[int, ...] = ()) -> RolePlan:
    """The next actions for one role: the first of the module docstring's rules that applies;
    `vacated`: slots to refill first (see `vacancies`)."""
    view = _RolePods.of(role, template_hash, pods)
    return (_replace_finished(view) or _scale_up(view, desired, vacated) or _finish_drains(view, drain)
            or _scale_down(view, desired, drain) or _settle(view) or _roll(view, desired))


@dataclass(frozen=True)
class _RolePods:
    """One role's pods, sorted the ways the rules read them."""
    role: str
    template_hash: str
    pods: list[ServerPod]
    alive: list[ServerPod]        # not terminating
    leaving: list[ServerPod]      # ... that a scale-down drains
    live: list[ServerPod]         # ... the others: the role's servers
    terminating: list[ServerPod]
    current: list[ServerPod]      # live, from the current template
    outdated: list[ServerPod]     # live, from an older one

    @classmethod
    def of(cls, role: str, template_hash: str, pods: list[ServerPod]) -> "_RolePods":
        alive = [p for p in pods if not p.terminating]
        live = [p for p in alive if not p.leaving]
        return cls(role, template_hash, pods, alive, [p for p in alive if p.leaving], live,
                   [p for p in pods if p.terminating], [p for p in live if p.template_hash == template_hash],
                   [p for p in live if p.template_hash != template_hash])

    @property
    def taken(self) -> set[int]:
        return {p.index for p in self.alive}

    def removal_order(self, pods: list[ServerPod]) -> list[ServerPod]:
        """The first pods are the first to go."""
        return sorted(pods, key=lambda p: _removal_order(p, self.template_hash))

    def waiting(self, pods: list[ServerPod], what: str, phase: str) -> RolePlan:
        return RolePlan(self.role, (), f"{', '.join(p.name for p in pods)} {what}", phase)


def _replace_finished(view: _RolePods) -> RolePlan | None:
    """Rule 1: a finished pod is deleted."""
    finished = [p for p in view.pods if p.finished and not p.terminating]
    if not finished:
        return None
    return RolePlan(view.role, tuple(DeleteServer(view.role, p.name, p.uid, f"pod {p.phase.lower()}: "
                                                  f"{p.problem or ''}".strip()) for p in finished), phase="Replacing")


def _scale_up(view: _RolePods, desired: int, vacated: tuple[int, ...]) -> RolePlan | None:
    """Rule 2: draining servers taken back first, then the free slots filled, vacated ones first."""
    missing = desired - len(view.live)
    if missing <= 0:
        return None
    role, template_hash = view.role, view.template_hash
    kept = sorted(view.leaving, key=lambda p: (p.template_hash != template_hash, not p.ready, p.index))[:missing]
    actions: tuple[ChildAction, ...] = tuple(UndrainServer(role, p.name, p.uid, "scale up: wanted again")
                                             for p in kept)
    wanted = missing - len(kept)
    taken, held = view.taken, {p.index: p for p in view.terminating}
    refill = [i for i in vacated if i not in taken]
    slots = (refill + [i for i in _free_slots(taken, wanted) if i not in refill])[:wanted]
    creatable = [i for i in slots if i not in held]
    waiting = [held[i].name for i in slots if i in held]
    actions += tuple(CreateServer(role, i, "replace a deleted server" if i in refill or waiting else "scale up")
                     for i in creatable)
    return RolePlan(role, actions, f"{', '.join(waiting)} to terminate" if waiting else None, "Scaling")


def _finish_drains(view: _RolePods, drain: Drain) -> RolePlan | None:
    """Rule 3: the servers a scale-down drained are deleted once drained."""
    leaving = view.leaving
    if not leaving:
        return None
    gone = [p for p in leaving if drain.done(p)]
    draining = [p for p in leaving if not drain.done(p)]
    return RolePlan(view.role, tuple(DeleteServer(view.role, p.name, p.uid, "scale down: drained") for p in gone),
                    f"{', '.join(p.name for p in draining)} to drain" if draining else None, "Scaling",
                    min((p.leaving_since + drain.timeout for p in draining), default=None))


def _scale_down(view: _RolePods, desired: int, drain: Drain) -> RolePlan | None:
    """Rule 4: the excess goes, Ready ones drained first; never a server under remediation."""
    live = view.live
    excess = len(live) - desired - (1 if view.outdated else 0)  # a roll may hold one surge pod
    if excess <= 0:
        return None
    role = view.role
    victims = view.removal_order([p for p in live if p.name not in drain.protected])[:excess]
    actions = tuple(DrainServer(role, p.name, p.uid, "scale down") if p.ready and drain.timeout > 0
                    else DeleteServer(role, p.name, p.uid, "scale down") for p in victims)
    protected = sorted(p.name for p in live if p.name in drain.protected)
    return RolePlan(role, actions, f"{', '.join(protected)} to be remediated" if len(victims) < excess else None,
                    phase="Scaling")


def _settle(view: _RolePods) -> RolePlan | None:
    """Every server runs the current template: waiting for the terminating to go and the new to be Ready."""
    if view.outdated:
        return None
    if view.terminating:
        return view.waiting(view.terminating, "to terminate", "Scaling")
    not_ready = [p for p in view.current if not p.ready]
    return view.waiting(not_ready, "to become ready", "Scaling") if not_ready else RolePlan(view.role)


def _roll(view: _RolePods, desired: int) -> RolePlan:
    """Rule 5: one server at a time, new before old."""
    role, live = view.role, view.live
    if view.terminating:
        return view.waiting(view.terminating, "to terminate", "RollingUpdate")
    if len(live) <= desired:  # no surge pod yet: start the next replacement, new before old
        slot = _free_slots(view.taken, 1)[0]
        return RolePlan(role, (CreateServer(role, slot, "rolling update: new server before the old one"),),
                        phase="RollingUpdate")
    pending = [p for p in view.current if not p.ready]
    victim = view.removal_order(view.outdated)[0]
    if not pending:
        return RolePlan(role, (DeleteServer(role, victim.name, victim.uid, "rolling update: replaced"),),
                        phase="RollingUpdate")
    stuck = [p for p in pending if p.unschedulable]
    ready_now = sum(p.ready for p in live)
    keeps_a_ready_server = ready_now - int(victim.ready) >= 1 or ready_now == 0
    if stuck and keeps_a_ready_server:
        return RolePlan(role, (DeleteServer(role, victim.name, victim.uid,
                                            f"rolling update: making room for {stuck[0].name}"),),
                        phase="RollingUpdate")
    what = "room to schedule" if stuck else "to become ready"
    return view.waiting(pending, what, "RollingUpdate")


def _free_slots(taken: set[int], count: int) -> list[int]:
    slots, i = [], 0
    while len(slots) < count:
        if i not in taken:
            slots.append(i)
        i += 1
    return slots


@dataclass(frozen=True)
class ObjectsPlan:
    actions: tuple[ChildAction, ...] = ()
    waiting_for: str | None = None


def plan_objects(desired: list[dict], observed: list[OwnedObject], fleet_uid: str) -> ObjectsPlan:
    """Apply what is missing or changed, delete what is no longer wanted; an object of the same
    name left by an earlier fleet of the same name is waited for (the garbage collector removes it)."""
    seen = {(o.kind, o.name): o for o in observed}
    actions: list[ChildAction] = []
    waiting = []
    wanted = set()
    for manifest in desired:
        key = (manifest["kind"], manifest["metadata"]["name"])
        wanted.add(key)
        have = seen.get(key)
        want_hash = manifest["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH]
        if have is None:
            actions.append(ApplyObject(key[0], key[1], manifest, "missing"))
        elif have.owner_uid != fleet_uid or have.terminating:
            waiting.append(f"{key[0]} {key[1]} of an earlier fleet to be deleted")
        elif have.template_hash != want_hash:
            actions.append(ApplyObject(key[0], key[1], manifest, "spec changed"))
    for key, have in seen.items():
        if key not in wanted and have.owner_uid == fleet_uid and not have.terminating:
            actions.append(DeleteObject(have.kind, have.name, have.uid, "no longer wanted"))
    return ObjectsPlan(tuple(actions), "; ".join(waiting) or None)
