"""One reconcile pass against a fake API: what it writes, and that a pass with nothing to do
writes nothing (the property the steady-state test measures on the real API server)."""

import asyncio
import dataclasses
import logging

from adpfleet.operator.adapters.kube import ApiResult
from adpfleet.operator.decisions.observed import FleetObservation, RoleObject, ServerPod
from adpfleet.operator.reconciler import FleetMemory, Reconciler
from adpfleet.operator.telemetry import OperatorMetrics

from specs import fleet_manifest

log = logging.getLogger("test")


class FakeApi:
    """Records calls; every call succeeds unless told otherwise."""

    def __init__(self, fail=()):
        self.calls = []
        self.fail = set(fail)

    def _out(self, name, *args):
        self.calls.append((name, *args))
        return ApiResult(False, 500, "boom") if name in self.fail else ApiResult(True)

    async def create_pod(self, manifest):
        return self._out("create_pod", manifest["metadata"]["name"])

    async def delete_pod(self, namespace, name, uid):
        return self._out("delete_pod", name)

    async def apply(self, manifest):
        return self._out("apply", manifest["kind"])

    async def delete_object(self, kind, namespace, name, uid):
        return self._out("delete_object", kind)

    async def patch_fleet_status(self, namespace, name, status):
        self.last_status = status
        return self._out("patch_status")

    async def record_event(self, fleet, type_, reason, message):
        return self._out("event", type_, reason)

    async def create_secret(self, manifest):
        return self._out("create_secret", manifest["metadata"]["name"])

    async def create_role_object(self, manifest):
        return self._out("create_role_object", manifest["metadata"]["name"])

    async def patch_role_object(self, namespace, name, body):
        self.last_role_patch = body
        return self._out("patch_role_object", name)

    async def patch_role_status(self, namespace, name, status):
        self.role_statuses = {**getattr(self, "role_statuses", {}), name: status}
        return self._out("patch_role_status", name)

    async def set_leaving(self, namespace, name, uid, since):
        return self._out("set_leaving", name, since is not None)


def role_object(role, replicas=1, spec_servers=1, status=None, manager="adpfleet-operator", decision=None):
    """A role's InferenceFleetRole as the index shows it; by default one whose status says what
    running_pods() has."""
    if status is None:
        status = {"replicas": 1, "readyReplicas": 1, "desiredReplicas": 1,
                  "selector": f"adpfleet.io/fleet=f,adpfleet.io/role={role}"}
    return RoleObject(name=f"f-{role}", uid=f"r-{role}", owner_uid="fleet-uid", role=role, replicas=replicas,
                      spec_servers=spec_servers, replicas_manager=manager, decision=decision, status=status)


SETTLED_ROLES = (role_object("context"), role_object("generation"))


def servers_only() -> dict:
    """A fleet of two servers and nothing else (no router, no disruption budgets)."""
    m = fleet_manifest("f", router={"enabled": False})
    for role in ("context", "generation"):
        m["spec"][role]["disruptionBudget"] = {"enabled": False}
    return m


def observation(manifest=None, pods=(), objects=(), status=None, generation=1, rv="1", roles=SETTLED_ROLES):
    m = manifest or servers_only()
    return FleetObservation(name="f", namespace="ns", uid="fleet-uid", generation=generation, resource_version=rv,
                            spec=m["spec"], status=status or {}, pods=tuple(pods), objects=tuple(objects),
                            role_objects=tuple(roles))


def reconcile(api, obs, memory=None, clock=lambda: 0.0):
    r = Reconciler(api, OperatorMetrics(), clock=clock)
    return asyncio.run(r.reconcile(obs, memory or FleetMemory(), log))


def running_pods(status_from_hash=None):
    """What the cluster looks like after the first pass's pods came up."""
    from adpfleet.operator.decisions.desired import desired_fleet
    from adpfleet.operator.resource.names import FleetRef
    from adpfleet.operator.resource.models import FleetSpec
    spec = FleetSpec.model_validate(servers_only()["spec"])
    desired = desired_fleet(FleetRef("f", "ns", "fleet-uid"), spec)
    return [ServerPod(name=f"f-{role}-0", uid=f"u-{role}", role=role, index=0,
                      template_hash=desired.servers[role].template_hash, owner_uid="fleet-uid", phase="Running",
                      ready=True, terminating=False, unschedulable=False, problem=None) for role in ("context", "generation")]


