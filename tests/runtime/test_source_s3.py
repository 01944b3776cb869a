"""s3:// sources: the real `boto3` client against a real S3-compatible server (moto in server mode,
with authentication enforced), through AWS_ENDPOINT_URL as for MinIO or Ceph."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adpfleet.cluster.testing import wait_for
from adpfleet.model_uri import COMPLETE_MARKER, ModelSourceError
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.sources.fetch import resolve_model

from hf_models import save_hf_model

SETUP_ACTIONS = 3  # create the user, its key and its policy unauthenticated; then keys are checked


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server holding a sharded Llama under models/llama/tiny; yields its endpoint and
    a valid key pair."""
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
        yield endpoint, creds, src
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture
def env(s3, monkeypatch, tmp_path):
    endpoint, creds, _ = s3
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
