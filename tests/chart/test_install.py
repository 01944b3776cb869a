"""`helm install` into the real API server. The node agent runs the chart's operator Deployment as a
process with its own service-account token, so a fleet that becomes Ready and answers a request
proves the chart's RBAC is enough; requests outside it, refused, prove it is no more than that.

One release for the module (installing it and running a fleet is most of the cost): the tests run
in file order and each leaves the release as it found it.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import pathlib
import re
import secrets
import subprocess
import time

import httpx
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import wait_for

import doc_commands
from helm_chart import CHART, EXAMPLES, ROOT, helm

pytestmark = pytest.mark.k8s

RELEASE = "adpfleet"  # the docs' release: the chart names its objects "adpfleet", as the runbooks do
FULLNAME = "adpfleet"
FLEET = "tiny"
INSTALL_MD = ROOT / "docs" / "install.md"
TIMINGS: dict[str, float] = {}  # what bench/install.py reports (it sets ADPFLEET_INSTALL_TIMINGS to a path)


@pytest.fixture(scope="module", autouse=True)
def timings():
    yield TIMINGS
    if path := os.environ.get("ADPFLEET_INSTALL_TIMINGS"):
        pathlib.Path(path).write_text(json.dumps(TIMINGS, indent=2))


def install_md(section: str) -> list[doc_commands.Block]:
    """The command blocks of a section of docs/install.md that a test runs."""
    return [b for b in doc_commands.blocks(INSTALL_MD, section) if not b.not_run]


def _namespace(cluster, prefix: str, labels: dict | None = None) -> str:
    name = f"{prefix}-{secrets.token_hex(3)}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels)))
    wait_for(lambda: cluster.core.read_namespaced_service_account("default", name), timeout=30,
             what=f"the default service account in {name}")
    return name


@pytest.fixture(scope="module")
def namespace(k8s_cluster):
    """The release's namespace: docs/install.md's Quickstart creates it (`release`) and labels it so
    that the restricted Pod Security Standard is enforced: the operator's pod (and the fleet's) must
    meet it."""
    ns = f"chart-{secrets.token_hex(3)}"
    yield ns
    helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s", kubeconfig=k8s_cluster.kubeconfig, check=False)
    k8s_cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def other_namespace(k8s_cluster):
    ns = _namespace(k8s_cluster, "chart-other")
    k8s_cluster.core.create_namespaced_secret(ns, client.V1Secret(metadata=client.V1ObjectMeta(name="not-yours"),
                                                                  string_data={"password": "s3cret"}))
    yield ns
    k8s_cluster.core.delete_namespace(ns)


def diagnosis(cluster, namespace: str) -> str:
    """The namespace's pods, events and the operator's logs (this run's and the previous one's)."""
    parts = [cluster.kubectl("get", "pods,inferencefleets", "-n", namespace, "-o", "wide", check=False).stdout,
             cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
    for previous in ("--previous", ""):
        proc = cluster.kubectl("logs", f"deployment/{FULLNAME}", "-n", namespace, "--tail=40", *filter(None, [previous]),
                               check=False)
        parts.append(f"--- operator logs {previous or '(current)'}:\n{proc.stdout}{proc.stderr}")
    return "\n".join(parts)


@pytest.fixture(scope="module")
def release(k8s_cluster, namespace):
    """Installed by the first block of docs/install.md's Quickstart, as written (the namespace is
    this module's): what it prints is the release's NOTES."""
    install, *_ = install_md("Quickstart")
    start = time.monotonic()
    try:
        out = doc_commands.run(install.commands, doc_commands.Place(namespace, FLEET), k8s_cluster, timeout=240)
    except AssertionError as failed:
        raise AssertionError(f"{failed}\n{diagnosis(k8s_cluster, namespace)}") from None
    TIMINGS["helm install, rollout status (operator Ready)"] = time.monotonic() - start
    return out


@pytest.fixture
def explain(k8s_cluster, namespace, request):
    """On failure, print what the cluster shows (pytest reports the test's captured output)."""
    yield
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(diagnosis(k8s_cluster, namespace))


def _operator_pods(cluster, namespace: str) -> list:
    """The operator's replicas (not those already terminating)."""
    pods = cluster.core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=operator,"
                                                                      f"app.kubernetes.io/instance={RELEASE}").items
    return [p for p in pods if p.metadata.deletion_timestamp is None]


