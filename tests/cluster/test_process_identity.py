"""A recorded process is recognised by what no clock step can move — its start time in clock ticks
since boot and its command line — so a stepped wall clock never makes a live component look dead,
and a pid reused by another process is never taken for ours."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time

import psutil
import psutil._pslinux
import pytest

from adpfleet.cluster import processes
from adpfleet.cluster.controlplane import ControlPlane
from adpfleet.cluster.testing import wait_for


@pytest.fixture
def sleeper(tmp_path):
    record = processes.spawn(["sleep", "60"], tmp_path / "sleep.log")
    yield record
    os.kill(record.pid, signal.SIGKILL)


def step_the_wall_clock(monkeypatch, seconds: float) -> None:
    """What a stepped clock does to psutil: the kernel's boot time in wall-clock seconds (`btime` in
    /proc/stat), from which create_time() is derived, moves by the step."""
    boot_time = psutil._pslinux.boot_time
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: boot_time() + seconds)


def test_a_live_process_stays_alive_across_a_wall_clock_step(sleeper, monkeypatch):
    stored = json.loads(json.dumps(sleeper.to_json()))  # as state.json keeps it
    before = psutil.Process(sleeper.pid).create_time()
    step_the_wall_clock(monkeypatch, 28)  # seen on the CI machine: +28 s in 40 minutes
    assert psutil.Process(sleeper.pid).create_time() == pytest.approx(before + 28)  # psutil does see a step
    assert sleeper.alive()
    assert processes.ProcessRecord.from_json(stored) == sleeper


def test_a_reused_pid_is_not_the_recorded_process(sleeper):
    assert sleeper.cmdline == ("sleep", "60") and sleeper.alive()  # recorded once the program runs
    # Same pid number, started at another moment (a pid recycled after the recorded process died)...
    assert not dataclasses.replace(sleeper, start_ticks=sleeper.start_ticks - 1).alive()
    # ...or, should it ever start in the same clock tick, running another program.
    assert not dataclasses.replace(sleeper, cmdline=("sleep", "61")).alive()


def test_a_process_that_is_exiting_is_alive_until_it_is_a_zombie(sleeper, monkeypatch):
    """While it exits, a process has already released its memory (the command line reads empty) but
    not yet closed its files: its listening ports are still taken."""
    observe = processes._observe
    monkeypatch.setattr(processes, "_observe", lambda pid: dataclasses.replace(observe(pid), cmdline=()))
    assert sleeper.alive()
    monkeypatch.setattr(processes, "_observe", lambda pid: dataclasses.replace(observe(pid), cmdline=(), state="Z"))
    assert not sleeper.alive()


def test_the_start_time_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    program = tmp_path / "x) 1 2 (y"  # /proc/PID/stat shows it as "(x) 1 2 (y)"
    shutil.copy(shutil.which("sleep"), program)
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    proc = subprocess.Popen([str(program), "60"])
    try:
        record = processes.ProcessRecord.of(proc.pid)
        assert record.start_ticks / os.sysconf("SC_CLK_TCK") == pytest.approx(since_boot, abs=2)
        assert record.cmdline == (str(program), "60") and record.alive()
    finally:
        proc.kill()
        proc.wait()


def test_a_zombie_is_not_alive():
    proc = subprocess.Popen(["sleep", "60"])
    record = processes.ProcessRecord.of(proc.pid)
    proc.kill()
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, timeout=10, what="a zombie")
    try:
        assert not record.alive()
    finally:
        proc.wait()


def test_state_of_version_1_keeps_only_the_records_whose_process_is_provably_that_component(tmp_path):
    """Version 1 recorded pid + psutil's create_time (wall clock). Such a record is kept when the
    process at its pid is this cluster's component of that name by its command line, else dropped."""
    state = tmp_path / "cluster"
    state.mkdir()
    etcd = subprocess.Popen(["bash", "-c", f'exec -a "{state}/bin/etcd" sleep 60'])
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        wait_for(lambda: psutil.Process(etcd.pid).cmdline() == [f"{state}/bin/etcd", "60"], timeout=10,
                 what="the stand-in etcd to run")

        def v1(proc):  # as the old code wrote it, seen after the clock was stepped by 28 s
            return {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time() - 28}
        (state / "state.json").write_text(json.dumps({
            "version": 1, "ports": {"etcd": processes.free_port()},
            "components": {"etcd": v1(etcd), "kube-apiserver": v1(stranger), "node-agent": v1(stranger)}}))
        statuses = {s.name: s for s in ControlPlane(state).status()}
        assert statuses["etcd"].running and statuses["etcd"].pid == etcd.pid
        assert "/health unreachable" in statuses["etcd"].detail  # a stand-in: it only sleeps
        assert not statuses["kube-apiserver"].running and statuses["kube-apiserver"].pid is None
        assert not statuses["node-agent"].running
    finally:
        for proc in (etcd, stranger):
            proc.kill()
            proc.wait()
