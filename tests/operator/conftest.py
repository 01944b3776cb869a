"""Fixtures of the operator tests against the real control plane (see cluster/testing.py)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # specs.py, operator_harness.py

from adpfleet.cluster.apiproxy import CountingProxy  # noqa: E402
from adpfleet.cluster.testing import fresh_namespace, wait_for  # noqa: E402
from adpfleet.operator.resource import crd, names  # noqa: E402

from operator_harness import Fleets, OperatorProcess, delete_fleets, operators, print_log  # noqa: E402

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / crd.FILE_NAME


@pytest.fixture(scope="session")
def fleet_crd(k8s_cluster):
    """The committed CRD file (tests/operator/test_crd.py keeps it equal to the models), installed."""
    k8s_cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    def established():
        conditions = k8s_cluster.get_json("crd", names.CRD_NAME).get("status", {}).get("conditions", [])
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)
    wait_for(established, timeout=60, what=f"CRD {names.CRD_NAME} to be Established")
    return names.CRD_NAME


@pytest.fixture(scope="session")
def api_proxy(k8s_cluster):
    with CountingProxy(k8s_cluster.kubeconfig) as proxy:
        yield proxy


@pytest.fixture
def fleets(k8s_cluster, k8s_namespace, fleet_crd) -> Fleets:
    return Fleets(k8s_cluster, k8s_namespace)


@pytest.fixture
def start_operator(api_proxy, k8s_namespace, fleets, tmp_path, request):
    """start_operator(scope=None, **kwargs): an operator watching the test's namespace (or `scope`),
    stopped after the test's fleets are deleted (`operator_harness.operators`); its log is printed
    when the test failed."""
    def failed() -> bool:
        report = getattr(request.node, "rep_call", None)
        return report is None or report.failed

    with operators(api_proxy, k8s_namespace, fleets, tmp_path, failed) as start:
        yield start


class SharedOperator(NamedTuple):
    process: OperatorProcess
    namespaces: dict[str, str]  # test node id -> the namespace made for it, which the operator watches


@pytest.fixture(scope="module")
def shared_operator(fleet_crd, k8s_cluster, tmp_path_factory, request):
    """One operator, with default settings, for the tests of a module that take `module_operator`.
    It watches a fresh namespace for each of them, made now (an operator's namespaces are fixed
    when it starts), and reaches the API server through a counting proxy of its own, so that the
    session's `api_proxy` counts only the requests of the operators a test started itself."""
    users = [item for item in request.session.items
             if getattr(item, "module", None) is request.module and "module_operator" in item.fixturenames]
    with contextlib.ExitStack() as stack:
        namespaces = {item.nodeid: stack.enter_context(fresh_namespace(k8s_cluster, item.name)) for item in users}
        proxy = stack.enter_context(CountingProxy(k8s_cluster.kubeconfig))
        scope = [arg for namespace in namespaces.values() for arg in ("--namespace", namespace)]
        op = OperatorProcess(proxy, tmp_path_factory.mktemp("shared-operator"), scope, name="shared-operator")
        stack.callback(op.stop)
        yield SharedOperator(op.start(), namespaces)


@pytest.fixture
def module_operator(shared_operator, k8s_namespace, fleets, request) -> OperatorProcess:
    """The module's shared operator, already watching this test's namespace: for a test that needs
    an operator with default settings and does not stop it, read its counters or count its requests
    (such a test takes `start_operator`). At the end the test's fleets are deleted, as with
    start_operator."""
    op = shared_operator.process
    assert op.running(), f"the module's shared operator exited (log: {op.log_path})"
    yield op
    try:
        delete_fleets(fleets, op.running())
    finally:
        fleets.drop_finalizers()
        print_log_if_failed(op, request)


@pytest.fixture
def k8s_namespace(k8s_cluster, request):
    """A fresh namespace per test (cluster/testing.py's); for a test that takes `module_operator`,
    the one made for it that the shared operator watches."""
    if "module_operator" in request.fixturenames:
        yield request.getfixturevalue("shared_operator").namespaces[request.node.nodeid]
        return
    with fresh_namespace(k8s_cluster, request.node.name) as name:
        yield name



def print_log_if_failed(op: OperatorProcess, request) -> None:
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed:
        print_log(op)

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
