"""A fill's downloads, run so that a hostile or broken source can neither fill the disk beyond what
it listed nor hold the fetch for ever; the same for every source.

`fetch_files(fetch, files, directory, label)` fetches each file not already there at its listed
size, on daemon threads (a download stuck in a socket read must not keep the process from exiting
once the fetch has given up), while the calling thread watches the bytes landing under
`directory` (where the clients also keep their partial files):
- more than the listing promised for the files being fetched (plus the clients' bookkeeping,
  OVERRUN_SLACK) is SizeMismatch at once: a listing that says 1 byte passes the room check, so the
  file it serves must not be let run on to 73 MB;
- less than STALL_BYTES within the stall deadline (STALL_TIMEOUT_ENV, 300 s by default) is
  FetchStalled: a shard trickling in at 2 KB/s ends the fetch instead of holding the init container
  for ever. The hub client writes 10 MB at a time, so against a hub the floor is ~10 MB a deadline.
Once all are there, each file must have exactly its listed size (SizeMismatch otherwise).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from adpfleet.model_uri import FETCH_STALLED, SIZE_MISMATCH, ModelSourceError
from adpfleet.runtime.model.sources.progress import bytes_under

# Files downloaded at once: parallel streams hide a remote store's latency, but each costs a core
# (measured on 2 cores against a local hub: 8 streams took 1.6x as long as 1 or 2).
DOWNLOAD_WORKERS = min(8, os.cpu_count() or 1)
STALL_TIMEOUT_ENV = "ADPFLEET_FETCH_STALL_TIMEOUT"
DEFAULT_STALL_TIMEOUT_S = 300.0
STALL_BYTES = 1_000_000        # progress is at least this much within the deadline
OVERRUN_SLACK = 1_000_000      # what the clients write beside the files (the hub's .cache/ metadata)


def stall_timeout() -> float:
    """Seconds a download may go with less than STALL_BYTES of progress (STALL_TIMEOUT_ENV)."""
    raw = os.environ.get(STALL_TIMEOUT_ENV, "")
    if not raw:
        return DEFAULT_STALL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{STALL_TIMEOUT_ENV}={raw!r} is not a number of seconds above 0")
    return value


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def fetch_files(fetch: Callable[[str], None], files: dict[str, int], directory: Path, label: str) -> None:
    """Runs `fetch(name)` for each of `files` (name -> listed size) that is not in `directory` at
    that size yet, under watch; then checks every size."""
    todo = {name: size for name, size in files.items() if size_of(directory / name) != size}
    batch = _Batch(fetch, list(todo), DOWNLOAD_WORKERS)
    watch = _Watch(directory, sum(todo.values()), label, stall_timeout())
    try:
        while not batch.finished.wait(watch.poll_s):
            watch.check(batch.running())
    finally:
        batch.stop()  # what has not started never will; what runs is left to end with the process
    if batch.error is not None:
        raise batch.error
    wrong = {name: size_of(directory / name) for name, size in files.items() if size_of(directory / name) != size}
    if wrong:
        raise ModelSourceError(SIZE_MISMATCH, f"{label}: the source served files of another size than it listed: "
                                              + ", ".join(f"{n} is {amount(got)}, listed as {amount(files[n])}"
                                                          for n, got in sorted(wrong.items())))


def amount(n: int) -> str:
    return (f"{n} byte" + "s" * (n != 1)) if n < 1_000_000 else f"{n / 1e6:.1f} MB"


class _Watch:
    """What the calling thread checks between waits: the bytes written under the directory since
    the start, against the listing and against the stall deadline."""

    def __init__(self, directory: Path, expected: int, label: str, timeout: float):
        self.directory, self.expected, self.label, self.timeout = directory, expected, label, timeout
        self.poll_s = min(0.5, timeout / 4)
        self._start = bytes_under(directory)
        self._mark_bytes, self._mark_at = 0, time.monotonic()

    def check(self, running: list[str]) -> None:
        now, written = time.monotonic(), bytes_under(self.directory) - self._start
        fetching = ", ".join(running) or "the files"
        if written > self.expected + OVERRUN_SLACK:
            raise ModelSourceError(SIZE_MISMATCH, f"{self.label}: the source served more than it listed: "
                                                  f"{amount(written)} written for {fetching}, listed as "
                                                  f"{amount(self.expected)}; stopped there")
        self._mark_bytes = min(self._mark_bytes, written)  # a client that starts a file over is not progress
        if written - self._mark_bytes >= STALL_BYTES:
            self._mark_bytes, self._mark_at = written, now
        elif now - self._mark_at > self.timeout:
            raise ModelSourceError(FETCH_STALLED, f"{self.label}: less than {amount(STALL_BYTES)} arrived in "
                                                  f"{self.timeout:g} s while fetching {fetching} ({amount(written)} "
                                                  f"of {amount(self.expected)}): the source is stalled or too slow "
                                                  f"(the deadline is {STALL_TIMEOUT_ENV})")


class _Batch:
    """`fetch(name)` for each name on `workers` daemon threads; the first failure ends the batch."""

    def __init__(self, fetch: Callable[[str], None], names: list[str], workers: int):
        self._fetch, self._todo = fetch, list(names)
        self._lock = threading.Lock()
        self._running: list[str] = []
        self._left = len(names)
        self.error: BaseException | None = None
        self.finished = threading.Event()
        if not names:
            self.finished.set()
        for _ in range(min(workers, len(names))):
            threading.Thread(target=self._work, name="fetch-file", daemon=True).start()

    def running(self) -> list[str]:
        with self._lock:
            return list(self._running)

    def stop(self) -> None:
        with self._lock:
            self._todo.clear()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    return
                name = self._todo.pop(0)
                self._running.append(name)
            try:
                self._fetch(name)
            except BaseException as e:  # handed to the calling thread, which raises it
                with self._lock:
                    self.error = self.error or e
                    self._todo.clear()
                self.finished.set()
                return
            with self._lock:
                self._running.remove(name)
                self._left -= 1
                if self._left == 0:
                    self.finished.set()
