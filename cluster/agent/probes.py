"""Startup, liveness and readiness probes with the kubelet's timing and thresholds, and the
lifecycle hooks (postStart, preStop), which run the same handlers once.

A `Prober` runs one probe of one container: it waits `initialDelaySeconds`, probes every
`periodSeconds` with `timeoutSeconds`, and reports a change only after `successThreshold`
consecutive successes or `failureThreshold` consecutive failures.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp


@dataclass(frozen=True)
class ProbeTarget:
    """What a probe needs to know about the running container."""
    pod_ip: str
    ports: dict[str, int]           # named container ports
    env: dict[str, str]
    cwd: str
    pid: int
    private_mounts: bool            # exec probes must enter the container's mount namespace


async def probe_once(probe: dict, target: ProbeTarget, session: aiohttp.ClientSession) -> tuple[bool, str]:
    """One attempt: (success, why it failed)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            return await asyncio.wait_for(_http(probe["httpGet"], target, session, timeout), timeout)
        if "tcpSocket" in probe:
            return await asyncio.wait_for(_tcp(probe["tcpSocket"], target), timeout)
        if "exec" in probe:
            return await _exec(probe["exec"]["command"], target, timeout)
    except asyncio.TimeoutError:
        return False, f"timed out after {timeout:g}s"
    except (OSError, aiohttp.ClientError) as exc:
        return False, str(exc) or type(exc).__name__
    return False, "only httpGet, tcpSocket and exec probes are supported by the adpfleet node agent"


def _port(value: int | str, target: ProbeTarget) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    if value not in target.ports:
        raise OSError(f"the container has no port named {value!r}")
    return target.ports[value]


async def _http(spec: dict, target: ProbeTarget, session: aiohttp.ClientSession, timeout: float):
    scheme = spec.get("scheme", "HTTP").lower()
    host = spec.get("host") or target.pod_ip
    path = spec.get("path", "/")
    url = f"{scheme}://{host}:{_port(spec['port'], target)}{path if path.startswith('/') else '/' + path}"
    headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
    async with session.get(url, headers=headers, allow_redirects=False, ssl=False,
                           timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        await resp.read()
        if 200 <= resp.status < 400:
            return True, ""
        return False, f"HTTP probe failed with statuscode: {resp.status}"


async def _tcp(spec: dict, target: ProbeTarget):
    _, writer = await asyncio.open_connection(spec.get("host") or target.pod_ip, _port(spec["port"], target))
    writer.close()
    return True, ""


async def _exec(command: list[str], target: ProbeTarget, timeout: float):
    argv = (["nsenter", f"--target={target.pid}", "--mount", "--uts", "--"] if target.private_mounts else []) + command
    proc = await asyncio.create_subprocess_exec(*argv, env=target.env, cwd=target.cwd, start_new_session=True,
                                                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return False, f"command timed out after {timeout:g}s"
    if proc.returncode == 0:
        return True, ""
    return False, f"command exited with {proc.returncode}: {out.decode(errors='replace').strip()[:200]}"


async def run_handler(handler: dict, target: ProbeTarget, session: aiohttp.ClientSession,
                      timeout: float) -> tuple[bool, str]:
    """A lifecycle hook (postStart, preStop): exec, httpGet or sleep, bounded by `timeout`."""
    if "sleep" in handler:
        await asyncio.sleep(min(float(handler["sleep"]["seconds"]), timeout))
        return True, ""
    return await probe_once({**handler, "timeoutSeconds": timeout}, target, session)


class Prober:
    """Runs one probe forever (until cancelled) and calls `on_change(ok, message)` on transitions."""

    def __init__(self, kind: str, probe: dict, target: ProbeTarget, session: aiohttp.ClientSession,
                 on_change: Callable[[str, bool, str], Awaitable[None]]):
        self.kind, self.probe, self.target, self.session = kind, probe, target, session
        self.on_change = on_change
        self.period = float(probe.get("periodSeconds", 10))
        self.success_threshold = int(probe.get("successThreshold", 1))
        self.failure_threshold = int(probe.get("failureThreshold", 3))

    async def run(self, started_at: float) -> None:
        delay = started_at + float(self.probe.get("initialDelaySeconds", 0)) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        successes = failures = 0
        state: bool | None = None
        while True:
            tick = time.monotonic()
            ok, message = await probe_once(self.probe, self.target, self.session)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if ok and successes >= self.success_threshold and state is not True:
                state = True
                await self.on_change(self.kind, True, "")
            elif not ok and failures >= self.failure_threshold and state is not False:
                state = False
                await self.on_change(self.kind, False, message)
            await asyncio.sleep(max(0.0, self.period - (time.monotonic() - tick)))
