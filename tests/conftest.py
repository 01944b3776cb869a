import os
import sys

import pytest
import torch
from hypothesis import settings

# Several rank processes share two cores here; one intra-op thread each keeps them from fighting.
torch.set_num_threads(int(os.environ.get("ADPFLEET_TEST_THREADS", "1")))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "runtime"))
sys.path.insert(0, os.path.dirname(__file__))  # doc_commands.py: the docs' commands, as the tests run them

import budgets  # noqa: E402 - tests/, on the path from the line above

# Kubernetes fixtures (k8s_cluster, k8s_namespace) for tests against the local control plane; the
# per-module durations table printed at the end (tests/module_durations.py); which tests share a worker
# when ./scripts/test runs two (tests/lanes.py); pytester, which tests them.
pytest_plugins = ["adpfleet.cluster.testing", "module_durations", "lanes", "pytester"]


# The modules that use `server_trio` run one after another (pytest_collection_modifyitems), so the
# trio starts once and stops after its last test (pytest_runtest_teardown) rather than idling on
# (three idle servers of 2 ranks take about a third of a core) to the end of the session. These run
# last among them: they leave KV held on the context server until its lease ends, which the others
# would count (test_disagg: pulled KV is freed; test_fuzz_http: fuzzing frees none).
TRIO_MODULES_LAST = ("test_router_real.py",)
_trio: dict = {"servers": None, "last_user": None}


@pytest.fixture(scope="session")
def server_trio(tmp_path_factory):
    """Aggregated, context and generation servers (model tiny, 2 ADP ranks each, 64 KV blocks), shared
    by the disaggregation tests, the router in front of real servers, the fuzzing."""
    from servers import trio

    with trio(tmp_path_factory.mktemp("trio"), "--kv-lease", "30") as servers:
        _trio["servers"] = servers
        yield servers


def pytest_collection_modifyitems(session, config, items):
    users = [i for i in items if "server_trio" in getattr(i, "fixturenames", ())]
    if not users:
        return
    modules = list(dict.fromkeys(i.path for i in users))
    modules.sort(key=lambda path: path.name in TRIO_MODULES_LAST)  # stable: collection order otherwise
    grouped = [i for path in modules for i in items if i.path == path]
    first = next(n for n, i in enumerate(items) if i.path in modules)
    rest = [i for i in items if i.path not in modules]
    items[:] = rest[:first] + grouped + rest[first:]


def pytest_collection_finish(session):
    users = [i for i in session.items if "server_trio" in getattr(i, "fixturenames", ())]
    _trio["last_user"] = users[-1] if users else None


def pytest_runtest_teardown(item, nextitem):
    if item is _trio["last_user"] and _trio["servers"]:
        for server in _trio["servers"].values():
            server.stop()


def pytest_addoption(parser):
    # The model tests (kernel, parity) run where a user would run the model: bench/gpu_check.sh
    # passes --device cuda and each --dtype; the default is the CPU in float32.
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"), help="device for the model tests")
    parser.addoption("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype for the model tests")
    parser.addoption("--deep", action="store_true",
                     help="the full search budgets (tests/budgets.py); the same as HYPOTHESIS_PROFILE=deep")


# Property tests without a budget of their own get Hypothesis's default (100 examples) in the deep
# profile and the CI share of it otherwise; those with one take it from budgets.examples().
settings.register_profile("deep", max_examples=100)
settings.register_profile("ci", max_examples=budgets.ci_examples(100))


def pytest_configure(config):
    if config.getoption("--deep"):
        os.environ["HYPOTHESIS_PROFILE"] = "deep"  # budgets.deep() reads it when the test modules are imported
    settings.load_profile("deep" if budgets.deep() else "ci")


@pytest.fixture(scope="session")
def device(request) -> str:
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda: torch sees no CUDA device on this machine")
    return name


@pytest.fixture(scope="session")
def dtype(request) -> torch.dtype:
    return getattr(torch, request.config.getoption("--dtype"))


