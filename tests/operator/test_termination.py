"""Servers end gracefully, whatever ends them: streams in flight survive their server's scale-down
(drained before it is deleted), deletion by hand, roll and eviction through the role's
PodDisruptionBudget (the operator's DeleteServer, kubectl, the Eviction API, the kubelet's
SIGTERM, the server's drain: runtime/serving/drain.py), and every deleted server pod ends
Succeeded. The same fleet's server, router and operator expose /metrics that the real
`promtool check metrics` accepts.

One fleet of real servers (tiny model, one rank each) for the whole module: servers take a while
to start on two cores. A stream of the tiny model lasts a few seconds, less than a new server takes
to become Ready; so streams run in chains (a new one starts when one ends) until the server a case
ends is seen deleted, and each case checks that the server ran streams when its SIGTERM came (the
first line of its drain, in its log), and that every stream of the client completed. Streams are
kept short: a server's drain must finish them within its grace period even on loaded cores (at
3,800 tokens one did not)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names

from operator_harness import PodTimeline, pod_ready
from specs import fleet_manifest

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.multiproc]

FLEET = "grace"
SERVER_START = 300
STREAM_TOKENS = 1000  # ~3 s on an idle core; the drain (55 s) finishes it on loaded ones
KV_BLOCKS = 1000  # four such streams on one server (16 tokens a block), with room to spare
DRAINING = re.compile(r"SIGTERM: draining \((\d+) requests in flight")


def role(servers: int) -> dict:
    return {"servers": servers, "adpRanks": 1, "engine": {"kvBlocks": KV_BLOCKS}, "terminationGracePeriodSeconds": 60,
            "probes": {"readinessPeriodSeconds": 1}}


class Stream:
    """A long streamed completion of `tokens` through the router, read on a thread."""

    def __init__(self, url: str, tokens: int = STREAM_TOKENS):
        self.events, self.error, self.tokens = [], None, tokens
        self.started_at, self.ended_at = time.monotonic(), None
        self.ended = threading.Event()
        body = {"model": "tiny", "prompt": "go", "max_tokens": tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        threading.Thread(target=self._read, args=(url, body), daemon=True).start()

    def _read(self, url, body):
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[6:]))
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.ended.set()

    @property
    def completed(self) -> bool:
        usage = next((e["usage"] for e in self.events if e.get("usage")), {})
        return self.error is None and usage.get("completion_tokens") == self.tokens

    def __repr__(self) -> str:
        return f"Stream(error={self.error!r}, last={self.events[-1:]})"


class Chains:
    """`n` streams in flight through the router at all times, until `stop()` or `until()` holds
    (checked before each new stream: a deletion seen stops the chains at once).

    Chain i's streams are STREAM_TOKENS + 150 i long. Streams of one length, begun together, are
    batched together and end on the same pass: the chains' gaps between a stream and the next come
    together, and a SIGTERM that falls in one finds a server running none of them (the likely cause
    of one CI run's "ran no stream when its SIGTERM came")."""

    def __init__(self, url: str, n: int, until: Callable[[], bool] = lambda: False):
        self.streams: list[Stream] = []
        self._stop = threading.Event()
        self._until = until
        for i in range(n):
            threading.Thread(target=self._chain, args=(url, STREAM_TOKENS + 150 * i), daemon=True).start()

    def _chain(self, url: str, tokens: int) -> None:
        while not self._stop.is_set() and not self._until():
            stream = Stream(url, tokens)
            self.streams.append(stream)
            stream.ended.wait(150)

    def stop(self) -> None:
        """No new streams; those in flight run on."""
        self._stop.set()

    def finish(self) -> list[Stream]:
        """Every stream, once all have ended."""
        self.stop()
        wait_for(lambda: all(s.ended.is_set() for s in list(self.streams)), timeout=150, what="the streams to end")
        return list(self.streams)


def server_url(pod) -> str:
    return f"http://{pod.status.pod_ip}:{names.SERVER_HTTP_PORT}"


class DrainLog:
    """`kubectl logs -f` of a server, read on a thread from before its deletion to its exit: how many
    requests it ran when its SIGTERM came (its drain's first line, runtime/serving/drain.py). Read
    there, not from its gauges once the deletion is seen: by then its last stream may have ended."""

    def __init__(self, fleets, pod):
        self.name = pod.metadata.name
        self.lines: list[str] = []
        self._proc = subprocess.Popen([str(fleets.cluster.kubectl_path), f"--kubeconfig={fleets.cluster.kubeconfig}",
                                       "logs", "-f", self.name, "-n", fleets.ns],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self._proc.stdout), daemon=True).start()

    def in_flight_at_sigterm(self, timeout: float = 90) -> int:
        line = wait_for(lambda: next((m for line in list(self.lines) if (m := DRAINING.search(line))), None),
                        timeout=timeout, what=f"{self.name}'s drain to begin")
        return int(line.group(1))

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()


