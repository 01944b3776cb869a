"""A model directory that exists only when complete, filled safely by processes racing for it.

`fill_once(final, fill)`:
1. `flock` on `<final>.lock` (next to it, on the same volume) serialises the processes of one node
   that fill the same directory; a second server starting beside the first waits, then finds the
   directory complete and downloads nothing.
2. The fill writes into `<final>.partial/`, a fixed name, so a fill that was interrupted (the pod
   was killed) is continued by the next one: files already complete there are not fetched again.
3. The marker (COMPLETE_MARKER, JSON: the source, its resolved revision, files and bytes) is written
   last inside `.partial`, then `.partial` is renamed to `final` in one atomic rename.
So `final` either does not exist or is complete; a reader never sees half a model. Where `flock`
does not hold across writers (some network filesystems, pods on two nodes), two fills can run at
once: the loser's rename finds `final` already there, and it discards its copy — a duplicated
download, never a corrupted one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from adpfleet.model_uri import COMPLETE_MARKER


def read_marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def fill_once(final: Path, fill: Callable[[Path], dict]) -> dict:
    """The marker of `final`, filling it first with `fill(partial_dir) -> marker fields` unless it
    is already complete."""
    marker = read_marker(final)
    if marker is not None:
        return marker
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    with open(final.with_name(final.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        marker = read_marker(final)
        if marker is not None:  # another process filled it while this one waited
            return marker
        if final.exists():  # not ours (no marker): set it aside rather than trust it
            final.rename(final.with_name(f"{final.name}.incomplete-{int(time.time())}"))
        partial.mkdir(exist_ok=True)
        marker = {**fill(partial), "completedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        shutil.rmtree(partial / ".cache", ignore_errors=True)  # the hub client's resume bookkeeping
        (partial / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1))
        try:
            os.rename(partial, final)
        except OSError:  # a writer the lock did not exclude finished first
            if read_marker(final) is None:
                raise
            shutil.rmtree(partial, ignore_errors=True)
            return read_marker(final)
        return marker
