"""Killing the node agent stops no pod, and the next agent picks up exactly where it left off."""

import os
import signal

import pytest

from adpfleet.cluster import processes
from adpfleet.cluster.testing import http_server_pod, pod_manifest, wait_for

pytestmark = pytest.mark.k8s


def agent_record(cluster) -> processes.ProcessRecord:
    return processes.ProcessRecord.from_json(cluster.plane.state["components"]["node-agent"])


def pid_of(pod) -> int:
    return int(pod.status.container_statuses[0].container_id.removeprefix("adpfleet://"))


def test_a_restarted_agent_adopts_running_pods_and_stops_those_deleted_meanwhile(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    k8s_cluster.apply([http_server_pod("survivor"), pod_manifest("doomed", ["sleep", "3600"]),
                       pod_manifest("forgotten", ["sleep", "3600"])], ns)
    survivor, doomed, forgotten = (k8s_cluster.wait_for_pod(ns, n) for n in ("survivor", "doomed", "forgotten"))

    agent = agent_record(k8s_cluster)
    os.kill(agent.pid, signal.SIGKILL)
    wait_for(lambda: not agent.alive(), timeout=10, what="the agent to die")
    assert processes.ProcessRecord.of(pid_of(survivor)).alive(), "a pod died with the agent"

    # While no agent runs: a graceful delete waits for a node to finish it; a forced one does not.
    k8s_cluster.core.delete_namespaced_pod("doomed", ns)
    k8s_cluster.core.delete_namespaced_pod("forgotten", ns, grace_period_seconds=0)
    k8s_cluster.wait_for_pod_gone(ns, "forgotten")

    report = k8s_cluster.plane.up()
    assert report.started == ["node-agent"]
    assert "node-agent" in report.notes[0] and "restarted" in report.notes[0]

    k8s_cluster.wait_for_pod_gone(ns, "doomed", timeout=20)
    for gone in (doomed, forgotten):
        wait_for(lambda: not processes.processes_with_env("ADPFLEET_POD_UID", gone.metadata.uid), timeout=15,
                 what=f"the processes of {gone.metadata.name} to be stopped")
    after = k8s_cluster.wait_for_pod(ns, "survivor")
    assert pid_of(after) == pid_of(survivor) and after.status.pod_ip == survivor.status.pod_ip
    assert after.status.container_statuses[0].restart_count == 0
    assert ready_since(after) == ready_since(survivor), "readiness flapped across the agent restart"


def ready_since(pod):
    return next(c.last_transition_time for c in pod.status.conditions if c.type == "Ready")
