"""Servers over several pods on the local cluster: a generation server of 2 pods x 1 rank, whose
worker finds its leader by the headless Service's DNS name (the node agent answers it through each
pod's /etc/hosts, as CoreDNS would), serves through the router exactly as a one-pod server of 2
ranks does; losing its worker replaces the whole group; a roll never leaves the role without a
Ready server. One test, one fleet: each server start costs a torch import per process."""

import threading
import time

import pytest

from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names

from operator_harness import pod_ready
from specs import fleet_manifest
from test_end_to_end import SERVER_START, real_role, router_client

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

PROMPTS = ["The operator says", "A server over two pods", "Gang lifecycle"]


def greedy(fleets, fleet: str) -> list[list[str]]:
    client = router_client(fleets, fleet)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS]


class LeaderReadiness:
    """Samples, every 0.2 s, how many generation leaders are Ready (a leader is Ready only while its
    whole group is joined: its /health counts every rank of the server)."""

    def __init__(self, fleets, fleet: str):
        self.fleets, self.fleet, self.samples = fleets, fleet, []
        self._stop = threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _run(self):
        selector = names.discovery_selector(self.fleet) + f",{names.LABEL_ROLE}=generation"
        while not self._stop.wait(0.2):
            pods = self.fleets.core.list_namespaced_pod(self.fleets.ns, label_selector=selector).items
            self.samples.append(sum(pod_ready(p) for p in pods if p.metadata.deletion_timestamp is None))


def test_a_generation_server_over_two_pods_serves_is_replaced_whole_and_rolls(start_operator, fleets):
    start_operator()
    generation = {**real_role(1, 2), "podsPerServer": 2}
    start = time.monotonic()
    fleets.apply(fleet_manifest("mn", context=real_role(1, 1), generation=generation))
    fleets.wait_ready("mn", timeout=SERVER_START)
    print(f"group create -> Ready: {time.monotonic() - start:.1f} s")

    pods = fleets.live_pods("mn", "generation")
    assert [p.metadata.name for p in pods] == ["mn-generation-0-0", "mn-generation-0-1"]
    assert all(pod_ready(p) for p in pods)
    split = greedy(fleets, "mn")

    # Deleting the worker replaces the leader too (no half group), and the server comes back.
    old = {p.metadata.uid for p in pods}
    fleets.core.delete_namespaced_pod("mn-generation-0-1", fleets.ns)
    lost = time.monotonic()
    wait_for(lambda: (live := fleets.live_pods("mn", "generation")) and len(live) == 2
             and not {p.metadata.uid for p in live} & old and all(pod_ready(p) for p in live),
             timeout=SERVER_START, what="a whole new group of two Ready pods", interval=0.5)
    wait_for(lambda: greedy(fleets, "mn") == split, timeout=60, what="the new group to answer as the old one")
    print(f"group failure -> serving: {time.monotonic() - lost:.1f} s")

    # A roll to one pod of 2 ranks: the new server comes up before the group goes, and it answers
    # token for token as the group did.
    with LeaderReadiness(fleets, "mn") as readiness:
        fleets.patch_spec("mn", {"generation": {"podsPerServer": 1}})
        wait_for(lambda: [p.metadata.name for p in fleets.live_pods("mn", "generation")] == ["mn-generation-1"]
                 and pod_ready(fleets.live_pods("mn", "generation")[0]), timeout=SERVER_START,
                 what="the group to be replaced by one Ready pod", interval=0.5)
        fleets.wait_ready("mn", timeout=60)
    assert min(readiness.samples) >= 1, "the role had no Ready server during the roll"
    assert greedy(fleets, "mn") == split
