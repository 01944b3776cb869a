"""Loading through the registry: sharded checkpoints, each rank reading only the slices it keeps,
and configs the runtime refuses with the key named."""

import json

import pytest
import torch

from adpfleet.runtime.model.config import ModelConfig, ModelLoadError
from adpfleet.runtime.model.loader import assemble, load_model
from adpfleet.runtime.model.parallel import ParallelContext
from adpfleet.runtime.model.checkpoint import checkpoint_files
from adpfleet.runtime.model.weights import read_checkpoint

from hf_models import hf_config, save_hf_model


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    whole, shards = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("sharded")
    save_hf_model("mixtral", whole)
    save_hf_model("mixtral", shards, max_shard_size="60KB")
    return whole, shards


def test_a_sharded_checkpoint_loads_as_the_whole_one(sharded):
    whole, shards = sharded
    assert len(checkpoint_files(shards)) > 3 and len(checkpoint_files(whole)) == 1
    for (na, a), (nb, b) in zip(load_model(whole).named_parameters(), load_model(shards).named_parameters()):
        assert na == nb and torch.equal(a, b)


def test_an_index_naming_a_missing_shard_is_no_safetensors(sharded, tmp_path):
    _, shards = sharded
    for f in shards.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError) as err:
        load_model(tmp_path)
    assert err.value.reason == "NoSafetensors" and "model-00002-of" in str(err.value)


