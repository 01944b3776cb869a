"""s3:// sources: the real `boto3` client against a real S3-compatible server (moto in server mode,
with authentication enforced), through AWS_ENDPOINT_URL as for MinIO or Ceph."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import wait_for
from adpfleet.model_uri import COMPLETE_MARKER, ModelSourceError, parse_termination_message
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.sources.fetch import resolve_model
from adpfleet.runtime.model.sources.progress import bytes_under

from fetch_cli import fetch_process
from hf_models import save_hf_model
from rogue_s3 import RogueS3

SETUP_ACTIONS = 3  # create the user, its key and its policy unauthenticated; then keys are checked


def hostile_names(outside: Path) -> dict[str, str]:
    """Shard names a hostile store's index and listing give, by prefix: one climbing out of the
    fill directory <cache>/<key>.partial into <tmp>/escape, one absolute."""
    return {"dotdot": "../../escape/evil.safetensors", "absolute": str(outside / "evil.safetensors")}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server holding a sharded Llama under models/llama/tiny; yields its endpoint and
    a valid key pair."""
    import boto3

    port = free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(SETUP_ACTIONS)}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True,
                 timeout=60, what="the moto server to listen")
        anon = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                    aws_secret_access_key="setup")
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="fleet")
        key = iam.create_access_key(UserName="fleet")["AccessKey"]
        iam.put_user_policy(UserName="fleet", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        creds = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])
        src = tmp_path_factory.mktemp("s3-model")
        save_hf_model("llama", src, max_shard_size="80KB")
        (src / "pytorch_model.bin").write_bytes(b"not needed")
        client.create_bucket(Bucket="models")
        for f in src.iterdir():
            client.upload_file(str(f), "models", f"llama/tiny/{f.name}")
        client.create_bucket(Bucket="empty")
        outside = tmp_path_factory.mktemp("outside")
        for prefix, evil in hostile_names(outside).items():  # S3 takes any key: '..' and '//' included
            client.upload_file(str(src / "config.json"), "models", f"hostile/{prefix}/config.json")
            index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": evil}}
            client.put_object(Bucket="models", Key=f"hostile/{prefix}/model.safetensors.index.json",
                              Body=json.dumps(index).encode())
            client.put_object(Bucket="models", Key=f"hostile/{prefix}/{evil}", Body=b"import os  # a .pth runs this")
        yield endpoint, creds, src, outside
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture
def env(s3, monkeypatch, tmp_path):
    endpoint, creds = s3[:2]
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ADPFLEET_MODEL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_a_prefix_is_fetched_with_only_the_files_the_runtime_needs(env, s3):
    model = resolve_model("s3://models/llama/tiny")
    names = {p.name for p in Path(model.path).iterdir()}
    assert "pytorch_model.bin" not in names and "config.json" in names and "model.safetensors.index.json" in names
    assert model.served_name == "tiny"
    marker = json.loads((Path(model.path) / COMPLETE_MARKER).read_text())
    assert len(marker["etags"]) == 5 and marker["uri"] == "s3://models/llama/tiny"
    ours, source = load_model(model.path), load_model(s3[2])
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), source.parameters()))


@pytest.mark.parametrize("uri, reason", [
    ("s3://no-such-bucket/llama/tiny", "BucketNotFound"),
    ("s3://empty/llama/tiny", "ObjectNotFound"),
    ("s3://models/llama/nothing-here", "ObjectNotFound"),
])
def test_a_missing_bucket_or_prefix_is_named(env, uri, reason):
    with pytest.raises(ModelSourceError) as err:
        resolve_model(uri)
    assert err.value.reason == reason and err.value.uri == uri


@pytest.mark.parametrize("key_id", ["AKIAWRONGWRONGWRONG0", None])
def test_wrong_or_missing_credentials_are_invalid_credentials(env, monkeypatch, key_id):
    if key_id:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    else:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ModelSourceError) as err:
        resolve_model("s3://models/llama/tiny")
    assert err.value.reason == "InvalidCredentials", err.value


