"""The engine's defaults are written once (EngineConfig); the command line reads them, and the
InferenceFleet CRD, the public contract, states the same values."""

import dataclasses

from adpfleet.cli import build_parser
from adpfleet.operator.resource.models import EngineSettings
from adpfleet.runtime.config import EngineConfig

SHARED = ("device", "dtype", "kv_blocks", "tokens_per_block", "max_num_tokens", "max_batch_size",
          "max_num_active_requests")


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
