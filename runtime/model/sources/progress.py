"""Download progress in the log: bytes on disk under the fill directory against the total, every
few seconds, the same for every source. The lines are a contract with the operator, which reads
`bytes done / total` back from the init container's log: they are written (and parsed) by
`adpfleet.model_uri`.

    fetch-model: hf://org/repo@3f1c...: 52.4 MB of 104.9 MB (50%) at 35.1 MB/s
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from adpfleet.model_uri import progress_line, progress_start_line

log = logging.getLogger("adpfleet.fetch")
INTERVAL_ENV = "ADPFLEET_PROGRESS_INTERVAL"


def bytes_under(directory: Path) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # moved or removed between listing and stat
                pass
    return total


class Progress:
    """`with Progress(dir, total, label):` logs progress every interval and a summary at the end."""

    def __init__(self, directory: Path, total: int, label: str, interval: float | None = None):
        self.directory, self.total, self.label = directory, total, label
        self.interval = interval if interval is not None else float(os.environ.get(INTERVAL_ENV, "5"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)
        self._start_bytes = 0
        self._t0 = 0.0

    def line(self) -> str:
        done = bytes_under(self.directory)
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        return progress_line(self.label, done, self.total, (done - self._start_bytes) / elapsed)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            log.info("%s", self.line())

    def __enter__(self) -> "Progress":
        self._start_bytes = bytes_under(self.directory)
        self._t0 = time.monotonic()
        log.info("%s", progress_start_line(self.label, self.total, self._start_bytes))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            log.info("%s", self.line())
