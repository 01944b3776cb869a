"""Model sources on the local cluster, end to end: the operator's fetch-model init containers
download from a local Hugging Face Hub (the real `huggingface_hub` client through HF_ENDPOINT on
loopback), read a claim bound to a hostPath PersistentVolume, fetch from a real S3-compatible
server (moto); the servers load what was fetched and serve what the same checkpoint serves from a
directory; every way the model cannot be had is the fleet's Degraded ModelUnavailable with its
cause, and an Event, within a minute.

Cheap on purpose: one tiny sharded Llama, one fleet for the working sources (hf://, rolled to
pvc://, then to s3:// with a cache claim its servers share), and failure fleets that never start a
server (their init containers fail in a second or two), deleted as soon as they have said what is
wrong; beside them one fleet fetches the gated repository with its Secret's token, deleted once
fetched."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adpfleet.cluster.processes import free_port
from adpfleet.cluster.testing import wait_for
from adpfleet.operator.resource import names

from operator_harness import ADPFLEET, pod_ready
from specs import fleet_manifest

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

SERVER_START = 300   # seconds: torch import + rank processes, on two cores shared with everything else
FAILURE_SEEN = 60    # the issue's bound: a model that cannot be had is on the fleet within a minute
REPO = "acme/tiny-llama"
PROMPT = "w3 w17 w42 w99 w5"
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 128)]  # one word per id: text compares ids


def save_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A sharded tiny Llama (also inside a directory a PersistentVolume serves), one without
    safetensors, one of an architecture adpfleet does not run."""
    from hf_models import save_hf_model

    base = tmp_path_factory.mktemp("checkpoints")
    llama = base / "volume" / "tiny-llama"
    save_hf_model("llama", llama, seed=3, max_shard_size="80KB")
    save_tokenizer(llama)
    (llama / "pytorch_model.bin").write_bytes(b"never fetched" * 10)
    no_weights = base / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((llama / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"weights" * 10)
    gpt2 = base / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({**json.loads((llama / "config.json").read_text()),
                                                  "model_type": "gpt2"}))
    return {"llama": llama, "volume": llama.parent, "no-weights": no_weights, "gpt2": gpt2}


@pytest.fixture(scope="module")
def hub(checkpoints):
    from hub_server import LocalHub

    hub = LocalHub(tokens={"hf_valid", "hf_other"})
    hub.add_commit(REPO, checkpoints["llama"])
    hub.v1 = hub.add_commit(REPO, checkpoints["llama"], ref="v1")
    hub.add_commit("acme/gated", checkpoints["llama"], gated=True, granted={"hf_valid"})
    hub.add_commit("acme/no-weights", checkpoints["no-weights"])
    hub.add_commit("acme/gpt2", checkpoints["gpt2"])
    with hub:
        yield hub


@pytest.fixture(scope="module")
def s3(checkpoints):
    """moto's S3 server (authentication enforced) with the checkpoint under models/tiny-llama; its
    endpoint and a valid key pair."""
    import boto3

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: socket.create_connection(("127.0.0.1", port), timeout=1).close() or True, timeout=60,
                 what="the moto server to listen")
        setup = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                     aws_secret_access_key="setup")
        iam = boto3.client("iam", **setup)
        iam.create_user(UserName="fleet")
        key = iam.create_access_key(UserName="fleet")["AccessKey"]
        iam.put_user_policy(UserName="fleet", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        creds = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
                 "AWS_REGION": "us-east-1"}
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"])
        client.create_bucket(Bucket="models")
        for f in checkpoints["llama"].iterdir():
            client.upload_file(str(f), "models", f"tiny-llama/{f.name}")
        yield endpoint, creds
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture
def volumes(k8s_cluster, k8s_namespace):
    """volumes(claim, host_dir): a hostPath PersistentVolume for `host_dir`, bound to a claim of that
    name in the test's namespace (pre-bound: no other claim takes it); both deleted after the test."""
    made = []

    def make(claim: str, path: Path) -> None:
        pv = f"{k8s_namespace}-{claim}"
        made.append(pv)
        k8s_cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                           "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                                    "storageClassName": "", "persistentVolumeReclaimPolicy": "Retain",
                                    "hostPath": {"path": str(path), "type": "Directory"},
                                    "claimRef": {"namespace": k8s_namespace, "name": claim}}})
        k8s_cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
                           "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                                    "resources": {"requests": {"storage": "100Mi"}}}}, k8s_namespace)
        wait_for(lambda: k8s_cluster.get_json("pvc", claim, "-n", k8s_namespace)["status"].get("phase") == "Bound",
                 timeout=30, what=f"claim {claim} to be bound")

    yield make
    for pv in made:
        k8s_cluster.kubectl("delete", "persistentvolume", pv, "--wait=false", "--ignore-not-found", check=False)


