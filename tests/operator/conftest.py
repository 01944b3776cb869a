"""Fixtures of the operator tests against the real control plane (see cluster/testing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # specs.py, operator_harness.py

from adpfleet.cluster.apiproxy import CountingProxy  # noqa: E402
from adpfleet.cluster.testing import wait_for  # noqa: E402
from adpfleet.operator.resource import crd, names  # noqa: E402

from operator_harness import Fleets, operators  # noqa: E402

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
