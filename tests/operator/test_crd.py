"""The CRD is generated from the pydantic models; the committed copies must be exactly that."""

import subprocess
import sys
from pathlib import Path

import yaml

from adpfleet.operator.resource import crd, names
from adpfleet.operator.resource.reference import reference_markdown
from adpfleet.operator.resource.vocabulary import Action, Outcome, RemediationMode, Signature

ROOT = Path(__file__).resolve().parents[2]
COPIES = [ROOT / "crds" / crd.FILE_NAME, ROOT / "charts" / "adpfleet" / "crds" / crd.FILE_NAME]
REGENERATE = ("regenerate: adpfleet crds > crds/{f} && cp crds/{f} charts/adpfleet/crds/ && "
              "adpfleet crds --reference > docs/configuration.md").format(f=crd.FILE_NAME)


def test_adpfleet_crds_prints_the_crd_generated_from_the_models():
    out = subprocess.run([sys.executable, "-m", "adpfleet.cli", "crds"], capture_output=True, text=True, check=True)
    assert out.stdout == crd.crd_yaml()


def test_committed_crd_files_are_identical_to_the_generated_one():
    generated = crd.crd_yaml()
    for copy in COPIES:
        assert copy.read_text() == generated, f"{copy.relative_to(ROOT)} is stale; {REGENERATE}"


def test_configuration_reference_is_generated_from_the_same_schema():
    assert (ROOT / "docs" / "configuration.md").read_text() == reference_markdown(), REGENERATE


def _walk(node, path="$"):
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}[{i}]")


def test_every_field_has_a_description_that_states_its_default_and_allowed_values():
    """`kubectl explain` shows a field's description and nothing else of its schema."""
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    missing, unstated = [], []

    def visit(node, path):
        for name, sub in node.get("properties", {}).items():
            where = f"{path}.{name}"
            text = sub.get("description", "")
            if where == ".metadata":
                continue  # ObjectMeta: the API server describes it and refuses anything more in a CRD
            if ".podTemplate.spec." in where:
                continue  # Kubernetes' PodSpec: documented upstream (`kubectl explain pod.spec`)
            if not text:
                missing.append(where)
            if crd.default_text(sub) and f"Default: {crd.default_text(sub).strip('`')}." not in text:
                unstated.append(where)
            if ("minimum" in sub or "enum" in sub) and "Allowed: " not in text:
                unstated.append(where)
            target = sub.get("items", sub)
            visit(target, where + ("[]" if "items" in sub else ""))
    visit(schema, "")
    assert not missing, f"fields without a description: {missing}"
    assert not unstated, f"descriptions that do not state the default or bounds: {unstated}"
    engine = schema["properties"]["spec"]["properties"]["context"]["properties"]["engine"]["properties"]
    assert engine["kvBlocks"]["description"].endswith("Default: 512. Allowed: 1 to 10000000.")


def test_schema_is_structural():
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        if not isinstance(node, dict) or path.endswith((".default", ".properties")) or ".default." in path:
            continue
        if path.endswith("]") and ".x-kubernetes-validations" in path:
            continue
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "const", "title", "$defs"):
            assert forbidden not in node, f"{path} has {forbidden}"
        if "properties" in node:
            assert node.get("type") == "object", f"{path} has properties but no type object"
            assert "additionalProperties" not in node, path
        if any(k in node for k in ("minimum", "maxLength", "enum", "pattern", "items")):
            # a quantity in a pod template is an int-or-string, the one node Kubernetes leaves untyped
            assert "type" in node or node.get("x-kubernetes-int-or-string") is True, f"{path} is untyped"


def test_crd_has_status_subresource_printer_columns_short_name_and_rules():
    doc = next(yaml.safe_load_all(crd.crd_yaml()))
    version = doc["spec"]["versions"][0]
    assert doc["metadata"]["name"] == "inferencefleets.adpfleet.io"
    assert doc["spec"]["scope"] == "Namespaced"
    assert version["subresources"] == {"status": {}}
    assert names.SHORT_NAMES[0] in doc["spec"]["names"]["shortNames"]
    columns = {c["name"] for c in version["additionalPrinterColumns"]}
    assert {"Roles Ready", "Stalled", "Age"} <= columns
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["image", "model"]
    role = spec["properties"]["context"]
    assert role["properties"]["servers"]["minimum"] == 1
    assert any("gpusPerServer % self.adpRanks" in r["rule"] for r in role["x-kubernetes-validations"])
    assert spec["properties"]["remediation"]["properties"]["mode"]["enum"] == ["Auto", "DryRun", "Disabled"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert set(status["conditions"]["items"]["properties"]["type"]["enum"]) >= {"Stalled", "Remediating"}
    assert status["recentRemediations"]["maxItems"] == 20


def test_the_crd_speaks_the_one_vocabulary_of_stalls_and_remediation():
    # vocabulary.py defines each word once; the CRD's enums are generated from it
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]["remediation"]["properties"]
    record = crd.openapi_schema()["properties"]["status"]["properties"]["recentRemediations"]["items"]["properties"]
    assert record["signature"]["enum"] == [s.value for s in Signature]
    assert record["action"]["enum"] == [a.value for a in Action]
    assert record["outcome"]["enum"] == [o.value for o in Outcome]
    assert spec["mode"]["enum"] == [m.value for m in RemediationMode]
    assert set(spec["escalation"]["properties"]["action"]["enum"]) <= set(record["action"]["enum"])


def test_every_field_has_a_description_or_is_self_evident():
    undocumented = []
    spec = crd.openapi_schema()["properties"]["spec"]
    for path, node in _walk(spec):
        if ".podTemplate.properties.spec." in path:
            continue  # Kubernetes' PodSpec: documented upstream (`kubectl explain pod.spec`)
        if path.endswith(".properties") and isinstance(node, dict):
            for name, sub in node.items():
                if sub.get("type") in ("object", "array", "integer") and not sub.get("description"):
                    undocumented.append(f"{path}.{name}")
    # objects inside lists describe themselves in their item schema
    assert all("imagePullSecrets" in p or "tolerations" in p or "env" in p for p in undocumented), undocumented


def test_defaults_are_complete_so_the_api_server_can_check_them_against_the_rules():
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    engine_default = spec["context"]["properties"]["engine"]["default"]
    assert engine_default["maxBatchSize"] <= engine_default["maxNumActiveRequests"]
    assert spec["router"]["default"]["replicas"] == 1
    # no default for a role: one cannot default on another's absence (aggregated); FleetSpec fills them
    assert all("default" not in spec[role] for role in ("context", "generation", "aggregated"))
    assert "default" not in spec["model"]["properties"]["tokenSecretRef"]  # optional: absent unless given


def test_each_role_has_a_scale_target_kind_with_the_scale_subresource():
    fleet, role = list(yaml.safe_load_all(crd.crd_yaml()))
    assert fleet["metadata"]["name"] == names.CRD_NAME and role["metadata"]["name"] == names.ROLE_CRD_NAME
    version = role["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    assert role["spec"]["names"]["shortNames"] == names.ROLE_SHORT_NAMES
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["replicas"]["minimum"] == 1 and spec["required"] == ["fleet", "role", "replicas"]
    assert spec["properties"]["fleet"]["x-kubernetes-validations"] == [{"rule": "self == oldSelf",
                                                                        "message": "fleet is immutable"}]
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Desired", "Current", "Ready", "Last Scale"}
