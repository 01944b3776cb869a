"""Each role's scale target (decisions/scale_target.py) and the scale-down drain (decisions/rollout.py),
as specifications."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from adpfleet.operator.decisions import scale_target
from adpfleet.operator.decisions.observed import RoleObject, ServerPod, role_object, server_pod
from adpfleet.operator.decisions.rollout import (CreateServer, DeleteServer, Drain, DrainServer, UndrainServer,
                                                 plan_role)
from adpfleet.operator.decisions.scale_target import CreateRoleObject, SetRoleReplicas
from adpfleet.operator.resource import names
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.resource.vocabulary import ScaleReason

FLEET = FleetRef("f", "ns", "fleet-uid")
NOW = "2026-01-01T00:00:00Z"


def spec(servers=2, **autoscaling) -> FleetSpec:
    role = {"servers": servers}
    if autoscaling:
        role["autoscaling"] = {"enabled": True, **autoscaling}
    return FleetSpec.model_validate({"image": "i", "model": {"name": "tiny"}, "context": role,
                                     "generation": {"servers": 1}})


def obj(replicas=2, spec_servers=2, manager="adpfleet-operator", decision=None, status=None) -> RoleObject:
    return RoleObject(name="f-context", uid="r1", owner_uid="fleet-uid", role="context", replicas=replicas,
                      spec_servers=spec_servers, replicas_manager=manager, decision=decision,
                      status=status if status is not None else {"desiredReplicas": 2})


# ---- whose count --------------------------------------------------------------------------------

def test_a_role_runs_the_fleets_servers_until_its_scale_target_is_scaled():
    assert scale_target.replicas_of(spec(2), "context", None) == 2
    assert scale_target.replicas_of(spec(2), "context", obj(replicas=5)) == 5  # kubectl scale, an HPA
    # the fleet's servers changed since the object took them: the newer of the two wins
    assert scale_target.replicas_of(spec(3), "context", obj(replicas=5, spec_servers=2)) == 3


def test_autoscaling_bounds_the_count_whoever_set_it():
    assert scale_target.replicas_of(spec(2, minServers=2, maxServers=4), "context", obj(replicas=9)) == 4
    assert scale_target.replicas_of(spec(2, minServers=2, maxServers=4), "context", obj(replicas=1)) == 2


def test_the_scale_target_is_created_owned_and_labelled_with_the_fleets_servers():
    (create,) = scale_target.plan_role_object(FLEET, spec(3), "context", None, False, NOW)
    assert isinstance(create, CreateRoleObject)
    m = create.manifest
    assert (m["kind"], m["metadata"]["name"]) == (names.ROLE_KIND, "f-context")
    assert m["spec"] == {"fleet": "f", "role": "context", "replicas": 3}
    assert m["metadata"]["annotations"][names.ANNOTATION_SPEC_SERVERS] == "3"
    assert m["metadata"]["ownerReferences"][0]["uid"] == "fleet-uid"
    assert m["metadata"]["labels"][names.LABEL_FLEET] == "f"
    assert scale_target.plan_role_object(FLEET, spec(3), "context", None, True, NOW) == []  # an old one is going


def test_a_changed_servers_field_is_written_into_the_scale_target_with_why():
    assert scale_target.plan_role_object(FLEET, spec(2), "context", obj(replicas=5), False, NOW) == []
    (sync,) = scale_target.plan_role_object(FLEET, spec(3), "context", obj(replicas=5), False, NOW)
    assert isinstance(sync, SetRoleReplicas) and sync.replicas == 3
    patch = sync.patch()
    assert patch["spec"] == {"replicas": 3} and patch["metadata"]["uid"] == "r1"
    assert patch["metadata"]["annotations"][names.ANNOTATION_SPEC_SERVERS] == "3"
    note = json.loads(patch["metadata"]["annotations"][names.ANNOTATION_SCALE_DECISION])
    assert (note["previous"], note["desired"], note["reason"], note["source"]) == (5, 3, "SpecChanged", "spec")


# ---- status and lastScale -------------------------------------------------------------------------

def counts(desired, current=2, ready=2):
    return {"desired": desired, "current": current, "ready": ready, "updated": current}


def test_the_status_carries_counts_and_the_pod_selector_for_an_hpa():
    status = scale_target.role_status(spec(2), "context", obj(), "f", counts(2, 3, 1), NOW)
    assert status == {"replicas": 3, "readyReplicas": 1, "desiredReplicas": 2,
                      "selector": "adpfleet.io/fleet=f,adpfleet.io/role=context"}


def test_a_change_by_kubectl_or_an_autoscaler_is_recorded_with_its_field_manager():
    status = scale_target.role_status(spec(2), "context", obj(replicas=4, manager="kubectl"), "f", counts(4), NOW)
    last = status["lastScale"]
    assert (last["previous"], last["desired"], last["reason"], last["source"]) == \
        (2, 4, ScaleReason.SCALED_EXTERNALLY.value, "kubectl")
    # recorded once: the next status holds desiredReplicas 4 and keeps the record as it was
    again = scale_target.role_status(spec(2), "context", obj(replicas=4, manager="kubectl", status=status), "f",
                                     counts(4), "2026-01-01T00:09:00Z")
    assert again["lastScale"] == last


def test_the_policys_own_change_is_recorded_with_its_reason():
    note = scale_target.decision(NOW, 2, 3, ScaleReason.WAITING, "context 2 -> 3: waiting/rank 6 > target 2",
                                 scale_target.SOURCE_POLICY)
    last = scale_target.role_status(spec(2, maxServers=4), "context", obj(replicas=3, decision=note), "f",
                                    counts(3), NOW)["lastScale"]
    assert (last["reason"], last["source"], last["desired"]) == ("WaitingAboveTarget", "policy", 3)
    assert "waiting/rank 6" in last["message"]
    # the same count set afterwards by someone else is theirs, not the policy's
    other = scale_target.role_status(spec(2, maxServers=4), "context",
                                     obj(replicas=3, decision=note, manager="kube-controller-manager"), "f",
                                     counts(3), NOW)["lastScale"]
    assert (other["reason"], other["source"]) == ("ScaledExternally", "kube-controller-manager")


def test_a_count_held_by_autoscalings_bounds_says_so():
    last = scale_target.role_status(spec(2, minServers=1, maxServers=4), "context", obj(replicas=9, manager="kubectl"),
                                    "f", counts(4), NOW)["lastScale"]
    assert (last["reason"], last["source"]) == ("AboveMaximum", "policy")


def test_a_spec_change_written_this_pass_is_recorded_as_one():
    (sync,) = scale_target.plan_role_object(FLEET, spec(3), "context", obj(replicas=2), False, NOW)
    last = scale_target.role_status(spec(3), "context", obj(replicas=2), "f", counts(3), NOW, sync)["lastScale"]
    assert (last["reason"], last["source"], last["previous"], last["desired"]) == ("SpecChanged", "spec", 2, 3)


def test_the_index_reads_the_object_and_who_last_set_its_replicas():
    body = {"metadata": {"name": "f-context", "uid": "r1",
                         "annotations": {names.ANNOTATION_SPEC_SERVERS: "2"},
                         "ownerReferences": [{"uid": "fleet-uid", "controller": True}],
                         "managedFields": [
                             {"manager": "adpfleet-operator", "time": "2026-01-01T00:00:00Z",
                              "fieldsV1": {"f:spec": {"f:replicas": {}, "f:role": {}}}},
                             {"manager": "kubectl", "time": "2026-01-01T00:05:00Z", "subresource": "scale",
                              "fieldsV1": {"f:spec": {"f:replicas": {}}}},
                             {"manager": "other", "time": "2026-01-01T00:09:00Z",
                              "fieldsV1": {"f:metadata": {}}}]},
            "spec": {"fleet": "f", "role": "context", "replicas": 4}, "status": {"desiredReplicas": 2}}
    o = role_object(body)
    assert (o.replicas, o.spec_servers, o.replicas_manager, o.owner_uid) == (4, 2, "kubectl", "fleet-uid")


# ---- scale-down drains first ----------------------------------------------------------------------

T = 1_700_000_000.0


def pod(index, ready=True, leaving_since=None, hash_="h", terminating=False):
    return ServerPod(name=f"f-context-{index}", uid=f"u{index}", role="context", index=index, template_hash=hash_,
                     owner_uid="fleet-uid", phase="Running", ready=ready, terminating=terminating,
                     unschedulable=False, problem=None, leaving_since=leaving_since,
                     draining=leaving_since is not None)


def test_a_ready_server_is_drained_before_it_goes_and_a_not_ready_one_goes_at_once():
    p = plan_role("context", 1, "h", [pod(0), pod(1, ready=False), pod(2)], Drain(T, 60))
    assert [(type(a), a.name) for a in p.actions] == [(DeleteServer, "f-context-1"), (DrainServer, "f-context-2")]
    # without a drain timeout, the server is deleted (its own SIGTERM handling drains it)
    p = plan_role("context", 1, "h", [pod(0), pod(2)], Drain(T, 0))
    assert [(type(a), a.name) for a in p.actions] == [(DeleteServer, "f-context-2")]


def test_a_drained_server_goes_once_idle_or_not_ready_or_out_of_time():
    leaving = pod(2, leaving_since=T - 10)
    wait = plan_role("context", 2, "h", [pod(0), pod(1), leaving], Drain(T, 60))
    assert wait.actions == () and "f-context-2 to drain" in wait.waiting_for and wait.phase == "Scaling"
    for drain in (Drain(T, 60, finished=frozenset({"u2"})), Drain(T + 50, 60)):
        p = plan_role("context", 2, "h", [pod(0), pod(1), leaving], drain)
        assert p.actions == (DeleteServer("context", "f-context-2", "u2", "scale down: drained"),), drain
    p = plan_role("context", 2, "h", [pod(0), pod(1), pod(2, ready=False, leaving_since=T)], Drain(T, 60))
    assert [a.name for a in p.actions] == ["f-context-2"]


def test_a_server_wanted_again_while_draining_is_kept_rather_than_a_new_one_started():
    p = plan_role("context", 3, "h", [pod(0), pod(1), pod(2, leaving_since=T - 5)], Drain(T, 60))
    assert p.actions == (UndrainServer("context", "f-context-2", "u2", "scale up: wanted again"),)
    p = plan_role("context", 4, "h", [pod(0), pod(1), pod(2, leaving_since=T - 5)], Drain(T, 60))
    assert [type(a) for a in p.actions] == [UndrainServer, CreateServer] and p.actions[1].index == 3


def test_a_server_under_remediation_is_never_the_one_scaled_down():
    p = plan_role("context", 1, "h", [pod(0), pod(1, ready=False)], Drain(T, 60, protected=frozenset({"f-context-1"})))
    assert [(type(a), a.name) for a in p.actions] == [(DrainServer, "f-context-0")]
    p = plan_role("context", 1, "h", [pod(0), pod(1)], Drain(T, 60, protected=frozenset({"f-context-0", "f-context-1"})))
    assert p.actions == () and "to be remediated" in p.waiting_for


def test_draining_servers_do_not_count_as_the_roles_servers():
    from adpfleet.operator.decisions.conditions import role_counts
    assert role_counts(2, "h", [pod(0), pod(1), pod(2, leaving_since=T)]) == \
        {"desired": 2, "current": 2, "updated": 2, "ready": 2}


def test_the_annotation_makes_a_pod_leaving_since_its_time():
    body = {"metadata": {"name": "f-context-2", "uid": "u2", "labels": {names.LABEL_ROLE: "context",
                                                                        names.LABEL_INDEX: "2"},
                         "annotations": {names.ANNOTATION_DRAIN: "true",
                                         names.ANNOTATION_SCALE_DOWN: "2026-01-01T00:00:00Z"}},
            "status": {"phase": "Running"}}
    p = server_pod(body)
    assert p.leaving and p.draining and p.leaving_since == pytest.approx(1767225600.0)


@pytest.mark.parametrize("seed", range(15))
def test_simulated_scaling_with_drains_converges_and_deletes_no_ready_server_undrained(seed):
    """Random counts, a roll now and then; servers drain for a step or two before they are idle. A
    Ready server is only ever deleted after its drain was started."""
    rng = random.Random(seed)
    pods: list[ServerPod] = []
    hash_, desired, now, drained_at = "h0", 1, T, {}
    for step in range(200):
        if step % 25 == 0:
            desired = rng.randint(1, 5)
            if rng.random() < 0.3:
                hash_ = f"h{step}"
        finished = frozenset(uid for uid, at in drained_at.items() if now >= at)
        p = plan_role("context", desired, hash_, pods, Drain(now, 60, finished))
        for a in p.actions:
            target = next((x for x in pods if x.name == getattr(a, "name", None)), None)
            if isinstance(a, CreateServer):
                pods.append(dataclasses.replace(pod(a.index, ready=False, hash_=hash_), uid=f"u{a.index}-{step}"))
            elif isinstance(a, DrainServer):
                pods = [dataclasses.replace(x, leaving_since=now, draining=True) if x is target else x for x in pods]
                drained_at[target.uid] = now + rng.choice([0, 2, 4])
            elif isinstance(a, UndrainServer):
                pods = [dataclasses.replace(x, leaving_since=None, draining=False) if x is target else x for x in pods]
                drained_at.pop(target.uid, None)
            elif isinstance(a, DeleteServer):
                assert not target.ready or target.leaving or target.template_hash != hash_, (a, target)
                pods = [dataclasses.replace(x, terminating=True) if x is target else x for x in pods]
        now += 1
        pods = [dataclasses.replace(x, ready=True) for x in pods if not x.terminating]  # a step later: gone, Ready
        if step % 25 == 24:
            live = [x for x in pods if not x.leaving]
            assert len(live) == desired and not [x for x in pods if x.leaving], (step, pods)
            assert all(x.template_hash == hash_ for x in live)


def test_a_waiting_drain_says_when_it_times_out_so_the_pass_looks_again_then():
    p = plan_role("context", 1, "h", [pod(0), pod(1, leaving_since=T - 10), pod(2, leaving_since=T - 30)],
                  Drain(T, 60))
    assert p.recheck_at == T - 30 + 60
    assert plan_role("context", 1, "h", [pod(0)], Drain(T, 60)).recheck_at is None