def _role(pod) -> str | None:
    """'leader' or 'standby', as the replica itself says on /readyz."""
    try:
        r = httpx.get(f"http://{pod.status.pod_ip}:8080/readyz", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json().get("role") if r.status_code == 200 else None


def _operator_pod(cluster, namespace: str):
    """The replica that acts: it holds the Lease (named like the release) and says so on /readyz."""
    def leader():
        lease = client.CoordinationV1Api(cluster.api_client).read_namespaced_lease(FULLNAME, namespace)
        holder = (lease.spec.holder_identity or "").rsplit("_", 1)[0]
        pods = [p for p in _operator_pods(cluster, namespace) if p.metadata.name == holder]
        return pods[0] if pods and _role(pods[0]) == "leader" else None
    return wait_for(leader, timeout=60, what="an operator replica holding the Lease")


def _fleet_condition(cluster, namespace: str, name: str, type_: str) -> str | None:
    fleet = cluster.get_json("inferencefleet", name, "-n", namespace)
    return {c["type"]: c["status"] for c in fleet.get("status", {}).get("conditions", [])}.get(type_)


def _operator_metrics(cluster, namespace: str) -> str:
    return httpx.get(f"http://{_operator_pod(cluster, namespace).status.pod_ip}:8080/metrics", timeout=10).text


def _sa_client(cluster, namespace: str) -> client.ApiClient:
    """An API client that authenticates as the chart's service account, with a token from the
    TokenRequest API (what the pod's projected token is)."""
    request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[],
                                                                                 expiration_seconds=600))
    token = cluster.core.create_namespaced_service_account_token(FULLNAME, namespace, request).status.token
    config = copy.copy(cluster.api_client.configuration)
    config.cert_file = config.key_file = None
    config.api_key = {"authorization": token}
    config.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(config)


