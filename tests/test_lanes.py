"""The suite's lanes (tests/lanes.py): under `-n 2 --dist loadgroup`, every module that uses the
cluster runs in one worker (one cluster), the second-cluster modules in the other, the modules that
share the server trio in one worker, each other module in one worker of its own choosing, and the
modules that must run alone after everything else has ended."""

import collections
from pathlib import Path

import lanes

# Stand-ins for the session fixtures the real plugins provide, so the grouping can be seen without
# starting anything: each test records which worker ran it.
CONFTEST = """
    import os, sys, time, pytest

    sys.path.insert(0, os.path.dirname(__file__))  # lanes.py, copied beside this file
    pytest_plugins = ["lanes"]

    @pytest.fixture(scope="session")
    def k8s_cluster():
        return "cluster"

    @pytest.fixture(scope="session")
    def server_trio():
        return "trio"

    @pytest.fixture(autouse=True)
    def _record(request):
        start = time.time()
        yield
        with open(os.path.join(str(request.config.rootpath), "ran.txt"), "a") as out:
            out.write(f"{request.node.nodeid} {os.environ['PYTEST_XDIST_WORKER']} {start} {time.time()}\\n")
"""


def module(fixture: str | None, tests: int = 3, marker: str | None = None, seconds: float = 0.0) -> str:
    head = f"import time, pytest\npytestmark = pytest.mark.{marker}\n" if marker else "import time\n"
    args = fixture or ""
    return head + "".join(f"def test_{n}({args}):\n    time.sleep({seconds})\n" for n in range(tests))


def test_modules_that_share_a_cluster_or_the_trio_run_in_one_worker(pytester):
    pytester.makepyfile(lanes=Path(lanes.__file__).read_text())
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    k8s: the cluster\n    vllm: vLLM\n")
    (pytester.path / "tests" / "operator").mkdir(parents=True)
    # The cluster's tests take a while, as the real ones do: with none, its worker can run all nine and take the next
    # group before the other worker, waiting for the unit after its one EARLY test, begins that test (likely one CI
    # run's failure: a passing run's first starts were 2-15 ms apart)
    files = {"tests/test_pods.py": module("k8s_cluster", seconds=0.3),
             "tests/test_fleet.py": module("k8s_cluster", seconds=0.3),
             "tests/test_vllm.py": module(None, marker="vllm"),  # marked: a cluster test without the fixture
             lanes.SECOND_CLUSTER[0]: module("k8s_cluster", tests=1),  # fewer tests than any other group
             lanes.ALONE[0]: module("k8s_cluster"), lanes.ALONE[-1]: module(None),
             "tests/test_disagg.py": module("server_trio"), "tests/test_fuzz.py": module("server_trio"),
             "tests/test_plain_a.py": module(None, tests=4, seconds=0.3), "tests/test_plain_b.py": module(None, tests=4),
             lanes.EARLY[0]: module(None, tests=1)}  # fewer tests than any plain group
    for path, text in files.items():
        (pytester.path / path).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / path).write_text(text)
    result = pytester.runpytest("-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3 * 7 + 1 + 2 * 4 + 1)
    workers, spans = collections.defaultdict(set), collections.defaultdict(list)
    for line in (pytester.path / "ran.txt").read_text().splitlines():
        nodeid, worker, start, end = line.split()
        workers[nodeid.split("::")[0]].add(worker)
        spans[nodeid.split("::")[0]].append((float(start), float(end)))
    assert all(len(w) == 1 for w in workers.values()), workers  # a module never splits
    one = lambda paths: set().union(*(workers[p] for p in paths))  # noqa: E731
    assert len(one(["tests/test_pods.py", "tests/test_fleet.py", "tests/test_vllm.py"])) == 1, workers
    # The two clusters' groups start first, one on each worker, though the second has the fewest tests.
    assert one(lanes.SECOND_CLUSTER) != one(["tests/test_pods.py"]), workers
    cluster = ["tests/test_pods.py", "tests/test_fleet.py", "tests/test_vllm.py"]
    for group in (cluster, [lanes.SECOND_CLUSTER[0]]):
        beside = [p for p in spans if workers[p] == workers[group[0]] and p not in group]
        assert min(start for p in group for start, _ in spans[p]) <= min(
            start for p in beside for start, _ in spans[p]), (group, spans)
    alone = [lanes.ALONE[0], lanes.ALONE[-1]]
    assert len(one(alone)) == 1, workers
    last_other_end = max(end for path, s in spans.items() if path not in alone for _, end in s)
    assert min(start for path in alone for start, _ in spans[path]) >= last_other_end, spans
    # in ALONE's order, not the collection's (the last is the first collected here)
    assert max(end for _, end in spans[lanes.ALONE[0]]) <= min(start for start, _ in spans[lanes.ALONE[-1]]), spans
    assert len(one(["tests/test_disagg.py", "tests/test_fuzz.py"])) == 1, workers
    # a long module of one test starts before the groups of more tests (after the clusters)
    first = lambda path: min(start for start, _ in spans[path])  # noqa: E731
    assert all(first(lanes.EARLY[0]) <= first(p) for p in ("tests/test_plain_a.py", "tests/test_plain_b.py",
                                                            "tests/test_disagg.py")), spans


def test_the_modules_the_lanes_name_exist():
    """A renamed module would silently move back to the first lane: unbalanced, or not alone."""
    root = Path(__file__).resolve().parents[1]
    for path in lanes.SECOND_CLUSTER:
        assert "pytest.mark.k8s" in (root / path).read_text(), path
    for path in lanes.ALONE + lanes.EARLY:
        assert (root / path).is_file(), path