def test_first_pass_creates_the_servers_writes_status_and_records_events():
    api = FakeApi()
    result = reconcile(api, observation())
    names = [c[0] for c in api.calls]
    assert names.count("create_pod") == 2 and names.count("patch_status") == 1
    assert ("event", "Normal", "CreatedServer") in api.calls
    status = api.last_status
    assert status["observedGeneration"] == 1 and status["context"]["desired"] == 1
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Ready"]["status"] == "False" and conditions["Progressing"]["status"] == "True"
    assert conditions["Degraded"]["status"] == "False"
    assert result.requeue_after is not None  # looks again even if the watch says nothing


def test_a_pass_with_nothing_to_change_makes_no_call():
    api = FakeApi()
    pods = running_pods()
    reconcile(api, observation(pods=pods))
    settled = api.last_status
    assert {c["type"]: c["status"] for c in settled["conditions"]}["Ready"] == "True"
    api2 = FakeApi()
    result = reconcile(api2, observation(pods=pods, status=settled, rv="2"))
    assert api2.calls == [] and result.actions == 0 and result.requeue_after is None


def test_created_pods_are_not_created_again_before_the_watch_shows_them():
    api, memory = FakeApi(), FleetMemory()
    reconcile(api, observation(), memory)
    api2 = FakeApi()
    reconcile(api2, observation(rv="2"), memory)  # the cache has not caught up yet
    assert not [c for c in api2.calls if c[0] == "create_pod"]


def test_expectations_expire_so_a_lost_create_is_retried():
    api, memory = FakeApi(), FleetMemory()
    reconcile(api, observation(), memory, clock=lambda: 0.0)
    api2 = FakeApi()
    reconcile(api2, observation(rv="2"), memory, clock=lambda: 1000.0)
    assert [c for c in api2.calls if c[0] == "create_pod"]


def test_status_written_moments_ago_is_not_written_again_while_the_cache_lags():
    api, memory = FakeApi(), FleetMemory()
    pods = running_pods()
    reconcile(api, observation(pods=pods, rv="7"), memory)
    api2 = FakeApi()
    reconcile(api2, observation(pods=pods, rv="7"), memory)  # same resourceVersion: our write not seen yet
    assert api2.calls == []


def test_a_deleted_server_comes_back_under_its_name_even_from_a_higher_slot():
    # a roll left f-generation-1 as the only generation server; then it was deleted (remediation)
    pods = running_pods()
    gen = dataclasses.replace(pods[1], name="f-generation-1", index=1, uid="u-gen-1")
    memory = FleetMemory()
    api = FakeApi()
    reconcile(api, observation(pods=[pods[0], dataclasses.replace(gen, terminating=True)], rv="2"), memory)
    assert not [c for c in api.calls if c[0] == "create_pod"]  # its name is still taken: wait
    api = FakeApi()
    reconcile(api, observation(pods=[pods[0]], rv="3"), memory)  # gone
    assert [c for c in api.calls if c[0] == "create_pod"] == [("create_pod", "f-generation-1")]


def test_the_internal_token_secret_is_created_before_any_pod_and_never_read():
    api = FakeApi()
    reconcile(api, observation())
    acting = [c for c in api.calls if c[0] not in ("event", "patch_status", "patch_role_status")]
    assert acting[0] == ("create_secret", "f-internal-token")
    assert [c[0] for c in acting[1:]] == ["create_pod", "create_pod"]  # (no Secret read among them)
    # settled: no request at all, the Secret included
    api2 = FakeApi()
    pods = running_pods()
    reconcile(api2, observation(pods=pods))
    api3 = FakeApi()
    reconcile(api3, observation(pods=pods, status=api2.last_status, rv="2"))
    assert api3.calls == []


def test_a_pod_that_cannot_find_the_internal_token_gets_it_created_again():
    pods = running_pods()
    pods[0] = dataclasses.replace(pods[0], ready=False, problem='CreateContainerConfigError: secret '
                                                                 '"f-internal-token" not found')
    api = FakeApi()
    reconcile(api, observation(pods=pods))
    assert ("create_secret", "f-internal-token") in api.calls
    degraded = {c["type"]: c for c in api.last_status["conditions"]}["Degraded"]
    assert degraded["reason"] == "SecretNotFound" and "internal token" in degraded["message"]


