"""What a pod gives each of its containers (CRI's "pod sandbox"): who the pod is, where its files
live, how to build one container's launch, and where to report.

A leaf module: `container.py` sees its pod only through a `PodSandbox`, never the `PodWorker`, so
the agent's modules form a tree (agent → pod → container → sandbox, podenv, probes, ...).

The pod directory (`<agent state>/pods/<namespace>_<pod>_<uid>/`):

    volumes/<volume>/                      materialised volumes
    logs/<container>/<restartCount>.log    each run's stdout and stderr
    run/<container>.json                   the launch spec podinit.py reads (holds secret values)
    run/<container>.start-error            why the last exec failed, written by podinit.py
    run/<container>.termination-log        bind-mounted at the container's terminationMessagePath
    etc-hosts                              bind-mounted at /etc/hosts (see hosts.py)
    tmp/<container>/                       the container's TMPDIR, reached through a short link in the
                                           host's temporary directory (`tmp_link`)
    work/                                  the default working directory
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp


@dataclass(frozen=True)
class Launch:
    """One run of a container, as podinit.py executes it."""
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    mounts: list[dict]          # {"source", "target", "readOnly"}, bind-mounted in order
    hostname: str | None        # set in a private UTS namespace; None where mounts are unavailable


@dataclass(frozen=True)
class LogSource:
    """A run's log file, and whether that run still writes to it (`kubectl logs -f` follows it
    until then)."""
    path: Path
    writing: Callable[[], bool]


@dataclass(frozen=True)
class PodDirectory:
    path: Path

    @property
    def work(self) -> Path:
        return self.path / "work"

    @property
    def run(self) -> Path:
        return self.path / "run"

    @property
    def hosts(self) -> Path:
        return self.path / "etc-hosts"

    def tmp(self, container: str) -> Path:
        return self.path / "tmp" / container

    def tmp_link(self, container: str) -> Path:
        """The short name a container gets for tmp(container): a Unix socket's path must fit in 108
        bytes (vLLM binds its IPC sockets in TMPDIR, named by a UUID), which a pod directory exceeds."""
        digest = hashlib.sha256(str(self.tmp(container)).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"adpfleet-tmp-{digest}"

    def remove(self) -> None:
        """Delete the directory and the links to its containers' temporary directories."""
        for tmp in (self.path / "tmp").glob("*"):
            self.tmp_link(tmp.name).unlink(missing_ok=True)
        shutil.rmtree(self.path, ignore_errors=True)

    def log(self, container: str, restart_count: int) -> Path:
        return self.path / "logs" / container / f"{restart_count}.log"

    def start_error(self, container: str) -> Path:
        return self.run / f"{container}.start-error"

    def termination_log(self, container: str) -> Path:
        return self.run / f"{container}.termination-log"


Emit = Callable[[str, str, str], None]  # (type, reason, message): an Event on the pod about one container


@dataclass
class PodSandbox:
    namespace: str
    name: str
    uid: str
    dir: PodDirectory
    restart_policy: str             # spec.restartPolicy (immutable)
    grace_period: float             # spec.terminationGracePeriodSeconds
    backoff_initial: float          # crash-loop back-off: first delay, then doubling ...
    backoff_max: float              # ... up to this
    private_mounts: bool            # exec probes and hooks must enter the container's mount namespace
    probe_session: aiohttp.ClientSession  # the agent's, for HTTP probes and hooks
    prepare: Callable[[dict], Awaitable[Launch]]  # container spec -> its launch (raises ContainerConfigError)
    changed: Callable[[], None]     # a container's status changed: the pod rewrites its status
    event: Callable[[str], Emit]    # container name -> how to record Events about it
    ip: str = ""                    # set by the pod once its address is allocated