class Recording:
    """A checkpoint tensor that records which slices were read."""

    def __init__(self, inner, reads, name):
        self.inner, self.reads, self.name, self.shape = inner, reads, name, inner.shape

    def __getitem__(self, index):
        self.reads.setdefault(self.name, []).append(index)
        return self.inner[index]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_the_slices_it_keeps(sharded, rank):
    whole, shards = sharded
    cfg = ModelConfig.from_dir(shards)
    reads: dict = {}
    sources = [(f, ((n, Recording(t, reads, n)) for n, t in read_checkpoint(f))) for f in checkpoint_files(shards)]
    ours = assemble(cfg, sources, ParallelContext(rank, 2), "cpu", torch.float32)
    experts = range(rank * 2, rank * 2 + 2)  # 4 experts over 2 ranks
    assert any(".experts." in n for n in reads)
    assert not [n for n in reads if ".experts." in n and int(n.split(".experts.")[1].split(".")[0]) not in experts]
    full = load_model(whole)
    mine = dict(ours.named_parameters())
    gate_up = full.get_parameter("model.layers.0.mlp.gate_up")
    assert torch.equal(mine["model.layers.0.mlp.gate_up"], gate_up[rank * 2:rank * 2 + 2])
    assert torch.equal(mine["model.layers.0.self_attn.qkv_proj.weight"],
                       full.get_parameter("model.layers.0.self_attn.qkv_proj.weight"))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_reads_its_rows_and_columns_of_the_mlp(tmp_path, rank):
    save_hf_model("qwen3", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    reads: dict = {}
    [file] = checkpoint_files(tmp_path)
    assemble(cfg, [(file, ((n, Recording(t, reads, n)) for n, t in read_checkpoint(file)))],
             ParallelContext(rank, 2), "cpu", torch.float32)
    half = slice(rank * 48, rank * 48 + 48)  # intermediate_size 96 over 2 ranks
    assert reads["model.layers.0.mlp.gate_proj.weight"] == [half]
    assert reads["model.layers.0.mlp.down_proj.weight"] == [(slice(None), half)]


def test_the_model_is_built_in_its_dtype(tmp_path):
    save_hf_model("qwen2", tmp_path)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("model_type, key, value, message", [
    ("qwen2", "use_sliding_window", True, "use_sliding_window=True is not supported"),
    ("qwen3", "use_sliding_window", True, "use_sliding_window=True is not supported"),
    ("llama", "mlp_bias", True, "mlp_bias=True is not supported"),
    ("llama", "hidden_act", "gelu", "hidden_act='gelu' is not supported"),
    ("mixtral", "num_local_experts", 0, "'num_local_experts' must be a positive integer"),
    ("gpt2", "model_type", "gpt2", "unsupported model_type 'gpt2'; adpfleet runs llama, mixtral, qwen2, qwen3"),
])
def test_configs_the_runtime_does_not_run_are_refused_naming_the_key(model_type, key, value, message):
    raw = hf_config(model_type if model_type != "gpt2" else "llama").to_dict()
    raw[key] = value
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_dict(raw)
    assert message in str(err.value)
    assert err.value.reason == ("UnsupportedModelType" if key == "model_type" else "InvalidModel")


@pytest.mark.parametrize("model_type, features, overrides", [
    ("llama", dict(qkv_bias=False, o_bias=False, qk_norm=False, is_moe=False), {}),
    ("llama", dict(qkv_bias=True, o_bias=True), dict(attention_bias=True)),
    ("mixtral", dict(qkv_bias=False, qk_norm=False, is_moe=True, num_local_experts=4), {}),
    ("qwen2", dict(qkv_bias=True, o_bias=False, qk_norm=False, tie_word_embeddings=True), {}),
    ("qwen3", dict(qkv_bias=False, o_bias=False, qk_norm=True), {}),
    ("qwen3", dict(qkv_bias=True, o_bias=True, qk_norm=True), dict(attention_bias=True)),
])
def test_each_architecture_maps_its_config(model_type, features, overrides):
    cfg = ModelConfig.from_dict(json.loads(hf_config(model_type, **overrides).to_json_string()))
    assert {k: getattr(cfg, k) for k in features} == features


def test_a_tensor_for_an_expert_the_config_lacks_is_named():
    from pathlib import Path

    from adpfleet.runtime.model.tiny import tiny_checkpoint

    cfg, weights = tiny_checkpoint("tiny")
    weights["model.layers.0.block_sparse_moe.experts.7.w1.weight"] = weights[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    with pytest.raises(ModelLoadError) as err:
        assemble(cfg, [(Path("ckpt"), weights.items())], ParallelContext(), "cpu", torch.float32)
    assert "is for expert 7, but config.json has num_local_experts=4" in str(err.value)


def test_a_chat_template_file_is_the_models_chat_template(tmp_path):
    from tokenizers import Tokenizer, models

    from adpfleet.runtime.tokenizer import load_tokenizer

    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old"}))
    cfg = ModelConfig.from_dict(hf_config("llama").to_dict())
    assert load_tokenizer(str(tmp_path), cfg).chat_template == "old"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    tok = load_tokenizer(str(tmp_path), cfg)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_a_part_of_a_packed_parameter_the_checkpoint_lacks_is_named():
    from pathlib import Path

    from adpfleet.runtime.model.tiny import tiny_checkpoint

    cfg, weights = tiny_checkpoint("tiny-dense")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ModelLoadError) as err:
        assemble(cfg, [(Path("ckpt"), weights.items())], ParallelContext(), "cpu", torch.float32)
    assert "no weights for parameter 'model.layers.1.self_attn.qkv_proj.weight'" in str(err.value)


def test_a_rank_needs_only_its_own_experts():
    from pathlib import Path

    from adpfleet.runtime.model.tiny import tiny_checkpoint

    cfg, weights = tiny_checkpoint("tiny")
    del weights["model.layers.0.block_sparse_moe.experts.3.w1.weight"]  # rank 1's (4 experts, 2 ranks)
    assemble(cfg, [(Path("ckpt"), weights.items())], ParallelContext(0, 2), "cpu", torch.float32)
    with pytest.raises(ModelLoadError) as err:
        assemble(cfg, [(Path("ckpt"), weights.items())], ParallelContext(1, 2), "cpu", torch.float32)
    assert "no weights for parameter 'model.layers.0.mlp.gate_up'" in str(err.value)
