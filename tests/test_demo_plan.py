"""`adpfleet demo --engine vllm`: the command line reaches the plan, the plan's fleet is a valid vLLM
fleet, recovery is the replacement's first tokens, and the fault freezes an engine only while it has
work (a real process stopped and continued by title, as the node's side does it). The full run is
the same story as tests/test_demo.py's with the real vLLM: minutes, so it is run by hand
(docs/remediation.md, "Dialects", says when and what it measured)."""

import os
import signal
import subprocess
import time
from argparse import Namespace

import psutil
import pytest

from adpfleet.cli import build_parser
from adpfleet.cluster import processes
from adpfleet.cluster.testing import wait_for
from adpfleet.demo import Demo, Plan, fleet_manifest
from adpfleet.operator.resource.models import FleetSpec


def test_the_command_line_selects_the_vllm_plan_and_quick_keeps_its_window():
    args = build_parser().parse_args(["demo", "--engine", "vllm", "--quick"])
    assert (args.engine, args.quick, args.run) == ("vllm", True, "adpfleet.demo:main")
    assert build_parser().parse_args(["demo"]).engine == "adpfleet"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--engine", "sglang"])
    quick, adp = Plan.of("vllm", quick=True), Plan.of("adpfleet", quick=True)
    assert (quick.role, quick.window, quick.scrape) == ("aggregated", adp.window, adp.scrape)
    assert adp.role == "generation" and (adp.duration, adp.fault_at) == (70, 12)  # the adpfleet run unchanged
    # the replacement's vLLM start comes before the recovery the quick run waits for
    assert quick.duration - quick.fault_at >= 540 and quick.ready_timeout >= 600  # > 4.5 min measured under load
    assert Plan.of("vllm", quick=False).duration >= quick.duration


def test_the_vllm_demo_fleet_is_two_aggregated_vllm_servers_with_the_demos_key_and_windows():
    manifest = fleet_manifest(8, 2, vllm_model="/models/tiny")
    spec = FleetSpec.model_validate(manifest["spec"])
    assert spec.engine == "vllm" and spec.model.served_name == "tiny"  # the name the demo's clients send
    role = spec.role("aggregated")
    assert (role.servers, role.adp_ranks) == (2, 1)  # the peer serves while the frozen one is replaced
    env = {e["name"]: e["value"] for e in manifest["spec"]["aggregated"]["env"]}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"  # bound, both servers and a restart shared one core
    assert manifest["spec"]["auth"] == fleet_manifest(8, 2)["spec"]["auth"]
    assert manifest["spec"]["remediation"]["stallWindowSeconds"] == 8
    assert "faultInjection" not in manifest["spec"]  # the node freezes vLLM; no fault endpoint is asked
    assert FleetSpec.model_validate(fleet_manifest(8, 2)["spec"]).engine == "adpfleet"


def test_recovery_is_when_a_server_that_replaced_the_frozen_one_first_generated_tokens():
    demo = Demo(Namespace(quick=True, engine="vllm", out="unused", keep=False))
    demo.before_fault = {"old-a", "old-b"}
    demo.first_tokens = {"old-a": 1.0, "old-b": 40.0}  # the peer's first request came after the remediation
    demo.timeline.events = [(20.0, "Fault: froze"), (30.0, "Stalled: hung"), (31.0, "Remediation: RestartServer")]
    assert demo.recovered_at() is None  # the peer kept serving: that is not the frozen server's recovery
    demo.first_tokens["new-a"] = 95.0
    assert demo.recovered_at() == 95.0
    demo.timeline.events = demo.timeline.events[:2]
    assert demo.recovered_at() is None  # nothing was remediated


@pytest.fixture
def engine_core():
    """A process titled VLLM::EngineCore in a pod's marked environment, as the node agent starts one."""
    uid = f"uid-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"],
                            env={**os.environ, "ADPFLEET_POD_UID": uid})
    wait_for(lambda: psutil.Process(proc.pid).cmdline()[:1] == ["VLLM::EngineCore"], timeout=10, what="its title")
    yield uid, psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


def test_a_freeze_that_caught_the_engine_without_work_is_thawed_and_tried_again(engine_core):
    uid, proc = engine_core
    seen = iter([2, 0, 2, 1])  # busy; frozen with 0 running (its requests had just ended); busy; frozen with work
    states = []

    def running(name: str) -> float:
        states.append(proc.status())
        return next(seen)
    victim, t_fault = processes.freeze_busy_pod({"vf-aggregated-0": uid}, "VLLM::EngineCore", running, settle_s=0.01)
    assert victim == "vf-aggregated-0" and abs(time.time() - t_fault) < 5
    assert states[1] == psutil.STATUS_STOPPED and states[2] != psutil.STATUS_STOPPED  # thawed after the miss
    assert proc.status() == psutil.STATUS_STOPPED  # the second freeze holds
    os.kill(proc.pid, signal.SIGCONT)


def test_an_unanswered_read_is_read_again_and_never_taken_for_no_work(engine_core):
    uid, proc = engine_core
    seen = iter([None, 2, None, 1])  # no answer; busy; frozen, no answer (not "0 running"); frozen with work
    states = []

    def running(name: str) -> float | None:
        states.append(proc.status())
        return next(seen)
    victim, _ = processes.freeze_busy_pod({"vf-aggregated-0": uid}, "VLLM::EngineCore", running, settle_s=0.01,
                                          poll_s=0.01)
    assert victim == "vf-aggregated-0" and states[2:] == [psutil.STATUS_STOPPED] * 2  # never thawed between
    os.kill(proc.pid, signal.SIGCONT)


def test_no_busy_engine_within_the_timeout_says_so(engine_core):
    uid, _ = engine_core
    answered = r"ran 2 requests within 0.2 s \(\d+ of \d+ reads answered, the most running 1\)"
    with pytest.raises(TimeoutError, match=answered):
        processes.freeze_busy_pod({"p": uid}, "VLLM::EngineCore", lambda name: 1, timeout=0.2, poll_s=0.05)


def test_a_load_that_seldom_runs_two_can_ask_for_one(engine_core):
    uid, proc = engine_core
    seen = iter([0, 1, 1])  # idle; one running; frozen with it
    victim, _ = processes.freeze_busy_pod({"p": uid}, "VLLM::EngineCore", lambda name: next(seen), settle_s=0.01,
                                          poll_s=0.01, busy=1)
    assert victim == "p" and proc.status() == psutil.STATUS_STOPPED
    os.kill(proc.pid, signal.SIGCONT)
