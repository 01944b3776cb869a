"""The operator process itself: liveness from real heartbeats, /metrics, JSON logs, graceful
shutdown, and namespace-scoped or cluster-wide watching. The tests that neither stop the operator
nor give it flags share the module's (`module_operator`)."""

import json
import time

import pytest
from kubernetes import client

from adpfleet.cluster.testing import wait_for

from operator_harness import Fleets
from specs import fleet_manifest



@pytest.mark.k8s
def test_metrics_count_reconciles_durations_and_every_api_request(module_operator, fleets):
    op = module_operator  # shared with the module's other tests: its counters are read as what this fleet added
    before = op.metrics()
    fleets.apply(fleet_manifest("demo", status_only=True, router={"enabled": False}))
    fleets.wait_ready("demo")
    assert op.metric("adpfleet_operator_reconciles_total", since=before, result="ok") >= 1
    assert op.metric("adpfleet_operator_reconcile_duration_seconds_count", since=before) >= 1
    assert op.metric("adpfleet_operator_api_requests_total", since=before, verb="create", resource="pods") == 2
    assert op.metric("adpfleet_operator_api_requests_total", since=before, verb="patch",
                     resource="inferencefleets/status") >= 1
    assert op.metric("adpfleet_operator_actions_total", since=before, action="CreateServer") == 2
    assert op.metric("adpfleet_operator_fleets") == 1  # a gauge: the earlier tests' fleets are gone
    assert op.metric("adpfleet_operator_reconcile_errors_total", since=before) == 0


@pytest.mark.k8s
def test_liveness_follows_the_reconcile_loops_heartbeat(start_operator, fleets, api_proxy):
    """A pass stuck on the API server (writes held at the proxy) turns /healthz 503 after
    --stuck-seconds; when it completes, /healthz is 200 again."""
    op = start_operator(extra_args=("--stuck-seconds", "2"))
    fleets.apply(fleet_manifest("demo", status_only=True, router={"enabled": False}))
    fleets.wait_ready("demo")
    code, body = op.healthz()
    assert code == 200 and f"{fleets.ns}/demo" in body["fleets"]

    with api_proxy.writes_held():
        fleets.patch_spec("demo", {"context": {"servers": 2}})  # the next pass creates a pod: held
        code, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(op.healthz()), timeout=20,
                              what="/healthz to report the stuck pass")
        assert f"reconcile of {fleets.ns}/demo has been running for" in body["problems"][0]
    wait_for(lambda: op.healthz()[0] == 200, timeout=20, what="/healthz to recover")
    fleets.wait_ready("demo")


@pytest.mark.k8s
def test_given_a_certificate_the_webhook_is_served_over_tls_and_not_over_plain_http(start_operator, tmp_path):
    import ssl

    import httpx

    from operator_harness import free_port
    from test_webhook_tls import issue, make_ca

    ca_key, ca_cert, ca = make_ca(tmp_path)
    crt, key, _ = issue(tmp_path, ca_key, ca_cert, "operator")
    port = free_port()
    op = start_operator(extra_args=("--alerts-tls-cert", str(crt), "--alerts-tls-key", str(key),
                                    "--alerts-port", str(port)))
    assert op._get("/alerts")[0] == 404 and op._get("/healthz")[0] == 200  # the HTTP port has no webhook
    with httpx.Client(verify=ssl.create_default_context(cafile=str(ca))) as tls:
        # a real TLS handshake with the process; no token Secret is configured, so a retryable 503
        r = tls.post(f"https://127.0.0.1:{port}/alerts", json={"version": "4", "alerts": []},
                     headers={"Authorization": "Bearer x"})
    assert r.status_code == 503 and "webhook token is not available" in r.json()["error"]["message"]
    assert op.stop() == 0


@pytest.mark.k8s
def test_logs_are_json_lines_naming_the_fleet(start_operator, fleets):
    op = start_operator()
    fleets.apply(fleet_manifest("demo", status_only=True, router={"enabled": False}))
    fleets.wait_ready("demo")
    assert op.stop() == 0
    lines = [json.loads(line) for line in op.log().splitlines() if line.strip()]
    assert all({"message", "severity", "timestamp"} <= set(line) for line in lines)
    created = [line for line in lines if line["message"].startswith("created context server demo-context-0")]
    assert created and created[0]["object"]["name"] == "demo" and created[0]["object"]["namespace"] == fleets.ns


@pytest.mark.k8s
def test_sigterm_stops_the_operator_promptly_and_cleanly(start_operator, fleets):
    op = start_operator()
    fleets.apply(fleet_manifest("demo", status_only=True, router={"enabled": False}))
    fleets.wait_ready("demo")
    start = time.monotonic()
    assert op.stop(timeout=20) == 0
    assert time.monotonic() - start < 10
    assert '"stopped"' in op.log()


@pytest.mark.k8s
def test_a_namespace_scoped_operator_leaves_other_namespaces_alone(module_operator, fleets, k8s_cluster):
    other = f"{fleets.ns[:50]}-other"
    k8s_cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=other)))
    try:
        elsewhere = Fleets(k8s_cluster, other)
        elsewhere.apply(fleet_manifest("stranger", status_only=True))
        fleets.apply(fleet_manifest("demo", status_only=True))
        fleets.wait_ready("demo")
        time.sleep(2)
        assert "status" not in elsewhere.get("stranger") and elsewhere.pods("stranger") == []
        assert not elsewhere.get("stranger")["metadata"].get("finalizers")
    finally:
        k8s_cluster.core.delete_namespace(other)


@pytest.mark.k8s
def test_a_cluster_wide_operator_reconciles_fleets_in_every_namespace(start_operator, fleets, k8s_cluster):
    other = f"{fleets.ns[:50]}-other"
    k8s_cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=other)))
    elsewhere = Fleets(k8s_cluster, other)
    wait_for(lambda: k8s_cluster.core.read_namespaced_service_account("default", other), timeout=30,
             what="the default service account")
    op = start_operator(scope=["--all-namespaces"])
    try:
        fleets.apply(fleet_manifest("demo", status_only=True, router={"enabled": False}))
        elsewhere.apply(fleet_manifest("demo", status_only=True, router={"enabled": False}))
        fleets.wait_ready("demo")
        elsewhere.wait_ready("demo")
        elsewhere.delete("demo")
        wait_for(lambda: elsewhere.owned_objects("demo") == [], timeout=30, what="the other fleet's pods to go")
    finally:
        op.stop()
        elsewhere.drop_finalizers()  # in case the test failed before the fleet was deleted
        k8s_cluster.core.delete_namespace(other)


@pytest.mark.parametrize("served,refused", [([], True), (["v1beta9"], True), (["v1alpha1"], False)])
def test_the_operator_refuses_to_start_without_the_crd_and_says_how_to_install_it(monkeypatch, served, refused):
    from types import SimpleNamespace

    from adpfleet.operator.adapters import kube

    group = SimpleNamespace(name="adpfleet.io", versions=[SimpleNamespace(version=v) for v in served])
    apis = SimpleNamespace(get_api_versions=lambda **_: SimpleNamespace(groups=[group] if served else []))
    monkeypatch.setattr(kube.client, "ApisApi", lambda _api_client: apis)
    if refused:
        with pytest.raises(ValueError, match=r"install the CRD first, e.g. `adpfleet crds \| kubectl apply"):
            kube.require_crd(None)
    else:
        kube.require_crd(None)
