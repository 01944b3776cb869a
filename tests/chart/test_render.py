"""The chart as `helm lint` and `helm template` see it: every rendered object valid for the targeted
Kubernetes version, monitoring objects only where their API exists, least-privilege RBAC, the
restricted pod security profile, and the operator started the way `adpfleet operator` expects."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from adpfleet.cluster.binaries import kubernetes_version
from adpfleet.operator.decisions.gang import APIS, POD_GROUP_PLURAL
from adpfleet.operator.main import add_arguments
from adpfleet.operator.resource import crd, names
from adpfleet.operator.resource.models import FleetSpec

from helm_chart import (ALL_MONITORING_ON, CHART, EXAMPLES, MONITORING_APIS, ROOT, Rendered, helm,
                        render_error,
                        operator_container, render)

MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"}

# Value sets that between them render every template branch.
VALUE_SETS = {
    "defaults": {},
    "all-monitoring": ALL_MONITORING_ON,
    "cluster-wide": {"watch.allNamespaces": "true", **ALL_MONITORING_ON},
    "two-namespaces": {"watch.namespaces": ["team-a", "team-b"], "monitoring.serviceMonitor.enabled": "true"},
    "existing-secret": {"webhook.existingSecret": "my-token", "webhook.secretKey": "bearer",
                        "monitoring.alertmanagerConfig.enabled": "true"},
    "webhook-tls": {"webhook.tls.secretName": "adp-webhook-tls", "webhook.tls.port": "9443", **ALL_MONITORING_ON},
    "no-webhook-no-rbac": {"webhook.enabled": "false", "rbac.create": "false", "serviceAccount.create": "false",
                           "serviceAccount.name": "mine"},
    "everything-set": {"image.digest": "sha256:" + "a" * 64, "imagePullSecrets": [{"name": "regcred"}],
                       "podLabels": {"team": "inference"}, "podAnnotations": {"a": "b"},
                       "nodeSelector": {"kubernetes.io/os": "linux"},
                       "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                       "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                           "nodeSelectorTerms": [{"matchExpressions": [
                               {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
                       "priorityClassName": "system-cluster-critical", "operator.verbose": "true",
                       "operator.extraArgs": ["--stall-detection=off"],
                       "operator.extraEnv": [{"name": "X", "value": "1"}],
                       "service.type": "LoadBalancer", "service.annotations": {"a": "b"},
                       "serviceAccount.annotations": {"iam": "role"}, **ALL_MONITORING_ON},
    "network-policy-narrowed": {"networkPolicy.prometheus": [{"namespaceSelector": {"matchLabels": {
                                    "kubernetes.io/metadata.name": "monitoring"}}}],
                                "networkPolicy.alertmanager": [], "networkPolicy.apiServer.cidrs": ["10.0.0.10/32"],
                                "networkPolicy.apiServer.ports": [6443], "networkPolicy.extraEgress": [
                                    {"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 3128}]}]},
}


def test_helm_lint_is_clean_with_and_without_the_optional_objects():
    for values in VALUE_SETS.values():
        args = []
        for key, value in values.items():
            args += ["--set", f"{key}={value}"] if isinstance(value, str) else ["--set-json", f"{key}={json.dumps(value)}"]
        out = helm("lint", "--strict", str(CHART), *args).stdout
        assert "1 chart(s) linted, 0 chart(s) failed" in out
        assert "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("apis", ["absent", "present"])
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid_for_the_targeted_kubernetes_version(name, apis):
    rendered = render(VALUE_SETS[name], api_versions=MONITORING_APIS if apis == "present" else (),
                      include_crds=True)
    version = kubernetes_version()
    assert "CustomResourceDefinition" in rendered.kinds()
    checked = 0
    for obj in rendered.objects:
        where = f"{obj['kind']} {obj['metadata']['name']}"
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # kubernetes-validate knows only Kubernetes' own schemas; these are checked against the
            # Prometheus Operator's required fields in test_monitoring_objects_have_what_the_prometheus_operator_requires
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} is not a valid {version} object: {e.message} at {list(e.path)}")
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "adpfleet", where
        checked += 1
    assert checked >= 3  # at least the CRD, the Service and the Deployment


def test_the_chart_ships_the_generated_crds_unchanged():
    rendered = render(include_crds=True)
    assert rendered.one("CustomResourceDefinition", "inferencefleets.adpfleet.io") == crd.crd()
    assert rendered.one("CustomResourceDefinition", "inferencefleetroles.adpfleet.io") == crd.role_crd()


def test_monitoring_objects_are_rendered_only_when_enabled_and_their_api_exists():
    off = render({}, api_versions=MONITORING_APIS)
    assert not MONITORING_KINDS & set(off.kinds()) and not off.of("ConfigMap")

    absent = render(ALL_MONITORING_ON)
    assert not MONITORING_KINDS & set(absent.kinds())
    # a ConfigMap is a core object: its value alone gates the dashboard
    assert absent.one("ConfigMap", "-dashboard")

    present = render(ALL_MONITORING_ON, api_versions=MONITORING_APIS)
    assert sorted(k for k in present.kinds() if k in MONITORING_KINDS) == sorted(MONITORING_KINDS)

    # each object follows its own API: a cluster with ServiceMonitor but no PodMonitor gets only that
    partial = render(ALL_MONITORING_ON, api_versions=("monitoring.coreos.com/v1/ServiceMonitor",))
    assert [k for k in partial.kinds() if k in MONITORING_KINDS] == ["ServiceMonitor"]


# ---- monitoring.coreos.com objects ----------------------------------------------------------------

DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
ENDPOINT_KEYS = {"port", "path", "interval", "scrapeTimeout", "relabelings"}
RELABEL_KEYS = {"sourceLabels", "targetLabel", "action", "regex", "replacement", "separator", "modulus"}


def _check_metadata(obj: dict) -> None:
    meta = obj["metadata"]
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}, obj["kind"]
    assert meta["name"] and meta["namespace"], obj["kind"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, kubernetes_version(),
                                 strict=True)  # ObjectMeta is ObjectMeta whatever the kind


def _check_selector(selector: dict) -> None:
    assert set(selector) <= {"matchLabels", "matchExpressions"} and selector
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] in ("In", "NotIn", "Exists", "DoesNotExist") and expr["key"]


def _check_endpoint(endpoint: dict) -> None:
    assert set(endpoint) <= ENDPOINT_KEYS, set(endpoint) - ENDPOINT_KEYS
    assert endpoint["port"] and endpoint["path"].startswith("/")
    for key in ("interval", "scrapeTimeout"):
        assert DURATION.match(endpoint[key]), endpoint[key]
    for relabel in endpoint.get("relabelings", []):
        assert set(relabel) <= RELABEL_KEYS and relabel["targetLabel"]


def test_monitoring_objects_have_what_the_prometheus_operator_requires(tmp_path):
    """Checked by hand against the Prometheus Operator's API (its CRDs are not installed here, and
    kubernetes-validate has no schema for them): the required fields, the keys used, durations,
    and for the PrometheusRule the real promtool."""
    seen = set()
    for name in ("all-monitoring", "cluster-wide", "existing-secret"):
        rendered = render(VALUE_SETS[name], api_versions=MONITORING_APIS)
        for obj in rendered.objects:
            if obj["apiVersion"].startswith("monitoring.coreos.com/"):
                _check_metadata(obj)
                seen.add(obj["kind"])

        for pod_monitor in rendered.of("PodMonitor"):
            pm = pod_monitor["spec"]
            assert set(pm) == {"namespaceSelector", "selector", "podMetricsEndpoints"}
            _check_selector(pm["selector"])
            assert pm["namespaceSelector"] == {"any": True} or pm["namespaceSelector"]["matchNames"]
            for endpoint in pm["podMetricsEndpoints"]:
                _check_endpoint(endpoint)

        for service_monitor in rendered.of("ServiceMonitor"):
            sm = service_monitor["spec"]
            assert set(sm) == {"namespaceSelector", "selector", "endpoints"}
            _check_selector(sm["selector"])
            for endpoint in sm["endpoints"]:
                _check_endpoint(endpoint)

        for config in rendered.of("AlertmanagerConfig"):
            amc = config["spec"]
            receivers = {r["name"]: r for r in amc["receivers"]}
            assert amc["route"]["receiver"] in receivers
            for matcher in amc["route"]["matchers"]:
                assert set(matcher) == {"name", "matchType", "value"}
                assert matcher["matchType"] in ("=", "!=", "=~", "!~")
            for key in ("groupWait", "groupInterval", "repeatInterval"):
                assert DURATION.match(amc["route"][key])
            (hook,) = receivers[amc["route"]["receiver"]]["webhookConfigs"]
            assert hook["url"].startswith("http") and hook["url"].endswith("/alerts")
            creds = hook["httpConfig"]["authorization"]
            assert creds["type"] == "Bearer" and set(creds["credentials"]) == {"name", "key"}
            # the token Secret the chart made (or was given), in the AlertmanagerConfig's namespace
            secret = creds["credentials"]["name"]
            assert secret in ("adp-adpfleet-webhook", VALUE_SETS["existing-secret"]["webhook.existingSecret"])
    assert seen == MONITORING_KINDS

    rule = render(ALL_MONITORING_ON, api_versions=MONITORING_APIS).one("PrometheusRule")
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: scripts/setup installs it (Debian package prometheus)"
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_prometheus_rule_is_the_canonical_rule_file_with_the_configured_labels():
    canonical = yaml.safe_load((CHART / "files" / "alert-rules.yaml").read_text())
    rule = render({**ALL_MONITORING_ON, "monitoring.prometheusRule.labels": {"release": "kps"},
                   "monitoring.prometheusRule.additionalRuleLabels": {"team": "inference", "severity": "low"}},
                  api_versions=MONITORING_APIS).one("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    rendered_rules = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    canonical_rules = [r for g in canonical["groups"] for r in g["rules"]]
    assert [r["alert"] for r in rendered_rules] == [r["alert"] for r in canonical_rules]
    for got, want in zip(rendered_rules, canonical_rules):
        assert got["labels"] == {**want["labels"], "team": "inference"}  # an alert's own severity wins
        assert {k: v for k, v in got.items() if k != "labels"} == {k: v for k, v in want.items() if k != "labels"}


def test_the_fleet_pod_monitor_gives_series_the_labels_the_alert_rules_use():
    pm = render({"monitoring.serviceMonitor.enabled": "true"}, api_versions=MONITORING_APIS).one("PodMonitor")["spec"]
    # namespace and pod come from the Prometheus Operator; fleet from the pod's label
    (endpoint,) = pm["podMetricsEndpoints"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_adpfleet_io_fleet"], "targetLabel": "fleet"} \
        in endpoint["relabelings"]
    # it selects exactly the fleets' server pods, which name their metrics port `http`
    assert pm["selector"]["matchLabels"] == {names.LABEL_MANAGED_BY: names.MANAGER}
    assert pm["selector"]["matchExpressions"] == [{"key": names.LABEL_ROLE, "operator": "Exists"}]
    assert endpoint["port"] == "http"
    assert pm["namespaceSelector"] == {"matchNames": ["adpfleet-system"]}


def test_the_grafana_dashboard_shows_progress_empty_batches_per_rank_and_remediations():
    cm = render({"monitoring.grafanaDashboard.enabled": "true",
                 "monitoring.grafanaDashboard.namespace": "grafana"}).one("ConfigMap", "-dashboard")
    assert cm["metadata"]["namespace"] == "grafana" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["adpfleet.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    for metric in ("adpfleet_generation_tokens_total", "adpfleet_prompt_tokens_total",
                   "adpfleet_empty_batch_iterations_total", "adpfleet_operator_remediations_total"):
        assert metric in exprs, metric
    per_rank = [p for p in dashboard["panels"] if "empty_batch" in json.dumps(p.get("targets", []))]
    assert any("rank" in t["expr"] and "{{rank}}" in t["legendFormat"] for p in per_rank for t in p["targets"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# ---- the operator Deployment -------------------------------------------------------------------

def test_the_operator_runs_with_flags_the_operator_accepts():
    import argparse

    rendered = render({"operator.verbose": "true", "operator.extraArgs": ["--stuck-seconds=60"]})
    container = operator_container(rendered)
    assert container["command"] == ["adpfleet", "operator"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    args = parser.parse_args(container["args"])  # the real parser: a flag it lacks fails here
    assert args.namespace == ["adpfleet-system"] and not args.all_namespaces and args.verbose
    assert args.http_host == "$(POD_IP)" and args.http_port == 8080
    port = container["ports"][0]
    assert port == {"name": "http", "containerPort": 8080, "protocol": "TCP"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"

    wide = operator_container(render({"watch.allNamespaces": "true"}))
    assert parser.parse_args(wide["args"]).all_namespaces
    two = operator_container(render({"watch.namespaces": ["a", "b"]}))
    assert parser.parse_args(two["args"]).namespace == ["a", "b"]


def test_two_replicas_elect_a_leader_by_a_lease_and_roll_without_a_gap():
    import argparse

    rendered = render()
    deployment = rendered.one("Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate",
                                              "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    args = parser.parse_args(operator_container(rendered)["args"])
    assert args.leader_elect and args.leader_election_id == "adp-adpfleet"
    assert (args.lease_duration, args.renew_deadline, args.retry_period) == (15, 10, 2)
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in operator_container(rendered)["env"]}
    assert env["POD_NAMESPACE"] == "metadata.namespace" and env["POD_NAME"] == "metadata.name"  # the Lease's namespace, who
    role = rendered.one("Role", "-leader")
    assert role["metadata"]["namespace"] == "adpfleet-system"
    assert flatten(role["rules"]) == LEADER_RULES
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["adp-adpfleet"],
            "verbs": ["get", "update"]} in role["rules"]  # renewing only its own Lease
    budget = rendered.one("PodDisruptionBudget")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}
    spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread == [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                       "labelSelector": deployment["spec"]["selector"]}]

    single = render({"replicaCount": 1, "leaderElection.enabled": "false"})
    assert single.one("Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert not parser.parse_args(operator_container(single)["args"]).leader_elect
    assert not single.of("PodDisruptionBudget") and not [r for r in single.of("Role") if "leader" in r["metadata"]["name"]]


def test_unelected_replicas_and_unsafe_election_timing_are_refused():
    assert "needs leaderElection.enabled=true" in render_error({"replicaCount": 3, "leaderElection.enabled": "false"})
    assert "retryPeriod < renewDeadline < leaseDuration" in render_error({"leaderElection.renewDeadline": 20})


def test_the_operator_pod_meets_the_restricted_pod_security_standard():
    pod = render().one("Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["readOnlyRootFilesystem"] is True
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
    assert all(set(v) <= {"name", "emptyDir", "configMap", "secret", "projected", "downwardAPI"}
               for v in pod["volumes"])


def test_the_webhook_token_secret_is_generated_or_taken_from_an_existing_one():
    generated = render()
    secret = generated.one("Secret")
    assert secret["metadata"]["name"] == "adp-adpfleet-webhook"
    assert len(secret["data"]["token"]) >= 64  # base64 of 48 random characters
    env = {e["name"]: e.get("value") for e in operator_container(generated)["env"]}
    assert env["ADPFLEET_ALERTS_TOKEN_SECRET"] == "adpfleet-system/adp-adpfleet-webhook:token"

    existing = render({"webhook.existingSecret": "my-token", "webhook.secretKey": "bearer"})
    assert not existing.of("Secret")
    env = {e["name"]: e.get("value") for e in operator_container(existing)["env"]}
    assert env["ADPFLEET_ALERTS_TOKEN_SECRET"] == "adpfleet-system/my-token:bearer"
    token_role = existing.one("Role", "-webhook-token")
    assert token_role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["my-token"],
                                    "verbs": ["get"]}]

    off = render({"webhook.enabled": "false"})
    assert not off.of("Secret") and [r["metadata"]["name"] for r in off.of("Role")] == ["adp-adpfleet",
                                                                                         "adp-adpfleet-leader"]
    assert "ADPFLEET_ALERTS_TOKEN_SECRET" not in {e["name"] for e in operator_container(off)["env"]}


def test_given_a_certificate_the_webhook_is_served_over_tls_on_its_own_port():
    import argparse

    rendered = render(VALUE_SETS["webhook-tls"], api_versions=MONITORING_APIS)
    container = operator_container(rendered)
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    args = parser.parse_args(container["args"])  # the operator accepts the flags the chart passes
    mount = next(m for m in container["volumeMounts"] if m["name"] == "webhook-tls")
    assert mount["readOnly"] is True
    assert (args.alerts_tls_cert, args.alerts_tls_key, args.alerts_port) == (
        f"{mount['mountPath']}/tls.crt", f"{mount['mountPath']}/tls.key", 9443)
    volume = next(v for v in rendered.one("Deployment")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == "adp-webhook-tls"
    assert {i["key"] for i in volume["secret"]["items"]} == {"tls.crt", "tls.key"}
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]
    assert {"name": "webhook", "port": 9443, "targetPort": "webhook", "protocol": "TCP"} in \
        rendered.one("Service")["spec"]["ports"]
    (hook,) = rendered.one("AlertmanagerConfig")["spec"]["receivers"][0]["webhookConfigs"]
    assert hook["url"] == "https://adp-adpfleet.adpfleet-system.svc:9443/alerts"
    assert hook["httpConfig"]["tlsConfig"] == {"ca": {"secret": {"name": "adp-webhook-tls", "key": "ca.crt"}}}
    # without a certificate: plain HTTP on the operator's port, no TLS flags, no mount
    plain = render(ALL_MONITORING_ON, api_versions=MONITORING_APIS)
    assert not parser.parse_args(operator_container(plain)["args"]).alerts_tls_cert
    (hook,) = plain.one("AlertmanagerConfig")["spec"]["receivers"][0]["webhookConfigs"]
    assert hook["url"] == "http://adp-adpfleet.adpfleet-system.svc:8080/alerts" and "tlsConfig" not in hook["httpConfig"]



def test_the_operator_pods_network_policy_admits_prometheus_and_alertmanager_and_reaches_the_api_and_servers():
    from adpfleet.operator.decisions.security import NAMESPACE_LABEL

    def policy(values=None) -> tuple[dict, dict]:
        rendered = render(values or {})
        return rendered.one("NetworkPolicy")["spec"], operator_container(rendered)

    spec, container = policy()
    assert spec["podSelector"] == render().one("Deployment")["spec"]["selector"]  # exactly the operator's pods
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    ports = {p["name"] for p in container["ports"]}
    metrics, hook = spec["ingress"]
    assert metrics["ports"] == hook["ports"] == [{"port": "http", "protocol": "TCP"}] and "http" in ports
    assert metrics["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {names.LABEL_NAME: "prometheus"}}}]
    assert hook["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {names.LABEL_NAME: "alertmanager"}}}]
    api, servers = spec["egress"]
    assert api == {"ports": [{"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}  # any address
    # the servers the operator scrapes: the fleets' server pods (as its own scrapes find them), in the watched
    # namespaces, on their HTTP port
    (peer,) = servers["to"]
    assert servers["ports"] == [{"port": names.SERVER_HTTP_PORT, "protocol": "TCP"}]
    assert peer["podSelector"] == {"matchLabels": {names.LABEL_MANAGED_BY: names.MANAGER},
                                   "matchExpressions": [{"key": names.LABEL_ROLE, "operator": "Exists"}]}
    assert peer["namespaceSelector"] == {"matchExpressions": [
        {"key": NAMESPACE_LABEL, "operator": "In", "values": ["adpfleet-system"]}]}
    assert policy({"watch.namespaces": ["a", "b"]})[0]["egress"][1]["to"][0]["namespaceSelector"][
        "matchExpressions"][0]["values"] == ["a", "b"]
    assert policy({"watch.allNamespaces": "true"})[0]["egress"][1]["to"][0]["namespaceSelector"] == {}

    # the webhook over TLS: Alertmanager reaches its own port; without the webhook, Alertmanager nothing
    tls, container = policy({"webhook.tls.secretName": "adp-webhook-tls"})
    assert tls["ingress"][1]["ports"] == [{"port": "webhook", "protocol": "TCP"}]
    assert "webhook" in {p["name"] for p in container["ports"]}
    assert policy({"webhook.enabled": "false"})[0]["ingress"] == [metrics]
    assert policy({"webhook.enabled": "false", "networkPolicy.prometheus": []})[0]["ingress"] == []  # no one

    narrowed = policy(VALUE_SETS["network-policy-narrowed"])[0]
    assert narrowed["ingress"] == [{"ports": metrics["ports"], "from": [
        {"namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "monitoring"}}}]}]
    assert narrowed["egress"][0] == {"ports": [{"port": 6443, "protocol": "TCP"}],
                                     "to": [{"ipBlock": {"cidr": "10.0.0.10/32"}}]}
    assert narrowed["egress"][2] == {"to": [{"ipBlock": {"cidr": "10.1.0.0/16"}}], "ports": [{"port": 3128}]}
    assert not render({"networkPolicy.enabled": "false"}).of("NetworkPolicy")


def test_the_operator_container_requests_and_limits_its_disk_but_not_its_cpu():
    resources = operator_container(render())["resources"]
    assert resources["requests"]["ephemeral-storage"] == "64Mi" and resources["limits"]["ephemeral-storage"] == "256Mi"
    assert "cpu" in resources["requests"] and "cpu" not in resources["limits"]  # declined in docs/install.md


# ---- RBAC ---------------------------------------------------------------------------------------

# Exactly what the operator's code asks of the API (kopf's watches from operator/handlers.py, every
# other request in operator/adapters/kube.py): a new verb here must come with the code that uses it.
FLEET_RULES = {
    ("adpfleet.io", "inferencefleets"): {"list", "watch", "patch"},
    ("adpfleet.io", "inferencefleets/status"): {"patch"},
    ("adpfleet.io", "inferencefleetroles"): {"list", "watch", "create", "patch"},
    ("adpfleet.io", "inferencefleetroles/status"): {"patch"},
    ("", "pods"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "services"): {"list", "watch", "create", "patch", "delete"},
    ("", "serviceaccounts"): {"list", "watch", "create", "patch", "delete"},
    ("apps", "deployments"): {"list", "watch", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"list", "watch", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"list", "watch", "create", "patch", "delete"},
    ("networking.k8s.io", "networkpolicies"): {"list", "watch", "create", "patch", "delete"},
    ("policy", "poddisruptionbudgets"): {"list", "watch", "create", "patch", "delete"},
    ("", "events"): {"create"},
    ("", "secrets"): {"create"},  # the fleets' internal tokens; never get or list (docs/security.md)
    ("", "persistentvolumeclaims"): {"get"},
    ("", "pods/log"): {"get"},
    # gang scheduling's PodGroups (operator/decisions/gang.py): applied and deleted, never watched
    ("scheduling.volcano.sh", "podgroups"): {"create", "patch", "delete"},
    ("scheduling.x-k8s.io", "podgroups"): {"create", "patch", "delete"},
}


LEADER_RULES = {("coordination.k8s.io", "leases"): {"get", "create", "update"}}


def flatten(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_every_api_request_in_the_operator_code_is_covered_by_the_rules():
    """A new request in operator/ without a rule here fails this test before it fails in a cluster."""
    from adpfleet.operator.handlers import OWNED_KINDS

    source = "\n".join(p.read_text() for p in (ROOT / "operator").rglob("*.py"))
    calls = set(re.findall(r'_call\(\s*"(\w+)",\s*(f?"[^"]+")', source))
    assert calls, "no API requests found in operator/: the pattern needs updating"
    group_of = {"pods": "", "secrets": "", "events": "", "persistentvolumeclaims": "", "pods/log": "",
                f"{names.PLURAL}/status": names.GROUP, "leases": "coordination.k8s.io",
                names.ROLE_PLURAL: names.GROUP, f"{names.ROLE_PLURAL}/status": names.GROUP}
    needed = set()
    for verb, resource in calls:
        resource = resource.replace('f"{names.PLURAL}', f'"{names.PLURAL}').strip('"')
        if resource == "discovery":  # served to every signed-in client (system:discovery): no rule
            continue
        if resource == 'f"{plural}.{group}':  # another project's custom resources: gang scheduling's PodGroups
            verbs = {verb, "create"} if verb == "patch" else {verb}  # server-side apply creates what is missing
            needed |= {(api.group, POD_GROUP_PLURAL, v) for api in APIS.values() for v in verbs}
            continue
        assert resource in group_of, f"operator/ requests {verb} {resource}: add it to the chart's RBAC and here"
        if (verb, resource) == ("get", "secrets"):  # the webhook's own token: its own Role, one resourceName
            continue
        needed.add((group_of[resource], resource, verb))
    for _, group, _, plural in OWNED_KINDS:  # watched (kopf indexes) and server-side applied, deleted
        needed |= {(group, plural, verb) for verb in ("list", "watch", "create", "patch", "delete")}
    needed |= {(names.GROUP, names.PLURAL, verb) for verb in ("list", "watch", "patch")}  # kopf
    needed |= {("", "pods", verb) for verb in ("list", "watch")}  # kopf index of server pods
    needed |= {(names.GROUP, names.ROLE_PLURAL, verb) for verb in ("list", "watch")}  # kopf index of role objects
    # the Lease (leader election) is in the release namespace, granted by a Role of its own
    leases = {n for n in needed if n[1] == "leases"}
    assert leases == {(g, r, v) for (g, r), verbs in LEADER_RULES.items() for v in verbs}
    needed -= leases
    granted = {(g, r, v) for (g, r), verbs in FLEET_RULES.items() for v in verbs}
    assert needed <= granted, needed - granted
    # and nothing granted that nothing needs, except `get` on pods (the router's Role grants it)
    assert granted - needed == {("", "pods", "get")}


def test_rbac_is_namespace_scoped_by_default_and_grants_only_what_the_operator_uses():
    rendered = render()
    assert not rendered.of("ClusterRole") and not rendered.of("ClusterRoleBinding")
    role = rendered.one("Role", "adp-adpfleet")
    assert role["metadata"]["namespace"] == "adpfleet-system"
    assert flatten(role["rules"]) == FLEET_RULES
    binding = rendered.one("RoleBinding", "adp-adpfleet")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "adp-adpfleet", "namespace": "adpfleet-system"}]
    # the router's Role (operator/decisions/desired.py) must be a subset of the operator's own rights:
    # Kubernetes refuses to let it create a Role granting more (no escalate verb)
    assert {"get", "list", "watch"} <= FLEET_RULES[("", "pods")]


def test_rbac_covers_each_watched_namespace_or_the_cluster_by_a_value():
    rendered = render({"watch.namespaces": ["team-a", "team-b"]})
    roles = {r["metadata"]["namespace"]: r for r in rendered.of("Role") if r["metadata"]["name"] == "adp-adpfleet"}
    assert set(roles) == {"team-a", "team-b"}
    bindings = [b for b in rendered.of("RoleBinding") if b["metadata"]["name"] == "adp-adpfleet"]
    assert {b["metadata"]["namespace"] for b in bindings} == {"team-a", "team-b"}
    assert all(b["subjects"][0]["namespace"] == "adpfleet-system" for b in bindings)
    # the token Secret lives in the release namespace whichever namespaces are watched
    assert rendered.one("Role", "-webhook-token")["metadata"]["namespace"] == "adpfleet-system"

    wide = render({"watch.allNamespaces": "true"})
    assert flatten(wide.one("ClusterRole")["rules"]) == FLEET_RULES
    assert wide.one("ClusterRoleBinding")["roleRef"]["kind"] == "ClusterRole"
    assert [r["metadata"]["name"] for r in wide.of("Role")] == ["adp-adpfleet-leader", "adp-adpfleet-webhook-token"]


# ---- examples ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_each_example_is_a_valid_inference_fleet(path):
    (manifest,) = list(yaml.safe_load_all(path.read_text()))
    assert manifest["apiVersion"] == names.API_VERSION and manifest["kind"] == names.KIND
    assert "namespace" not in manifest["metadata"]  # applied with -n into a watched namespace
    FleetSpec.model_validate(manifest["spec"])  # the API server's check is in test_install.py


def test_rendered_object_names_fit_kubernetes_limits_for_a_long_release_name():
    long_release = "a-release-name-that-is-quite-long-indeed-for-sure"
    rendered = Rendered(render(release=long_release).objects)
    for obj in rendered.objects:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]


def test_the_api_key_and_network_policies_are_on_by_default_and_each_has_a_switch(monkeypatch):
    """The chart's security values become the operator's flags, which parse into its security config."""
    import argparse

    from adpfleet.operator.decisions.security import OperatorIdentity, SecurityConfig
    from adpfleet.operator.main import security_config

    def config(values=None):
        rendered = render(values or {})
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_arguments(parser)
        monkeypatch.setenv("POD_NAMESPACE", "adpfleet-system")
        return rendered, security_config(parser.parse_args(operator_container(rendered)["args"]))

    rendered, on = config()
    pod_labels = rendered.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert on.require_api_key and on.network_policies.namespace == "adpfleet-system"
    # the policies let exactly the operator's own pods reach the servers' /metrics
    assert on.network_policies.pod_labels.items() <= pod_labels.items()
    assert on.network_policies.pod_labels == rendered.one("Deployment")["spec"]["selector"]["matchLabels"]
    assert config({"security.requireApiKey": "false", "security.networkPolicies": "false"})[1] == SecurityConfig()
    assert config({"security.networkPolicies": "false"})[1] == SecurityConfig(require_api_key=True)
    assert config({"security.requireApiKey": "false"})[1].network_policies == OperatorIdentity(
        "adpfleet-system", on.network_policies.pod_labels)
