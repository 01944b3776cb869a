"""The rollout rules (decisions/rollout.py), as specifications, plus a small simulation that plays
whole rolls and scalings to the end and checks the invariants at every step."""

import dataclasses
import random

import pytest

from adpfleet.operator.decisions.observed import OwnedObject, ServerPod
from adpfleet.operator.decisions.rollout import (ApplyObject, CreateServer, DeleteObject, DeleteServer, plan_objects,
                                                 plan_role, vacancies)

OLD, NEW = "old-hash", "new-hash"


def pod(index, hash_=NEW, ready=True, terminating=False, unschedulable=False, phase="Running"):
    return ServerPod(name=f"f-context-{index}", uid=f"uid-{index}-{hash_}", role="context", index=index,
                     template_hash=hash_, owner_uid="fleet", phase=phase, ready=ready, terminating=terminating,
                     unschedulable=unschedulable, problem="Unschedulable: no GPUs" if unschedulable else None)


def plan(desired, pods, hash_=NEW):
    return plan_role("context", desired, hash_, pods)


def test_a_new_role_creates_all_servers_at_once():
    p = plan(3, [])
    assert p.actions == (CreateServer("context", 0, "scale up"), CreateServer("context", 1, "scale up"),
                         CreateServer("context", 2, "scale up"))
    assert p.phase == "Scaling"


def test_converged_role_does_nothing():
    p = plan(2, [pod(0), pod(1)])
    assert p.actions == () and p.converged


def test_scale_up_fills_the_lowest_free_slots():
    p = plan(4, [pod(0), pod(2)])
    assert [a.index for a in p.actions] == [1, 3]


def test_a_deleted_server_is_recreated_under_its_own_name_once_it_is_gone():
    waiting = plan(2, [pod(0), pod(1, terminating=True)])
    assert waiting.actions == () and "f-context-1 to terminate" in waiting.waiting_for
    assert plan(2, [pod(0)]).actions == (CreateServer("context", 1, "scale up"),)


def test_a_server_a_roll_left_in_a_higher_slot_comes_back_under_its_own_name():
    # after a roll the only server is f-context-1; remediation deletes it; the slot is refilled, not 0
    vacated = vacancies((), 1, [pod(1, terminating=True)])
    assert vacated == (1,)
    waiting = plan_role("context", 1, NEW, [pod(1, terminating=True)], vacated=vacated)
    assert waiting.actions == () and "f-context-1 to terminate" in waiting.waiting_for
    vacated = vacancies(vacated, 1, [])  # gone: remembered until refilled
    assert plan_role("context", 1, NEW, [], vacated=vacated).actions == (CreateServer("context", 1, "replace a deleted server"),)
    assert vacancies(vacated, 1, [pod(1, ready=False)]) == ()  # whole again: forgotten


def test_scale_downs_and_rolls_leave_no_vacancy():
    assert vacancies((), 1, [pod(0), pod(1, terminating=True)]) == ()  # scaled 2 -> 1
    assert vacancies((), 1, [pod(0, OLD, terminating=True), pod(1)]) == ()  # rolled: 1 replaced 0
    assert vacancies((), 3, [pod(0), pod(2, terminating=True)]) == (2,)  # deleted while short
    assert plan_role("context", 3, NEW, [pod(0)], vacated=(2,)).actions == (
        CreateServer("context", 2, "replace a deleted server"), CreateServer("context", 1, "scale up"))


def test_scale_down_removes_not_ready_then_highest_slots():
    p = plan(2, [pod(0), pod(1, ready=False), pod(2), pod(3)])
    assert {a.name for a in p.actions} == {"f-context-1", "f-context-3"}
    assert all(isinstance(a, DeleteServer) and a.why == "scale down" for a in p.actions)


def test_scale_down_keeps_a_ready_server():
    p = plan(1, [pod(0, ready=False), pod(1), pod(2, ready=False)])
    assert {a.name for a in p.actions} == {"f-context-0", "f-context-2"}


def test_a_scale_down_during_a_roll_deletes_a_not_ready_pod_never_the_only_ready_one():
    # 3 -> 1 while rolling: the old server is the only Ready one, the new ones are still starting
    p = plan(1, [pod(0, OLD), pod(1, ready=False), pod(2, ready=False)])
    assert [(type(a), a.name) for a in p.actions] == [(DeleteServer, "f-context-2")]
    assert p.phase == "Scaling"


