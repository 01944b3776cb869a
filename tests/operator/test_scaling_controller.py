"""The autoscaling controller and the scale-down drain watch without a cluster: scripted scrapes,
fed through the stall controller's tick (one scrape per server for both), and a fake API."""

from __future__ import annotations

import asyncio
import json
import logging

from prometheus_client import CollectorRegistry

from adpfleet.operator.adapters.kube import ApiResult
from adpfleet.operator.adapters.scrape import RankSample, Scrape
from adpfleet.operator.decisions.observed import FleetObservation, RoleObject, ServerPod
from adpfleet.operator.drains import DrainWatch
from adpfleet.operator.inbox import AlertInbox
from adpfleet.operator.resource import names
from adpfleet.operator.resource.names import FleetRef
from adpfleet.operator.scaling import ScalingController
from adpfleet.operator.stall import FleetStall, StallController
from adpfleet.operator.telemetry import ScalingMetrics, StallMetrics

KEY = ("prod", "llama")
T0 = 1_700_000_000.0


class FakeApi:
    def __init__(self):
        self.patches: list[tuple[str, dict]] = []

    async def patch_role_object(self, namespace, name, body):
        self.patches.append((name, body))
        return ApiResult(True)

    async def record_event(self, fleet, type_, reason, message):
        return ApiResult(True)


def pod(name, role, ip, ready=True, leaving_since=None):
    return ServerPod(name=name, uid=f"{name}-uid", role=role, index=int(name[-1]), template_hash="h",
                     owner_uid="fleet-uid", phase="Running", ready=ready, terminating=False, unschedulable=False,
                     problem=None, ip=ip, created=T0 - 3600, leaving_since=leaving_since)


class World:
    def __init__(self, detection=True, generation_scaling=None):
        self.now = T0
        self.api = FakeApi()
        self.registry = CollectorRegistry()
        scaling = {"enabled": True, "minServers": 1, "maxServers": 4, "targets": {"waitingPerRank": 2},
                   "scaleUp": {"stabilizationWindowSeconds": 3, "maxServersPerStep": 2}}
        self.spec = {"image": "x", "model": {"name": "tiny"}, "monitoring": {"scrapeIntervalSeconds": 1},
                     "remediation": {"stallWindowSeconds": 4},
                     "generation": {"servers": 1, "adpRanks": 2, "autoscaling": generation_scaling or scaling}}
        self.pods = [pod("llama-context-0", "context", "127.0.9.1"), pod("llama-generation-0", "generation", "127.0.9.2")]
        self.roles = [RoleObject(name=f"llama-{r}", uid=f"r-{r}", owner_uid="fleet-uid", role=r, replicas=1,
                                 spec_servers=1, replicas_manager=names.MANAGER, decision=None, status={})
                      for r in names.ROLES]
        self.waiting = {"127.0.9.1": 0.0, "127.0.9.2": 0.0}
        self.scraped: list[str] = []
        self.woken = 0
        self.scaling = ScalingController(self.api, ScalingMetrics(self.registry), self.wake, clock=lambda: self.now)
        self.stall = StallController(self.api, StallMetrics(self.registry), AlertInbox(), self.wake,
                                     detection=detection, clock=lambda: self.now, scraper=self.scrape,
                                     listener=self.scaling)
        self.fleet = self.stall.fleets[KEY] = FleetStall(FleetRef("llama", "prod", "fleet-uid"), self.observe,
                                                         logging.getLogger("test"))
        self.tokens = 0

    def wake(self, key):
        self.woken += 1

    async def scrape(self, url, timeout, dialect):
        ip = url.split("//")[1].split(":")[0]
        self.scraped.append(ip)
        self.tokens += 10
        ranks = {r: RankSample(iterations=self.tokens, generation_tokens=self.tokens, requests_running=4,
                               requests_waiting=self.waiting[ip], kv_cache_blocks_used=10, kv_cache_capacity_blocks=64)
                 for r in (0, 1)}
        return Scrape(at=self.now, ranks=ranks)

    def observe(self):
        return FleetObservation(name="llama", namespace="prod", uid="fleet-uid", generation=1, resource_version="1",
                                spec=self.spec, status={}, pods=tuple(self.pods), objects=(),
                                role_objects=tuple(self.roles))

    async def ticks(self, n):
        for _ in range(n):
            await self.stall.tick(KEY, self.fleet)
            self.now += 1

    def metric(self, name, **labels):
        return self.registry.get_sample_value(name, labels)