def running(pod) -> float:
    """Requests the server runs (also while it drains: /metrics stays up)."""
    try:
        text = httpx.get(server_url(pod) + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("adpfleet_requests_running{"))


def promtool_check(text: str, what: str) -> None:
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), f"{what}: {proc.stdout}{proc.stderr}"


def deletion_seen(timeline: PodTimeline, pods: list) -> Callable[[], bool]:
    uids = {p.metadata.uid for p in pods}
    return lambda: bool(uids & timeline.deleting.keys())


def deleted_while_streaming(timeline: PodTimeline, pod, chains: Chains, drain: DrainLog, *, timeout: float = 30):
    """`pod` once its deletion is seen (`chains` run until then): it ran at least one of the client's
    streams when its SIGTERM came (`drain`, its log), and every stream completes."""
    wait_for(lambda: pod.metadata.uid in timeline.deleting, timeout=timeout, what=f"{pod.metadata.name}'s deletion")
    streams = chains.finish()
    try:
        draining = drain.in_flight_at_sigterm()
    finally:
        drain.close()
    print(f"{pod.metadata.name}: {draining} streams in flight at its SIGTERM", flush=True)
    assert draining >= 1, f"{pod.metadata.name} ran no stream when its SIGTERM came"
    assert all(s.completed for s in streams), [s for s in streams if not s.completed]
    assert max(s.ended_at for s in streams) > timeline.deleting[pod.metadata.uid]
    return pod


def drained_then_deleted(timeline: PodTimeline, pods: list, chains: Chains):
    """The one of `pods` a scale-down removes: deleted only once it runs nothing (its drain ended),
    after its streams, which all complete."""
    uids = {p.metadata.uid: p for p in pods}
    pod = wait_for(lambda: next((uids[u] for u in timeline.deleting if u in uids), None), timeout=120,
                   what="the scaled-down server's deletion")
    assert running(pod) == 0, f"{pod.metadata.name} was deleted with requests in flight"
    streams = chains.finish()
    assert all(s.completed for s in streams), [s for s in streams if not s.completed]
    return pod


def evicted(fleets, pod, refused: list) -> int | None:
    """201 once the Eviction API evicts `pod`; a 429 (the budget says not now) is noted in
    `refused` and gives None, to try again."""
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=pod.metadata.name, namespace=fleets.ns))
    try:
        fleets.core.create_namespaced_pod_eviction(pod.metadata.name, fleets.ns, body)
        return 201
    except ApiException as exc:
        if exc.status != 429:
            raise
        refused.append(pod.metadata.name)
        return None