@pytest.mark.parametrize("prefix, why", [("dotdot", "a '..' segment"), ("absolute", "an absolute path")])
def test_a_store_naming_files_outside_the_model_directory_is_refused_before_writing_them(env, s3, prefix, why):
    """The issue's probe wrote both files outside the cache and reported success."""
    outside = s3[3]
    with pytest.raises(ModelSourceError) as err:
        resolve_model(f"s3://models/hostile/{prefix}")
    assert err.value.reason == "UnsafeFileName", err.value
    assert f"names {hostile_names(outside)[prefix]!r}, which escapes the model directory ({why})" in str(err.value)
    assert not (env / "escape").exists() and not (outside / "evil.safetensors").exists()


# ---- a lying store (moto cannot be made to lie) ----------------------------------------------------

@pytest.fixture(scope="module")
def rogue(s3):
    """A store that lies about sizes and serves slowly, with moto's tiny Llama as the files."""
    src = s3[2]
    shard = (src / "model-00001-of-00005.safetensors").read_bytes()
    with RogueS3() as store:
        for prefix in ("big-liar", "short", "huge-config", "slow"):
            store.put("models", f"{prefix}/config.json", (src / "config.json").read_bytes(),
                      listed_size=10**13 if prefix == "huge-config" else None)
        store.put("models", "big-liar/model.safetensors", os.urandom(20_000_000), listed_size=1, rate=4_000_000)
        store.put("models", "short/model.safetensors", shard, listed_size=len(shard) + 1000)
        store.put("models", "huge-config/model.safetensors", shard)
        store.put("models", "slow/model.safetensors", shard * 3, rate=2_000)
        yield store


@pytest.fixture
def rogue_env(env, rogue, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", rogue.url)
    monkeypatch.setenv("ADPFLEET_TERMINATION_LOG", str(env / "termination-log"))
    return env


@pytest.mark.parametrize("prefix, reason, words", [
    ("short", "SizeMismatch", "model.safetensors is "),
    ("huge-config", "DiskFull", "GB free"),  # the listing's sizes are what the room is checked for
])
def test_a_listing_that_lies_about_sizes_is_refused(rogue_env, prefix, reason, words):
    with pytest.raises(ModelSourceError) as err:
        resolve_model(f"s3://models/{prefix}")
    assert err.value.reason == reason and words in str(err.value), err.value
    assert not list((rogue_env / "cache").glob(f"*/{COMPLETE_MARKER}"))


def test_a_file_served_past_its_listed_size_is_stopped_within_the_cache_limit(rogue_env):
    """The issue's probe: listed at 1 byte, served 73 MB, through the size check, exit 0."""
    limit = 5_000_000
    proc = fetch_process(rogue_env, "s3://models/big-liar", ADPFLEET_CACHE_SIZE_LIMIT=str(limit))
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 26, err
    failure = parse_termination_message((rogue_env / "termination-log").read_text())
    assert failure.reason == "SizeMismatch" and "model.safetensors" in failure.message, failure.message
    assert bytes_under(rogue_env / "cache") < limit


def test_an_object_trickling_in_past_the_stall_deadline_ends_the_fetch_as_fetch_stalled(rogue_env):
    """One stream per object: boto3's own transfer threads would hold the exit until the object ends."""
    t0 = time.monotonic()
    proc = fetch_process(rogue_env, "s3://models/slow", ADPFLEET_FETCH_STALL_TIMEOUT="1")
    try:
        out, err = proc.communicate(timeout=45)
    finally:
        proc.kill()
    assert proc.returncode == 27 and time.monotonic() - t0 < 30, err  # the object would take 2 minutes
    failure = parse_termination_message((rogue_env / "termination-log").read_text())
    assert failure.reason == "FetchStalled" and "model.safetensors" in failure.message, failure.message
