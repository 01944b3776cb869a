"""Fixtures of the operator tests against the real control plane (see cluster/testing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # specs.py, operator_harness.py

from adpfleet.cluster.apiproxy import CountingProxy  # noqa: E402
from adpfleet.cluster.testing import wait_for  # noqa: E402
from adpfleet.operator.resource import crd, names  # noqa: E402

from operator_harness import Fleets, OperatorProcess  # noqa: E402

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
    """start_operator(scope=None, **kwargs): an operator watching the test's namespace (or `scope`).
    At the end the test's fleets are deleted while it still runs (it owns their finalizer), then it
    is stopped; its log is printed when the test failed."""
    started: list[OperatorProcess] = []

    def start(scope: list[str] | None = None, **kwargs) -> OperatorProcess:
        op = OperatorProcess(api_proxy, tmp_path, scope or ["--namespace", k8s_namespace], **kwargs).start()
        started.append(op)
        return op

    yield start
    try:
        for fleet in fleets.custom.list_namespaced_custom_object(names.GROUP, names.VERSION, fleets.ns,
                                                                 names.PLURAL)["items"]:
            fleets.delete(fleet["metadata"]["name"])
        if any(op.running() for op in started):
            wait_for(lambda: not fleets.custom.list_namespaced_custom_object(
                names.GROUP, names.VERSION, fleets.ns, names.PLURAL)["items"], timeout=60,
                what="the test's fleets to be deleted")
    finally:
        for op in started:
            op.stop()
        fleets.drop_finalizers()
        failed = getattr(request.node, "rep_call", None)
        if started and (failed is None or failed.failed):
            print(f"---- operator log ({started[-1].log_path.parent}) ----\n{started[-1].log()[-20000:]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
