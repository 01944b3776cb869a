"""pvc:// and directory sources: found where they are mounted, checked by `fetch-model` the way
loading would refuse them, each failure with its reason and exit code."""

import json
import shutil
import subprocess
import sys

import pytest

from adpfleet.cli import main
from adpfleet.model_uri import parse_termination_message

from hf_models import save_hf_model


@pytest.fixture(scope="module")
def claim_root(tmp_path_factory):
    """A directory standing for the claims' mount root, with claim 'store' holding a model."""
    root = tmp_path_factory.mktemp("pvc")
    save_hf_model("qwen2", root / "store" / "qwen2")
    return root


@pytest.fixture
def env(claim_root, monkeypatch, tmp_path):
    monkeypatch.setenv("ADPFLEET_PVC_ROOT", str(claim_root))
    monkeypatch.setenv("ADPFLEET_TERMINATION_LOG", str(tmp_path / "termination-log"))
    return tmp_path


def test_a_pvc_model_is_found_under_its_claims_mount(env, claim_root, capsys):
    assert main(["fetch-model", "pvc://store/qwen2"]) == 0
    assert capsys.readouterr().out.strip() == str(claim_root / "store" / "qwen2")


@pytest.mark.parametrize("uri, breakage, reason, code", [
    ("pvc://other-claim/qwen2", None, "VolumeNotMounted", 22),
    ("pvc://store/nothing-here", None, "VolumeNotMounted", 22),
    ("{tmp}/nope", None, "DirectoryNotFound", 23),
    ("{tmp}/model", "model_type", "UnsupportedModelType", 16),
    ("{tmp}/model", "weights", "NoSafetensors", 15),
    ("{tmp}/model", "config", "InvalidModel", 17),
    ("{tmp}/model", "index-escape", "UnsafeFileName", 25),  # the loader would read what the index names
    ("{tmp}/model", "symlink", "UnsafeFileName", 25),
    ("{tmp}/model", "index-nul", "UnsafeFileName", 25),  # not an OS error with no reason
    ("{tmp}/model", "index-number", "UnsafeFileName", 25),
])
def test_an_unusable_local_model_exits_with_its_reason(env, claim_root, capsys, uri, breakage, reason, code):
    model = env / "model"
    shutil.copytree(claim_root / "store" / "qwen2", model)
    if breakage == "model_type":
        raw = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**raw, "model_type": "falcon"}))
    elif breakage == "weights":
        (model / "model.safetensors").unlink()
    elif breakage == "config":
        (model / "config.json").unlink()
    elif breakage == "index-escape":
        (model / "model.safetensors").rename(env / "outside.safetensors")
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}}))
    elif breakage in ("index-nul", "index-number"):
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"model.embed_tokens.weight": "evil\0.safetensors" if breakage == "index-nul" else 7}}))
    elif breakage == "symlink":
        (model / "model.safetensors").rename(env / "outside.safetensors")
        (model / "model.safetensors").symlink_to(env / "outside.safetensors")
    text = uri.format(tmp=env)
    assert main(["fetch-model", text]) == code
    assert reason in capsys.readouterr().err
    failure = parse_termination_message((env / "termination-log").read_text())
    assert (failure.reason, failure.uri) == (reason, text)


@pytest.mark.parametrize("breakage, reason, code", [
    (None, None, 0),  # a model_type adpfleet does not run (falcon) is vLLM's to judge
    ("no model_type", "InvalidModel", 17),
    ("weights", "NoSafetensors", 15),  # a store's *.bin is a pickle: never fetched for loading
    ("symlink", "UnsafeFileName", 25),
])
def test_a_model_for_vllm_is_checked_as_vllm_loads_it(env, claim_root, capsys, breakage, reason, code):
    model = env / "model"
    shutil.copytree(claim_root / "store" / "qwen2", model)
    raw = {**json.loads((model / "config.json").read_text()), "model_type": "falcon"}
    if breakage == "no model_type":
        del raw["model_type"]
    (model / "config.json").write_text(json.dumps(raw))
    if breakage == "weights":
        (model / "model.safetensors").rename(model / "pytorch_model.bin")
    elif breakage == "symlink":
        (model / "model.safetensors").rename(env / "outside.safetensors")
        (model / "model.safetensors").symlink_to(env / "outside.safetensors")
    assert main(["fetch-model", str(model), "--engine", "vllm"]) == code
    out = capsys.readouterr()
    if reason:
        assert reason in out.err and parse_termination_message((env / "termination-log").read_text()).reason == reason
    else:
        assert out.out.strip() == str(model)
        assert main(["fetch-model", str(model)]) == 16  # adpfleet's engine refuses what it does not run


def test_fetch_model_does_not_import_torch(claim_root):
    code = (f"import sys; from adpfleet.cli import main; assert main(['fetch-model', '{claim_root}/store/qwen2']) == 0; "
            "assert 'torch' not in sys.modules, 'fetch-model imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("value", ["0", "-5", "soon", "inf"])
def test_a_stall_deadline_that_is_not_seconds_above_zero_is_refused_naming_the_variable(monkeypatch, value):
    from adpfleet.runtime.model.sources.transfer import stall_timeout

    monkeypatch.setenv("ADPFLEET_FETCH_STALL_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"ADPFLEET_FETCH_STALL_TIMEOUT={value!r}"):
        stall_timeout()
    monkeypatch.setenv("ADPFLEET_FETCH_STALL_TIMEOUT", "2.5")
    assert stall_timeout() == 2.5
