"""Invalid fleets are refused by the real API server at apply time, with a message naming the field.

Each catalogue entry (specs.py) is applied with `kubectl apply --server-side`, as a user would; the
same entries are refused by pydantic in test_models.py, so the operator and the API server agree.
"""

import pytest
import yaml

from specs import GPU_TEMPLATE, INVALID_NAMES, INVALID_SPECS, INVALID_TEMPLATES, fleet_manifest, gpu_role

pytestmark = pytest.mark.k8s


@pytest.fixture(scope="module")
def bad_specs_namespace(k8s_cluster, fleet_crd):
    from kubernetes import client
    name = "bad-specs"
    k8s_cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    k8s_cluster.core.delete_namespace(name)


def kubectl_apply(cluster, namespace, manifest):
    return cluster.kubectl("apply", "--server-side", f"--namespace={namespace}", "-f", "-",
                           input=yaml.safe_dump(manifest), check=False)


def test_there_are_at_least_fifteen_kinds_of_invalid_spec_and_ten_of_invalid_pod_template():
    assert len(INVALID_SPECS) >= 15 and len(INVALID_TEMPLATES) >= 10


@pytest.mark.parametrize("case", INVALID_SPECS, ids=lambda c: c.what)
def test_invalid_spec_is_refused_with_a_message_naming_the_field(k8s_cluster, bad_specs_namespace, case):
    result = kubectl_apply(k8s_cluster, bad_specs_namespace, case.manifest())
    assert result.returncode != 0, f"{case.what}: the API server accepted it"
    for word in case.api_words:
        assert word in result.stderr, f"{case.what}: {word!r} not in {result.stderr!r}"


@pytest.mark.parametrize("name,words", INVALID_NAMES)
def test_fleet_name_that_cannot_prefix_pod_names_is_refused(k8s_cluster, bad_specs_namespace, name, words):
    result = kubectl_apply(k8s_cluster, bad_specs_namespace, fleet_manifest(name))
    assert result.returncode != 0
    for word in words:
        assert word in result.stderr


def test_a_valid_fleet_is_accepted_and_defaulted(k8s_cluster, bad_specs_namespace):
    result = kubectl_apply(k8s_cluster, bad_specs_namespace, fleet_manifest("good"))
    assert result.returncode == 0, result.stderr
    spec = k8s_cluster.get_json("inferencefleet", "good", f"--namespace={bad_specs_namespace}")["spec"]
    assert spec["remediation"]["mode"] == "Auto" and spec["context"]["engine"]["kvBlocks"] == 64
    assert spec["generation"]["engine"]["maxBatchSize"] == 64  # nested defaults of a partly given object
    k8s_cluster.kubectl("delete", "inferencefleet", "good", f"--namespace={bad_specs_namespace}")


def test_an_aggregated_vllm_fleet_is_accepted_and_cannot_become_disaggregated(k8s_cluster, bad_specs_namespace):
    manifest = fleet_manifest("vllm-agg")
    spec = manifest["spec"]
    del spec["context"], spec["generation"]
    spec.update(engine="vllm", model={"uri": "hf://org/llama"}, aggregated={"adpRanks": 2},
                vllm={"image": "vllm/vllm-openai:v0.32.0", "args": ["--max-model-len=4096"]})
    result = kubectl_apply(k8s_cluster, bad_specs_namespace, manifest)
    assert result.returncode == 0, result.stderr
    stored = k8s_cluster.get_json("inferencefleet", "vllm-agg", f"--namespace={bad_specs_namespace}")["spec"]
    assert "context" not in stored and stored["aggregated"]["engine"]["kvBlocks"] == 512  # role defaults apply
    spec.update(engine="adpfleet", model={"uri": "tiny"}, context={}, generation={})
    del spec["aggregated"], spec["vllm"]
    result = kubectl_apply(k8s_cluster, bad_specs_namespace, manifest)  # the transition rule
    assert result.returncode != 0 and "spec.aggregated" in result.stderr and "aggregated is immutable" in result.stderr
    k8s_cluster.kubectl("delete", "inferencefleet", "vllm-agg", f"--namespace={bad_specs_namespace}")


def test_kubectl_explain_shows_each_fields_description_default_and_range(k8s_cluster, fleet_crd):
    from adpfleet.cluster.testing import wait_for

    def explain(field: str) -> str:
        return k8s_cluster.kubectl("explain", f"inferencefleet.{field}").stdout
    text = wait_for(lambda: explain("spec.context.engine.kvBlocks"), timeout=30, what="the CRD in OpenAPI v3")
    assert "Paged KV-cache blocks per ADP rank. Default: 512. Allowed: 1 to 10000000." in " ".join(text.split())
    for field, words in (("spec.imagePullPolicy", "When the kubelet pulls"), ("spec.imagePullSecrets", "registry"),
                         ("status.conditions", "Progressing, Degraded")):
        assert words in " ".join(explain(field).split()), field


def test_a_full_pod_template_is_accepted_as_written(k8s_cluster, bad_specs_namespace):
    """The CRD takes a template with every kind of field (and the API server prices its rules)."""
    manifest = fleet_manifest("templated", context=gpu_role(), router={"podTemplate": {"spec": {
        "priorityClassName": "router-high", "containers": [{"name": "router", "env": [{"name": "A", "value": "1"}]}]}}})
    result = kubectl_apply(k8s_cluster, bad_specs_namespace, manifest)
    assert result.returncode == 0, result.stderr
    stored = k8s_cluster.get_json("inferencefleet", "templated", f"--namespace={bad_specs_namespace}")["spec"]
    assert stored["context"]["podTemplate"] == GPU_TEMPLATE  # no field pruned, nothing defaulted into it
    k8s_cluster.kubectl("delete", "inferencefleet", "templated", f"--namespace={bad_specs_namespace}")