def test_a_missing_api_key_secret_degrades_the_fleet_naming_the_secret_and_the_field():
    """The kubelet resolves the Secret; its CreateContainerConfigError becomes the condition."""
    manifest = fleet_manifest("f", router={"enabled": False}, auth={"apiKeySecret": {"name": "api", "key": "k"}})
    pods = [dataclasses.replace(p, template_hash=_hash(manifest, p.role)) for p in running_pods()]
    pods[1] = dataclasses.replace(pods[1], ready=False,
                                  problem="CreateContainerConfigError: couldn't find key k in Secret ns/api")
    api = FakeApi()
    reconcile(api, observation(manifest, pods=pods))
    degraded = {c["type"]: c for c in api.last_status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "SecretNotFound"
    assert "Secret ns/api" in degraded["message"] and "spec.auth.apiKeySecret" in degraded["message"]
    assert ("event", "Warning", "SecretNotFound") in api.calls


def test_a_fleet_without_an_api_key_is_refused_when_the_operator_requires_one():
    from adpfleet.operator.decisions.security import SecurityConfig
    api = FakeApi()
    r = Reconciler(api, OperatorMetrics(), clock=lambda: 0.0, security_config=SecurityConfig(require_api_key=True))
    asyncio.run(r.reconcile(observation(), FleetMemory(), log))
    assert [c[0] for c in api.calls if c[0] != "event"] == ["patch_status"]
    ready = {c["type"]: c for c in api.last_status["conditions"]}["Ready"]
    assert ready["reason"] == "InvalidSpec" and "spec.auth.apiKeySecret" in ready["message"]
    manifest = fleet_manifest("f", router={"enabled": False}, auth={"apiKeySecret": {"name": "api"}})
    api2 = FakeApi()
    r.api = api2
    asyncio.run(r.reconcile(observation(manifest), FleetMemory(), log))
    assert len([c for c in api2.calls if c[0] == "create_pod"]) == 2


def _hash(manifest, role):
    from adpfleet.operator.decisions.desired import desired_fleet
    from adpfleet.operator.resource.models import FleetSpec
    from adpfleet.operator.resource.names import FleetRef
    return desired_fleet(FleetRef("f", "ns", "fleet-uid"), FleetSpec.model_validate(manifest["spec"])) \
        .servers[role].template_hash


def test_failed_api_calls_degrade_the_fleet_and_back_off():
    api, memory = FakeApi(fail={"create_pod"}), FleetMemory()
    result = reconcile(api, observation(), memory)
    assert result.failed and result.requeue_after == 2.0
    degraded = {c["type"]: c for c in api.last_status["conditions"]}["Degraded"]
    assert degraded["reason"] == "CreateServerFailed" and "boom" in degraded["message"]
    assert ("event", "Warning", "CreateServerFailed") in api.calls
    assert reconcile(FakeApi(fail={"create_pod"}), observation(rv="2"), memory).requeue_after == 4.0


def test_invalid_spec_that_got_past_the_api_server_is_reported_not_acted_on():
    manifest = fleet_manifest("f")
    manifest["spec"]["context"]["servers"] = 0
    api = FakeApi()
    reconcile(api, observation(manifest))
    assert [c[0] for c in api.calls if c[0] != "event"] == ["patch_status"]
    ready = {c["type"]: c for c in api.last_status["conditions"]}["Ready"]
    assert ready["reason"] == "InvalidSpec" and "spec.context.servers" in ready["message"]


def test_crash_looping_server_is_reported_as_degraded():
    pods = running_pods()
    pods[0] = dataclasses.replace(pods[0], ready=False, problem="CrashLoopBackOff: back-off 8s restarting")
    api = FakeApi()
    reconcile(api, observation(pods=pods))
    degraded = {c["type"]: c for c in api.last_status["conditions"]}["Degraded"]
    assert degraded["reason"] == "ServersFailing" and "f-context-0: CrashLoopBackOff" in degraded["message"]


def test_a_crash_loop_keeps_degraded_with_the_containers_error_through_every_back_off():
    """A model that cannot load: the server exits, the kubelet backs off, runs it again, it exits..."""
    from adpfleet.operator.decisions.observed import server_pod
    failed = {"terminated": {"exitCode": 3, "reason": "Error", "message": "model 'tinny' not found"}}

    def server(state, last, restarts, started=False):
        base = running_pods()[0]
        body = {"metadata": {"name": base.name, "uid": base.uid, "labels": {"adpfleet.io/role": "context",
                                                                            "adpfleet.io/index": "0"},
                             "annotations": {"adpfleet.io/template-hash": base.template_hash},
                             "ownerReferences": [{"controller": True, "uid": "fleet-uid"}]},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
                           "containerStatuses": [{"name": "server", "ready": False, "started": started,
                                                  "restartCount": restarts, "state": state, "lastState": last}]}}
        return server_pod(body)
    cycle = [server({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1s restarting failed"}}, failed, 1),
             server({"running": {"startedAt": "2024-01-01T00:00:00Z"}}, failed, 1),
             server({"terminated": failed["terminated"]}, {}, 1),
             server({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 2s restarting failed"}}, failed, 2)]
    status, api, events = {}, None, []
    for i, pod in enumerate(cycle):
        api = FakeApi()
        reconcile(api, observation(pods=[pod, running_pods()[1]], status=status, rv=str(i)))
        status = getattr(api, "last_status", status)
        events += [c for c in api.calls if c[0] == "event"]
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["reason"] == "ServersFailing"
    assert degraded["message"] == "f-context-0: CrashLoopBackOff: container server exited with code 3: model 'tinny' " \
                                  "not found"
    assert ("event", "Normal", "Recovered") not in events and events.count(("event", "Warning", "ServersFailing")) == 1
    # a run that got past its startup probe is no longer failing, whatever ended the one before
    assert server({"running": {}}, failed, 1, started=True).problem is None


def test_scaling_up_keeps_a_serving_fleet_ready():
    pods = running_pods()
    manifest = fleet_manifest("f", router={"enabled": False})
    manifest["spec"]["context"]["servers"] = 2
    api = FakeApi()
    reconcile(api, observation(manifest, pods=pods))
    ready = {c["type"]: c for c in api.last_status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "MinimumServersReady")
    assert ready["message"] == "context 1/2, generation 1/1 ready"
    pods[1] = dataclasses.replace(pods[1], ready=False)  # the only generation server is down: not serving
    reconcile(api := FakeApi(), observation(pods=pods))
    ready = {c["type"]: c for c in api.last_status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "ServersNotReady") and "no Ready generation" in ready["message"]

    # every server Ready, the router not: the fleet does not serve either
    reconcile(api := FakeApi(), observation(fleet_manifest("f"), pods=running_pods()))
    ready = {c["type"]: c for c in api.last_status["conditions"]}["Ready"]
    assert (ready["status"], ready["reason"]) == ("False", "RouterNotReady") and "no Ready router" in ready["message"]


def test_router_objects_are_applied_in_dependency_order():
    api = FakeApi()
    reconcile(api, observation(fleet_manifest("f")))
    applied = [c[1] for c in api.calls if c[0] == "apply"]
    assert applied == ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service",
                       "PodDisruptionBudget", "PodDisruptionBudget", "PodDisruptionBudget"]
    assert [c[0] for c in api.calls].index("create_secret") < [c[0] for c in api.calls].index("apply")


def test_conditions_keep_their_transition_time_while_their_status_holds():
    pods = running_pods()
    api = FakeApi()
    reconcile(api, observation(pods=pods))
    first = api.last_status
    changed = [dataclasses.replace(pods[0], ready=False), pods[1]]
    api2 = FakeApi()
    reconcile(api2, observation(pods=changed, status=first, rv="2"))
    before = {c["type"]: c for c in first["conditions"]}
    after = {c["type"]: c for c in api2.last_status["conditions"]}
    assert after["Degraded"]["lastTransitionTime"] == before["Degraded"]["lastTransitionTime"]
    assert after["Ready"]["status"] == "False"
    assert ("event", "Warning", "FleetNotReady") in api2.calls


def test_stall_conditions_and_remediation_history_are_carried_over_untouched():
    pods = running_pods()
    api = FakeApi()
    reconcile(api, observation(pods=pods))
    status = dict(api.last_status)
    stalled = {"type": "Stalled", "status": "True", "reason": "RankVetoed", "message": "x",
               "lastTransitionTime": "2026-01-01T00:00:00Z"}
    status["conditions"] = status["conditions"] + [stalled]
    status["recentRemediations"] = [{"time": "2026-01-01T00:00:00Z"}]
    api2 = FakeApi()
    reconcile(api2, observation(pods=pods, status=status, rv="3"))
    assert api2.calls == []


def test_a_status_the_api_server_refuses_is_reported_as_an_event_once_and_retried_with_back_off():
    api, memory = FakeApi(fail={"patch_status"}), FleetMemory()
    pods = running_pods()
    result = reconcile(api, observation(pods=pods), memory)
    assert result.failed and result.requeue_after == 2.0
    refused = [c for c in api.calls if c[:3] == ("event", "Warning", "StatusUpdateFailed")]
    assert len(refused) == 1
    again = FakeApi(fail={"patch_status"})
    assert reconcile(again, observation(pods=pods, rv="2"), memory).requeue_after == 4.0
    assert not [c for c in again.calls if c[0] == "event"]  # the same refusal is not reported twice
    healed = FakeApi()
    result = reconcile(healed, observation(pods=pods, rv="3"), memory)
    assert not result.failed and ("patch_status",) in healed.calls and memory.status_refused is None


class Part:
    """A StatusPart that owns one condition, like the stall controller."""

    def __init__(self):
        self.stored_statuses = []

    def overlay(self, key, obs, status):
        mine = {"type": "Stalled", "status": "False", "reason": "NoStallDetected", "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}
        return {**status, "conditions": [c for c in status["conditions"] if c["type"] != "Stalled"] + [mine]}

    def stored(self, key, status):
        self.stored_statuses.append(status)


def test_a_status_part_is_laid_over_the_pass_and_hears_what_the_api_server_holds():
    part, memory = Part(), FleetMemory()
    r = Reconciler(FakeApi(), OperatorMetrics(), clock=lambda: 0.0, status_part=part)
    pods = running_pods()
    asyncio.run(r.reconcile(observation(pods=pods), memory, log))
    written = r.api.last_status
    assert [c["type"] for c in written["conditions"]][-1] == "Stalled" and part.stored_statuses == [written]
    # nothing changed: no write, and the part hears that the stored status already says it
    r.api = FakeApi()
    asyncio.run(r.reconcile(observation(pods=pods, status=written, rv="2"), memory, log))
    assert r.api.calls == [] and len(part.stored_statuses) == 2
    # refused: the part is not told that its records are stored
    r.api = FakeApi(fail={"patch_status"})
    asyncio.run(r.reconcile(observation(pods=pods[:1], status=written, rv="3"), memory, log))
    assert len(part.stored_statuses) == 2


# ---- each role's scale target, and scale-down's drain -----------------------------------------------

def pods_of(role, n, ready=True, **extra):
    template = running_pods()[0 if role == "context" else 1]
    return [dataclasses.replace(template, name=f"f-{role}-{i}", uid=f"u-{role}-{i}", index=i, ready=ready, **extra)
            for i in range(n)]


def test_the_first_pass_creates_a_scale_target_per_role():
    api = FakeApi()
    reconcile(api, observation(roles=()))
    assert sorted(c[1] for c in api.calls if c[0] == "create_role_object") == ["f-context", "f-generation"]
    assert ("event", "Normal", "CreatedScaleTarget") in api.calls


def test_a_role_scaled_through_its_scale_target_gets_its_servers_and_a_recorded_reason():
    api = FakeApi()
    scaled = role_object("context", replicas=3, manager="kubectl")
    reconcile(api, observation(pods=running_pods(), roles=(scaled, role_object("generation"))))
    assert sorted(c[1] for c in api.calls if c[0] == "create_pod") == ["f-context-1", "f-context-2"]
    last = api.role_statuses["f-context"]["lastScale"]
    assert (last["previous"], last["desired"], last["reason"], last["source"]) == (1, 3, "ScaledExternally", "kubectl")
    assert ("event", "Normal", "ScaledUp") in api.calls
    status = api.last_status
    assert status["context"]["desired"] == 3 and status["context"]["servers"] == "1/3"
    assert status["lastScale"] == last and status["context"]["lastScale"] == last


class Drains:
    def __init__(self, done=()):
        self.done = frozenset(done)
        self.asked = []

    def finished(self, key, leaving, role, dialect):
        self.asked.append((role, [p.name for p in leaving]))
        self.dialect = dialect
        return self.done & {p.uid for p in leaving}


def test_a_scale_down_drains_the_server_and_deletes_it_once_drained():
    pods = pods_of("context", 2) + pods_of("generation", 1)
    down = (role_object("context", replicas=1, status={"desiredReplicas": 2}), role_object("generation"))
    api = FakeApi()
    Reconciler(api, OperatorMetrics(), clock=lambda: 0.0, drains=Drains())
    asyncio.run(Reconciler(api, OperatorMetrics(), clock=lambda: 0.0, drains=Drains()).reconcile(
        observation(pods=pods, roles=down), FleetMemory(), log))
    assert ("set_leaving", "f-context-1", True) in api.calls and not [c for c in api.calls if c[0] == "delete_pod"]
    assert ("event", "Normal", "DrainingServer") in api.calls and ("event", "Normal", "ScaledDown") in api.calls

    leaving = [pods[0], dataclasses.replace(pods[1], leaving_since=1e12, draining=True), pods[2]]
    for drains, deleted in ((Drains(), []), (Drains(done={"u-context-1"}), ["f-context-1"])):
        api = FakeApi()
        asyncio.run(Reconciler(api, OperatorMetrics(), clock=lambda: 0.0, drains=drains).reconcile(
            observation(pods=leaving, roles=down), FleetMemory(), log))
        assert [c[1] for c in api.calls if c[0] == "delete_pod"] == deleted
        assert ("context", ["f-context-1"]) in drains.asked


def test_a_vllm_servers_drain_is_read_in_vllms_dialect_and_ends_when_it_is_idle():
    from test_engines import vllm_spec
    from adpfleet.operator.decisions.desired import desired_fleet
    from adpfleet.operator.resource.models import FleetSpec
    from adpfleet.operator.resource.names import FleetRef
    spec = {**vllm_spec(), "router": {"enabled": False}}
    spec["aggregated"]["disruptionBudget"] = {"enabled": False}
    desired = desired_fleet(FleetRef("f", "ns", "fleet-uid"), FleetSpec.model_validate(spec))
    template = dataclasses.replace(running_pods()[0], role="aggregated",
                                   template_hash=desired.servers["aggregated"].template_hash)
    pods = [dataclasses.replace(template, name="f-aggregated-0", uid="u-0"),
            dataclasses.replace(template, name="f-aggregated-1", uid="u-1", index=1, leaving_since=1e12,
                                draining=True)]
    down = (role_object("aggregated", replicas=1, spec_servers=2, status={"desiredReplicas": 2}),)
    drains, api = Drains(done={"u-1"}), FakeApi()
    asyncio.run(Reconciler(api, OperatorMetrics(), clock=lambda: 0.0, drains=drains).reconcile(
        observation({"spec": spec}, pods=pods, roles=down), FleetMemory(), log))
    assert ("aggregated", ["f-aggregated-1"]) in drains.asked and drains.dialect.engine == "vllm"
    assert ("delete_pod", "f-aggregated-1") in [c[:2] for c in api.calls]


def test_a_scale_down_leaves_a_server_under_remediation_alone():
    pods = pods_of("context", 2) + pods_of("generation", 1)
    record = {"time": "2099-01-01T00:00:00Z", "role": "context", "server": "f-context-1", "signature": "hung",
              "action": "RestartServer", "outcome": "Pending", "targets": ["f-context-1"]}
    down = (role_object("context", replicas=1, status={"desiredReplicas": 2}), role_object("generation"))
    api = FakeApi()
    asyncio.run(Reconciler(api, OperatorMetrics(), clock=lambda: 0.0, wall_clock=lambda: 4070908810.0,
                           drains=Drains()).reconcile(
        observation(pods=pods, roles=down, status={"recentRemediations": [record]}), FleetMemory(), log))
    assert [c[1] for c in api.calls if c[0] == "set_leaving"] == ["f-context-0"]


def test_a_pass_waiting_for_a_drain_looks_again_when_it_times_out():
    pods = pods_of("context", 1) + [dataclasses.replace(pods_of("context", 2)[1], leaving_since=1000.0,
                                                         draining=True)] + pods_of("generation", 1)
    result = asyncio.run(Reconciler(FakeApi(), OperatorMetrics(), clock=lambda: 0.0, wall_clock=lambda: 1020.0,
                                    drains=Drains()).reconcile(observation(pods=pods), FleetMemory(), log))
    assert result.requeue_after == 60.0 - 20.0  # drainTimeoutSeconds (60) from when it began
