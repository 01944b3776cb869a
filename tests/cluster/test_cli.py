"""`adpfleet cluster up|down|status` from a user's seat: idempotent, self-healing, says what is
wrong, and leaves nothing behind."""

import json
import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest

from adpfleet.cluster import processes
from adpfleet.cluster.binaries import ensure_binaries
from adpfleet.cluster.controlplane import ClusterError, ControlPlane
from adpfleet.cluster.testing import TEST_AGENT_ARGS, wait_for

pytestmark = pytest.mark.k8s


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adpfleet", "cluster", *args], capture_output=True, text=True,
                          timeout=180, env=env)


def processes_of(state_dir) -> list[psutil.Process]:
    marker = str(state_dir)
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or []):
            found.append(proc)
    return found + processes.processes_with_env("ADPFLEET_CLUSTER", f"{state_dir}/agent")


def test_up_status_crash_recovery_and_down_leave_nothing_behind(tmp_path):
    state = tmp_path / "cluster"
    agent_args = [f"--agent-arg={a}" for a in TEST_AGENT_ARGS]
    try:
        first = cli("up", f"--state-dir={state}", *agent_args)
        assert first.returncode == 0, first.stderr
        assert f"export KUBECONFIG={state}/kubeconfig" in first.stdout
        assert "apiserver ready in" in first.stdout
        # The commands it prints act on this cluster, not on the default directory.
        assert f"`adpfleet cluster status --state-dir {state}`" in first.stdout
        assert f"`adpfleet cluster down --state-dir {state}`" in first.stdout
        elsewhere = {k: v for k, v in os.environ.items() if k != "ADPFLEET_CLUSTER_DIR"}
        elsewhere["XDG_STATE_HOME"] = str(tmp_path / "empty-state-home")
        lost = cli("status", env=elsewhere)
        assert lost.returncode == 1
        assert f"a local cluster runs in {state}: `adpfleet cluster status --state-dir {state}`" in lost.stderr

        again = cli("up", f"--state-dir={state}")
        assert again.returncode == 0 and "already up" in again.stdout

        status = cli("status", f"--state-dir={state}")
        assert status.returncode == 0, status.stdout
        assert status.stdout.count(" ok ") == 4

        regpu = cli("up", f"--state-dir={state}", *agent_args, "--agent-arg=--gpus=2")
        assert regpu.returncode == 0 and "restarting the node agent with arguments" in regpu.stdout
        kubectl = [str(ensure_binaries().kubectl), f"--kubeconfig={state}/kubeconfig"]
        gpus = subprocess.run([*kubectl, "get", "node", "adpfleet-node", "-o",
                               r"jsonpath={.status.capacity.nvidia\.com/gpu}"], capture_output=True, text=True)
        assert gpus.stdout == "2", gpus.stderr

        components = json.loads((state / "state.json").read_text())["components"]
        for name in ("etcd", "kube-apiserver"):
            os.kill(components[name]["pid"], signal.SIGKILL)
        wait_for(lambda: cli("status", f"--state-dir={state}").returncode == 1, timeout=10,
                 what="status to notice the crash")
        broken = cli("status", f"--state-dir={state}").stdout
        assert "etcd" in broken and "NOT OK" in broken and "not running" in broken

        healed = cli("up", f"--state-dir={state}")
        assert healed.returncode == 0, healed.stderr
        assert "etcd (pid" in healed.stdout and "kube-apiserver (pid" in healed.stdout
        assert "restarted it" in healed.stdout
        assert cli("status", f"--state-dir={state}").returncode == 0
    finally:
        down = cli("down", f"--state-dir={state}")
    assert down.returncode == 0, down.stderr
    assert not state.exists()
    assert not [p for p in processes_of(state) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_up_names_the_process_holding_a_requested_port(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        plane = ControlPlane(tmp_path / "cluster", apiserver_port=port)
        try:
            with pytest.raises(ClusterError) as error:
                plane.up()
        finally:
            plane.down()
    message = str(error.value)
    assert f"port 127.0.0.1:{port} (apiserver) is in use by pid {os.getpid()}" in message
    assert "cannot start kube-apiserver" in message


def test_up_refuses_a_corrupt_state_directory_and_down_clears_it(tmp_path):
    state = tmp_path / "cluster"
    state.mkdir()
    (state / "state.json").write_text("{ half a file")
    result = cli("up", f"--state-dir={state}")
    assert result.returncode == 1
    assert f"the state file {state}/state.json is unreadable" in result.stderr
    assert "adpfleet cluster down" in result.stderr
    assert not processes_of(state)
    assert cli("down", f"--state-dir={state}").returncode == 0 and not state.exists()


def test_status_without_a_cluster_says_how_to_start_one(tmp_path):
    result = cli("status", f"--state-dir={tmp_path / 'none'}")
    assert result.returncode == 1
    assert "start one with `adpfleet cluster up`" in result.stderr
