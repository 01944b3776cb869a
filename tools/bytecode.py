"""Compile an environment's packages to bytecode once per set of installed files, and reuse that work.

Pods run with PYTHONDONTWRITEBYTECODE=1, as the runtime image does (cluster/agent/podenv.py), so scripts/setup
compiles the environment they run from as pip compiles an image's. On two cores that is ~40 s for the
project's ~19,000 files, in every fresh clone. uv installs a package's files as hard links to its cache, so a
fresh clone's sources are the very files (same modification time and size) that an earlier clone's
bytecode was compiled from, and Python accepts that bytecode: it checks a .pyc against its source's
modification time and size, and sets the code's file name from where it loads the source.

So the .pyc files of a compile are kept under $ADPFLEET_CACHE/bytecode/<key> (default ~/.cache/adpfleet),
the key naming the interpreter and every distribution uv installed with its version and the modification time
of its metadata (files uv extracted again are new files: another key; pip, uv itself and the editable checkout
are installed anew in each clone and are not in it). A later environment with the same key
gets them as hard links (copies across file systems) in under a second; any other compiles and stores its own.
The newest three keys are kept.

Run with the environment's interpreter: `python -I tools/bytecode.py` (scripts/setup does)."""

from __future__ import annotations

import compileall
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

KEEP = 3


def key(site: Path) -> str:
    parts = [sys.version, sys.implementation.cache_tag]
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if (dist.read_text("INSTALLER") or "").strip() != "uv" or \
                json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"):
            continue  # pip and uv themselves (installed new in each clone, not linked), the checkout (editable)
        meta = Path(dist._path, "METADATA")  # type: ignore[attr-defined]  # a PathDistribution's own directory
        mtime = meta.stat().st_mtime_ns if meta.is_file() else 0
        parts.append(f"{dist.metadata['Name']}=={dist.version}@{mtime}")
    return hashlib.sha256("\n".join(sorted(parts)).encode()).hexdigest()[:16]


def link(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` (a copy across file systems); a file already at `dst` is kept."""
    try:
        os.link(src, dst)
    except FileExistsError:
        pass
    except OSError:  # another file system
        shutil.copy2(src, dst)


def place(src: Path, dst: Path) -> None:
    """Every file under `src` at the same place under `dst`, linked where it can be; files there are kept."""
    for root, _, files in os.walk(src):
        target = dst / Path(root).relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            link(Path(root, name), target / name)


def store(site: Path, out: Path) -> None:
    """The .pyc files under `site` (their __pycache__ directories only) as `out`, whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    for root, _, files in os.walk(site):
        if Path(root).name != "__pycache__":
            continue
        target = tmp / Path(root).relative_to(site)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".pyc"):
                link(Path(root, name), target / name)
    try:
        tmp.rename(out)
    except OSError:  # another setup stored the same key meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    for old in sorted((p for p in out.parent.iterdir() if not p.name.startswith(".")),
                      key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    cache = Path(os.environ.get("ADPFLEET_CACHE") or Path.home() / ".cache" / "adpfleet") / "bytecode"
    done = Path(sys.prefix, ".adpfleet-bytecode")
    k = key(site)
    if done.is_file() and done.read_text().strip() == k:
        return 0
    kept = cache / k
    if kept.is_dir():
        place(kept, site)
        os.utime(kept)  # the newest, for pruning
    else:
        # a few packages ship files that do not compile (templates, other Pythons' code): not a failure
        compileall.compile_dir(str(site), quiet=2, workers=0)
        store(site, kept)
    done.write_text(k + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