def test_a_queue_held_over_the_up_window_scales_the_role_through_its_scale_target():
    w = World()
    asyncio.run(w.ticks(5))
    assert w.api.patches == []  # nothing waits
    w.waiting["127.0.9.2"] = 7.0
    asyncio.run(w.ticks(2))
    assert w.api.patches == []  # not for the whole window yet
    asyncio.run(w.ticks(3))
    (name, body), = w.api.patches
    # 4 running and 7 waiting per rank on one server: on two, 5.5 per rank, 1.5 of them waiting
    assert name == "llama-generation" and body["spec"] == {"replicas": 2}
    note = json.loads(body["metadata"]["annotations"][names.ANNOTATION_SCALE_DECISION])
    assert (note["reason"], note["source"], note["previous"]) == ("WaitingAboveTarget", "policy", 1)
    assert body["metadata"]["uid"] == "r-generation" and w.woken
    labels = {"fleet_namespace": "prod", "fleet": "llama", "role": "generation"}
    assert w.metric("adpfleet_operator_role_signal", **labels, signal="waiting_per_rank") == 7.0
    assert w.metric("adpfleet_operator_scaling_decisions_total", role="generation",
                    reason="WaitingAboveTarget") == 1
    # until the watch shows the new count, and then the new servers are Ready, nothing more is decided
    asyncio.run(w.ticks(5))
    assert len(w.api.patches) == 1


def test_the_servers_are_scraped_once_per_tick_for_detection_and_scaling_alike():
    w = World()
    asyncio.run(w.ticks(3))
    assert w.scraped.count("127.0.9.2") == 3
    # detection off: still scraped, for the policy alone
    w = World(detection=False)
    asyncio.run(w.ticks(3))
    assert w.scraped.count("127.0.9.2") == 3


def test_no_scrapes_at_all_when_neither_detection_nor_scaling_wants_them():
    w = World(detection=False, generation_scaling={"enabled": False})
    asyncio.run(w.ticks(3))
    assert w.scraped == []


def test_nothing_is_decided_while_a_server_of_the_role_is_not_ready():
    w = World()
    w.pods.append(pod("llama-generation-1", "generation", "127.0.9.3", ready=False))
    w.waiting["127.0.9.2"] = 9.0
    asyncio.run(w.ticks(10))
    assert w.api.patches == []


def test_a_server_being_scaled_down_is_neither_judged_nor_counted_in_the_load():
    w = World()
    w.pods.append(pod("llama-generation-1", "generation", "127.0.9.3", leaving_since=T0))
    w.waiting["127.0.9.3"] = 50.0
    asyncio.run(w.ticks(3))
    assert "127.0.9.3" not in w.scraped and "llama-generation-1" not in w.fleet.detection.verdicts


# ---- the drain watch ----------------------------------------------------------------------------

def test_a_leaving_server_is_finished_once_its_requests_are_done_or_nothing_listens():
    async def scenario():
        answers = {"127.0.9.5": [2, 1, 0], "127.0.9.6": ["refused"]}

        async def scraper(url, timeout, dialect):
            ip = url.split("//")[1].split(":")[0]
            left = answers[ip].pop(0) if len(answers[ip]) > 1 else answers[ip][0]
            if left == "refused":
                return Scrape(at=0, error="refused", refused=True)
            return Scrape(at=0, ranks={0: RankSample(requests_running=left)})
        woken = []
        watch = DrainWatch(scraper, woken.append)
        leaving = [pod("llama-context-5", "context", "127.0.9.5", leaving_since=T0),
                   pod("llama-context-6", "context", "127.0.9.6", leaving_since=T0)]
        assert watch.finished(KEY, leaving, "context") == frozenset()
        for _ in range(100):
            await asyncio.sleep(0.05)
            if len(woken) == 2:
                break
        assert watch.finished(KEY, leaving, "context") == {"llama-context-5-uid", "llama-context-6-uid"}
        assert woken == [KEY, KEY]
        # gone (deleted, or wanted again): forgotten
        assert watch.finished(KEY, [], "context") == frozenset() and not watch._done
        busy = DrainWatch(lambda url, t: _busy(), woken.append)
        busy.finished(KEY, leaving[:1], "context")
        await asyncio.sleep(0.1)
        busy.finished(KEY, [], "context")
        assert not busy._tasks
    asyncio.run(scenario())


async def _busy():
    return Scrape(at=0, ranks={0: RankSample(requests_running=1)})
