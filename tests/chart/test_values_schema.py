"""values.schema.json: bad values fail before anything is rendered, with the schema's message naming
the value; and the schema, values.yaml and its comments describe the same keys.
(test_install.py shows the same refusal from `helm install` against the API server.)"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from helm_chart import CHART, render, render_error

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALUES_FILE = CHART / "values.yaml"

INVALID = [  # (values, words the error must contain)
    # wrong types
    ({"watch.allNamespaces": "yes"}, ["/watch/allNamespaces", "got string, want boolean"]),
    ({"operator.httpPort": "http"}, ["/operator/httpPort", "want integer"]),
    ({"monitoring.serviceMonitor.interval": 15}, ["/monitoring/serviceMonitor/interval", "got number, want string"]),
    ({"monitoring.prometheusRule.labels": {"release": 1}}, ["/monitoring/prometheusRule/labels/release", "want string"]),
    ({"watch.namespaces": "team-a"}, ["/watch/namespaces", "got string, want array"]),
    ({"resources": "lots"}, ["/resources", "want object"]),
    # unknown keys, at the top and nested (a typo must not be silently ignored)
    ({"replicas": 2}, ["additional properties 'replicas' not allowed"]),
    ({"replicaCount": 0}, ["/replicaCount", "minimum"]),
    ({"leaderElection.leaseDuration": "long"}, ["/leaderElection/leaseDuration", "want number"]),
    ({"monitoring.serviceMonitor.enable": True}, ["/monitoring/serviceMonitor", "additional properties 'enable'"]),
    ({"image.name": "x"}, ["/image", "additional properties 'name'"]),
    # negative and out-of-range numbers
    ({"operator.resyncSeconds": -5}, ["/operator/resyncSeconds", "exclusiveMinimum"]),
    ({"operator.stuckSeconds": 0}, ["/operator/stuckSeconds", "exclusiveMinimum"]),
    ({"terminationGracePeriodSeconds": -1}, ["/terminationGracePeriodSeconds", "minimum: got -1, want 0"]),
    ({"operator.httpPort": 70000}, ["/operator/httpPort", "maximum"]),
    ({"resources.requests.cpu": -1}, ["/resources/requests/cpu"]),
    # enums and patterns
    ({"image.pullPolicy": "Sometimes"}, ["/image/pullPolicy", "'Always', 'IfNotPresent', 'Never'"]),
    ({"operator.logFormat": "xml"}, ["/operator/logFormat", "'json', 'plain'"]),
    ({"service.type": "ExternalName"}, ["/service/type"]),
    ({"watch.namespaces": ["Team_A"]}, ["/watch/namespaces/0", "does not match pattern"]),
    ({"image.digest": "md5:abc"}, ["/image/digest", "does not match pattern"]),
    ({"resources.limits.memory": "lots"}, ["/resources/limits/memory"]),
    ({"monitoring.alertmanagerConfig.repeatInterval": "5 minutes"}, ["/monitoring/alertmanagerConfig/repeatInterval"]),
    ({"fullnameOverride": "x" * 49}, ["/fullnameOverride", "maxLength"]),
    # combinations the schema cannot express, refused by the templates with what to change
    ({"watch.allNamespaces": True, "watch.namespaces": ["a"]}, ["either watch.allNamespaces=true or a list"]),
    ({"monitoring.alertmanagerConfig.enabled": True, "webhook.enabled": False},
     ["monitoring.alertmanagerConfig.enabled needs webhook.enabled"]),
    ({"serviceAccount.create": False}, ["serviceAccount.name is required when serviceAccount.create is false"]),
]


@pytest.mark.parametrize("values, words", INVALID, ids=[json.dumps(v)[:60] for v, _ in INVALID])
def test_invalid_values_are_refused_with_a_message_naming_the_value(values, words):
    if "alertmanagerConfig" in json.dumps(values):  # the check runs where the object renders
        error = _render_error_with_monitoring_apis(values)
    else:
        error = render_error(values)
    for word in words:
        assert word in error, f"{values}: {word!r} not in:\n{error}"


def _render_error_with_monitoring_apis(values: dict) -> str:
    from helm_chart import MONITORING_APIS, helm, set_args
    args = ["template", "adp", str(CHART), *set_args(values)]
    for api in MONITORING_APIS:
        args += ["--api-versions", api]
    proc = helm(*args, check=False)
    assert proc.returncode != 0, f"helm accepted {values}"
    return proc.stderr


def test_valid_edge_values_are_accepted():
    render({"operator.resyncSeconds": 0.5, "terminationGracePeriodSeconds": 0, "operator.httpPort": 1,
            "resources": {"requests": {"cpu": "250m", "memory": "1Gi", "nvidia.com/gpu": 1}},
            "image.tag": "v1.2.3-rc.1", "watch.namespaces": ["a-b", "c"], "monitoring.serviceMonitor.interval": "1m30s"})


def _schema_paths(node: dict, prefix: str = "") -> dict[str, dict]:
    out = {}
    for key, sub in node.get("properties", {}).items():
        path = f"{prefix}{key}"
        out[path] = sub
        if sub.get("additionalProperties") is False:
            out.update(_schema_paths(sub, path + "."))
    return out


def _value_paths(node: dict, schema: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in node.items():
        path = f"{prefix}{key}"
        out.add(path)
        sub = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and sub.get("additionalProperties") is False:
            out |= _value_paths(value, sub, path + ".")
    return out


def test_the_schema_and_values_yaml_describe_the_same_keys():
    values = yaml.safe_load(VALUES_FILE.read_text())
    schema_paths = _schema_paths(SCHEMA)
    assert _value_paths(values, SCHEMA) == set(schema_paths) - {"global"}
    assert [p for p, n in schema_paths.items() if not n.get("description")] == []
    render()  # and the defaults satisfy the schema


KEY = re.compile(r"^(\s*)([A-Za-z_][\w./-]*):")


def test_every_key_in_values_yaml_has_a_comment():
    """A comment right above each key; a `# --` comment documents the whole value, so the keys
    inside it (resources.requests.cpu) need none of their own."""
    lines = VALUES_FILE.read_text().splitlines()
    undocumented = []
    parents: list[tuple[int, bool]] = []  # (indent, documents the whole value)
    for i, line in enumerate(lines):
        match = KEY.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        while parents and parents[-1][0] >= indent:
            parents.pop()
        start = i
        while start > 0 and lines[start - 1].strip().startswith("#"):
            start -= 1
        comment = lines[start].strip() if start < i else ""  # first line of the comment block above
        if not comment and not any(whole for _, whole in parents):
            undocumented.append(f"values.yaml:{i + 1}: {line.strip()}")
        parents.append((indent, comment.startswith("# --")))
    assert undocumented == []
