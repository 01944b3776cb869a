"""tools/bytecode.py: the bytecode one clone compiled serves the next, whose package files are the same files."""

from __future__ import annotations

import compileall
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bytecode  # noqa: E402


def environment(root: Path, source: Path) -> Path:
    """A site directory whose package file is a hard link to `source`, as uv installs from its cache."""
    site = root / "site-packages"
    (site / "pkg").mkdir(parents=True)
    os.link(source, site / "pkg" / "__init__.py")
    return site


def loaded_from_bytecode(site: Path) -> bool:
    out = subprocess.run([sys.executable, "-I", "-B", "-v", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); "
                          "import pkg; assert pkg.ANSWER == 42"],
                         capture_output=True, text=True, check=True, cwd="/").stderr
    return f"matches {site / 'pkg' / '__init__.py'}" in out


def test_a_second_environment_of_the_same_files_loads_the_first_ones_bytecode_as_links(tmp_path):
    source = tmp_path / "cache" / "pkg.py"
    source.parent.mkdir()
    source.write_text("ANSWER = 42\n")
    first, second = environment(tmp_path / "a", source), environment(tmp_path / "b", source)
    compileall.compile_dir(str(first), quiet=2)
    kept = tmp_path / "bytecode" / "k1"
    bytecode.store(first, kept)
    assert [p.name for p in kept.rglob("*") if p.is_file()] == [Path(importlib.util.cache_from_source("x.py")).name
                                                                  .replace("x.", "__init__.")]
    assert not loaded_from_bytecode(second)  # nothing compiled there: Python reads the source
    bytecode.place(kept, second)
    pyc = Path(importlib.util.cache_from_source(str(second / "pkg" / "__init__.py")))
    assert pyc.stat().st_ino == (kept / "pkg" / "__pycache__" / pyc.name).stat().st_ino  # linked, not copied
    assert loaded_from_bytecode(second)


def test_placing_keeps_the_files_an_environment_has(tmp_path):
    kept, site = tmp_path / "kept", tmp_path / "site"
    (kept / "pkg" / "__pycache__").mkdir(parents=True)
    (kept / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"kept")
    (site / "pkg" / "__pycache__").mkdir(parents=True)
    (site / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"own")
    bytecode.place(kept, site)
    assert (site / "pkg" / "__pycache__" / "m.pyc").read_bytes() == b"own"


def test_only_the_newest_keys_are_kept(tmp_path):
    site = tmp_path / "site"
    (site / "__pycache__").mkdir(parents=True)
    (site / "__pycache__" / "m.pyc").write_bytes(b"x")
    for i in range(bytecode.KEEP + 2):
        bytecode.store(site, tmp_path / "cache" / f"k{i}")
        os.utime(tmp_path / "cache" / f"k{i}", (i, i))
    bytecode.store(site, tmp_path / "cache" / "newest")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["k3", "k4", "newest"]