def test_a_finished_pod_is_replaced():
    p = plan(2, [pod(0), pod(1, phase="Failed", ready=False)])
    assert [(type(a), a.name) for a in p.actions] == [(DeleteServer, "f-context-1")]
    assert p.phase == "Replacing"


def test_roll_creates_one_new_server_before_deleting_an_old_one():
    p = plan(2, [pod(0, OLD), pod(1, OLD)])
    assert p.actions == (CreateServer("context", 2, "rolling update: new server before the old one"),)
    assert p.phase == "RollingUpdate"


def test_roll_waits_for_the_new_server_to_be_ready():
    p = plan(2, [pod(0, OLD), pod(1, OLD), pod(2, ready=False)])
    assert p.actions == () and "f-context-2 to become ready" in p.waiting_for


def test_roll_deletes_one_old_server_when_the_new_one_is_ready():
    p = plan(2, [pod(0, OLD), pod(1, OLD), pod(2)])
    assert p.actions == (DeleteServer("context", "f-context-1", "uid-1-old-hash", "rolling update: replaced"),)


def test_roll_waits_for_the_old_server_to_terminate_before_the_next_step():
    p = plan(2, [pod(0, OLD), pod(1, OLD, terminating=True), pod(2)])
    assert p.actions == () and "terminate" in p.waiting_for


def test_roll_of_a_single_server_never_deletes_it_while_the_new_one_cannot_be_scheduled():
    p = plan(1, [pod(0, OLD), pod(1, ready=False, unschedulable=True)])
    assert p.actions == () and "room to schedule" in p.waiting_for


def test_roll_makes_room_when_another_ready_server_remains():
    p = plan(2, [pod(0, OLD), pod(1, OLD), pod(2, ready=False, unschedulable=True)])
    assert p.actions == (DeleteServer("context", "f-context-1", "uid-1-old-hash",
                                      "rolling update: making room for f-context-2"),)


def test_roll_replaces_a_not_ready_old_server_first():
    p = plan(2, [pod(0, OLD), pod(1, OLD, ready=False), pod(2)])
    assert p.actions[0].name == "f-context-1"


# ---- simulation ----

@dataclasses.dataclass
class Sim:
    """A role under the rules: actions take effect at once; pods get ready and terminating pods
    vanish one step after they are asked to (or never, for `never_ready`)."""
    pods: list
    ready_after: int = 1
    never_ready: frozenset = frozenset()
    schedulable_slots: int | None = None  # capacity in pods (None: unlimited)

    def step(self, desired, hash_):
        p = plan_role("context", desired, hash_, self.pods)
        for action in p.actions:
            if isinstance(action, CreateServer):
                self.pods.append(pod(action.index, hash_, ready=False))
            else:
                self.pods = [dataclasses.replace(x, terminating=True) if x.name == action.name else x
                             for x in self.pods]
        return p

    def tick(self):
        self.pods = [x for x in self.pods if not x.terminating]  # terminations complete
        scheduled = 0
        out = []
        for x in sorted(self.pods, key=lambda x: (not x.ready, x.index)):
            fits = self.schedulable_slots is None or scheduled < self.schedulable_slots
            scheduled += fits
            ready = x.ready or (fits and x.index not in self.never_ready)
            out.append(dataclasses.replace(x, ready=ready, unschedulable=not fits))
        self.pods = sorted(out, key=lambda x: x.index)

    def ready(self):
        return sum(x.ready and not x.terminating for x in self.pods)


def run(sim: Sim, desired: int, hash_: str, max_steps=60):
    had_ready = sim.ready() > 0
    history = []
    for _ in range(max_steps):
        p = sim.step(desired, hash_)
        history.append(p)
        live = [x for x in sim.pods if not x.terminating]
        if had_ready:
            assert sim.ready() >= 1, f"the role dropped to zero ready servers: {sim.pods}"
        outdated = any(x.template_hash != hash_ for x in live)
        if outdated:
            assert len(live) <= max(desired, len([x for x in live if x.template_hash != hash_])) + 1, sim.pods
            assert sum(isinstance(a, DeleteServer) for a in p.actions) <= 1 or p.phase == "Scaling"
        if p.converged and not p.actions:
            return history
        sim.tick()
        had_ready = had_ready or sim.ready() > 0
    raise AssertionError(f"did not converge: {sim.pods}; last plan {history[-1]}")


