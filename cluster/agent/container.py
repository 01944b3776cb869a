"""One container of a pod: a local process, its probes, and its restarts.

The loop, like the kubelet's for one container:
    start (or adopt the process a previous agent started) → running → probes decide started,
    ready, or kill → exited → restartPolicy says whether to run again → back-off → start ...

The process is `podinit.py` exec'ing the container's command in a new session, so its process
group holds everything it forks; stopping runs the `preStop` hook, sends SIGTERM to the group,
waits what is left of the grace period, then SIGKILLs the group. When a run ends, the file at its
`terminationMessagePath` (or, with `FallbackToLogsOnError`, the end of its log) becomes the
message of its `terminated` state.

A sidecar (an init container with `restartPolicy: Always`) is restarted whatever the pod's policy,
is probed like a container, and counts as initialized once it has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from adpfleet.cluster.agent import podenv
from adpfleet.cluster.agent.events import now_iso
from adpfleet.cluster.agent.probes import Prober, ProbeTarget, run_handler
from adpfleet.cluster.agent.sandbox import Launch, LogSource, PodSandbox

log = logging.getLogger(__name__)
PODINIT = str(Path(__file__).with_name("podinit.py"))
UNKNOWN_EXIT = 255  # the process ended while no agent watched it: its exit code is lost
# The kubelet's limits: a termination message file is read up to 4096 bytes; the fallback to the
# log takes its last 80 lines, at most 2048 bytes; after a preStop hook SIGTERM gets at least 2 s.
MAX_TERMINATION_MESSAGE = 4096
FALLBACK_LOG_LINES, FALLBACK_LOG_BYTES = 80, 2048
MIN_GRACE_AFTER_HOOK = 2.0


class ContainerProcess:
    """A container's main process, waited on through a pidfd: no thread per process, and the
    same for a process a previous agent started (adopted), whose exit code is unknowable.

    Plain `subprocess.Popen`, not asyncio's subprocess: asyncio kills its children when the loop
    closes, and pods must outlive the agent.
    """

    def __init__(self, pid: int, popen: subprocess.Popen | None = None):
        self.pid, self.popen = pid, popen

    @property
    def adopted(self) -> bool:
        return self.popen is None

    async def wait(self) -> int:
        try:
            fd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            fd = None
        if fd is not None:
            loop = asyncio.get_running_loop()
            exited = loop.create_future()
            loop.add_reader(fd, lambda: exited.done() or exited.set_result(None))
            try:
                await exited
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        if self.popen is None:
            return UNKNOWN_EXIT
        code = self.popen.wait()
        return code if code >= 0 else 128 - code  # killed by signal N: 128 + N, like a shell


class ContainerRunner:
    def __init__(self, sandbox: PodSandbox, spec: dict, *, init: bool, previous: dict | None):
        self.sandbox, self.spec, self.name, self.init = sandbox, spec, spec["name"], init
        self.sidecar = init and spec.get("restartPolicy") == "Always"
        self._emit = sandbox.event(self.name)
        previous = previous or {}
        self.previous = previous
        self.restart_count = int(previous.get("restartCount", 0))
        # After an agent restart, start from what the previous agent reported, so that a pod whose
        # process is adopted reports no transition at all.
        self.previous_state: dict = previous.get("state") or {}
        self.state: dict = self.previous_state or {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = previous.get("lastState") or {}
        self.ready = bool(previous.get("ready"))
        self.started = bool(previous.get("started"))
        self.ever_started = self.restart_count > 0 or bool(self.last_state) or "terminated" in self.previous_state
        self.pid: int | None = _pid_of(previous.get("containerID", "")) if "running" in self.previous_state else None
        self.finished = asyncio.Event()   # set when it will not run again
        self.has_started = asyncio.Event()  # set when a run has started (startup probe passed)
        self.exit_code: int | None = None
        self._kill = asyncio.Event()
        self._kill_grace: float = 0.0
        self._stopping = False
        self._backoff = 0.0
        self._env: dict[str, str] = {}   # of the current process, for exec probes
        self._cwd = str(sandbox.dir.work)

    # ---- status ----

    def status(self) -> dict:
        status = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
                  "ready": self.ready, "restartCount": self.restart_count, "started": self.started,
                  "state": self.state, "lastState": self.last_state}
        if self.pid:
            status["containerID"] = f"adpfleet://{self.pid}"
        return status

    @property
    def initialized(self) -> bool:
        """For an init container: may the next one start (completed, or a sidecar that started)?"""
        if self.sidecar:
            return self.has_started.is_set()
        return self.finished.is_set() and self.exit_code == 0

    def log_source(self, previous: bool) -> LogSource | None:
        """The log of the current run (or the previous one), None when there is none."""
        restart = self.restart_count - (1 if previous else 0)
        path = self.sandbox.dir.log(self.name, restart)
        if restart < 0 or not path.exists():
            return None
        return LogSource(path, lambda: self.restart_count == restart and "running" in self.state)

    def _set(self, state: dict) -> None:
        if "terminated" in self.state and "terminated" not in state:
            self.last_state = self.state  # like the kubelet: lastState is the previous run's end
        self.state = state
        self.sandbox.changed()

    # ---- the loop ----

    async def run(self, adopted: psutil.Process | None) -> None:
        try:
            await self._run(adopted)
        except Exception as exc:  # noqa: BLE001 - a bug here must show on the pod, not vanish
            log.exception("container %s of %s/%s", self.name, self.sandbox.namespace, self.sandbox.name)
            self._set({"waiting": {"reason": "AgentError", "message": f"node agent error: {exc!r}"}})
            self._finish()

    async def _run(self, adopted: psutil.Process | None) -> None:
        if not adopted and self._already_done():
            return
        if not adopted and self.previous_state.get("running"):
            self._ended_unobserved()
            if not self._should_restart(UNKNOWN_EXIT):
                return self._finish()
            self.restart_count += 1
        elif not adopted and "waiting" in self.previous_state and "terminated" in self.last_state:
            self.restart_count += 1  # the previous agent died during a back-off: this is that restart
        while adopted or not self._stopping:
            if adopted:  # even a pod being deleted: its adopted process must still be stopped
                handle, started_at = ContainerProcess(adopted.pid), _create_time(adopted)
                with contextlib.suppress(psutil.Error):
                    self._env, self._cwd = adopted.environ(), adopted.cwd()
                adopted = None
                self.pid = handle.pid
                since = self.previous_state.get("running", {}).get("startedAt") or now_iso()
                self._set({"running": {"startedAt": since}})
            else:
                handle = await self._start()
                if handle is None:
                    continue
                started_at = time.time()
            self.ever_started = True
            code = await self._supervise(handle, time.monotonic() - (time.time() - started_at))
            ran_for = time.time() - started_at
            if self._stopping:
                break
            if not self._should_restart(code):
                return self._finish()
            delay = self._next_backoff(ran_for)
            if delay:
                sandbox = self.sandbox
                message = (f"back-off {delay:g}s restarting failed container={self.name} "
                           f"pod={sandbox.name}_{sandbox.namespace}({sandbox.uid})")
                self._set({"waiting": {"reason": "CrashLoopBackOff", "message": message}})
                self._emit("Warning", "BackOff", f"Back-off restarting failed container {self.name}")
                await self._sleep_unless_stopped(delay)
                if self._stopping:
                    break
            self.restart_count += 1
        self._finish()

    def _already_done(self) -> bool:
        """After an agent restart: a container that finished for good stays finished."""
        terminated = self.previous_state.get("terminated")
        if terminated and not self._should_restart(int(terminated.get("exitCode", 1))):
            self.state = self.previous_state
            self.exit_code = int(terminated.get("exitCode", 1))
            self.ready = self.init and self.exit_code == 0
            self._finish()
            return True
        return False

    def _ended_unobserved(self) -> None:
        self.ready = self.started = False
        self.last_state = {"terminated": {
            "exitCode": UNKNOWN_EXIT, "reason": "Unknown", "finishedAt": now_iso(),
            "startedAt": self.previous_state["running"].get("startedAt"),
            "message": "the process ended while the node agent was not running; its exit code is unknown"}}
        self.exit_code = UNKNOWN_EXIT

    def _should_restart(self, code: int) -> bool:
        policy = self.sandbox.restart_policy
        if self.sidecar:
            return True
        if self.init:  # init containers run until they succeed, unless the pod never restarts
            return code != 0 and policy != "Never"
        return policy == "Always" or (policy == "OnFailure" and code != 0)

    def _next_backoff(self, ran_for: float) -> float:
        """The kubelet's back-off: the first restart is immediate, then initial, doubling, capped;
        a container that ran longer than the cap starts over."""
        sandbox = self.sandbox
        if ran_for > sandbox.backoff_max:
            self._backoff = 0.0
        delay = self._backoff
        self._backoff = min(sandbox.backoff_max, max(sandbox.backoff_initial, self._backoff * 2))
        return delay

    def _finish(self) -> None:
        self.finished.set()
        self.sandbox.changed()

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._kill.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    # ---- one run of the process ----

    async def _start(self):
        try:
            launch = await self.sandbox.prepare(self.spec)
        except podenv.ContainerConfigError as exc:
            return await self._not_created("CreateContainerConfigError", str(exc))
        except OSError as exc:  # a mount point or subPath that cannot be created
            return await self._not_created("CreateContainerError", str(exc))
        try:
            return self._launch(launch)
        except OSError as exc:
            return await self._not_created("CreateContainerError", str(exc))

    async def _not_created(self, reason: str, message: str) -> None:
        self._set({"waiting": {"reason": reason, "message": message}})
        self._emit("Warning", "Failed", f"Error: {message}")
        await self._sleep_unless_stopped(2.0)  # the kubelet retries on its next sync, too

    def _launch(self, launch: Launch) -> ContainerProcess:
        directory = self.sandbox.dir
        directory.run.mkdir(mode=0o700, parents=True, exist_ok=True)  # launch specs hold secret values
        start_error = directory.start_error(self.name)
        start_error.unlink(missing_ok=True)
        spec = directory.run / f"{self.name}.json"
        spec.write_text(json.dumps({"argv": launch.argv, "env": launch.env, "cwd": str(launch.cwd),
                                    "mounts": launch.mounts, "hostname": launch.hostname,
                                    "startErrorFile": str(start_error)}))
        log_path = directory.log(self.name, self.restart_count)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", PODINIT, str(spec)], env=launch.env,
                                    cwd=str(launch.cwd), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    start_new_session=True)
        self.pid = proc.pid
        self.ready = False
        self._env, self._cwd = launch.env, str(launch.cwd)
        self._set({"running": {"startedAt": now_iso()}})
        self._emit("Normal", "Started", f"Started container {self.name}")
        return ContainerProcess(proc.pid, proc)

    async def _supervise(self, handle, started_monotonic: float) -> int:
        resumed = handle.adopted and bool(self.previous.get("started"))
        self.started = False
        probers = self._start_probers(handle, started_monotonic, resumed)
        exited = asyncio.ensure_future(handle.wait())
        killed = asyncio.ensure_future(self._kill.wait())
        post_start = (asyncio.ensure_future(self._post_start(handle))
                      if (self.spec.get("lifecycle") or {}).get("postStart") else None)
        await asyncio.wait({exited, killed}, return_when=asyncio.FIRST_COMPLETED)
        if post_start:
            post_start.cancel()
        if not exited.done():
            await self._terminate(handle, exited, self._kill_grace)
        killed.cancel()
        for task in probers:
            task.cancel()
        code = exited.result()
        _kill_group(handle.pid, signal.SIGKILL)  # what the main process left behind goes with it
        self._record_exit(code, adopted=handle.adopted)
        if not self._stopping:
            self._kill.clear()  # a liveness kill is spent; the back-off must not see it
        return code

    async def _post_start(self, handle) -> None:
        ok, message = await run_handler(self.spec["lifecycle"]["postStart"], self._hook_target(handle),
                                        self.sandbox.probe_session, self.sandbox.grace_period)
        if not ok:
            self._emit("Warning", "FailedPostStartHook", f"PostStartHook failed: {message}")
            self.request_kill(self.sandbox.grace_period)

    async def _terminate(self, handle, exited: asyncio.Future, grace: float) -> None:
        pre_stop = (self.spec.get("lifecycle") or {}).get("preStop")
        if pre_stop:
            began = time.monotonic()
            hook = asyncio.ensure_future(run_handler(pre_stop, self._hook_target(handle), self.sandbox.probe_session,
                                                     grace))
            await asyncio.wait({hook, exited}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            if hook.done() and not hook.result()[0]:
                self._emit("Warning", "FailedPreStopHook", f"PreStopHook failed: {hook.result()[1]}")
            hook.cancel()
            grace = max(grace - (time.monotonic() - began), MIN_GRACE_AFTER_HOOK)
        _kill_group(handle.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(exited), grace)
        except asyncio.TimeoutError:
            _kill_group(handle.pid, signal.SIGKILL)
            await exited

    def _record_exit(self, code: int, adopted: bool) -> None:
        running = self.state.get("running", {})
        start_error = self.sandbox.dir.start_error(self.name)
        terminated = {"exitCode": code, "startedAt": running.get("startedAt"), "finishedAt": now_iso(),
                      "reason": "Completed" if code == 0 else "Error", "containerID": f"adpfleet://{self.pid}"}
        message = self._termination_message(code)
        if start_error.exists():
            failure = json.loads(start_error.read_text())
            terminated.update(reason=failure["reason"], message=failure["message"])
            self._emit("Warning", "Failed", f"Error: {failure['message']}")
        elif adopted:
            terminated.update(reason="Unknown", message=message or "the process was started by a previous node "
                                                                   "agent, so its exit code is unknown")
        elif message:
            terminated["message"] = message
        self.exit_code = code
        self.ready = self.init and not self.sidecar and code == 0
        self.started = False
        self._set({"terminated": terminated})

    def _termination_message(self, code: int) -> str:
        try:
            with open(self.sandbox.dir.termination_log(self.name), "rb") as f:
                message = f.read(MAX_TERMINATION_MESSAGE)
        except OSError:
            message = b""
        if not message and code != 0 and self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            try:
                lines = self.sandbox.dir.log(self.name, self.restart_count).read_bytes().splitlines(keepends=True)
            except OSError:
                lines = []
            message = b"".join(lines[-FALLBACK_LOG_LINES:])[-FALLBACK_LOG_BYTES:]
        return message.decode(errors="replace")

    def _hook_target(self, handle) -> ProbeTarget:
        named_ports = {p["name"]: p["containerPort"] for p in self.spec.get("ports") or [] if p.get("name")}
        return ProbeTarget(pod_ip=self.sandbox.ip, ports=named_ports, env=self._env, cwd=self._cwd, pid=handle.pid,
                           private_mounts=self.sandbox.private_mounts)

    # ---- probes ----

    def _start_probers(self, handle, started_monotonic: float, resumed: bool) -> list[asyncio.Task]:
        if self.init and not self.sidecar:
            return []
        self._target = self._hook_target(handle)
        self._started_monotonic = started_monotonic
        self._probe_tasks: list[asyncio.Task] = []
        if "startupProbe" in self.spec and not resumed:
            self._spawn_prober("startup", self.spec["startupProbe"])
        else:
            self._on_started()
        return self._probe_tasks

    def _spawn_prober(self, kind: str, probe: dict) -> None:
        prober = Prober(kind, probe, self._target, self.sandbox.probe_session, self._on_probe)
        self._probe_tasks.append(asyncio.ensure_future(prober.run(self._started_monotonic)))

    def _on_started(self) -> None:
        self.started = True
        self.has_started.set()
        if "livenessProbe" in self.spec:
            self._spawn_prober("liveness", self.spec["livenessProbe"])
        if "readinessProbe" in self.spec:
            self._spawn_prober("readiness", self.spec["readinessProbe"])
        else:
            self.ready = True
        self.sandbox.changed()

    async def _on_probe(self, kind: str, ok: bool, message: str) -> None:
        if kind == "readiness":
            self.ready = ok
            if not ok:
                self._emit("Warning", "Unhealthy", f"Readiness probe failed: {message}")
            self.sandbox.changed()
            return
        if ok:
            if kind == "startup" and not self.started:
                self._on_started()
            return
        label = "Liveness" if kind == "liveness" else "Startup"
        self._emit("Warning", "Unhealthy", f"{label} probe failed: {message}")
        self._emit("Normal", "Killing", f"Container {self.name} failed {kind} probe, will be restarted")
        probe = self.spec[f"{kind}Probe"]
        self.request_kill(float(probe.get("terminationGracePeriodSeconds") or self.sandbox.grace_period))

    # ---- commands from the pod ----

    def request_kill(self, grace: float) -> None:
        self._kill_grace = grace
        self._kill.set()

    def stop(self, grace: float) -> None:
        """The pod is going away: terminate and never restart."""
        self._stopping = True
        self.request_kill(grace)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def terminate_group(pgid: int, grace: float) -> None:
    """SIGTERM a process group we cannot wait() on, then SIGKILL it after `grace` seconds."""
    _kill_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and psutil.pid_exists(pgid):
        try:
            if psutil.Process(pgid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        await asyncio.sleep(0.1)
    _kill_group(pgid, signal.SIGKILL)


def _create_time(proc: psutil.Process) -> float:
    try:
        return proc.create_time()
    except psutil.NoSuchProcess:
        return time.time()


def _pid_of(container_id: str) -> int | None:
    pid = container_id.removeprefix("adpfleet://")
    return int(pid) if pid.isdigit() else None
