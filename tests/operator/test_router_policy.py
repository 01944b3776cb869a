"""The fleet's router.policy reaches the router's command line, with the tokenizer it needs when
the router can load it (a built-in model, a directory in the image)."""

import pytest

from adpfleet.operator.decisions.desired import router_objects
from adpfleet.operator.resource.models import FleetSpec
from adpfleet.operator.resource.names import FleetRef

from specs import fleet_manifest

FLEET = FleetRef("demo", "ns1", "uid-1")


def router_args(**spec_overrides) -> list[str]:
    spec = FleetSpec.model_validate(fleet_manifest(**spec_overrides)["spec"])
    return router_objects(FLEET, spec)[3]["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_the_router_is_cache_aware_by_default_with_the_built_in_models_tokenizer():
    args = router_args()
    assert flag(args, "--policy") == "cache-aware" and flag(args, "--tokenizer") == "tiny"


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_another_policy_is_rendered_and_needs_no_tokenizer(policy):
    args = router_args(router={"policy": policy})
    assert flag(args, "--policy") == policy and "--tokenizer" not in args


@pytest.mark.parametrize("uri, tokenizer", [("/models/llama", "/models/llama"), ("hf://org/repo", None),
                                            ("pvc://models/llama", None)])
def test_the_router_tokenizes_with_a_model_it_can_read_and_routes_by_load_otherwise(uri, tokenizer):
    assert flag(router_args(model={"uri": uri}), "--tokenizer") == tokenizer


def test_a_vllm_fleets_router_gets_no_tokenizer_and_routes_by_load():
    """Its model directory is in the vLLM image, not the router's, and vLLM publishes no prefix-cache snapshot."""
    from test_engines import vllm_spec

    spec = FleetSpec.model_validate(vllm_spec(model="/models/llama"))
    args = router_objects(FLEET, spec)[3]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--tokenizer" not in args
