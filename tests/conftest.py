import os
import sys

import pytest
import torch

# Several rank processes share two cores here; one intra-op thread each keeps them from fighting.
torch.set_num_threads(int(os.environ.get("ADPFLEET_TEST_THREADS", "1")))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "runtime"))
sys.path.insert(0, os.path.dirname(__file__))  # doc_commands.py: the docs' commands, as the tests run them

# Kubernetes fixtures (k8s_cluster, k8s_namespace) for tests against the local control plane.
pytest_plugins = ["adpfleet.cluster.testing"]


@pytest.fixture(scope="module")
def server_trio(tmp_path_factory):
    """Aggregated, context and generation servers (model tiny, 2 ADP ranks each, 64 KV blocks), shared
    by a module: the disaggregation tests, the router in front of real servers, the fuzzing."""
    from servers import trio

    with trio(tmp_path_factory.mktemp("trio"), "--kv-lease", "30") as servers:
        yield servers


def pytest_addoption(parser):
    # The model tests (kernel, parity) run where a user would run the model: bench/gpu_check.sh
    # passes --device cuda and each --dtype; the default is the CPU in float32.
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"), help="device for the model tests")
    parser.addoption("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype for the model tests")


@pytest.fixture(scope="session")
def device(request) -> str:
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.fail("--device cuda: torch sees no CUDA device on this machine")
    return name


@pytest.fixture(scope="session")
def dtype(request) -> torch.dtype:
    return getattr(torch, request.config.getoption("--dtype"))
