"""The pydantic models: defaults, and the same refusals the API server gives (specs.py)."""

import pytest
from pydantic import ValidationError

from adpfleet.operator.resource.models import FleetSpec, fleet_name_problem
from adpfleet.operator.resource.status import FleetStatus

from specs import INVALID_NAMES, INVALID_SPECS, fleet_manifest


def test_a_minimal_spec_gets_one_server_per_role_and_documented_defaults():
    spec = FleetSpec.model_validate({"image": "adpfleet:1", "model": {"name": "tiny"}})
    assert spec.context.servers == 1 and spec.generation.adp_ranks == 1
    assert spec.remediation.mode == "Auto"
    assert spec.remediation.stall_window_seconds >= 2 * spec.monitoring.scrape_interval_seconds
    assert spec.router.enabled and spec.router.replicas == 1
    assert spec.to_kube()["context"]["engine"]["kvBlocks"] == 512


def test_camel_case_in_yaml_snake_case_in_python():
    spec = FleetSpec.model_validate(fleet_manifest()["spec"])
    assert spec.context.engine.kv_blocks == 64
    assert "kvBlocks" in spec.to_kube()["context"]["engine"]


@pytest.mark.parametrize("case", INVALID_SPECS, ids=lambda c: c.what)
def test_pydantic_refuses_what_the_api_server_refuses(case):
    with pytest.raises(ValidationError) as refused:
        FleetSpec.model_validate(case.manifest()["spec"])
    text = str(refused.value)
    for word in case.pydantic_words:
        assert word in text, f"{case.what}: {word!r} not in {text}"


@pytest.mark.parametrize("name,words", INVALID_NAMES)
def test_fleet_names_that_cannot_prefix_pod_names_are_refused(name, words):
    assert "metadata.name" in fleet_name_problem(name)


def test_valid_fleet_name():
    assert fleet_name_problem("demo-1") is None


def test_gpus_a_multiple_of_ranks_on_cuda_is_accepted():
    spec = FleetSpec.model_validate({"image": "x", "model": {"name": "tiny"},
                                     "generation": {"adpRanks": 4, "gpusPerServer": 8, "engine": {"device": "cuda"}}})
    assert spec.generation.gpus_per_server == 8


def test_status_model_accepts_room_for_stall_conditions_and_bounded_remediations():
    status = FleetStatus.model_validate({
        "conditions": [{"type": "Stalled", "status": "True", "reason": "RankVetoed", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "recentRemediations": [{"time": "2026-01-01T00:00:00Z", "role": "context", "server": "f-context-0",
                                "signature": "vetoed", "action": "RestartServer", "outcome": "Succeeded"}] * 20})
    assert status.conditions[0].type == "Stalled"
    unknown = {**status.recent_remediations[0].to_kube(), "action": "Restart"}
    with pytest.raises(ValidationError, match="recentRemediations.0.action"):
        FleetStatus.model_validate({"recentRemediations": [unknown]})
    with pytest.raises(ValidationError):
        FleetStatus.model_validate({"recentRemediations": [status.recent_remediations[0].to_kube()] * 21})


# ---- model-source URIs: the API server's regular expressions and adpfleet/model_uri.py agree ----

URIS = [
    "tiny", "tiny-dense", "/models/llama", "rel/dir", "file:///models/llama/", "models@v1",
    "hf://Qwen/Qwen3-0.6B", "hf://meta-llama/Llama-3.1-8B@v1.0", "hf://org/repo@refs/pr/1", "hf://gpt2",
    "hf://a.b_c-d/e", "hf://org/repo@0123456789abcdef", "hf://" + "a" * 96 + "/r",
    "s3://my-models/llama/8b/", "s3://my-models", "s3://a.b-c/x.y/z..w", "pvc://model-store/llama/8b",
    "pvc://model-store", "pvc://a.b/c", "pvc://" + "a" * 63 + "/x",
    # refused
    "hf://a b/c", "a\tb", "x\x01y", "gs://bucket/x", "http://example.com/model", "HF://org/repo", "hf:/org/repo",
    "hf://", "hf://org/", "hf:///repo", "hf://a/b/c", "hf://org/re--po", "hf://org/..", "hf://-org/repo",
    "hf://org/repo-", "hf://" + "a" * 97 + "/r", "hf://org/repo@", "hf://org/repo@a..b", "hf://org/repo@main/",
    "hf://org/repo@-x", "hf://org/repo@a@b", "hf://@main",
    "s3://", "s3://UPPER/x", "s3://ab/x", "s3://b..x/y", "s3://bucket/../etc", "s3://bucket/a/./b", "s3://-ab/x",
    "pvc://", "pvc://Not_DNS/x", "pvc://claim/../../etc", "pvc://claim/.", "pvc://-claim/x", "pvc://a..b/x",
    "pvc://" + "a" * 64 + "/x", "pvc://" + ".".join(["a" * 63] * 4) + "/x",  # each label fits, 255 in all
    "file://relative", "file://",
]


@pytest.mark.parametrize("text", URIS, ids=repr)
def test_the_crd_uri_rules_refuse_exactly_what_the_parser_refuses_for_the_same_part(text):
    from adpfleet.model_uri import ModelURIError, parse_model_uri
    from adpfleet.operator.resource.model_source import URI_RULES

    failing = {rule.part for rule in URI_RULES if not rule.holds(text)}  # what the API server says
    try:
        parse_model_uri(text)
    except ModelURIError as e:
        assert e.part in failing, f"the parser refuses the {e.part}, the CRD's rules {failing or 'nothing'}"
    else:
        assert not failing, f"the parser accepts it, the CRD's rules refuse the {failing}"


def test_the_uri_rules_cover_every_part_the_parser_names():
    from adpfleet.operator.resource.model_source import URI_RULES

    assert {r.part for r in URI_RULES} == {"the URI", "scheme", "repo", "revision", "bucket", "prefix", "claim", "path"}


def test_uri_and_name_are_the_same_source_and_exactly_one_is_set():
    assert FleetSpec.model_validate({"image": "x", "model": {"uri": "hf://org/repo@v1"}}).model.source == "hf://org/repo@v1"
    assert FleetSpec.model_validate({"image": "x", "model": {"name": "tiny"}}).model.parsed.kind == "builtin"
    with pytest.raises(ValidationError, match="set exactly one of uri and name"):
        FleetSpec.model_validate({"image": "x", "model": {}})