def test_install_runs_the_operator_under_its_service_account_and_it_reconciles_a_fleet(
        k8s_cluster, namespace, release, explain):
    pod = _operator_pod(k8s_cluster, namespace)
    assert pod.spec.service_account_name == FULLNAME
    # two replicas, both Ready: the one holding the Lease acts, the other stands by
    replicas = _operator_pods(k8s_cluster, namespace)
    assert len(replicas) == 2 and all(any(c.type == "Ready" and c.status == "True" for c in p.status.conditions)
                                      for p in replicas)
    assert sorted(_role(p) for p in replicas) == ["leader", "standby"]
    assert k8s_cluster.get_json("pdb", FULLNAME, "-n", namespace)["spec"]["maxUnavailable"] == 1
    # the namespace really enforces the restricted profile: the operator's pod passed it
    privileged = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "privileged"},
                  "spec": {"containers": [{"name": "c", "image": "x", "command": ["true"],
                                           "securityContext": {"privileged": True}}]}}
    refused = k8s_cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                                  input=json.dumps(privileged), check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    assert any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions)
    assert k8s_cluster.get_json("crd", "inferencefleets.adpfleet.io")["spec"]["group"] == "adpfleet.io"
    # NOTES.txt: what to do next, for this namespace
    assert f"kubectl -n {namespace} rollout status deployment/{FULLNAME}" in release
    assert f"http://{FULLNAME}.{namespace}.svc:8080/alerts" in release and "helm show crds" in release
    assert "auth: {apiKeySecret: {name: tiny-api-key, key: key}}" in release  # its fleet has the required key

    # docs/install.md's Quickstart: the API key Secret and the example fleet, as written
    _, fleet, request = install_md("Quickstart")
    here = doc_commands.Place(namespace, FLEET)
    start = time.monotonic()
    doc_commands.run(fleet.commands[:2], here, k8s_cluster)
    for role in ("context", "generation"):
        k8s_cluster.wait_for_pod(namespace, f"{FLEET}-{role}-0", timeout=180)
    TIMINGS["fleet applied -> both servers Ready"] = time.monotonic() - start
    doc_commands.run(fleet.commands[2:], here, k8s_cluster)  # until READY becomes True
    assert _fleet_condition(k8s_cluster, namespace, FLEET, "Ready") == "True"
    TIMINGS["fleet applied -> fleet Ready (router included)"] = time.monotonic() - start
    api_key = base64.b64decode(k8s_cluster.core.read_namespaced_secret("tiny-api-key", namespace).data["key"]).decode()

    router = k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"app.kubernetes.io/instance={FLEET},app.kubernetes.io/component=router").items[0]
    assert router.spec.service_account_name == f"{FLEET}-router"  # made and bound by the operator

    def complete(key=api_key):
        r = httpx.post(f"http://{router.status.pod_ip}:8000/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
                       headers={"Authorization": f"Bearer {key}"})
        return r.json() if r.status_code == 200 else r.status_code
    body = wait_for(lambda: (lambda out: out if isinstance(out, dict) else None)(complete()), timeout=60,
                    what="a completion through the fleet's router", interval=1)
    assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    TIMINGS["fleet applied -> first completion"] = time.monotonic() - start
    answer = json.loads(doc_commands.run(request.commands, here, k8s_cluster))  # the page's request, as written
    # the page's request samples (no temperature), so the tiny model may draw its end-of-text token early
    used, finish = answer["usage"]["completion_tokens"], answer["choices"][0]["finish_reason"]
    assert (used, finish) == (16, "length") or (0 < used < 16 and finish == "stop"), answer
    assert complete("not-the-key") == 401
    # the chart's default: the operator's own NetworkPolicy and the fleet's, accepted by the API server
    policies = {p.metadata.name for p in client.NetworkingV1Api(k8s_cluster.api_client)
                .list_namespaced_network_policy(namespace).items}
    assert policies == {FULLNAME, f"{FLEET}-servers", f"{FLEET}-kv", f"{FLEET}-router"}

    # Every request the operator made was allowed: none answered 403.
    counts = re.findall(r'^adpfleet_operator_api_requests_total\{code="(\d+)",resource="([^"]+)",verb="([^"]+)"\}',
                        _operator_metrics(k8s_cluster, namespace), re.M)
    assert counts, "the operator's /metrics has no API request counts"
    assert not [c for c in counts if c[0] == "403"], counts
    assert {(r, v) for _, r, v in counts} >= {("pods", "create"), ("deployments", "patch"), ("roles", "patch"),
                                              ("rolebindings", "patch"), ("inferencefleets/status", "patch"),
                                              ("secrets", "create"), ("networkpolicies", "patch")}
    assert not [c for c in counts if c[1] == "secrets" and c[2] != "create"], counts  # never reads one
    print("\n".join(f"{k:50s} {v:6.1f} s" for k, v in TIMINGS.items()))


# ---- every runbook command, run against this release and its fleet ---------------------------------
# a vLLM fleet's runbook reads vllm: series, which the release's adpfleet fleet does not have: its commands run
# against a vLLM fleet in tests/operator/test_vllm_fleet_e2e.py
RUNBOOKS = sorted(p for p in (ROOT / "docs" / "runbooks").glob("*.md") if not p.stem.endswith("-vllm"))


@pytest.mark.parametrize("page", RUNBOOKS, ids=[p.stem for p in RUNBOOKS])
def test_every_runbook_command_runs_against_the_release(k8s_cluster, namespace, release, page):
    """Every command of the runbook, in order in one shell (a command may use what an earlier one
    set), succeeds against the chart's release and its Ready example fleet."""
    commands = [c for block in doc_commands.blocks(page) for c in block.commands]
    assert commands, f"{page.name} has no commands"
    doc_commands.run(commands, doc_commands.Place(namespace, FLEET), k8s_cluster, timeout=120)


