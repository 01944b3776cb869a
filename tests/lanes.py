"""The suite's two lanes: a pytest plugin (registered by tests/conftest.py) that decides which tests
run in the same worker when `./scripts/test` runs them in two (pytest-xdist, `-n 2 --dist loadgroup`).

Most of the suite's time is waiting (a pod to start, a window to pass, a stall to be seen) while the
other core idles; two workers fill it. A worker is a whole pytest session, so what a session fixture
holds is per worker, and the groups follow from that:

- every module whose tests use the local cluster (`k8s_cluster`, or marked k8s or vllm) is in the
  group `cluster`, run by the one worker that starts that cluster; the modules in SECOND_CLUSTER are
  in `cluster-2` instead, on a cluster of their own (each worker's cluster has its own state
  directory, ports and pod addresses: cluster/agent/addresses.py), which balances the two lanes;
- the modules that share `server_trio` are in the group `trio`, so the trio starts once;
- any other module is a group of its own, so its module-scoped servers start once;
- a module may name its group itself with `pytest.mark.xdist_group(name)`;
- the modules in ALONE, whose assertions hold a server or a process to wall-clock bounds that are
  the product's for one that has its cores (a waiter woken within 0.1 s, /health answered within
  its bound under a hostile client, an autoscaler reading the load its servers report, every
  request answered by its deadline while servers restart), are the group `alone`: it runs last,
  in one worker, once the other has finished and left, so nothing of the suite competes with it
  for the cores. On two loaded lanes (load average 6-7) those bounds failed.

xdist's own `loadgroup` reads `xdist_group` markers by rewriting node ids, which pytest 9 no longer
lets it do, so this plugin schedules the groups itself: each worker writes the group of every test
it collected into a directory the controller made, and the controller's scheduler (xdist's
`loadscope`, by group instead of by module) reads them. Without xdist nothing here runs."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

# Enough of the cluster tests' time (build/test-durations.json) that the second lane, with every test that needs
# no cluster, ends about when the first does.
SECOND_CLUSTER = ("tests/operator/test_model_sources_e2e.py", "tests/operator/test_termination.py")
# In the order they run. The vLLM modules go last: each leaves a replacement server starting (a DP=2 vLLM
# start is six processes importing torch), which went on eating the cores under the next module's bounds
# until its namespace's deletion reached the pod (test_hostile: 51 s run after nothing, 84 s after them).
ALONE = ("tests/router/test_router_queue.py", "tests/runtime/test_hostile.py", "tests/operator/test_scaling_k8s.py",
         "tests/operator/test_stall_e2e.py", "tests/operator/test_vllm_fleet_e2e.py",
         "tests/operator/test_vllm_dp_e2e.py")
# Long modules of few tests, each a group of its own: xdist orders groups by their count of tests, which put
# these last, and the worker that took the last of them (test_gpu_check, 47 s) ended 43 s after the other,
# which waited for it to begin the `alone` phase. Started right after the clusters, they leave the many
# short modules to even the lanes' ends.
EARLY = ("tests/test_gpu_check.py", "tests/runtime/test_progress_search.py", "tests/runtime/test_rank_failure.py",
         "tests/runtime/test_faults.py", "tests/runtime/test_drain.py")
ALONE_GROUP = "alone"
CLUSTER_GROUPS = ("cluster", "cluster-2")
CLUSTER_MARKS = ("k8s", "vllm")
_LANES_DIR = pytest.StashKey[str]()


def group_of(module: str, items: list[pytest.Item]) -> str:
    """The group of a test module, from its tests (`module` is its path from the rootdir)."""
    def uses(item: pytest.Item, fixture: str) -> bool:
        return fixture in getattr(item, "fixturenames", ())

    named = next((m for i in items if (m := i.get_closest_marker("xdist_group"))), None)
    if named:
        return str(named.args[0] if named.args else named.kwargs.get("name", "default"))
    if module in ALONE:
        return ALONE_GROUP
    if any(uses(i, "k8s_cluster") or any(i.get_closest_marker(m) for m in CLUSTER_MARKS) for i in items):
        return CLUSTER_GROUPS[1] if module in SECOND_CLUSTER else CLUSTER_GROUPS[0]
    if any(uses(i, "server_trio") for i in items):
        return "trio"
    return module


def groups(items: list[pytest.Item]) -> dict[str, str]:
    """Every test's group, by node id."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    return {item.nodeid: group_of(module, module_items)
            for module, module_items in modules.items() for item in module_items}


@pytest.hookimpl(trylast=True)  # the node ids are final
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    lanes_dir = getattr(config, "workerinput", {}).get("adpfleet_lanes_dir")
    if not lanes_dir:  # not an xdist worker of ours
        return
    # `alone` runs in ALONE's order (a group's tests go to its worker in the order collected); the same
    # order in every worker, as xdist requires
    items.sort(key=lambda item: ALONE.index(module) if (module := item.nodeid.split("::")[0]) in ALONE else -1)
    path = Path(lanes_dir) / f"{config.workerinput['workerid']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(groups(items)))
    path.with_suffix(".tmp").replace(path)  # whole, before the worker says its collection is done


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """The controller, for each worker it starts: where to write the groups."""
    config = node.config
    if _LANES_DIR not in config.stash:
        config.stash[_LANES_DIR] = tempfile.mkdtemp(prefix="adpfleet-lanes-")
    node.workerinput["adpfleet_lanes_dir"] = config.stash[_LANES_DIR]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        """xdist's loadscope with this plugin's groups as the scopes; it schedules once every worker
        has collected, so their files are there. The two clusters' groups go first, one to each
        worker: each is much of a lane in few tests, and ordered by their count of tests, as xdist
        orders scopes, the second cluster's came after most of the suite. Then EARLY's modules, then the
        group with the most tests; `alone` last: a worker that finds only it left leaves (its session ends), and
        the last worker takes it once the others are gone. (A worker runs a test only when it knows
        the next one, so a worker that waits for work still holds its last test: it must leave, not
        wait beside.)"""
        _groups: dict[str, str] | None = None

        def _assign_work_unit(self, node) -> None:
            if ALONE_GROUP in self.workqueue:
                self.workqueue.move_to_end(ALONE_GROUP)
            for group in reversed(CLUSTER_GROUPS + EARLY):  # the longest, whatever their count of tests
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            if next(iter(self.workqueue)) != ALONE_GROUP:
                return super()._assign_work_unit(node)
            others = [n for n in self.assigned_work if n is not node]
            if any(not n.shutting_down for n in others):
                node.shutdown()
            elif not others:
                super()._assign_work_unit(node)
            # else the others are leaving: remove_node hands `alone` on when the last has gone

        def remove_node(self, node):
            crashed = super().remove_node(node)
            for other in list(self.assigned_work):
                self._reschedule(other)
            return crashed

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                written = sorted(Path(config.stash[_LANES_DIR]).glob("*.json"))  # the same in each
                self._groups = json.loads(written[0].read_text())
            return self._groups.get(nodeid) or nodeid.split("::")[0]

    return LaneScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    if lanes_dir := config.stash.get(_LANES_DIR, None):
        shutil.rmtree(lanes_dir, ignore_errors=True)
