"""Killing the node agent stops no pod, and the next agent picks up exactly where it left off.
The session's cluster is checked before each test module that uses it: an agent an earlier test
killed comes back, and one that cannot come back fails the module at once, with its log, instead of
leaving its tests to time out on a cluster without a node agent."""

import os
import signal
import socket

import pytest

from adpfleet.cluster import processes
from adpfleet.cluster.controlplane import HOST
from adpfleet.cluster.testing import http_server_pod, pod_manifest, wait_for

pytestmark = pytest.mark.k8s


@pytest.fixture(autouse=True)
def leaves_the_session_cluster_healthy(k8s_cluster):
    """Each test here kills the node agent of the session's cluster: the tests after it get it back."""
    yield
    k8s_cluster.ensure_healthy()


def agent_record(cluster) -> processes.ProcessRecord:
    return processes.ProcessRecord.from_json(cluster.plane.state["components"]["node-agent"])


def kill_the_agent(cluster) -> processes.ProcessRecord:
    agent = agent_record(cluster)
    os.kill(agent.pid, signal.SIGKILL)
    wait_for(lambda: not agent.alive(), timeout=10, what="the node agent to die")
    return agent


def pid_of(pod) -> int:
    return int(pod.status.container_statuses[0].container_id.removeprefix("adpfleet://"))


def test_a_restarted_agent_adopts_running_pods_and_stops_those_deleted_meanwhile(k8s_cluster, k8s_namespace):
    ns = k8s_namespace
    k8s_cluster.apply([http_server_pod("survivor"), pod_manifest("doomed", ["sleep", "3600"]),
                       pod_manifest("forgotten", ["sleep", "3600"])], ns)
    survivor, doomed, forgotten = (k8s_cluster.wait_for_pod(ns, n) for n in ("survivor", "doomed", "forgotten"))

    kill_the_agent(k8s_cluster)
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


def test_the_health_step_brings_a_killed_node_agent_back(k8s_cluster, k8s_namespace):
    killed = kill_the_agent(k8s_cluster)
    notes = k8s_cluster.ensure_healthy()  # what runs before each module
    assert len(notes) == 1 and f"node-agent (pid {killed.pid}) was not running; restarted it" in notes[0]
    assert agent_record(k8s_cluster).alive() and agent_record(k8s_cluster).pid != killed.pid
    assert k8s_cluster.ensure_healthy() == []  # now healthy: left alone
    assert k8s_cluster.plane.up().started == []  # and `up` of the restarted agent changes nothing
    k8s_cluster.apply(http_server_pod("after"), k8s_namespace)
    k8s_cluster.wait_for_pod(k8s_namespace, "after")


def test_a_component_that_cannot_come_back_fails_loudly_with_its_log(k8s_cluster):
    port = k8s_cluster.plane.state["ports"]["agent"]
    log = k8s_cluster.plane.logs / "node-agent.log"
    kill_the_agent(k8s_cluster)
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((HOST, port))
        squatter.listen()
        with pytest.raises(pytest.fail.Exception) as failure:
            k8s_cluster.ensure_healthy()
    message = str(failure.value)
    assert f"cannot start node-agent: port {HOST}:{port} (agent) is in use by pid {os.getpid()}" in message
    assert f"node-agent: not running. The end of {log}:" in message
    assert "starting:" in message  # the log's own lines follow
    assert k8s_cluster.ensure_healthy() and agent_record(k8s_cluster).alive()  # the port is free again
