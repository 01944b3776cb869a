"""The model-source URI contract the operator relies on: grammar, refusals naming the part,
cache and mount paths, reasons and the termination message."""

import json
import subprocess
import sys

import pytest

from adpfleet.model_uri import (REASONS, TERMINATION_MESSAGE_LIMIT, ModelSourceError, ModelURIError,
                                parse_model_uri, parse_termination_message, termination_message,
                                write_termination_message)


@pytest.mark.parametrize("text, kind, name, path, revision, served", [
    ("tiny", "builtin", "tiny", "", None, "tiny"),
    ("tiny-dense", "builtin", "tiny-dense", "", None, "tiny-dense"),
    ("hf://Qwen/Qwen3-0.6B", "hf", "Qwen/Qwen3-0.6B", "", None, "Qwen3-0.6B"),
    ("hf://meta-llama/Llama-3.1-8B@v1.0", "hf", "meta-llama/Llama-3.1-8B", "", "v1.0", "Llama-3.1-8B"),
    ("hf://org/repo@refs/pr/1", "hf", "org/repo", "", "refs/pr/1", "repo"),
    ("hf://gpt2", "hf", "gpt2", "", None, "gpt2"),
    ("s3://my-models/llama/8b/", "s3", "my-models", "llama/8b", None, "8b"),
    ("s3://my-models", "s3", "my-models", "", None, "my-models"),
    ("pvc://model-store/llama/8b", "pvc", "model-store", "llama/8b", None, "8b"),
    ("pvc://model-store", "pvc", "model-store", "", None, "model-store"),
    ("/models/llama", "directory", "", "/models/llama", None, "llama"),
    ("file:///models/llama/", "directory", "", "/models/llama/", None, "llama"),
    ("rel/dir", "directory", "", "rel/dir", None, "dir"),
])
def test_each_source_parses(text, kind, name, path, revision, served):
    uri = parse_model_uri(text)
    assert (uri.kind, uri.name, uri.path, uri.revision, uri.served_name) == (kind, name, path, revision, served)
    assert uri.downloads == (kind in ("hf", "s3"))


@pytest.mark.parametrize("text, part", [
    ("", "the URI"), (" tiny", "the URI"), ("hf://a b/c", "the URI"),
    ("gs://bucket/x", "scheme"), ("http://example.com/model", "scheme"),
    ("hf://", "repo"), ("hf://org/", "repo"), ("hf://a/b/c", "repo"), ("hf://org/re--po", "repo"),
    ("hf://org/..", "repo"), ("hf://-org/repo", "repo"), ("hf://org/repo@", "revision"),
    ("hf://org/repo@a..b", "revision"),
    ("s3://", "bucket"), ("s3://UPPER/x", "bucket"), ("s3://ab/x", "bucket"), ("s3://b..x/y", "bucket"),
    ("s3://bucket/../etc", "prefix"),
    ("pvc://", "claim"), ("pvc://Not_DNS/x", "claim"), ("pvc://claim/../../etc", "path"),
    ("file://relative", "path"),
])
def test_a_malformed_uri_is_refused_naming_the_part(text, part):
    with pytest.raises(ModelURIError) as err:
        parse_model_uri(text)
    assert err.value.part == part and err.value.reason == "InvalidModelURI" and err.value.exit_code == 10
    assert part in str(err.value)


def test_downloads_have_one_cache_directory_per_repo_and_revision():
    a = parse_model_uri("hf://org/repo").cache_dir("/c")
    assert a == "/c/hf--org--repo--main"
    assert parse_model_uri("hf://org/repo@refs/pr/1").cache_dir("/c") == "/c/hf--org--repo--refs%2Fpr%2F1"
    assert parse_model_uri("s3://bucket/a/b").cache_dir("/c") == "/c/s3--bucket--a%2Fb"
    assert len(parse_model_uri("s3://bucket/" + "x" * 900).cache_dir("/c").rsplit("/", 1)[1]) <= 200


def test_a_pvc_source_is_read_where_its_claim_is_mounted(monkeypatch):
    monkeypatch.delenv("ADPFLEET_PVC_ROOT", raising=False)
    assert parse_model_uri("pvc://store/llama/8b").local_dir() == "/mnt/adpfleet/pvc/store/llama/8b"
    monkeypatch.setenv("ADPFLEET_PVC_ROOT", "/tmp/pvcs")
    assert parse_model_uri("pvc://store").local_dir() == "/tmp/pvcs/store/"


def test_every_reason_has_its_own_exit_code_clear_of_usage_and_signals():
    codes = [code for code, _ in REASONS.values()]
    assert len(set(codes)) == len(codes) and all(2 < c < 126 for c in codes)
    with pytest.raises(ValueError):
        ModelSourceError("SomethingElse", "x")


def test_the_termination_message_round_trips_and_fits_kubernetes_limit(tmp_path, monkeypatch):
    error = ModelSourceError("DiskFull", "no room " * 2000, "hf://org/repo")
    text = termination_message(error)
    assert len(text.encode()) <= TERMINATION_MESSAGE_LIMIT
    body = json.loads(text)
    assert body["reason"] == "DiskFull" and body["exitCode"] == 21 and body["uri"] == "hf://org/repo"
    back = parse_termination_message(text)
    assert back.reason == "DiskFull" and back.uri == "hf://org/repo"
    assert parse_termination_message("Error: OOMKilled") is None and parse_termination_message(None) is None
    monkeypatch.setenv("ADPFLEET_TERMINATION_LOG", str(tmp_path / "log"))
    assert write_termination_message(error) == str(tmp_path / "log")
    assert parse_termination_message((tmp_path / "log").read_text()).reason == "DiskFull"


def test_the_module_imports_only_the_standard_library():
    code = ("import sys; before = set(sys.modules); import adpfleet.model_uri; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            "print(sorted(new - set(sys.stdlib_module_names) - {'adpfleet'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
