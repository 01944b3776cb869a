"""Real servers: the operator runs `adpfleet serve` pods (tiny model, ranks as processes) and the
router, and an `openai` client gets completions through the router. Slow on a small machine (each
server imports torch and starts its ranks), so the fleets are as small as the point allows."""

import time

import openai
import pytest

from adpfleet.cluster.apiproxy import CountingProxy
from adpfleet.cluster.testing import wait_for

from operator_harness import PodTimeline, pod_ready
from specs import fleet_manifest

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

SERVER_START = 300  # seconds: torch import + rank processes, on two cores shared with everything else


def real_role(servers: int, ranks: int, kv_blocks: int = 64) -> dict:
    return {"servers": servers, "adpRanks": ranks, "engine": {"kvBlocks": kv_blocks},
            "probes": {"readinessPeriodSeconds": 1}}


def router_client(fleets, fleet: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleets.router_url(fleet) + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(fleets, fleet: str) -> openai.types.Completion:
    return router_client(fleets, fleet).completions.create(model="tiny", prompt="The operator says", max_tokens=8,
                                                              extra_body={"ignore_eos": True})


def test_a_fleet_of_real_servers_serves_openai_through_its_router_rolls_and_goes_away(start_operator, fleets):
    start_operator()
    fleets.apply(fleet_manifest("e2e", context=real_role(1, 2), generation=real_role(1, 2)))
    fleets.wait_ready("e2e", timeout=SERVER_START)

    answer = complete(fleets, "e2e")
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 8
    assert answer.model == "tiny"

    # A server setting changes: the context role rolls with real readiness (a new server must load
    # and start its ranks before the old one goes), and never has zero ready servers meanwhile.
    old = {p.metadata.uid for p in fleets.pods("e2e", "context")}
    generation_servers = {p.metadata.uid for p in fleets.pods("e2e", "generation")}
    with PodTimeline(fleets.cluster, fleets.ns, "e2e") as timeline:
        fleets.patch_spec("e2e", {"context": {"engine": {"kvBlocks": 48}}})
        wait_for(lambda: [p.metadata.uid not in old and pod_ready(p) for p in fleets.pods("e2e", "context")] == [True],
                 timeout=SERVER_START, what="the context server to be replaced by a ready new one", interval=1)
        fleets.wait_ready("e2e", timeout=60)
    samples = timeline.samples["context"]
    assert min(s.ready for s in samples) == 1 and max(s.live for s in samples) == 2
    assert any(s.live == 2 and s.ready == 1 for s in samples)  # the new server started beside the old one
    assert {p.metadata.uid for p in fleets.pods("e2e", "generation")} == generation_servers  # other role untouched

    wait_for(lambda: complete(fleets, "e2e").usage.completion_tokens == 8, timeout=60,
             what="a completion through the rolled fleet")

    fleets.delete("e2e")
    wait_for(lambda: fleets.owned_objects("e2e") == [], timeout=120, what="everything of the fleet to be deleted")


def test_an_operator_restarted_mid_roll_finishes_it_without_repeating_or_losing_a_step(
        start_operator, fleets, api_proxy):
    op = start_operator()
    fleets.apply(fleet_manifest("midroll", router={"enabled": False}, context=real_role(2, 1),
                                generation=real_role(1, 1)))
    fleets.wait_ready("midroll", timeout=SERVER_START)
    old = {p.metadata.uid for p in fleets.pods("midroll", "context")}
    start = time.monotonic()

    with PodTimeline(fleets.cluster, fleets.ns, "midroll") as timeline:
        fleets.patch_spec("midroll", {"context": {"engine": {"kvBlocks": 48}}})

        def surge_starting():
            return any(p.metadata.uid not in old and not pod_ready(p) for p in fleets.live_pods("midroll", "context"))
        wait_for(surge_starting, timeout=60, what="the first new server to be created", interval=0.2)
        assert op.stop() == 0  # mid-roll: one new server starting, both old ones still there
        first_run = CountingProxy.writes(api_proxy.since(start))

        op2 = start_operator()
        wait_for(lambda: all(p.metadata.uid not in old and pod_ready(p) for p in fleets.live_pods("midroll", "context"))
                 and len(fleets.pods("midroll", "context")) == 2, timeout=2 * SERVER_START,
                 what="the roll to finish", interval=1)
        fleets.wait_ready("midroll", timeout=60)

    pod_writes = [r for r in CountingProxy.writes(api_proxy.since(start)) if r.resource == "pods"]
    creates = [r for r in pod_writes if r.verb == "create"]
    deletes = [r for r in pod_writes if r.verb == "delete"]
    assert len(creates) == 2 and len(deletes) == 2, [(r.verb, r.path, r.status) for r in pod_writes]
    assert all(r.status in (200, 201, 202) for r in pod_writes), "a repeated create (409) or delete (404)"
    first_pod_writes = [r for r in first_run if r.resource == "pods"]
    assert first_pod_writes and first_pod_writes[0].verb == "create"  # the first operator started the roll
    assert op2.metric("adpfleet_operator_api_requests_total", verb="delete", resource="pods") >= 1  # the second went on
    samples = timeline.samples["context"]
    assert min(s.ready for s in samples) >= 1 and max(s.live for s in samples) <= 3
    new_context = [name for name, uid in timeline.created if uid not in old and "context" in name]
    assert len(new_context) == 2
