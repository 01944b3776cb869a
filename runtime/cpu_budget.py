"""How many CPUs this process may really use: the smallest of its affinity mask and its cgroup's
CPU quota (a pod's CPU limit), so that a rank runs as many torch threads as it gets cores.

A pod limited to 2 CPUs on a 64-core node sees 64 in `os.cpu_count()`; run 64 intra-op threads
and the kernel's CFS quota throttles them all together every period, while each parallel region
waits for its slowest thread: throughput collapses far below the quota's share. The quota is read
from cgroup v2 (`cpu.max`: "QUOTA PERIOD" or "max PERIOD") or v1 (`cpu.cfs_quota_us`, -1 for none,
and `cpu.cfs_period_us`); a fractional quota rounds down (a thread more than the quota is
throttled), never below one.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def quota_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (1.5 for "150000 100000"), or None when there is none."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        fields = v2.split()  # "max PERIOD": no quota, which _ratio answers as not a number
        return _ratio(*fields) if len(fields) == 2 else None
    quota, period = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    if quota is None or period is None:  # v1 mounts the controller as cpu,cpuacct too; cpu links to it
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None  # v1 writes -1 for no quota


def available_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota; at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = quota_cpus(root)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(1, cpus)


def threads_per_rank(ranks: int, root: Path = CGROUP_ROOT, environ: dict = os.environ) -> int:
    """Intra-op threads for each of `ranks` engine processes sharing this process's CPUs; an explicit
    OMP_NUM_THREADS wins (the operator sets it from a role's engine.threadsPerRank)."""
    chosen = environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(1, available_cpus(root) // max(1, ranks))


def sleep_between_regions(environ: dict = os.environ) -> None:
    """OpenMP threads that finish their share of a parallel region sleep until the next one
    (OMP_WAIT_POLICY=PASSIVE) instead of spinning for up to GOMP's spin count, unless the
    environment already chose: beside a busy neighbour, a spinning thread takes the cycles the
    straggler it waits for shares a core with. OpenMP reads it once, when torch loads it: call
    this before the first `import torch` of the process (or of the processes it starts)."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
