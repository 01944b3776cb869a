"""Starting, finding and stopping the processes the local cluster owns.

Every component and every pod container runs in its own process group (a new session), so one
signal reaches everything it forked. Processes are identified by pid, start time and command line
(`ProcessRecord`), so a recycled pid is never mistaken for ours; pod processes also carry marker
environment variables, so they can be found and stopped even when no record of them survives.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil


@dataclass(frozen=True)
class ProcessRecord:
    """One process, identified by what no clock step can move: its start time in clock ticks since
    boot and its command line. (psutil's create_time() adds the kernel's boot time in wall-clock
    seconds, `btime`, which moves whenever the wall clock is stepped: every process recorded before
    a step would look dead.)"""
    pid: int
    start_ticks: int
    cmdline: tuple[str, ...]

    @classmethod
    def of(cls, pid: int) -> "ProcessRecord":
        seen = _observe(pid)
        # The kernel lets Popen return (close-on-exec pipes are closed) before it has set up the new
        # program's arguments: for a moment the command line is empty. Wait for it (or the exit).
        deadline = time.monotonic() + 5
        while seen and not seen.cmdline and seen.state != "Z" and time.monotonic() < deadline:
            time.sleep(0.001)
            seen = _observe(pid)
        if seen is None:
            raise ProcessLookupError(f"no process with pid {pid}")
        return cls(pid, seen.start_ticks, seen.cmdline)

    @classmethod
    def from_json(cls, raw: dict) -> "ProcessRecord":
        return cls(raw["pid"], raw["start_ticks"], tuple(raw["cmdline"]))

    def to_json(self) -> dict:
        return {"pid": self.pid, "start_ticks": self.start_ticks, "cmdline": list(self.cmdline)}

    def alive(self) -> bool:
        """Until it is a zombie or gone. A process that is exiting has released its memory, command
        line included, before it closes its files (its listening ports): it is alive until then."""
        seen = _observe(self.pid)
        return (seen is not None and seen.state != "Z" and seen.start_ticks == self.start_ticks
                and seen.cmdline in (self.cmdline, ()))


@dataclass(frozen=True)
class _Observed:
    state: str  # field 3 of /proc/PID/stat: R, S, D, Z, ...
    start_ticks: int  # field 22: clock ticks from boot to the process's start
    cmdline: tuple[str, ...]


def _observe(pid: int) -> _Observed | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 is the command name in parentheses, and may itself hold spaces and parentheses: the
    # fields after it begin after the *last* ')'.
    fields = stat[stat.rindex(b")") + 1:].split()
    cmdline = cmdline.rstrip(b"\0")
    args = tuple(os.fsdecode(a) for a in cmdline.split(b"\0")) if cmdline else ()
    return _Observed(fields[0].decode(), int(fields[19]), args)


def spawn(argv: list[str], log: Path, *, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> ProcessRecord:
    """Start `argv` detached in its own session, appending stdout and stderr to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(f"\n--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)
    # Taken before the reaper starts, so that a program that exits at once is still there (a zombie)
    # to be recorded.
    record = ProcessRecord.of(proc.pid)
    # Reap it when it exits, so a dead component never lingers as a zombie of a long-lived caller
    # (pytest); a short-lived caller (the CLI) leaves that to init.
    threading.Thread(target=proc.wait, daemon=True, name=f"reap-{proc.pid}").start()
    return record


def live_groups() -> set[int]:
    """Process groups that still have a live (non-zombie) member."""
    groups = set()
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                groups.add(os.getpgid(proc.pid))
        except (psutil.Error, ProcessLookupError):
            continue
    return groups


def stop_groups(pgids: set[int], grace: float) -> None:
    """SIGTERM every group, give them `grace` seconds together, then SIGKILL whatever is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pgid in pgids:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while (pgids := pgids & live_groups()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pgids:
            return


def stop_group(pgid: int, grace: float) -> None:
    stop_groups({pgid}, grace)


def processes_with_env(key: str, value: str) -> list[psutil.Process]:
    """Processes whose initial environment has key=value (how pod processes are marked)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(key) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def titled_processes(roots: list[psutil.Process], title: str) -> list[psutil.Process]:
    """The live processes among `roots` and their descendants whose title is `title`.

    The title is argv[0] as a process rewrote it (setproctitle): vLLM names its engine processes
    `VLLM::EngineCore` (`VLLM::EngineCore_DP0`, `_DP1`, ... under data parallelism). Such a process
    is found by descent, not by its environment: retitling may overwrite the memory that
    /proc/PID/environ reads."""
    return [proc for proc, proc_title in process_titles(roots) if proc_title == title]


def signal_pod_processes(pod_uid: str, title: str, sig: int) -> list[int]:
    """Send `sig` to the processes of a pod on this node titled `title` (the node's side of a
    fault: SIGSTOP freezes a vLLM engine the way a wedged one looks to the kernel, SIGCONT thaws it).
    Returns their pids; LookupError names the titles the pod has when none matches."""
    family = process_titles(processes_with_env("ADPFLEET_POD_UID", pod_uid))
    targets = [proc for proc, proc_title in family if proc_title == title]
    if not targets:
        raise LookupError(f"pod {pod_uid} has no process titled {title!r} on this node (its processes: "
                          f"{', '.join(sorted({t for _, t in family})) or 'none'})")
    for proc in targets:
        os.kill(proc.pid, sig)
    return [proc.pid for proc in targets]


def freeze_busy_pod(pods: dict[str, str], title: str, running: Callable[[str], float], *, timeout: float = 60,
                    tries: int = 5, settle_s: float = 0.5) -> tuple[str, float]:
    """SIGSTOP the `title` processes of a pod (`pods`: name -> uid) whose engine runs 2 requests or
    more (`running(name)`: what its /metrics say); (its name, the time.time() of the signal).

    A vLLM engine's gauges are the state of its last step: one frozen just as its requests ended
    reports 0 running and cannot be told from an idle one (docs/remediation.md, "Dialects"). So the
    frozen engine's gauges are read again once its last outputs have reached them (`settle_s`), and
    a freeze that caught no request running is thawed and tried again."""
    deadline = time.monotonic() + timeout
    for _ in range(tries):
        while (busy := next((name for name in sorted(pods) if running(name) >= 2), None)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no pod of {sorted(pods)} ran 2 requests within {timeout:g} s")
            time.sleep(0.05)
        t_fault = time.time()
        signal_pod_processes(pods[busy], title, signal.SIGSTOP)
        time.sleep(settle_s)
        if running(busy) >= 1:
            return busy, t_fault
        signal_pod_processes(pods[busy], title, signal.SIGCONT)
    raise RuntimeError(f"{tries} freezes in a row caught an engine with no request running")


def process_titles(roots: list[psutil.Process]) -> list[tuple[psutil.Process, str]]:
    """(process, title) for the live processes among `roots` and their descendants, each once."""
    found: dict[int, tuple[psutil.Process, str]] = {}
    for root in roots:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in family:
            try:
                if proc.pid not in found and proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = (proc, (proc.cmdline() or [""])[0])
            except psutil.Error:
                continue
    return list(found.values())


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_owner(host: str, port: int) -> str | None:
    """None when `host:port` can be bound; else who holds it, as precisely as we can tell."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError:
            pass
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                proc = psutil.Process(conn.pid)
                return f"pid {conn.pid} ({' '.join(proc.cmdline())[:120]})"
            except psutil.Error:
                return f"pid {conn.pid}"
    return "another process"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join("    " + line for line in text[-lines:])