def role(**extra) -> dict:
    return {"servers": 1, "adpRanks": 1, "engine": {"kvBlocks": 64}, "probes": {"readinessPeriodSeconds": 1},
            **extra}


def complete(fleets, fleet: str, model: str) -> tuple[str, str]:
    import openai

    pods = fleets.core.list_namespaced_pod(
        fleets.ns, label_selector=f"{names.LABEL_INSTANCE}={fleet},{names.LABEL_COMPONENT}=router").items
    router = next(p for p in pods if pod_ready(p))
    answer = openai.OpenAI(base_url=f"http://{router.status.pod_ip}:{names.ROUTER_HTTP_PORT}/v1", api_key="unused",
                           max_retries=0, timeout=120).completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                                                          temperature=0)
    return answer.choices[0].text, answer.choices[0].finish_reason


def test_a_fleet_from_hf_then_pvc_then_s3_serves_what_the_directory_serves(
        start_operator, fleets, hub, s3, checkpoints, volumes, k8s_cluster, tmp_path):
    start_operator()
    # the directory's answer, computed beside the cluster while the fleet starts
    reference = subprocess.Popen([str(ADPFLEET), "generate", PROMPT, "--model", str(checkpoints["llama"]),
                                  "--max-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    volumes("models", checkpoints["volume"])
    for shard in (p.name for p in checkpoints["llama"].glob("*.safetensors")):  # a download long enough to watch
        hub.throttle[shard] = 5_000  # bytes/s: half a minute in all
    slow_progress = [{"name": "ADPFLEET_PROGRESS_INTERVAL", "value": "1"}]
    fleets.apply(fleet_manifest("src", model={"uri": f"hf://{REPO}@v1", "endpoint": hub.url},
                                context=role(env=slow_progress), generation=role(env=slow_progress)))

    def downloading():
        status = fleets.get("src").get("status", {})
        cond = next((c for c in status.get("conditions", []) if c["type"] == "Progressing"), {})
        model = status.get("model", {})
        return cond.get("reason") == "ModelDownloading" and " MB of " in cond.get("message", "") and \
            model.get("phase") == "Downloading" and model.get("bytesTotal") and (cond["message"], model)
    message, model = wait_for(downloading, timeout=60, what="Progressing ModelDownloading with bytes", interval=0.5)
    assert message.startswith(f"downloading hf://{REPO}@v1: src-")
    table = k8s_cluster.kubectl("get", "ifleet", "src", "-n", fleets.ns, "-o", "wide").stdout
    assert "MODEL" in table and "DOWNLOADED" in table and " of " in table
    hub.throttle.clear()

    fleets.wait_ready("src", timeout=SERVER_START)
    # the commit v1 named when the servers fetched it, from fetch-model's termination message
    assert fleets.get("src")["status"]["model"] == {"source": f"hf://{REPO}@v1", "phase": "Available",
                                                    "revision": hub.v1}
    from_hub = complete(fleets, "src", "tiny-llama")  # the served name defaults to the repository's

    old = {p.metadata.uid for p in fleets.live_pods("src")}
    fleets.patch_spec("src", {"model": {"uri": "pvc://models/tiny-llama", "endpoint": None}})
    wait_for(lambda: [p.metadata.uid not in old and pod_ready(p) for p in fleets.live_pods("src")] == [True, True],
             timeout=2 * SERVER_START, what="both servers to be replaced by ready ones loading from the claim",
             interval=1)
    fleets.wait_ready("src", timeout=60)
    server = fleets.live_pods("src", "context")[0]
    mount = next(m for m in server.spec.containers[0].volume_mounts if m.mount_path == "/mnt/adpfleet/pvc/models")
    assert mount.read_only
    from_claim = wait_for(lambda: complete(fleets, "src", "tiny-llama"), timeout=60,
                          what="a completion through the rolled fleet")

    # s3://, downloaded once into a cache claim both servers share: the second finds it complete
    endpoint, creds = s3
    k8s_cluster.core.create_namespaced_secret(fleets.ns, {"metadata": {"name": "s3"}, "stringData": creds})
    cache = tmp_path / "cache"
    cache.mkdir()
    volumes("model-cache", cache)
    old = {p.metadata.uid for p in fleets.live_pods("src")}
    fleets.patch_spec("src", {"model": {"uri": "s3://models/tiny-llama", "endpoint": endpoint,
                                        "credentialsSecretRef": {"name": "s3"}, "cache": {"claimName": "model-cache"}}})
    wait_for(lambda: [p.metadata.uid not in old and pod_ready(p) for p in fleets.live_pods("src")] == [True, True],
             timeout=2 * SERVER_START, what="both servers to be replaced by ready ones loading from S3", interval=1)
    fleets.wait_ready("src", timeout=60)
    from_s3 = wait_for(lambda: complete(fleets, "src", "tiny-llama"), timeout=60, what="a completion from S3")
    marker = json.loads((cache / "s3--models--tiny-llama" / ".adpfleet-complete.json").read_text())
    assert marker["uri"] == "s3://models/tiny-llama"
    fills = [fetch_log(k8s_cluster, fleets.ns, p.metadata.name) for p in fleets.live_pods("src")]
    assert sum("already here)" in log for log in fills) == 1, fills  # one download for the fleet
    # a replaced server (a remediation, a node drain) finds the model in the cache: nothing is downloaded
    gone = fleets.live_pods("src", "generation")[0]
    fleets.core.delete_namespaced_pod(gone.metadata.name, fleets.ns)
    wait_for(lambda: [p.metadata.uid != gone.metadata.uid and pod_ready(p)
                      for p in fleets.live_pods("src", "generation")] == [True], timeout=SERVER_START,
             what="the deleted server to come back", interval=1)
    assert "already here)" not in fetch_log(k8s_cluster, fleets.ns, gone.metadata.name)

    out, err = reference.communicate(timeout=SERVER_START)
    assert reference.returncode == 0, err
    assert from_hub == from_claim == from_s3 and from_hub[0] == out.rstrip("\n"), (from_hub, from_claim, from_s3, out)


def fetch_log(cluster, namespace: str, pod: str) -> str:
    return cluster.kubectl("logs", pod, "-c", "fetch-model", "-n", namespace).stdout


def test_each_way_the_model_cannot_be_had_is_degraded_with_its_cause_and_an_event_within_a_minute(
        start_operator, fleets, hub, s3, volumes, k8s_cluster, tmp_path):
    start_operator()
    endpoint, creds = s3
    for name, data in {"s3": creds, "s3-wrong": {**creds, "AWS_SECRET_ACCESS_KEY": "wrong"},
                       "hf-granted": {"token": "hf_valid"}, "hf-other": {"token": "hf_other"}}.items():
        k8s_cluster.core.create_namespaced_secret(fleets.ns, {"metadata": {"name": name}, "stringData": data})
    small = tmp_path / "small"  # a cache with room for the metadata, not for the weights
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.fail("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        volumes("small-cache", small)
        hf = {"endpoint": hub.url}
        s3_source = {"endpoint": endpoint, "credentialsSecretRef": {"name": "s3"}}
        cases = {  # fleet -> (model, the cause the fleet must name, words of its message)
            "missing": ({"uri": "hf://acme/missing", **hf}, "RepositoryNotFound", "acme/missing not found"),
            "gated": ({"uri": "hf://acme/gated", **hf}, "Unauthorized", "gated"),
            "denied": ({"uri": "hf://acme/gated", **hf, "tokenSecretRef": {"name": "hf-other", "key": "token"}},
                       "AccessDenied", "acme/gated"),
            "no-rev": ({"uri": f"hf://{REPO}@v9", **hf}, "RevisionNotFound", "'v9'"),
            "no-st": ({"uri": "hf://acme/no-weights", **hf}, "NoSafetensors", "safetensors"),
            "gpt2": ({"uri": "hf://acme/gpt2", **hf}, "UnsupportedModelType", "gpt2"),
            "no-claim": ({"uri": "pvc://absent/tiny-llama"}, "ClaimNotFound", "PersistentVolumeClaim 'absent'"),
            "no-bucket": ({"uri": "s3://absent-bucket/tiny-llama", **s3_source}, "BucketNotFound", "absent-bucket"),
            "no-key": ({"uri": "s3://models/absent", **s3_source}, "ObjectNotFound", "absent"),
            "s3-creds": ({"uri": "s3://models/tiny-llama", "endpoint": endpoint,
                          "credentialsSecretRef": {"name": "s3-wrong"}}, "InvalidCredentials", "credentials"),
            "full": ({"uri": f"hf://{REPO}", **hf, "cache": {"claimName": "small-cache"}}, "DiskFull", "free"),
        }
        # the gated repository with the fleet's Secret holding a token it was granted: fetched
        granted = {"uri": "hf://acme/gated", **hf, "tokenSecretRef": {"name": "hf-granted", "key": "token"}}
        applied = {}
        for name, model in [*((name, model) for name, (model, _, _) in cases.items()), ("granted", granted)]:
            fleets.apply(fleet_manifest(name, model=model, router={"enabled": False}, context=role(),
                                        generation=role()))
            applied[name] = time.monotonic()

        def degraded(name):
            status = fleets.get(name).get("status", {})
            cond = next((c for c in status.get("conditions", []) if c["type"] == "Degraded"), {})
            return cond.get("status") == "True" and cond.get("reason") == "ModelUnavailable" and (cond, status)

        seen = {}
        deadline = time.monotonic() + FAILURE_SEEN + 30
        while len(seen) < len(cases) and time.monotonic() < deadline:
            for name in cases.keys() - seen.keys():
                found = degraded(name)
                if found:
                    seen[name] = (time.monotonic() - applied[name], *found)
            time.sleep(0.5)
        assert seen.keys() == cases.keys(), f"never Degraded ModelUnavailable: {sorted(cases.keys() - seen.keys())}"
        events = {(e.involved_object.name, e.message) for e in fleets.events("ModelUnavailable") if e.type == "Warning"}
        for name, (model, cause, words) in cases.items():
            took, cond, status = seen[name]
            print(f"{name}: Degraded ModelUnavailable {cause} {took:.1f} s after apply")
            assert took <= FAILURE_SEEN, f"{name}: {took:.0f} s"
            assert cond["message"].startswith(cause) and words in cond["message"], (name, cond["message"])
            assert status["model"]["phase"] == "Unavailable" and status["model"]["reason"] == cause, status["model"]
            assert any(n == name and m.startswith(cause) for n, m in events), (name, events)
            if cause != "ClaimNotFound":  # a server that cannot have its model is not a crash loop
                assert "CrashLoopBackOff" not in cond["message"] and "ServersFailing" not in json.dumps(status)
        wait_for(lambda: fleets.get("granted").get("status", {}).get("model", {}).get("phase") == "Available",
                 timeout=FAILURE_SEEN, what="the gated model to be fetched with the granted token", interval=0.5)
        assert not degraded("granted")
        for name in [*cases, "granted"]:
            fleets.delete(name)
        wait_for(lambda: not any(fleets.live_pods(name) for name in [*cases, "granted"]), timeout=60,
                 what="the failure fleets' pods to be gone")
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
