"""The per-module durations table (tests/module_durations.py): every phase of a test counts in its
module, the slowest module comes first, the table prints before the short test summary, and the
whole of it is written as JSON."""

import json

PLUGIN = ["-p", "module_durations", "-p", "no:cacheprovider"]


def test_the_table_sums_each_modules_phases_slowest_first_and_prints_before_the_short_summary(pytester):
    pytester.makepyfile(
        test_slow="""
            import time, pytest

            @pytest.fixture
            def slow_teardown():
                yield
                time.sleep(0.3)

            def test_one(slow_teardown):
                time.sleep(0.2)

            def test_two():
                assert False
        """,
        test_fast="""
            def test_quick():
                pass
        """)
    result = pytester.runpytest("-ra", "--durations=5", *PLUGIN, "--module-durations-json", "out/table.json")
    result.assert_outcomes(passed=2, failed=1)
    table = json.loads((pytester.path / "out" / "table.json").read_text())
    assert [row["module"] for row in table["modules"]] == ["test_slow.py", "test_fast.py"]
    slow = table["modules"][0]
    assert slow["tests"] == 2
    assert 0.5 <= slow["seconds"] < 5  # the call's 0.2 s and the teardown's 0.3 s
    assert table["wall_seconds"] >= slow["seconds"]
    fast = table["modules"][1]  # the timeline: one module after the other, each inside the session
    for module in (slow, fast):
        assert 0 <= module["began"] <= module["ended"] <= table["wall_seconds"] + 0.1, module
        assert module["workers"] == []  # no xdist here
    assert slow["ended"] - slow["began"] >= 0.45, slow  # 0.5 s of its tests' phases, rounded to 0.1 s
    assert fast["ended"] <= slow["began"] + 0.1 or slow["ended"] <= fast["began"] + 0.1, table
    lines = result.outlines
    header = next(n for n, line in enumerate(lines) if "slowest 2 of 2 modules" in line)
    assert "test_slow.py" in lines[header + 1] and "2 tests" in lines[header + 1]
    assert "test_fast.py" in lines[header + 2]
    durations = next(n for n, line in enumerate(lines) if "slowest 5 durations" in line)
    short_summary = next(n for n, line in enumerate(lines) if "short test summary info" in line)
    assert durations < header < short_summary


def test_no_table_when_no_test_ran(pytester):
    pytester.makepyfile(test_empty="")
    result = pytester.runpytest(*PLUGIN)
    assert not any("modules:" in line for line in result.outlines)
    assert not (pytester.path / "build").exists()
