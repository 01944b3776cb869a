"""Starting, finding and stopping the processes the local cluster owns.

Every component and every pod container runs in its own process group (a new session), so one
signal reaches everything it forked. Processes are identified by pid, start time and command line
(`ProcessRecord`), so a recycled pid is never mistaken for ours; pod processes also carry marker
environment variables, so they can be found and stopped even when no record of them survives.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import tempfile
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


def freeze_busy_pod(pods: dict[str, str], title: str, running: Callable[[str], float | None], *, timeout: float = 60,
                    tries: int = 5, settle_s: float = 0.5, poll_s: float = 0.5, busy: float = 2) -> tuple[str, float]:
    """SIGSTOP the `title` processes of a pod (`pods`: name -> uid) whose engine runs `busy` requests
    or more (`running(name)`: what its /metrics say, None when it did not answer); (its name, the
    time.time() of the signal). Two by default: an engine frozen as one request ends still has the
    other; a load that seldom puts two on an engine asks for one and more tries.

    A vLLM engine's gauges are the state of its last step: one frozen just as its requests ended
    reports 0 running and cannot be told from an idle one (docs/remediation.md, "Dialects"). So the
    frozen engine's gauges are read again once its last outputs have reached them (`settle_s`), and
    a freeze that caught no request running is thawed and tried again. A read that got no answer
    says nothing either way: it is read again, frozen or not. The servers are read every `poll_s`,
    not back to back: a vLLM exposition is ~90 KB, rendered on the API server's event loop between
    its streams' tokens (a DP=2 server streaming to six clients beside a busy core took 2-10 s to
    answer a read). The error says how many reads were answered and the most they showed."""
    deadline = time.monotonic() + timeout
    seen: list[float | None] = []

    def read(name: str) -> float | None:
        seen.append(value := running(name))
        return value

    def timed_out() -> TimeoutError:
        answered = [v for v in seen if v is not None]
        return TimeoutError(f"no pod of {sorted(pods)} ran {busy:g} requests within {timeout:g} s ({len(answered)} of "
                            f"{len(seen)} reads answered, the most running {max(answered, default=None)})")

    for _ in range(tries):
        while (victim := next((name for name in sorted(pods) if (read(name) or 0) >= busy), None)) is None:
            if time.monotonic() > deadline:
                raise timed_out()
            time.sleep(poll_s)
        t_fault = time.time()
        signal_pod_processes(pods[victim], title, signal.SIGSTOP)
        time.sleep(settle_s)
        while (frozen_with := read(victim)) is None and time.monotonic() < deadline:
            time.sleep(poll_s)
        if frozen_with is not None and frozen_with >= 1:
            return victim, t_fault
        signal_pod_processes(pods[victim], title, signal.SIGCONT)
        if frozen_with is None:
            raise timed_out()
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


# Ports are picked outside the kernel's ephemeral range. A port picked by binding port 0 comes from
# that range, and once the picker closes it the kernel may hand it to any outgoing connection as its
# source port, or to any other bind of port 0, before the process it was picked for binds it: in two
# of four clean-clone runs of the suite, one server start of several hundred failed so. Outside the
# range only another picker can take it, and each pick is reserved from the others (per user).
PORT_RESERVATIONS = Path(tempfile.gettempdir()) / f"adpfleet-ports-{os.getuid()}"
PORT_RESERVATION_S = 600.0  # how long a picked port is kept from other pickers; binding takes seconds
PICKED_PORTS_FROM = 15000  # below, the ports that well-known services are configured to use


def ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections and to binds of port 0."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` listens on or is connected from, outside the ephemeral range, kept
    from every other caller on this machine for PORT_RESERVATION_S."""
    ephemeral = ephemeral_ports()
    candidates = [r for r in (range(PICKED_PORTS_FROM, ephemeral.start), range(ephemeral.stop, 65536)) if r]
    if not candidates:  # the whole range is ephemeral: the picks race the kernel's, as binding 0 does
        candidates = [ephemeral]
    PORT_RESERVATIONS.mkdir(parents=True, exist_ok=True)
    for _ in range(1000):
        port = random.choice(random.choice(candidates))
        if _reserve(port) and _bindable(host, port, reuse=False):
            return port
    raise RuntimeError(f"no free port on {host} after 1000 tries (reservations in {PORT_RESERVATIONS})")


def _reserve(port: int) -> bool:
    marker = PORT_RESERVATIONS / str(port)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        pass
    try:
        if time.time() - marker.stat().st_mtime < PORT_RESERVATION_S:
            return False
        # Expired. The rename is atomic: of two pickers clearing it, one finds nothing to rename.
        stale = marker.with_name(f"{port}.stale.{os.getpid()}.{threading.get_ident()}")
        os.rename(marker, stale)
        os.unlink(stale)
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except OSError:
        return False


def _bindable(host: str, port: int, reuse: bool) -> bool:
    with socket.socket() as sock:
        if reuse:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


def port_owner(host: str, port: int) -> str | None:
    """None when a server can bind `host:port`; else who holds it, as precisely as we can tell: a
    listener on that address (or on every address), else a connection from it. A port held only by
    connections waiting out their close (TIME_WAIT) is free to a server that sets SO_REUSEADDR, as
    uvicorn, Go's net package and every component here do."""
    if _bindable(host, port, reuse=True):
        return None
    same = [c for c in psutil.net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and c.laddr.ip in (host, "0.0.0.0", "::")]
    for conn in sorted(same, key=lambda c: c.status != psutil.CONN_LISTEN):
        if not conn.pid:
            continue
        role = ("listening" if conn.status == psutil.CONN_LISTEN
                else f"connected to {conn.raddr.ip}:{conn.raddr.port}" if conn.raddr else conn.status.lower())
        try:
            return f"pid {conn.pid} ({role}: {' '.join(psutil.Process(conn.pid).cmdline())[:120]})"
        except psutil.Error:
            return f"pid {conn.pid} ({role})"
    return "another process"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join("    " + line for line in text[-lines:])