def test_streams_survive_their_servers_scale_down_deletion_roll_and_eviction_and_the_pods_end_succeeded(
        start_operator, fleets):
    op = start_operator()
    fleets.apply(fleet_manifest(FLEET, context=role(1), generation=role(2)))
    fleets.wait_ready(FLEET, timeout=SERVER_START)
    url = fleets.router_url(FLEET)

    # Prometheus' conventions (a gauge does not end in _total, a counter does, ...) on all three.
    server = fleets.live_pods(FLEET, "generation")[0]
    promtool_check(httpx.get(server_url(server) + "/metrics").text, "server")
    promtool_check(httpx.get(url + "/metrics").text, "router")
    promtool_check(op._get("/metrics")[1], "operator")

    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline:
        # A node drain as `kubectl drain` does it, through the Eviction API: the role's
        # PodDisruptionBudget lets one of its two servers go at a time (the second eviction is refused
        # with 429 until the first one's replacement is Ready), and no stream is lost. First: the fleet
        # starts with the two servers it needs, and the scale-down below leaves the one the others need.
        two = fleets.live_pods(FLEET, "generation")
        chains = Chains(url, 2)
        wait_for(lambda: sum(running(p) for p in two) >= 1, timeout=60, what="streams on the generation servers")
        refused = []
        for pod in two:
            answer = wait_for(lambda: evicted(fleets, pod, refused), timeout=2 * SERVER_START, interval=1,
                              what=f"the eviction of {pod.metadata.name} to be allowed")
            assert answer == 201
        chains.stop()
        streams = chains.finish()
        assert all(s.completed for s in streams), [s for s in streams if not s.completed]
        assert refused, "the budget never refused an eviction (both servers could have gone at once)"
        print(f"drain: {len(streams)} streams completed; the second eviction was refused {len(refused)} times")
        wait_for(lambda: len([p for p in fleets.live_pods(FLEET, "generation") if pod_ready(p)
                              and p.metadata.uid not in {q.metadata.uid for q in two}]) == 2,
                 timeout=SERVER_START, what="both evicted servers back", interval=1)
        fleets.wait_ready(FLEET, timeout=SERVER_START)

        # Scale-down 2 -> 1: the server removed is drained first (the router sends it nothing new),
        # finishes the streams it runs, and only then is deleted.
        generation = fleets.live_pods(FLEET, "generation")
        chains = Chains(url, 4)
        wait_for(lambda: all(running(p) >= 1 for p in generation), timeout=60, what="streams on both servers")
        chains.stop()
        fleets.patch_spec(FLEET, {"generation": {"servers": 1}})
        removed = drained_then_deleted(timeline, generation, chains)

        # Deleted by hand: the server finishes its streams and comes back under its own name.
        only = fleets.live_pods(FLEET, "generation")
        assert [p.metadata.uid for p in only] != [removed.metadata.uid] and len(only) == 1
        chains = Chains(url, 2, until=deletion_seen(timeline, only))
        drain = DrainLog(fleets, only[0])
        wait_for(lambda: running(only[0]) >= 2, timeout=60, what="streams on the server")
        fleets.cluster.kubectl("delete", "pod", only[0].metadata.name, "-n", fleets.ns, "--wait=false")
        deleted = deleted_while_streaming(timeline, only[0], chains, drain)
        wait_for(lambda: [(p.metadata.name, p.metadata.uid != deleted.metadata.uid and pod_ready(p))
                          for p in fleets.live_pods(FLEET, "generation")] == [(deleted.metadata.name, True)],
                 timeout=SERVER_START, what="the server back under its own name", interval=1)
        fleets.wait_ready(FLEET, timeout=SERVER_START)

        # Rolled: the new server starts beside the old one, which runs streams until the new one is
        # Ready (the router sends only to Ready servers) and it is deleted, and finishes them after.
        old = fleets.live_pods(FLEET, "generation")
        chains = Chains(url, 4, until=deletion_seen(timeline, old))  # about two on the old one once the new is Ready
        drain = DrainLog(fleets, old[0])
        wait_for(lambda: running(old[0]) >= 2, timeout=60, what="streams on the old server")
        fleets.patch_spec(FLEET, {"generation": {"engine": {"kvBlocks": KV_BLOCKS + 10}}})
        wait_for(lambda: any(uid not in {p.metadata.uid for p in old} and "generation" in name
                             and uid in timeline.ready_at for name, uid in timeline.created),
                 timeout=SERVER_START, what="the new server to be Ready")
        rolled = deleted_while_streaming(timeline, old[0], chains, drain)
        fleets.wait_ready(FLEET, timeout=SERVER_START)

        ended = [*two, removed, deleted, rolled]
        wait_for(lambda: all(timeline.phases.get(p.metadata.uid) in ("Succeeded", "Failed") for p in ended)
                 and not {p.metadata.uid for p in ended} & {p.metadata.uid for p in fleets.pods(FLEET)},
                 timeout=90, what="the deleted servers to be gone")
    assert {p.metadata.name + " " + p.metadata.uid: timeline.phases[p.metadata.uid] for p in ended} == {
        p.metadata.name + " " + p.metadata.uid: "Succeeded" for p in ended}
