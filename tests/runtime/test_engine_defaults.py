"""The engine's defaults are written once (EngineConfig); the command line reads them, and the
InferenceFleet CRD, the public contract, states the same values."""

import dataclasses

from adpfleet.cli import build_parser
from adpfleet.operator.resource.server_role import EngineSettings
from adpfleet.runtime.config import EngineConfig

SHARED = ("device", "dtype", "kv_blocks", "tokens_per_block", "max_num_tokens", "max_batch_size",
          "max_num_active_requests", "draft_tokens", "prompt_lookup_max", "prompt_lookup_min", "padding_reserve")


def test_the_crd_engine_defaults_are_the_engine_defaults():
    crd, engine = EngineSettings(), EngineConfig()
    assert {k: getattr(crd, k) for k in SHARED} == {k: getattr(engine, k) for k in SHARED}


def test_every_engine_knob_of_the_crd_is_an_engine_field_or_a_serve_flag():
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    serve_only = {"collective_timeout_seconds", "pad_empty_batch", "threads_per_rank"}
    assert set(EngineSettings.model_fields) - serve_only == set(SHARED) and set(SHARED) <= engine


def test_the_command_line_defaults_are_the_engine_defaults():
    args = build_parser().parse_args(["serve"])
    assert EngineConfig.from_args(args) == EngineConfig()


def test_the_serve_flags_default_as_the_crd_does():
    args, crd = build_parser().parse_args(["serve"]), EngineSettings()
    assert args.collective_timeout == crd.collective_timeout_seconds
    assert (not args.no_pad_empty_batch) == crd.pad_empty_batch
    assert args.padding_reserve == crd.padding_reserve


def test_every_crd_engine_knob_reaches_the_serve_command_line():
    """Each engine field set away from its default changes what the operator passes to `serve`."""
    from adpfleet.operator.decisions.engines.adpfleet import server_args
    from adpfleet.operator.resource.models import FleetSpec
    changed = {"kvBlocks": 100, "tokensPerBlock": 8, "maxNumTokens": 100, "maxBatchSize": 3,
               "maxNumActiveRequests": 5, "draftTokens": 2, "promptLookupMax": 4, "promptLookupMin": 2,
               "paddingReserve": False}
    spec = FleetSpec.model_validate({"image": "x", "model": {"name": "tiny"}, "context": {"engine": changed}})
    args = build_parser().parse_args([a.replace("$(POD_IP)", "0.0.0.0") for a in server_args(spec, "context")])
    config = EngineConfig.from_args(args)
    for camel, value in changed.items():
        snake = "".join("_" + c.lower() if c.isupper() else c for c in camel)
        assert getattr(config, snake) == value, camel
