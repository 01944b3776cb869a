#!/usr/bin/env python3
"""Apply single-line mutations of the project's rules one at a time and run the tests that guard
them; report which mutants the tests kill.

A mutant list is a YAML file of entries:

    - rule: "post-schedule padding is a no-op when the rank has no active request"
      file: runtime/executor/padding.py
      find: "or not e.num_active_real or"     # must occur exactly once in the file
      replace: "or"
      tests: [tests/runtime/test_padding.py]  # pytest arguments (paths, -k ...)
      equivalent: "why this mutant cannot change behaviour"   # optional; a survivor then passes

Each mutant is applied to a fresh copy of the tree (the tracked and untracked-not-ignored files),
and the tests run in that copy with `PYTHONPATH` pointing at the copy's packages, so the working
tree is never touched and a crashed run leaves nothing behind. The exit status is 1 when a mutant
survives that is not marked `equivalent`, or when a `find` no longer matches (the list is stale).

    .venv/bin/python tools/mutants.py tools/mutants/padding.yaml [--json out.json] [-k WORD]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
# adpfleet's distribution maps these folders onto subpackages (pyproject's package-dir).
PACKAGE_DIRS = {"runtime": "runtime", "operator": "operator", "cluster": "cluster"}
TEST_TIMEOUT_S = 600


@dataclass
class Mutant:
    rule: str
    file: str
    find: str
    replace: str
    tests: list[str]
    equivalent: str | None = None


@dataclass
class Outcome:
    rule: str
    file: str
    mutation: str
    killed: bool | None  # None: the mutant could not be applied
    equivalent: str | None
    seconds: float
    detail: str


def load(path: Path) -> list[Mutant]:
    entries = yaml.safe_load(path.read_text()) or []
    mutants = []
    for i, entry in enumerate(entries):
        tests = entry.get("tests") or []
        mutants.append(Mutant(rule=entry["rule"], file=entry["file"], find=entry["find"],
                              replace=entry.get("replace", ""),
                              tests=[tests] if isinstance(tests, str) else list(tests),
                              equivalent=entry.get("equivalent")))
        if not mutants[-1].tests:
            raise SystemExit(f"{path}: entry {i} ({entry['rule']!r}) names no tests")
    return mutants


def tree_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def make_copy(files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    # `adpfleet.runtime` etc. resolve to the copy: the copy's own `adpfleet/` package (first on
    # sys.path, ahead of the editable install's finder) gets its subpackages as links.
    for sub, folder in PACKAGE_DIRS.items():
        (dest / "adpfleet" / sub).symlink_to(dest / folder)


def run_one(m: Mutant, files: list[str], python: str) -> Outcome:
    source = (ROOT / m.file).read_text()
    count = source.count(m.find)
    label = f"{m.find.strip()!r} -> {m.replace.strip()!r}"
    if count != 1:
        return Outcome(m.rule, m.file, label, None, m.equivalent, 0.0,
                       f"`find` occurs {count} times in {m.file}; the list is stale")
    with tempfile.TemporaryDirectory(prefix="adpfleet-mutant-") as tmp:
        copy = Path(tmp)
        make_copy(files, copy)
        (copy / m.file).write_text(source.replace(m.find, m.replace))
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        start = time.monotonic()
        try:
            proc = subprocess.run([python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                                   *m.tests], cwd=copy, env=env, capture_output=True, text=True,
                                  timeout=TEST_TIMEOUT_S)
            killed, tail = proc.returncode != 0, (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            killed, tail = True, [f"tests timed out after {TEST_TIMEOUT_S} s"]
        return Outcome(m.rule, m.file, label, killed, m.equivalent, time.monotonic() - start,
                       tail[0] if tail else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lists", nargs="+", type=Path, help="YAML mutant lists")
    parser.add_argument("--json", type=Path, help="write the outcomes here")
    parser.add_argument("-k", dest="keyword", help="only mutants whose rule contains this")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args(argv)

    mutants = [m for path in args.lists for m in load(path)
               if not args.keyword or args.keyword.lower() in m.rule.lower()]
    files = tree_files()
    outcomes = []
    for m in mutants:
        o = run_one(m, files, args.python)
        outcomes.append(o)
        verdict = {True: "killed", False: "SURVIVED", None: "NOT APPLIED"}[o.killed]
        print(f"{verdict:11} {o.seconds:6.1f}s  {m.rule}", flush=True)

    print("\n| rule | mutation | killed |\n|---|---|---|")
    for o in outcomes:
        killed = {True: "yes", False: "no", None: "not applied"}[o.killed]
        if o.killed is False and o.equivalent:
            killed = f"no (equivalent: {o.equivalent})"
        print(f"| {o.rule} | `{o.file}`: {o.mutation} | {killed} |")
    survivors = [o for o in outcomes if o.killed is False and not o.equivalent]
    stale = [o for o in outcomes if o.killed is None]
    print(f"\n{len(outcomes)} mutants: {sum(o.killed is True for o in outcomes)} killed, "
          f"{len(survivors)} survived, {sum(o.killed is False and bool(o.equivalent) for o in outcomes)} "
          f"equivalent, {len(stale)} not applied")
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    return 1 if survivors or stale else 0


if __name__ == "__main__":
    sys.exit(main())
