"""Bad model directories fail with one clear error; bad requests fail alone, the engine goes on."""

import json

import pytest
import torch
from safetensors.torch import save_file

from adpfleet.runtime.config import EngineConfig
from adpfleet.runtime.engine.llm_engine import LLMEngine
from adpfleet.runtime.engine.request import Request
from adpfleet.runtime.engine.sampling import InvalidRequestError, SamplingParams
from adpfleet.runtime.model.config import ModelLoadError
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.tiny import tiny_checkpoint


@pytest.fixture
def tiny_dir(tmp_path):
    cfg, weights = tiny_checkpoint("tiny-dense")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path, weights


def test_a_saved_tiny_model_loads_like_the_builtin_one(tiny_dir):
    path, _ = tiny_dir
    ids = torch.tensor([1, 2, 3])
    a, b = load_model(path), load_model("tiny-dense")
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert ids.numel() == 3


@pytest.mark.parametrize("case, expected", [
    ("missing_dir", "does not exist"),
    ("no_config", "config.json is missing"),
    ("bad_json", "is not valid JSON"),
    ("unknown_arch", "unsupported model_type 'gpt2'"),
    ("no_weights", "has no *.safetensors"),
    ("corrupt_weights", "not a readable safetensors file"),
    ("wrong_shape", "tensor 'model.layers.0.self_attn.o_proj.weight' has shape (128, 64)"),
    ("missing_tensor", "no weights for parameter 'model.layers.1.mlp.down_proj.weight'"),
    ("extra_tensor", "unexpected tensor 'model.vision_tower.weight'"),
    ("extra_layer", "is for layer 9, but config.json has num_hidden_layers=2"),
])
def test_broken_model_directories_name_the_culprit(tiny_dir, case, expected):
    path, weights = tiny_dir
    raw = json.loads((path / "config.json").read_text())
    target = path
    if case == "missing_dir":
        target = path / "nope"
    elif case == "no_config":
        (path / "config.json").unlink()
    elif case == "bad_json":
        (path / "config.json").write_text("{not json")
    elif case == "unknown_arch":
        (path / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    elif case == "no_weights":
        (path / "model.safetensors").unlink()
    elif case == "corrupt_weights":
        (path / "model.safetensors").write_bytes(b"\x00garbage")
    else:
        weights = dict(weights)
        if case == "wrong_shape":
            weights["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(128, 64)
        elif case == "missing_tensor":
            del weights["model.layers.1.mlp.down_proj.weight"]
        elif case == "extra_tensor":
            weights["model.vision_tower.weight"] = torch.zeros(2)
        elif case == "extra_layer":
            weights["model.layers.9.input_layernorm.weight"] = torch.zeros(128)
        save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError) as err:
        load_model(target)
    assert expected in str(err.value)


def test_the_cli_exits_nonzero_with_the_message(tmp_path, capsys):
    from adpfleet.cli import main

    assert main(["generate", "hi", "--model", str(tmp_path)]) != 0
    assert "config.json is missing" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="tiny", kv_blocks=16, tokens_per_block=16))


@pytest.mark.parametrize("prompt, params, param", [
    ("x" * 5000, SamplingParams(max_tokens=4), "prompt"),
    ("hello", SamplingParams(max_tokens=0), "max_tokens"),
    ("hello", SamplingParams(max_tokens=-3), "max_tokens"),
    ("hello", SamplingParams(max_tokens=4000), "max_tokens"),  # beyond the 256-token KV cache
    ("", SamplingParams(), "prompt"),
    ([1, 2, 99999], SamplingParams(), "prompt"),
    ({"a": 1}, SamplingParams(), "prompt"),
    ("hello", SamplingParams(temperature="hot"), "temperature"),
    ("hello", SamplingParams(top_p=0), "top_p"),
    ("hello", SamplingParams(stop=[""]), "stop"),
])
def test_a_bad_request_is_refused_alone_and_the_engine_keeps_serving(engine, prompt, params, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt, params)
    assert err.value.param == param
    [ok] = engine.generate(["still serving"], SamplingParams(max_tokens=3))
    assert ok.finish_reason in ("length", "stop") and ok.output_token_ids


