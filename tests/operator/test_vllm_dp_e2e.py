"""A vLLM server with two data-parallel engines, one of them frozen, end to end on the local cluster.

One InferenceFleet with `engine: vllm` and one aggregated server of `adpRanks: 2` (the operator renders
`--data-parallel-size 2`: two `VLLM::EngineCore_DP<r>` processes behind one API server). Under streaming
load through the fleet's router, only `VLLM::EngineCore_DP0` is frozen from the node's side (SIGSTOP) while
it runs requests: vLLM's coordinator keeps engine 0's requests there and `/health` stays 200, engine 1
goes on stepping. The operator, reading the server in vLLM's dialect (one rank per `engine` label), judges
the server `hung` on rank 0 alone within the stall window and two scrapes, and replaces it.

A DP=2 vLLM server takes several GB and a minute or more to start on two cores: this module starts one,
once, and does not wait for its replacement to be Ready (the DP=1 module, test_vllm_fleet_e2e.py, follows
a replacement to serving)."""

from __future__ import annotations

import base64
import time

import pytest
from vllm_servers import ENGINE_CORE, START_TIMEOUT_S, build_model

from adpfleet.cluster import processes
from adpfleet.cluster.testing import fresh_namespace, wait_for

from operator_harness import Fleets, PodTimeline, operators, pod_ready
from stall_harness import (Load, ProgressWatch, assert_decided_in_time, remediations, vllm_requests_running,
                           vllm_stall_fleet)

pytestmark = [pytest.mark.k8s, pytest.mark.vllm, pytest.mark.slow]

FLEET, KEY = "vdp", "vllm-dp-key"
WINDOW, INTERVAL = 8, 1  # as the DP=1 module's: longer than vLLM's longest step here
LONG_REQUEST_TOKENS = 384  # seconds of decoding each: engine 0 has requests running when it is frozen
ENGINE_0 = f"{ENGINE_CORE}_DP0"


@pytest.fixture
def served(k8s_cluster, api_proxy, fleet_crd, tmp_path_factory, vllm_cache_dir, request):
    """(fleets, operator): the fleet Ready, its operator watching; both gone after the test."""
    with fresh_namespace(k8s_cluster, "vllm-dp-e2e") as ns:
        fleets = Fleets(k8s_cluster, ns)
        failed = lambda: getattr(request.node, "rep_call", None) is None or request.node.rep_call.failed  # noqa: E731
        with operators(api_proxy, ns, fleets, tmp_path_factory.mktemp("vllm-dp-operator"), failed) as start:
            fleets.core.create_namespaced_secret(ns, {"metadata": {"name": "vdp-key"},
                                                      "data": {"key": base64.b64encode(KEY.encode()).decode()}})
            op = start()
            # the session's vLLM cache: an earlier vLLM start of the session inspected the model for this one
            fleet = vllm_stall_fleet(FLEET, str(build_model()), window=WINDOW, interval=INTERVAL, servers=1, adp_ranks=2,
                                     auth={"apiKeySecret": {"name": "vdp-key", "key": "key"}}, cache_dir=vllm_cache_dir)
            # one API server (vLLM starts one per engine by default): a process, its torch import and its memory less
            fleet["spec"]["vllm"]["args"] += ["--api-server-count", "1"]
            fleets.apply(fleet)
            fleets.wait_ready(FLEET, timeout=START_TIMEOUT_S + 120)
            yield fleets, op


def test_only_engine_0_of_a_dp2_vllm_server_frozen_is_hung_on_rank_0_and_the_server_is_replaced(served):
    fleets, op = served
    (pod,) = fleets.live_pods(FLEET, "aggregated")
    assert pod_ready(pod) and "--data-parallel-size" in (args := pod.spec.containers[0].args)
    assert args[args.index("--data-parallel-size") + 1] == "2"

    url = wait_for(lambda: fleets.router_url(FLEET), timeout=120, what="a Ready router", interval=1)
    with PodTimeline(fleets.cluster, fleets.ns, FLEET) as timeline:
        with Load(url, clients=6, max_tokens=LONG_REQUEST_TOKENS, deadline=240, streaming=True, api_key=KEY) as load:
            t_traffic = time.time()
            wait_for(lambda: load.completed_since(time.time() - 120) >= 2, timeout=240, what="traffic")
            assert op.metric("adpfleet_operator_stalls_detected_total") == 0  # busy, both engines stepping
            watch = ProgressWatch(pod, engine=0)
            # engine 0 alone, of six clients' requests: the clients are threads of this session, which the busy
            # pod's session starves (docs/cluster.md, autogroups), and one CI run's 16 reads in 60 s never showed it
            # more than one running; so one will do, and a freeze that catches it with none is thawed and tried again
            victim, t_fault = processes.freeze_busy_pod({pod.metadata.name: pod.metadata.uid}, ENGINE_0,
                                                        lambda name: vllm_requests_running(pod, engine=0),
                                                        busy=1, tries=10, timeout=120)
            record = wait_for(lambda: next((r for r in remediations(fleets.get(FLEET)) if r["server"] == victim),
                                           None), timeout=120, what=f"a remediation of {victim}", interval=0.2)
            t_decided = time.time()
            # the fleet's only server goes: the requests in flight would wait in the router's queue for its
            # replacement's start and then run (~70 s of a DP=2 vLLM start and 384 tokens), which this test
            # does not wait for and asserts nothing of
            load.abandon()
        assert (record["action"], record["signature"], record["targets"]) == ("RestartServer", "hung", [victim])
        assert_decided_in_time(op.log(), victim, t_fault, WINDOW, INTERVAL, watch.last_moved())
        (event,) = fleets.events("StallDetected")
        # rank 0 alone: engine 1 kept stepping, and a sum over the engines would have hidden engine 0's hang
        assert victim in event.message and "hung, ranks 0" in event.message and "ranks 0," not in event.message, \
            event.message
        # replaced: the server's pod is deleted and a new one of the same name is created
        wait_for(lambda: [name for name, uid in timeline.created if uid != pod.metadata.uid] == [victim],
                 timeout=120, what=f"a new {victim}", interval=0.5)
    assert pod.metadata.uid in timeline.deleting
    print(f"DP=2 vLLM: traffic to the freeze {t_fault - t_traffic:.1f} s, -> remediation record seen "
          f"{t_decided - t_fault:.1f} s -> new pod created {time.time() - t_decided:.1f} s", flush=True)