@pytest.mark.parametrize("servers", [1, 2, 3, 5])
def test_simulated_roll_converges_one_server_at_a_time_never_at_zero_ready(servers):
    sim = Sim([pod(i, OLD) for i in range(servers)])
    history = run(sim, servers, NEW)
    assert all(x.template_hash == NEW and x.ready for x in sim.pods) and len(sim.pods) == servers
    creates = [a for p in history for a in p.actions if isinstance(a, CreateServer)]
    deletes = [a for p in history for a in p.actions if isinstance(a, DeleteServer)]
    assert len(creates) == len(deletes) == servers  # each server replaced exactly once
    assert all(len([a for a in p.actions if isinstance(a, DeleteServer)]) <= 1 for p in history)


def test_simulated_roll_without_room_for_a_surge_pod_still_keeps_a_ready_server():
    sim = Sim([pod(i, OLD) for i in range(3)], schedulable_slots=3)
    sim.tick()
    run(sim, 3, NEW)
    assert all(x.template_hash == NEW for x in sim.pods)


@pytest.mark.parametrize("seed", range(20))
def test_simulated_random_scale_and_spec_changes_always_converge(seed):
    rng = random.Random(seed)
    sim = Sim([])
    hash_ = "h0"
    for round_ in range(6):
        desired = rng.randint(1, 5)
        if rng.random() < 0.5:
            hash_ = f"h{round_ + 1}"
        run(sim, desired, hash_)
        live = [x for x in sim.pods if not x.terminating]
        assert len(live) == desired and all(x.template_hash == hash_ and x.ready for x in live)
        assert len({x.index for x in live}) == desired


@pytest.mark.parametrize("seed", range(20))
def test_simulated_scale_changes_in_the_middle_of_a_roll_keep_a_ready_server(seed):
    """`desired` changes while a roll is underway (not only between converged states)."""
    rng = random.Random(seed)
    sim = Sim([pod(i, OLD) for i in range(rng.randint(1, 5))])
    sim.tick()
    desired = len(sim.pods)
    for _ in range(40):
        if rng.random() < 0.3:
            desired = rng.randint(1, 5)
        sim.step(desired, NEW)
        assert sim.ready() >= 1, f"the role dropped to zero ready servers: {sim.pods}"
        sim.tick()
    run(sim, desired, NEW)
    assert all(x.template_hash == NEW and x.ready for x in sim.pods) and len(sim.pods) == desired


def test_a_server_that_never_becomes_ready_stops_the_roll_with_a_reason():
    sim = Sim([pod(0, OLD), pod(1, OLD)], never_ready=frozenset({2}))
    for _ in range(5):
        p = sim.step(2, NEW)
        sim.tick()
    assert p.phase == "RollingUpdate" and "f-context-2 to become ready" in p.waiting_for
    assert sum(x.template_hash == OLD for x in sim.pods) == 2  # no old server was given up


# ---- router objects ----

def _manifest(kind, name, hash_):
    return {"kind": kind, "metadata": {"name": name, "annotations": {"adpfleet.io/template-hash": hash_}}}


def test_objects_missing_or_changed_are_applied_unchanged_ones_left_alone():
    desired = [_manifest("Service", "f-router", "a"), _manifest("Deployment", "f-router", "b"),
               _manifest("Role", "f-router", "c")]
    observed = [OwnedObject("Service", "f-router", "u1", "fleet", "a"),
                OwnedObject("Deployment", "f-router", "u2", "fleet", "old")]
    p = plan_objects(desired, observed, "fleet")
    assert [(a.kind, a.why) for a in p.actions] == [("Deployment", "spec changed"), ("Role", "missing")]
    assert all(isinstance(a, ApplyObject) for a in p.actions)


def test_objects_no_longer_wanted_are_deleted():
    observed = [OwnedObject("Service", "f-router", "u1", "fleet", "a")]
    assert plan_objects([], observed, "fleet").actions == (DeleteObject("Service", "f-router", "u1", "no longer wanted"),)


def test_an_object_left_by_an_earlier_fleet_of_the_same_name_is_waited_for():
    desired = [_manifest("Service", "f-router", "a")]
    observed = [OwnedObject("Service", "f-router", "u1", "earlier-fleet", "a")]
    p = plan_objects(desired, observed, "fleet")
    assert p.actions == () and "earlier fleet" in p.waiting_for