@pytest.mark.parametrize("params, param", [
    (SamplingParams(seed=2**64), "seed"),
    (SamplingParams(seed=2**63), "seed"),
    (SamplingParams(seed=-2**63 - 1), "seed"),
    (SamplingParams(stop=[f"s{i}" for i in range(100_000)]), "stop"),
    (SamplingParams(stop=["x" * 10_000]), "stop"),
    (SamplingParams(stop_token_ids=list(range(100_000))), "stop_token_ids"),
])
def test_parameters_a_rank_could_not_survive_are_refused_up_front(engine, params, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("hello", params)
    assert err.value.param == param


def test_the_int64_seed_bounds_are_accepted(engine):
    for seed in (2**63 - 1, -2**63):
        [r] = engine.generate(["seeded"], SamplingParams(max_tokens=2, temperature=1.0, seed=seed, ignore_eos=True))
        assert len(r.output_token_ids) == 2


@pytest.mark.parametrize("temperature", [1e-45, 1e-3, 0.0099])
def test_a_temperature_below_the_smallest_samples_greedily(engine, temperature):
    greedy, tiny = engine.generate(["x", "x"], [SamplingParams(max_tokens=8, ignore_eos=True),
                                                SamplingParams(max_tokens=8, ignore_eos=True, temperature=temperature)])
    assert tiny.output_token_ids == greedy.output_token_ids


def test_a_request_whose_sampling_fails_fails_alone_and_the_batch_goes_on(engine):
    # past validation (as a bug or an unforeseen input would be): torch refuses this seed in the rank
    bad = Request("doomed", engine.tokenizer.encode("doomed"), SamplingParams(max_tokens=6, temperature=1.0,
                                                                               seed=2**64))
    engine.pending.append(bad)
    good = engine.add_request("bystander", SamplingParams(max_tokens=6, ignore_eos=True))
    outputs = []
    while not good.is_finished:
        outputs += engine.step()
    [failed] = [o for o in outputs if o.request_id == "doomed"]
    assert failed.finish_reason == "error" and "sampling failed" in failed.error
    assert len(good.output_token_ids) == 6
    assert engine.kv.num_used_blocks == 0 and not engine.active


@pytest.mark.parametrize("content, match", [("raise", "roles must alternate"), ("escape", "unsafe")])
def test_a_chat_template_that_refuses_the_messages_is_a_bad_request_naming_messages(tmp_path, content, match):
    from chat_model import save_chat_model

    from adpfleet.runtime.model.config import ModelConfig
    from adpfleet.runtime.serving.protocol import ChatCompletionRequest
    from adpfleet.runtime.tokenizer import load_tokenizer

    path = save_chat_model(tmp_path / "model")
    tokenizer = load_tokenizer(str(path), ModelConfig.from_dir(str(path)))
    req = ChatCompletionRequest(messages=[{"role": "user", "content": content}])
    with pytest.raises(InvalidRequestError, match=match) as err:
        req.prompt_input(tokenizer)
    assert err.value.param == "messages"
    ok = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]).prompt_input(tokenizer)
    assert ok == "user: hi\nassistant:"


def test_pulled_kv_that_cannot_be_placed_fails_its_request_alone(engine):
    from adpfleet.runtime.executor.kv_transfer import KVPayload

    prompt = engine.tokenizer.encode("pulled")
    req = Request("misfit", prompt, SamplingParams(max_tokens=4))
    req.remote_kv, req.first_token_id = ("127.0.0.1:1", "h"), 65
    req.kv_payload = KVPayload(torch.zeros(2, 3, 1, 1), torch.zeros(2, 3, 1, 1))  # not this model's shape
    engine.pending.append(req)
    [out] = engine.fetch()
    assert out.request_id == "misfit" and out.finish_reason == "error" and "placing the pulled KV" in out.error
    assert engine.kv.num_used_blocks == 0 and req not in engine.active
    [ok] = engine.generate(["still serving"], SamplingParams(max_tokens=3))
    assert ok.output_token_ids


def test_a_rank_may_name_its_gpu_and_a_bad_device_is_named():
    # rank processes run on "cuda:<rank % GPUs>"; the CLI's "cuda" and "cpu" stay the only words
    with pytest.raises(ValueError, match="must be cpu or cuda, got 'tpu'"):
        EngineConfig(device="tpu").validate()
    with pytest.raises(ValueError, match="must be cpu or cuda, got 'cuda:x'"):
        EngineConfig(device="cuda:x").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            EngineConfig(device="cuda:0").validate()
    else:
        EngineConfig(device="cuda:0").validate()
