"""Where the suite's time goes, per test module: a pytest plugin (registered by tests/conftest.py).

Every phase of every test (setup, call, teardown) is added to its module; at the end the slowest
modules are printed, one line each, before pytest's short test summary, and the whole table is
written as JSON (`--module-durations-json`, by default build/test-durations.json) for a script to
compare two runs. A module-scoped fixture counts in its module (its setup in the first test's, its
teardown in the last's); a session-scoped one in the module that first used it. Each row also says
when the module's first test began and its last ended (seconds from the session's start) and, under
xdist, which worker ran it: the lanes' timeline (tests/lanes.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SHOWN = 25  # the slowest modules printed; CI shows only the head and tail of the output
DEFAULT_JSON = "build/test-durations.json"


@dataclass
class ModuleTime:
    seconds: float = 0.0
    tests: set[str] = field(default_factory=set)
    began: float = float("inf")  # time.time() of its first phase's start
    ended: float = 0.0
    workers: set[str] = field(default_factory=set)


class ModuleDurations:
    def __init__(self, rootpath: Path, json_path: Path):
        self.rootpath = rootpath
        self.json_path = rootpath / json_path  # an absolute json_path stays as it is
        self.modules: dict[str, ModuleTime] = {}
        self.started = time.monotonic()
        self.started_at = time.time()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = self.modules.setdefault(report.nodeid.split("::")[0], ModuleTime())
        module.seconds += report.duration
        module.tests.add(report.nodeid)
        module.began, module.ended = min(module.began, report.start), max(module.ended, report.stop)
        if node := getattr(report, "node", None):  # the xdist worker that ran it
            module.workers.add(node.gateway.id)

    def table(self) -> list[dict]:
        """Every module, the slowest first."""
        rows = [{"module": name, "seconds": round(m.seconds, 2), "tests": len(m.tests),
                 "began": round(m.began - self.started_at, 1), "ended": round(m.ended - self.started_at, 1),
                 "workers": sorted(m.workers)}
                for name, m in self.modules.items()]
        return sorted(rows, key=lambda row: (-row["seconds"], row["module"]))

    @pytest.hookimpl(trylast=True)  # after --durations' list, right above the short test summary
    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.modules:
            return
        rows, wall = self.table(), time.monotonic() - self.started
        counted = sum(row["seconds"] for row in rows)
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps({"wall_seconds": round(wall, 2), "modules": rows}, indent=1) + "\n")
        shown_path = self.json_path.relative_to(self.rootpath) if self.json_path.is_relative_to(self.rootpath) \
            else self.json_path
        tr = terminalreporter
        tr.write_sep("=", f"slowest {min(SHOWN, len(rows))} of {len(rows)} modules: {counted:.0f} s in tests "
                          f"of {wall:.0f} s wall (all: {shown_path})")
        for row in rows[:SHOWN]:
            tr.write_line(f"{row['seconds']:8.1f} s {row['tests']:5d} tests  {row['module']}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--module-durations-json", default=DEFAULT_JSON,
                     help=f"where the per-module durations table goes (default {DEFAULT_JSON}, under the rootdir)")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sees every report and prints
        return
    config.pluginmanager.register(ModuleDurations(config.rootpath, Path(config.getoption("--module-durations-json"))),
                                  "module-durations")