def test_install_md_commands_read_the_release_as_documented(k8s_cluster, namespace, release):
    """docs/install.md's Lease and budget (the tables it shows), the webhook token, and the s3://
    credentials Secret, run against the release."""
    here = doc_commands.Place(namespace, FLEET)
    lease_and_budget, = [b for b in doc_commands.blocks(INSTALL_MD, "Values") if "get lease" in b.text]
    holder, _ = doc_commands.run_console(lease_and_budget, here, k8s_cluster)
    assert holder.rsplit("_", 1)[0] == _operator_pod(k8s_cluster, namespace).metadata.name
    token_block, = [b for b in install_md("Prometheus and Alertmanager") if "secret adpfleet-webhook" in b.text]
    token = doc_commands.run(token_block.commands, here, k8s_cluster)
    assert token == base64.b64decode(
        k8s_cluster.core.read_namespaced_secret(f"{FULLNAME}-webhook", namespace).data["token"]).decode()
    s3, = [b for b in install_md("Pointing a fleet at its weights") if "s3-models" in b.text]
    doc_commands.run(s3.commands, here, k8s_cluster)
    assert set(k8s_cluster.core.read_namespaced_secret("s3-models", namespace).data) == {
        "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}


OPERATOR_MD = ROOT / "docs" / "operator.md"


def test_operator_md_commands_start_an_operator_and_a_standby_of_the_release(
        k8s_cluster, namespace, other_namespace, release):
    """docs/operator.md's `adpfleet operator` command lines, as written (the optional part in
    brackets included): each starts and turns ready; the one with leader election joins the
    release's Lease as its standby. team-a and team-b are namespaces without fleets; the chart's
    operator pods hold port 8080 on this machine, so each listens on a free port."""
    here = doc_commands.Place(namespace, FLEET, renamed=(("team-a", other_namespace), ("team-b", "default")))
    commands = [c for b in doc_commands.blocks(OPERATOR_MD, "Running it") for c in b.commands]
    assert [c.split()[:2] for c in commands] == [["adpfleet", "operator"]] * 2, commands
    listed, = doc_commands.blocks(OPERATOR_MD, "")  # `kubectl get ifleet`, and the columns it shows
    doc_commands.run_console(listed, here, k8s_cluster)
    started = []  # both at once: most of their start is importing
    for command in commands:
        port = free_port()
        line = doc_commands.as_run_here(command.replace("[", "").replace("]", ""), here)
        started.append((line, port, subprocess.Popen(
            ["bash", "-c", f"exec {line} --http-host 127.0.0.1 --http-port {port}"],
            env=doc_commands.shell_env(k8s_cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    try:
        for line, port, proc in started:
            def ready(proc=proc, port=port):
                if proc.poll() is not None:
                    return {"exited": proc.returncode}
                try:
                    r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                except httpx.HTTPError:
                    return None
                return r.json() if r.status_code == 200 else None
            answer = wait_for(ready, timeout=90, what=f"{line} to be ready", interval=0.5)
            assert "exited" not in answer, f"{line} exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}"
            if "--leader-elect" in line:
                assert answer.get("role") == "standby", answer  # the chart's leader holds the Lease
    finally:
        for _, _, proc in started:
            proc.terminate()
        for _, _, proc in started:
            proc.wait(timeout=30)


def test_the_webhook_receiver_reads_its_token_from_the_chart_secret(k8s_cluster, namespace, release):
    secret = k8s_cluster.core.read_namespaced_secret(f"{FULLNAME}-webhook", namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    url = f"http://{_operator_pod(k8s_cluster, namespace).status.pod_ip}:8080/alerts"
    payload = {"version": "4", "alerts": []}

    def post(bearer: str) -> httpx.Response:
        return httpx.post(url, json=payload, headers={"Authorization": f"Bearer {bearer}"}, timeout=10)
    assert wait_for(lambda: post(token).status_code == 202, timeout=30, what="the webhook to accept the token")
    assert post("not-the-token").status_code == 401
    # the standby acts on no alert: 503 and Retry-After, so Alertmanager retries (and reaches the leader)
    standby, = [p for p in _operator_pods(k8s_cluster, namespace) if p.metadata.uid != _operator_pod(
        k8s_cluster, namespace).metadata.uid]
    refused = httpx.post(f"http://{standby.status.pod_ip}:8080/alerts", json=payload, timeout=10,
                         headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 503 and refused.headers["Retry-After"] and "standby" in refused.text


DENIED = [  # (verb, resource, namespace or "" for cluster scope, what it would allow)
    ("get", "secrets", "other", "reading Secrets in a namespace it does not watch"),
    ("get", "secrets", "own", "reading the fleets' Secrets (the kubelet resolves them)"),
    ("list", "secrets", "own", "listing Secrets (it only reads the webhook's token)"),
    ("update", "secrets", "own", "changing a Secret (it only creates the fleets' internal tokens)"),
    ("list", "pods", "", "watching pods cluster-wide"),
    ("create", "pods", "other", "running pods in a namespace it does not watch"),
    ("create", "inferencefleets.adpfleet.io", "own", "creating fleets"),
    ("delete", "inferencefleets.adpfleet.io", "own", "deleting fleets"),
    ("update", "deployments.apps", "own", "updating Deployments (it applies)"),
    ("create", "clusterroles.rbac.authorization.k8s.io", "", "cluster-wide RBAC"),
    ("escalate", "roles.rbac.authorization.k8s.io", "own", "granting what it does not hold"),
    ("bind", "roles.rbac.authorization.k8s.io", "own", "binding roles it does not hold"),
    ("impersonate", "serviceaccounts", "own", "impersonation"),
    ("get", "nodes", "", "nodes"),
    ("create", "configmaps", "own", "ConfigMaps"),
    ("delete", "namespaces", "", "namespaces"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io", "", "CRDs"),
]
ALLOWED = [("create", "pods", "own"), ("patch", "inferencefleets.adpfleet.io/status", "own"),
           ("create", "roles.rbac.authorization.k8s.io", "own"), ("create", "secrets", "own"),
           ("get", f"secrets/{FULLNAME}-webhook", "own"), ("patch", "networkpolicies.networking.k8s.io", "own")]


def test_the_operator_service_account_is_denied_what_the_chart_does_not_grant(
        k8s_cluster, namespace, other_namespace, release):
    who = f"--as=system:serviceaccount:{namespace}:{FULLNAME}"

    def can_i(verb: str, resource: str, where: str) -> bool:
        scope = {"own": ["-n", namespace], "other": ["-n", other_namespace], "": []}[where]
        proc = k8s_cluster.kubectl("auth", "can-i", verb, resource, *scope, who, check=False)
        return proc.stdout.strip() == "yes"

    granted = [(verb, resource, where, why) for verb, resource, where, why in DENIED if can_i(verb, resource, where)]
    assert not granted, f"the chart grants more than the operator uses: {granted}"
    refused = [a for a in ALLOWED if not can_i(*a)]
    assert not refused, f"the chart lacks what the operator uses: {refused}"

    # And a real request with the service account's own token.
    api = client.CoreV1Api(_sa_client(k8s_cluster, namespace))
    with pytest.raises(ApiException) as denied:
        api.read_namespaced_secret("not-yours", other_namespace)
    message = json.loads(denied.value.body)["message"]
    assert denied.value.status == 403, message
    assert f'User "system:serviceaccount:{namespace}:{FULLNAME}" cannot get resource "secrets"' in message
    with pytest.raises(ApiException) as denied:
        api.list_namespaced_secret(namespace)
    assert denied.value.status == 403
    assert api.list_namespaced_pod(namespace).items  # the same token is good for what it is granted


def test_cluster_wide_rbac_grants_the_same_rules_in_every_namespace_and_nothing_cluster_scoped(
        k8s_cluster, other_namespace):
    """Only the RBAC objects of a cluster-wide release are applied (its operator would also act on
    other tests' fleets in this shared cluster); what they allow is asked of the API server."""
    ns = _namespace(k8s_cluster, "chart-wide")
    release_name = f"wide{secrets.token_hex(2)}"
    fullname = f"{release_name}-adpfleet"
    rendered = helm("template", release_name, str(CHART), "-n", ns, "--set", "watch.allNamespaces=true",
                    "--show-only", "templates/rbac.yaml", "--show-only", "templates/serviceaccount.yaml").stdout
    try:
        k8s_cluster.kubectl("apply", "-f", "-", input=rendered)
        who = f"--as=system:serviceaccount:{ns}:{fullname}"

        def can_i(verb: str, resource: str, *where: str) -> bool:
            proc = k8s_cluster.kubectl("auth", "can-i", verb, resource, *where, who, check=False)
            return proc.stdout.strip() == "yes"
        for where in (["-n", other_namespace], ["-n", "default"]):
            assert can_i("create", "pods", *where) and can_i("patch", "inferencefleets.adpfleet.io/status", *where)
            assert can_i("watch", "inferencefleets.adpfleet.io", *where) and can_i("create", "secrets", *where)
            assert not can_i("get", "secrets", *where) and not can_i("list", "secrets", *where)
            assert not can_i("create", "configmaps", *where)
        assert can_i("list", "pods", "--all-namespaces")  # the cluster-wide watch
        for verb, resource in (("get", "nodes"), ("create", "clusterroles.rbac.authorization.k8s.io"),
                               ("delete", "namespaces"), ("create", "customresourcedefinitions.apiextensions.k8s.io"),
                               ("escalate", "clusterroles.rbac.authorization.k8s.io")):
            assert not can_i(verb, resource), (verb, resource)
    finally:
        k8s_cluster.kubectl("delete", "-f", "-", "--wait=false", input=rendered, check=False)
        k8s_cluster.core.delete_namespace(ns)


def test_install_md_upgrades_the_crd_and_the_release_and_turns_monitoring_on(
        k8s_cluster, namespace, release, explain):
    """docs/install.md's "Upgrading the CRD" and "With the Prometheus Operator" blocks, as written:
    without the Prometheus Operator the upgrade succeeds and NOTES say what was left out."""
    here = doc_commands.Place(namespace, FLEET)
    upgrade, = install_md("Upgrading the CRD")
    doc_commands.run(upgrade.commands, here, k8s_cluster)
    monitoring, = [b for b in install_md("Prometheus and Alertmanager") if "serviceMonitor.enabled" in b.text]
    notes = doc_commands.run(monitoring.commands, here, k8s_cluster)
    assert "PodMonitor" in notes and "PrometheusRule" in notes, notes
    assert helm("get", "values", RELEASE, "-n", namespace, "-o", "json", kubeconfig=k8s_cluster.kubeconfig
                ).stdout.count('"enabled":true') >= 4
    wait_for(lambda: _fleet_condition(k8s_cluster, namespace, FLEET, "Ready") == "True", timeout=60,
             what="the fleet to stay Ready")


def test_upgrade_keeps_the_webhook_token_and_leaves_the_fleet_alone(k8s_cluster, namespace, release, explain):
    secret_name = f"{FULLNAME}-webhook"
    token = k8s_cluster.core.read_namespaced_secret(secret_name, namespace).data["token"]
    servers = {p.metadata.name: p.metadata.uid for p in k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"adpfleet.io/fleet={FLEET},adpfleet.io/role").items}
    old_operators = {p.metadata.uid for p in _operator_pods(k8s_cluster, namespace)}

    start = time.monotonic()
    helm("upgrade", RELEASE, str(CHART), "-n", namespace, "--wait", "--timeout", "120s", "--set",
         "operator.resyncSeconds=120", kubeconfig=k8s_cluster.kubeconfig, timeout=180)
    TIMINGS["helm upgrade --wait (new operator Ready)"] = time.monotonic() - start

    assert k8s_cluster.core.read_namespaced_secret(secret_name, namespace).data["token"] == token
    new_operator = _operator_pod(k8s_cluster, namespace)  # the Lease went to a new replica
    assert new_operator.metadata.uid not in old_operators
    assert "--resync-seconds=120" in new_operator.spec.containers[0].args
    wait_for(lambda: _fleet_condition(k8s_cluster, namespace, FLEET, "Ready") == "True", timeout=60,
             what="the fleet to stay Ready")
    after = {p.metadata.name: p.metadata.uid for p in k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"adpfleet.io/fleet={FLEET},adpfleet.io/role").items}
    assert after == servers  # the restarted operator adopted the fleet and replaced nothing


def test_examples_are_accepted_by_the_api_server(k8s_cluster, namespace, release):
    for path in sorted(EXAMPLES.glob("*.yaml")):
        k8s_cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(path))


def test_install_with_invalid_values_fails_with_the_schema_message_and_creates_nothing(k8s_cluster):
    """docs/install.md's example, as written (the kubeconfig's namespace): it fails with every line
    the page shows, and nothing is installed."""
    refused, = [b for b in doc_commands.blocks(INSTALL_MD, "Values") if "resyncSeconds=-5" in b.text]
    ns = _namespace(k8s_cluster, "chart-bad")
    try:
        doc_commands.run_console(refused, doc_commands.Place(ns), k8s_cluster)
        assert helm("list", "-A", "-q", "-f", "^adpfleet$", kubeconfig=k8s_cluster.kubeconfig
                    ).stdout.split() == [RELEASE]  # the module's release only
        assert not k8s_cluster.core.list_namespaced_service_account(ns).items[1:]  # only `default`
    finally:
        k8s_cluster.core.delete_namespace(ns)


def test_autoscaling_md_scales_a_role_as_documented(k8s_cluster, namespace, release):
    """docs/autoscaling.md's `kubectl scale ifrole`, as written (the next test deletes the fleet, so
    the new servers need not become Ready): the operator takes the count, and `kubectl get ifrole`
    prints the columns the page shows."""
    block, = doc_commands.blocks(ROOT / "docs" / "autoscaling.md")
    out = doc_commands.run(block.commands, doc_commands.Place(namespace, FLEET), k8s_cluster)
    shown = next(line for line in block.text.splitlines() if line.startswith("# NAME "))
    assert next(line for line in out.splitlines() if line.startswith("NAME ")).split() == shown[2:].split(), out
    wait_for(lambda: k8s_cluster.get_json("ifrole", f"{FLEET}-generation", "-n", namespace)
             .get("status", {}).get("desiredReplicas") == 3, timeout=60, what="the role's desiredReplicas 3")
    wait_for(lambda: len(k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"adpfleet.io/fleet={FLEET},adpfleet.io/role=generation").items) == 3,
        timeout=60, what="three generation servers")


def test_deleting_the_fleet_then_uninstalling_leaves_nothing_behind(k8s_cluster, namespace, release):
    """docs/install.md's "Uninstalling", as written (in the shared test cluster, the fleets of this
    namespace and a server-side dry run of the CRD's deletion)."""
    uninstall, = install_md("Uninstalling")
    doc_commands.run(uninstall.commands, doc_commands.Place(namespace, FLEET), k8s_cluster, timeout=180)
    wait_for(lambda: not k8s_cluster.core.list_namespaced_pod(
        namespace, label_selector=f"adpfleet.io/fleet={FLEET}").items, timeout=90,
        what="the fleet's pods to be deleted")
    wait_for(lambda: not k8s_cluster.core.list_namespaced_pod(namespace).items, timeout=60,
             what="the operator pod to be deleted")
    rbac = client.RbacAuthorizationV1Api(k8s_cluster.api_client)
    assert not [r.metadata.name for r in rbac.list_namespaced_role(namespace).items]
    # Helm never deletes what crds/ installed: fleets elsewhere keep their data
    assert k8s_cluster.get_json("crd", "inferencefleets.adpfleet.io")
