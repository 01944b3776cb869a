"""What every benchmark needs: the machine it ran on, its matmul peak, the RSS and CPU of the
processes it measures, a readable table. torch is imported only by what needs it, so that the
operator and cluster benchmarks run without it. The cluster benchmarks start their control plane and
operator with `operator_cluster`."""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Background:
    """A daemon thread running the subclass's `_run` from `start()` until `stop()` (which `_run`
    sees as `self._stop`): what every sampler and watcher of a benchmark is."""

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class ProcessSampler(Background):
    """RSS and CPU time of another process, sampled every `interval` seconds in a thread, so that a
    benchmark can ask for the peak RSS or the CPU share over any window of its run afterwards."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__()
        self.proc = psutil.Process(pid)
        self.interval = interval
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, rss MB, cpu seconds)

    def sample(self) -> None:
        """Take one sample now (the thread takes one every interval)."""
        times = self.proc.cpu_times()
        self.samples.append((time.monotonic(), self.proc.memory_info().rss / 2**20, times.user + times.system))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def peak_rss(self, start: float = 0, end: float = float("inf")) -> float:
        return max((s[1] for s in self.samples if start <= s[0] <= end), default=0.0)

    def cpu_seconds(self, start: float, end: float) -> float:
        window = [s for s in self.samples if start <= s[0] <= end]
        return window[-1][2] - window[0][2] if len(window) > 1 else 0.0

    def cpu_percent(self, start: float, end: float) -> float:
        """CPU used between the first and last samples in the window, in percent of one core."""
        window = [s for s in self.samples if start <= s[0] <= end]
        if len(window) < 2:
            return 0.0
        return 100.0 * (window[-1][2] - window[0][2]) / (window[-1][0] - window[0][0])


@contextlib.contextmanager
def busy_neighbour(cpu: int):
    """A process at normal priority spinning on `cpu` for the block: what a pod meets on a shared
    node when another pod's busy thread lands on one of its cores."""
    proc = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def matmul_gflops(m: int = 2048, k: int = 2048, n: int = 1024, repeats: int = 10, trials: int = 5,
                  device: str = "cpu", dtype=None) -> float:
    """The device's matmul throughput in GFLOP/s: best of `trials` timings of `repeats` products
    of [m, k] @ [k, n] (best, so that other load on the machine counts least), through each GEMM
    torch offers here: `torch.mm` (MKL on x86 CPUs, cuBLAS on GPUs) and, on the CPU, oneDNN
    (torch's mkldnn linear, which adpfleet's engine uses) - whichever is faster is the peak."""
    import torch

    dtype = dtype or torch.float32
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    gemms = [lambda: torch.mm(a, b, out=out)]
    if device == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        weight = b.t().contiguous()
        gemms.append(lambda: torch.ops.mkldnn._linear_pointwise(a, weight, None, "none", [], ""))
    best = float("inf")
    for gemm in gemms:
        gemm()  # warm-up: thread pool and kernel selection
        for _ in range(trials):
            _sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                gemm()
            _sync(device)
            best = min(best, time.perf_counter() - start)
    return 2 * m * k * n * repeats / best / 1e9


def memory_gbps(device: str = "cpu", mib: int = 1024, repeats: int = 5, trials: int = 5) -> float:
    """The device's memory bandwidth in GB/s: bytes read plus written by copying a `mib` MiB
    buffer, best of `trials` timings of `repeats` copies."""
    import torch

    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(trials):
        _sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 * repeats / best / 1e9


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def machine_info() -> dict:
    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def format_table(headers: list[str], rows: list[list]) -> str:
    """A plain-text table, numbers right-aligned, for a person to read in a terminal."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for i, row in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if i and _numeric(rows[i - 1][j]) else c.ljust(w)
                               for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def wait(check, timeout: float, what: str, interval: float = 0.2):
    """`check()`'s first truthy result, retried (exceptions included: "not yet") until `timeout`:
    the tests' wait_for, called positionally as the benchmarks do."""
    from adpfleet.cluster.testing import wait_for

    return wait_for(check, timeout=timeout, what=what, interval=interval)


@dataclass
class OperatorCluster:
    """A local control plane with the CRD installed, one namespace and an operator watching it."""
    state: Path
    kubectl: list[str]
    core: object      # kubernetes CoreV1Api
    custom: object    # kubernetes CustomObjectsApi
    operator_url: str


@contextlib.contextmanager
def operator_cluster(prefix: str, namespace: str, agent_args: list[str] | None = None):
    """Starts a fresh local control plane (state in a new temporary directory named `prefix`...),
    applies the CRD, creates `namespace` and runs `adpfleet operator` for it until its /readyz
    answers; yields an OperatorCluster and takes the operator and the plane down on the way out."""
    import httpx
    from kubernetes import client, config

    from adpfleet.cluster.controlplane import ControlPlane
    from adpfleet.cluster.processes import free_port
    from adpfleet.operator.resource import crd

    state = Path(tempfile.mkdtemp(prefix=prefix))
    plane = ControlPlane(state) if agent_args is None else ControlPlane(state, agent_args=agent_args)
    report = plane.up()
    operator = None
    try:
        kubectl = [str(report.binaries.kubectl), f"--kubeconfig={plane.kubeconfig}"]
        (state / "crd.yaml").write_text(crd.crd_yaml())
        subprocess.run(kubectl + ["apply", "--server-side", "-f", str(state / "crd.yaml")], check=True,
                       capture_output=True)
        subprocess.run(kubectl + ["create", "namespace", namespace], check=True, capture_output=True)
        api = config.new_client_from_config(str(plane.kubeconfig))
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        wait(lambda: core.read_namespaced_service_account("default", namespace), 60, "the default service account")
        port = free_port()
        operator = subprocess.Popen(
            [str(Path(sys.executable).with_name("adpfleet")), "operator", "--namespace", namespace, "--http-host",
             "127.0.0.1", "--http-port", str(port), "--log-format", "plain"],
            stdout=open(state / "operator.log", "w"), stderr=subprocess.STDOUT,
            env={"KUBECONFIG": str(plane.kubeconfig), "PATH": "/usr/bin:/bin", "HOME": str(state)})
        url = f"http://127.0.0.1:{port}"
        wait(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 60, "the operator")
        yield OperatorCluster(state, kubectl, core, custom, url)
    finally:
        if operator:
            operator.terminate()
            try:
                operator.wait(30)
            except subprocess.TimeoutExpired:
                operator.kill()
        plane.down()
