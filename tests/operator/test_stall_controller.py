"""The stall controller's loop without a cluster: scripted scrapes, a fake API, and a fake reconcile
pass that writes the controller's part of the status the way the reconciler does with its
StatusPart (overlay, then stored)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from prometheus_client import CollectorRegistry

from adpfleet.operator import remediator
from adpfleet.operator.adapters.kube import ApiResult
from adpfleet.operator.adapters.scrape import RankSample, Scrape
from adpfleet.operator.decisions.history import Remediation
from adpfleet.operator.decisions.observed import FleetObservation, ServerPod
from adpfleet.operator.inbox import AlertInbox, StallAlert
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.resource.vocabulary import Action, Outcome, Signature
from adpfleet.operator.stall import FleetStall, StallController
from adpfleet.operator.stall_events import FleetEvents
from adpfleet.operator.stall_leftover import LeftOver
from adpfleet.operator.telemetry import StallMetrics

KEY = ("prod", "llama")
T0 = 1_700_000_000.0


class FakeApi:
    def __init__(self):
        self.calls: list[tuple] = []

    async def set_drain(self, namespace, name, uid, drain):
        self.calls.append(("drain" if drain else "undrain", name, uid))
        return ApiResult(True)

    async def delete_pod(self, namespace, name, uid, grace_seconds=None):
        self.calls.append(("delete", name, uid))
        return ApiResult(True)

    async def record_event(self, fleet, type_, reason, message):
        self.calls.append(("event", reason, message))
        return ApiResult(True)

    def events(self, reason=None):
        return [c for c in self.calls if c[0] == "event" and (reason is None or c[1] == reason)]

    def deletes(self):
        return [c for c in self.calls if c[0] == "delete"]


class World:
    """A fleet of two servers whose /metrics the test scripts, and its stored status."""

    def __init__(self, mode="Auto", status=None, created=T0 - 3600):
        self.now = T0
        self.api = FakeApi()
        self.status = status or {}
        self.spec = {"image": "x", "model": {"name": "tiny"}, "monitoring": {"scrapeIntervalSeconds": 1},
                     "remediation": {"mode": mode, "stallWindowSeconds": 4, "cooldownSeconds": 30,
                                     "drainTimeoutSeconds": 1}}
        self.pods = {"llama-context-0": self._pod("llama-context-0", "context", "127.0.9.1", created),
                     "llama-generation-0": self._pod("llama-generation-0", "generation", "127.0.9.2", created)}
        self.metrics = {"127.0.9.1": self.busy(), "127.0.9.2": self.busy()}
        self.inbox = AlertInbox()
        self.written: list[dict] = []
        self.controller = StallController(self.api, StallMetrics(CollectorRegistry()), self.inbox, self.reconcile,
                                          clock=lambda: self.now, scraper=self.scrape)
        self.fleet = self.controller.fleets[KEY] = FleetStall(FleetRef("llama", "prod", "fleet-uid"), self.observe,
                                                              logging.getLogger("test"), started=T0)

    @staticmethod
    def _pod(name, role, ip, created):
        return ServerPod(name=name, uid=f"{name}-uid", role=role, index=0, template_hash="h", owner_uid="fleet-uid",
                         phase="Running", ready=True, terminating=False, unschedulable=False, problem=None, ip=ip,
                         created=created)

    def busy(self):
        state = {"tokens": 0}

        def sample():
            state["tokens"] += 10
            return {0: RankSample(iterations=state["tokens"] * 5, forward_steps=state["tokens"],
                                  generation_tokens=state["tokens"], requests_running=2)}
        return sample

    def stalled(self):
        state = {"it": 0}

        def sample():
            state["it"] += 50
            return {0: RankSample(iterations=state["it"], forward_vetoed=state["it"], prompt_tokens=500,
                                  requests_waiting=3),
                    1: RankSample(iterations=state["it"], forward_vetoed=state["it"], empty_batch_iterations=state["it"],
                                  prompt_tokens=400, requests_waiting=1)}
        return sample

    async def scrape(self, url, timeout, dialect):
        self.now += 0.01  # a scrape takes time
        ip = url.split("//")[1].split(":")[0]
        source = self.metrics[ip]
        if isinstance(source, str):
            return Scrape(at=self.now, error=source)
        return Scrape(at=self.now, ranks=source())

    def observe(self):
        return FleetObservation(name="llama", namespace="prod", uid="fleet-uid", generation=1, resource_version="1",
                                spec=self.spec, status=self.status, pods=tuple(self.pods.values()), objects=())

    def reconcile(self, key):  # what the reconcile pass does with its StatusPart
        base = {"observedGeneration": 1, "conditions": [c for c in self.status.get("conditions", [])
                                                        if c["type"] not in ("Stalled", "Remediating")]}
        self.status = self.controller.overlay(key, self.observe(), base)
        self.written.append(self.status)
        self.controller.stored(key, self.status)

    async def ticks(self, n):
        for _ in range(n):
            await self.controller.tick(KEY, self.fleet)
            await asyncio.gather(*list(self.fleet.tasks))
            self.now += 1.0

    def condition(self, type_):
        return next(c for c in self.status["conditions"] if c["type"] == type_)

    def records(self):
        return self.status.get("recentRemediations", [])


@pytest.fixture(autouse=True)
def quick_drain(monkeypatch):
    monkeypatch.setattr(remediator, "STALLED_DRAIN_GRACE_SECONDS", 0.05)


def run(coro):
    return asyncio.run(coro)


def test_a_busy_fleet_gets_no_action_and_a_false_stalled_condition():
    w = World()
    run(w.ticks(10))
    assert w.api.calls == []
    assert w.condition("Stalled")["status"] == "False" and w.condition("Remediating")["status"] == "False"


def test_a_stalled_server_is_recorded_drained_deleted_and_reported():
    w = World()
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(8))
    kinds = [c[:2] for c in w.api.calls if c[0] != "event"]
    assert kinds == [("drain", "llama-context-0"), ("delete", "llama-context-0")]
    assert {c[1] for c in w.api.events()} >= {"StallDetected", "RestartingServer", "Remediated"}
    (record,) = w.records()
    assert (record["action"], record["outcome"], record["signature"], record["targets"]) == (
        "RestartServer", "Succeeded", "vetoed", ["llama-context-0"])
    stalled = [c for st in w.written for c in st["conditions"] if c["type"] == "Stalled" and c["status"] == "True"]
    assert stalled and "ranks 1" in stalled[0]["message"] and "vetoed" in stalled[0]["message"]
    assert w.condition("Remediating")["status"] == "True"  # until the replacement is Ready


def test_dry_run_records_and_deletes_nothing():
    w = World(mode="DryRun")
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(12))
    assert w.api.deletes() == [] and not [c for c in w.api.calls if c[0] == "drain"]
    assert [r["outcome"] for r in w.records()] == ["DryRun"]  # once per cooldown, not every scrape
    assert len(w.api.events("RemediationDryRun")) == 1


def test_dry_run_then_auto_remediates_at_once_and_no_skip_follows_each_dry_run():
    w = World(mode="DryRun")
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(12))
    assert len(w.api.events("RemediationDryRun")) == 1 and w.api.events("RemediationSkipped") == []
    w.spec["remediation"]["mode"] = "Auto"  # the person read the dry run and turns remediation on
    run(w.ticks(1))
    assert [c[:2] for c in w.api.calls if c[0] in ("drain", "delete")] == [("drain", "llama-context-0"),
                                                                          ("delete", "llama-context-0")]
    assert [r["outcome"] for r in w.records()] == ["Succeeded", "DryRun"] and w.api.events("RemediationSkipped") == []


def test_stalled_changes_only_when_the_servers_state_does_and_says_why_it_ended():
    w = World(mode="DryRun")
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(8))
    assert w.condition("Stalled")["status"] == "True"
    transitions = {w.condition("Stalled")["lastTransitionTime"]}
    stalled = w.metrics["127.0.9.1"]
    for source in ("GET http://127.0.9.1:8000/metrics: timed out after 1 s", stalled):  # a missed scrape
        w.metrics["127.0.9.1"] = source
        run(w.ticks(1))
        assert w.condition("Stalled")["status"] == "True", w.condition("Stalled")
    run(w.ticks(3))  # unconfirmed again for a tick, then confirmed: the same stall all along
    statuses = [c["status"] for st in w.written for c in st["conditions"] if c["type"] == "Stalled"]
    assert statuses[statuses.index("True"):] == ["True"] * (len(statuses) - statuses.index("True")), statuses
    assert {w.condition("Stalled")["lastTransitionTime"]} == transitions
    assert len(w.api.events("StallDetected")) == 1
    def resumed(last=stalled()):  # the same counters, now with tokens
        resumed.tokens = getattr(resumed, "tokens", 0) + 10
        return {r: dataclasses.replace(sample, iterations=sample.iterations + resumed.tokens,
                                       prompt_tokens=sample.prompt_tokens + resumed.tokens)
                for r, sample in last.items()}
    w.metrics["127.0.9.1"] = resumed
    run(w.ticks(2))
    assert (w.condition("Stalled")["status"], w.condition("Stalled")["message"]) == (
        "False", "the stall ended: llama-context-0 made progress")
    writes = len(w.written)
    run(w.ticks(3))
    assert len(w.written) == writes  # the message is kept: nothing to write


def test_a_stored_stall_stands_until_a_restarted_operator_has_judged_a_window():
    stored = {"conditions": [{"type": "Stalled", "status": "True", "reason": "NoProgress", "message": "llama-context-0 "
                              "(context) has work but produces no tokens (hung) [hung]",
                              "lastTransitionTime": "2023-11-14T22:00:00.000000Z", "observedGeneration": 1}]}
    w = World(mode="DryRun", status=stored)
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(3))  # not a window yet: the stored condition stands, unchanged
    assert w.condition("Stalled") == {**stored["conditions"][0]}
    run(w.ticks(6))
    assert w.condition("Stalled")["status"] == "True"
    assert w.condition("Stalled")["lastTransitionTime"] == "2023-11-14T22:00:00.000000Z"


def test_a_repeat_stall_of_the_replacement_climbs_the_ladder_under_the_same_name():
    w = World()
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(8))
    assert [c[1] for c in w.api.deletes()] == ["llama-context-0"]
    # the reconcile recreates the server under its name (a new pod), which stalls again after the cooldown
    w.now += 30
    w.pods["llama-context-0"] = dataclasses.replace(w.pods["llama-context-0"], uid="new-uid", created=w.now)
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(8))
    first, second = w.records()[-1], w.records()[0]
    assert (first["action"], second["action"]) == ("RestartServer", "RestartPeers"), w.records()
    assert second["server"] == "llama-context-0" and second["targets"] == ["llama-generation-0"]
    assert "remediation 2 of llama-context-0" in second["message"]


def test_unreachable_servers_are_never_restarted():
    w = World()
    w.metrics["127.0.9.1"] = "GET http://127.0.9.1:8000/metrics: timed out after 1 s"
    w.metrics["127.0.9.2"] = "GET http://127.0.9.2:8000/metrics: not Prometheus text: garbage"
    run(w.ticks(20))
    assert w.api.deletes() == [] and w.records() == []
    assert len(w.api.events("ServerUnreachable")) == 2  # once each, after a window


def test_a_restarted_operator_finishes_a_pending_action_once():
    pending = Remediation(time=T0 - 2, role="context", server="llama-context-0", signature=Signature.VETOED,
                          action=Action.RESTART_SERVER, outcome=Outcome.PENDING, message="m",
                          targets=("llama-context-0",))
    w = World(status={"recentRemediations": [pending.to_status()]})
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(3))
    assert [c[1] for c in w.api.deletes()] == ["llama-context-0"]
    assert w.records()[0]["outcome"] == "Succeeded"


def test_a_restarted_operator_never_deletes_the_replacement():
    pending = Remediation(time=T0 - 20, role="context", server="llama-context-0", signature=Signature.VETOED,
                          action=Action.RESTART_SERVER, outcome=Outcome.PENDING, message="m",
                          targets=("llama-context-0",))
    w = World(status={"recentRemediations": [pending.to_status()]}, created=T0 - 5)  # the pod is already new
    run(w.ticks(8))
    assert w.api.deletes() == []
    assert w.records()[0]["outcome"] == "Resolved"  # finished, and the new server makes progress


def test_an_alert_is_rechecked_then_goes_through_the_same_policy():
    w = World()
    w.controller.detection = False
    w.metrics["127.0.9.1"] = w.stalled()
    alert = StallAlert("AdpfleetServerStalled", "prod", "llama", "llama-context-0", "fp", "2024-01-01T00:00:00Z",
                       T0)
    w.inbox.put(alert)
    run(w.ticks(1))
    assert [c[1] for c in w.api.deletes()] == ["llama-context-0"]
    assert "from alert AdpfleetServerStalled" in w.records()[0]["message"]
    # the same stall alerted again within the cooldown: skipped, not repeated
    w.inbox.put(StallAlert("AdpfleetServerStalled", "prod", "llama", "llama-context-0", "fp2", "t2", T0))
    run(w.ticks(1))
    assert len(w.api.deletes()) == 1


def test_an_alert_the_fresh_scrapes_do_not_confirm_is_not_acted_on():
    w = World()
    w.controller.detection = False
    w.inbox.put(StallAlert("AdpfleetServerStalled", "prod", "llama", "llama-context-0", "fp", "t", T0))
    run(w.ticks(1))
    assert w.api.deletes() == [] and w.api.events("AlertNotConfirmed")


def test_a_restarted_operator_abandons_a_pending_action_too_old_to_finish():
    stale = Remediation(time=T0 - 10_000, role="context", server="llama-context-0", signature=Signature.VETOED,
                        action=Action.RESTART_SERVER, outcome=Outcome.PENDING, message="m",
                        targets=("llama-context-0",))
    w = World(status={"recentRemediations": [stale.to_status()]})
    run(w.ticks(2))
    assert w.api.deletes() == [] and not [c for c in w.api.calls if c[0] == "drain"]
    (record,) = w.records()
    assert record["outcome"] == "Failed" and "too old to finish" in record["message"]


def test_a_server_left_drained_by_a_recovered_action_is_undrained():
    recovered = Remediation(time=T0 - 30, role="context", server="llama-context-0", signature=Signature.VETOED,
                            action=Action.RESTART_SERVER, outcome=Outcome.RECOVERED, message="m",
                            targets=("llama-context-0",))
    w = World(status={"recentRemediations": [recovered.to_status()]})
    w.pods["llama-context-0"] = dataclasses.replace(w.pods["llama-context-0"], draining=True)
    run(w.ticks(1))
    assert ("undrain", "llama-context-0", "llama-context-0-uid") in w.api.calls and w.api.deletes() == []


def group_world(**kw) -> World:
    """The World with its generation server over two pods: leader llama-generation-0-0 (rank 0,
    127.0.9.2) and worker llama-generation-0-1 (rank 1, 127.0.9.3)."""
    w = World(**kw)
    leader = dataclasses.replace(w.pods.pop("llama-generation-0"), name="llama-generation-0-0", node_rank=0,
                                 pods_per_server=2)
    worker = dataclasses.replace(leader, name="llama-generation-0-1", uid="worker-uid", ip="127.0.9.3", node_rank=1)
    w.pods.update({leader.name: leader, worker.name: worker})
    return w


def frozen(rank, iterations=100):  # a rank whose loop no longer advances, with requests on it
    return lambda: {rank: RankSample(iterations=iterations, forward_steps=50, generation_tokens=50,
                                     requests_running=2)}


def stalled_condition(w) -> str:
    return next(c for st in w.written for c in st["conditions"]
                if c["type"] == "Stalled" and c["status"] == "True")["message"]


def test_a_frozen_rank_on_a_worker_pod_makes_its_whole_group_hung_and_the_leader_is_restarted():
    w = group_world()
    # the worker's rank froze; the leader's waits for it in the next collective
    w.metrics["127.0.9.2"], w.metrics["127.0.9.3"] = frozen(0), frozen(1)
    run(w.ticks(8))
    assert [c[:2] for c in w.api.calls if c[0] != "event"] == [("drain", "llama-generation-0-0"),
                                                              ("delete", "llama-generation-0-0")]
    (record,) = w.records()
    assert record["signature"] == "hung" and record["targets"] == ["llama-generation-0-0"]
    # the group is judged on both pods' scrapes: ranks 0 and 1 are in the verdict, each with its pod
    assert "llama-generation-0-0 (generation) has work but produces no tokens (hung, ranks 0 on pod " \
           "llama-generation-0-0 and 1 on pod llama-generation-0-1)" in stalled_condition(w)
    (detected,) = w.api.events("StallDetected")  # one server, not two


def test_status_events_and_the_record_name_the_worker_pod_that_holds_the_frozen_rank():
    w = group_world()
    # the worker's rank stopped a pass before the leader's (which then waited for it)
    w.metrics["127.0.9.2"], w.metrics["127.0.9.3"] = frozen(0, 101), frozen(1, 100)
    run(w.ticks(8))
    named = "ranks 1 on pod llama-generation-0-1"
    assert f"(hung, {named})" in stalled_condition(w)
    (detected,) = w.api.events("StallDetected")
    assert f"[hung, {named}]" in detected[2]
    (restarting,) = w.api.events("RestartingServer")
    assert named in restarting[2]
    (record,) = w.records()
    assert named in record["message"] and record["targets"] == ["llama-generation-0-0"]


def test_an_alert_naming_a_worker_pod_rechecks_and_restarts_its_whole_server():
    # Prometheus scrapes every pod: the alert carries the worker's pod label
    w = group_world()
    w.controller.detection = False
    w.metrics["127.0.9.2"], w.metrics["127.0.9.3"] = frozen(0, 101), frozen(1, 100)
    w.inbox.put(StallAlert("AdpfleetServerStalled", "prod", "llama", "llama-generation-0-1", "fp",
                           "2024-01-01T00:00:00Z", T0))
    run(w.ticks(1))
    assert w.api.events("AlertIgnored") == []
    assert [c[1] for c in w.api.deletes()] == ["llama-generation-0-0"]  # the leader: the group goes whole
    (record,) = w.records()
    assert record["server"] == "llama-generation-0-0" and record["signature"] == "hung"
    assert "from alert AdpfleetServerStalled (fingerprint fp, since 2024-01-01T00:00:00Z) on pod " \
           "llama-generation-0-1" in record["message"]
    assert "ranks 1 on pod llama-generation-0-1" in record["message"]


def test_an_alert_naming_a_pod_of_no_server_of_the_fleet_is_ignored():
    w = group_world()
    w.controller.detection = False
    w.inbox.put(StallAlert("AdpfleetServerStalled", "prod", "llama", "llama-generation-0-2", "fp", "t", T0))
    run(w.ticks(1))
    assert w.api.deletes() == [] and w.api.events("AlertIgnored")


def test_a_group_whose_progress_resumes_while_its_leader_drains_is_recovered_not_restarted():
    w = group_world()
    w.metrics["127.0.9.2"], w.metrics["127.0.9.3"] = frozen(0), frozen(1)
    drain = w.api.set_drain

    def progressing(rank):
        state = {"tokens": 50}

        def sample():
            state["tokens"] += 10
            return {rank: RankSample(iterations=state["tokens"] * 2, forward_steps=state["tokens"],
                                     generation_tokens=state["tokens"], requests_running=2)}
        return sample

    async def drain_then_resume(namespace, name, uid, on):  # the stall ends as the leader is drained
        if on:
            w.metrics["127.0.9.2"], w.metrics["127.0.9.3"] = progressing(0), progressing(1)
        return await drain(namespace, name, uid, on)
    w.api.set_drain = drain_then_resume
    run(w.ticks(8))
    # watched on both pods' ranks, as it was judged: the progress is seen, nothing is deleted
    assert w.api.deletes() == []
    assert [c[:2] for c in w.api.calls if c[0] in ("drain", "undrain")] == [("drain", "llama-generation-0-0"),
                                                                           ("undrain", "llama-generation-0-0")]
    assert [r["outcome"] for r in w.records()] == ["Recovered"]


# ---- the loop's rooms -------------------------------------------------------------------------

def test_an_event_repeats_at_most_once_a_minute_unless_forced():
    api = FakeApi()
    events = FleetEvents(FleetRef("llama", "prod", "fleet-uid"), logging.getLogger("test"))
    for force in (False, False, True, False):
        run(events.say(api, "Warning", "RemediationSkipped", "m", "llama-context-0", force=force))
    run(events.say(api, "Warning", "RemediationSkipped", "m", "llama-generation-0"))  # another server
    assert len(api.events("RemediationSkipped")) == 3


def test_a_pending_action_is_resumed_once_even_while_it_is_still_underway():
    pending = Remediation(time=T0 - 2, role="context", server="llama-context-0", signature=Signature.VETOED,
                          action=Action.RESTART_SERVER, outcome=Outcome.PENDING, message="m",
                          targets=("llama-context-0",))
    w = World(status={"recentRemediations": [pending.to_status()]})
    look = w.fleet.spec.look(w.observe())
    resumed = []

    class Remediator:  # the action never finishes: the record stays Pending
        api = w.api

        async def execute(self, key, fleet, record, spec, batch, *, persisted, stalled_sample):
            resumed.append((record.server, persisted))

    async def three_ticks():
        leftover, started = LeftOver(), []
        for _ in range(3):
            await leftover.finish(KEY, w.fleet, look, w.now, Remediator(), started.append)
        await asyncio.gather(*started)
    run(three_ticks())
    assert resumed == [("llama-context-0", True)]


def test_a_fleet_disabled_then_enabled_again_is_judged_afresh():
    w = World(mode="DryRun")
    w.metrics["127.0.9.1"] = w.stalled()
    run(w.ticks(8))
    assert w.condition("Stalled")["status"] == "True"
    w.spec["remediation"]["mode"] = "Disabled"
    run(w.ticks(1))
    assert w.condition("Stalled")["status"] == "Unknown"
    w.spec["remediation"]["mode"] = "DryRun"  # the scrapes from before the pause are not compared with new ones
    run(w.ticks(1))
    assert w.condition("Stalled")["status"] == "False"
