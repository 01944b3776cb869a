"""What every benchmark needs: the machine it ran on, its matmul peak, the RSS and CPU of the
processes it measures, a readable table. torch is imported only by what needs it, so that the
operator and cluster benchmarks run without it."""

from __future__ import annotations

import os
import platform
import resource
import threading
import time

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
