"""hf:// sources: the real `huggingface_hub` client against a local hub (HF_ENDPOINT) serving real
checkpoints saved with `save_pretrained`; every failure is a specific reason."""

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from adpfleet.cluster.testing import wait_for
from adpfleet.model_uri import (COMPLETE_MARKER, ModelSourceError, parse_fetched_revision, parse_model_uri,
                                parse_termination_message)
from adpfleet.runtime.model.loader import load_model
from adpfleet.runtime.model.sources.fetch import resolve_model

from fetch_cli import fetch_process
from hf_models import save_hf_model
from hub_server import LocalHub

ROOT = Path(__file__).resolve().parents[2]
REPO = "acme/tiny-llama"
SHARDS = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
ESCAPE = "../../escape/evil.safetensors"  # from the fill directory <cache>/<key>.partial: <tmp>/escape
BACKSLASH = "..\\evil.safetensors"  # a plain name on POSIX; huggingface_hub refuses it everywhere


def escape_index(index: Path) -> Path:
    """A copy of the index whose every tensor is in ESCAPE."""
    raw = json.loads(index.read_text())
    out = index.parent.parent / "escape-index.json"  # beside the checkpoints, in none of them
    out.write_text(json.dumps({**raw, "weight_map": dict.fromkeys(raw["weight_map"], ESCAPE)}))
    return out


def save_tokenizer(directory: Path) -> None:
    """A word-level tokenizer within the tiny vocabulary, with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "hello", "world", "tiny", "model"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "{% for m in messages %}{{ m.content }} {% endfor %}"}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two commits of a sharded Llama (different weights) with files the runtime must not fetch,
    a gated copy, one without safetensors and one of an unsupported architecture."""
    base = tmp_path_factory.mktemp("checkpoints")
    dirs = {}
    for seed in (0, 1):
        d = dirs[seed] = base / f"seed{seed}"
        save_hf_model("llama", d, seed=seed, max_shard_size="80KB")
        save_tokenizer(d)
        (d / "README.md").write_text("# tiny")
        (d / "pytorch_model.bin").write_bytes(b"not needed" * 100)
        (d / "original").mkdir()
        (d / "original" / "consolidated.00.pth").write_bytes(b"not needed" * 100)
    no_st = base / "no-safetensors"
    no_st.mkdir()
    shutil.copy(dirs[0] / "config.json", no_st)
    (no_st / "pytorch_model.bin").write_bytes(b"weights" * 10)
    gpt2 = base / "gpt2"
    shutil.copytree(dirs[0], gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    return dirs, no_st, gpt2


@pytest.fixture(scope="module")
def hub(checkpoints):
    dirs, no_st, gpt2 = checkpoints
    with LocalHub(tokens={"hf_granted", "hf_not_granted"}) as hub:
        hub.first = hub.add_commit(REPO, dirs[0], ref="v1")
        hub.latest = hub.add_commit(REPO, dirs[1], ref="main")
        hub.add_commit("acme/gated", dirs[0], gated=True, granted={"hf_granted"})
        hub.add_commit("acme/pickles", no_st)
        hub.add_commit("acme/gpt2", gpt2)
        # hostile repositories: an index naming a shard outside the model, a name only the client refuses
        escape = dirs[0] / "model.safetensors.index.json"
        hub.add_commit("acme/escape", None, files={"config.json": dirs[0] / "config.json",
                                                   "model.safetensors.index.json": escape_index(escape),
                                                   ESCAPE: dirs[0] / SHARDS[0]})
        hub.add_commit("acme/backslash", None, files={"config.json": dirs[0] / "config.json",
                                                      BACKSLASH: dirs[0] / SHARDS[0]})
        yield hub


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored token, no shared cache
    monkeypatch.setenv("ADPFLEET_MODEL_CACHE", str(tmp_path / "cache"))
    hub.log.clear()
    return tmp_path


def same_weights(a, b) -> bool:
    return all(torch.equal(pa, pb) for pa, pb in zip(load_model(a).parameters(), load_model(b).parameters()))


def test_a_repository_is_fetched_with_only_the_files_the_runtime_needs(env, hub, checkpoints):
    model = resolve_model(f"hf://{REPO}")
    files = sorted(p.name for p in Path(model.path).iterdir())
    assert files == sorted([COMPLETE_MARKER, "config.json", "generation_config.json", "tokenizer.json",
                            "tokenizer_config.json", "model.safetensors.index.json", *SHARDS])
    assert model.revision == hub.latest and model.served_name == "tiny-llama"
    assert json.loads((Path(model.path) / COMPLETE_MARKER).read_text())["revision"] == hub.latest
    assert same_weights(model.path, checkpoints[0][1])
    assert not any("pytorch_model.bin" in p or "original" in p for _, p, _ in hub.log)


def test_a_complete_cache_is_used_without_downloading_again(env, hub):
    first = resolve_model(f"hf://{REPO}")
    hub.log.clear()
    again = resolve_model(f"hf://{REPO}")
    assert again == first and hub.log == []


@pytest.mark.parametrize("revision", ["first-commit", "v1"])
def test_a_pinned_revision_is_fetched_even_after_the_branch_moved(env, hub, checkpoints, revision):
    rev = hub.first if revision == "first-commit" else revision
    model = resolve_model(f"hf://{REPO}@{rev}")
    assert model.revision == hub.first
    assert same_weights(model.path, checkpoints[0][0]) and not same_weights(model.path, checkpoints[0][1])
    assert all(hub.latest not in path for _, path, _ in hub.log if "/resolve/" in path)


@pytest.mark.parametrize("token, reason", [(None, "Unauthorized"), ("hf_wrong", "Unauthorized"),
                                           ("hf_not_granted", "AccessDenied")])
def test_a_gated_repository_needs_a_granted_token(env, monkeypatch, token, reason):
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(ModelSourceError) as err:
        resolve_model("hf://acme/gated")
    assert err.value.reason == reason and "acme/gated" in str(err.value)
    assert err.value.uri == "hf://acme/gated"


def test_a_gated_repository_is_fetched_with_a_granted_token(env, monkeypatch, checkpoints):
    monkeypatch.setenv("HF_TOKEN", "hf_granted")
    assert same_weights(resolve_model("hf://acme/gated").path, checkpoints[0][0])


@pytest.mark.parametrize("uri, reason", [
    ("hf://acme/missing", "RepositoryNotFound"),
    (f"hf://{REPO}@no-such-branch", "RevisionNotFound"),
    ("hf://acme/pickles", "NoSafetensors"),
    ("hf://acme/gpt2", "UnsupportedModelType"),
])
def test_each_unavailable_model_has_its_reason_and_no_weights_are_downloaded(env, hub, uri, reason):
    with pytest.raises(ModelSourceError) as err:
        resolve_model(uri)
    assert err.value.reason == reason, err.value
    assert not [p for m, p, _ in hub.log if m == "GET" and "/lfs-objects/" in p]
    assert not list((env / "cache").glob(f"*/{COMPLETE_MARKER}")), "no complete directory for a failure"


def test_a_model_adpfleet_does_not_run_is_fetched_for_vllm_but_its_pickles_are_not(env, hub, checkpoints):
    """vLLM judges the architecture (gpt2 is vLLM's to run); the safetensors rule stays (a *.bin is a pickle)."""
    fetched = Path(resolve_model("hf://acme/gpt2", engine="vllm").path)
    weights = sorted(p.name for p in checkpoints[2].glob("*.safetensors"))
    assert weights and all((fetched / n).read_bytes() == (checkpoints[2] / n).read_bytes() for n in weights)
    with pytest.raises(ModelSourceError) as err:
        resolve_model("hf://acme/pickles", engine="vllm")
    assert err.value.reason == "NoSafetensors"


def test_a_dropped_connection_resumes_where_it_stopped(env, hub, tmp_path):
    """The client resumes with a Range request from the last chunk it wrote (it writes 10 MB
    chunks), so a connection dropped 11 MB into a 25 MB file is not downloaded from the start."""
    save_hf_model("llama", tmp_path / "big", vocab_size=50_000)  # embeddings: 2 x 12.8 MB
    hub.add_commit("acme/big", tmp_path / "big")
    data = (tmp_path / "big" / "model.safetensors").read_bytes()
    hub.cut_after["model.safetensors"] = 11_000_000
    model = resolve_model("hf://acme/big")
    first, resumed = hub.gets("model.safetensors")
    assert first is None and resumed.startswith("bytes=") and 0 < int(resumed[6:-1]) <= 11_000_000
    assert (Path(model.path) / "model.safetensors").read_bytes() == data


def test_a_killed_fetch_is_continued_without_fetching_complete_files_again(env, hub):
    hub.throttle[SHARDS[-1]] = 8_000  # the last shard takes seconds: the fetch is killed in it
    partial = Path(resolve_cache_dir(env)).with_name(Path(resolve_cache_dir(env)).name + ".partial")
    proc = fetch_process(env, f"hf://{REPO}")
    try:
        wait_for(lambda: all((partial / s).is_file() for s in SHARDS[:-1]) and hub.gets(SHARDS[-1]),
                 timeout=60, what="the first shards to complete")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    del hub.throttle[SHARDS[-1]]
    model = resolve_model(f"hf://{REPO}")
    assert all(len(hub.gets(s)) == 1 for s in SHARDS[:-1]), "complete shards were fetched again"
    assert len(hub.gets(SHARDS[-1])) == 2
    assert (Path(model.path) / SHARDS[-1]).is_file() and not partial.exists()


def resolve_cache_dir(env: Path) -> str:
    return parse_model_uri(f"hf://{REPO}").cache_dir(str(env / "cache"))


def test_two_processes_filling_one_cache_download_once(env, hub):
    for shard in SHARDS:
        hub.throttle[shard] = 200_000
    try:
        procs = [fetch_process(env, f"hf://{REPO}") for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        hub.throttle.clear()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert outs[0][0] == outs[1][0] == resolve_cache_dir(env) + "\n"
    assert all(len(hub.gets(s)) == 1 for s in SHARDS), "both processes downloaded"
    assert "MB of" in outs[0][1] + outs[1][1]  # progress in the log


def test_fetch_model_exits_with_the_reason_and_leaves_a_termination_message(env):
    log = env / "termination-log"
    proc = fetch_process(env, "hf://acme/missing", ADPFLEET_TERMINATION_LOG=str(log))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 11 and "RepositoryNotFound" in err
    failure = parse_termination_message(log.read_text())
    assert failure.reason == "RepositoryNotFound" and failure.uri == "hf://acme/missing"


def test_fetch_model_leaves_the_commit_it_fetched_as_its_termination_message(env, hub):
    log = env / "termination-log"
    proc = fetch_process(env, f"hf://{REPO}@v1", ADPFLEET_TERMINATION_LOG=str(log))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert parse_fetched_revision(log.read_text()) == hub.first  # the commit v1 names, not the branch
    assert parse_termination_message(log.read_text()) is None  # not a failure


def test_generate_runs_a_model_given_by_its_hf_uri(env, capsys):
    from adpfleet.cli import main

    assert main(["generate", "hello world", "--model", f"hf://{REPO}@v1", "--max-tokens", "3"]) == 0


@pytest.fixture
def small_volume(tmp_path):
    """A 64 KiB tmpfs: room for the metadata, not for the weights."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_cache_volume_without_room_is_disk_full_before_the_weights(env, hub, small_volume):
    with pytest.raises(ModelSourceError) as err:
        resolve_model(f"hf://{REPO}", cache_dir=str(small_volume))
    assert err.value.reason == "DiskFull" and "GB free" in str(err.value)
    assert not [p for m, p, _ in hub.log if m == "GET" and "/lfs-objects/" in p]


def test_a_cache_size_limit_the_file_system_does_not_show_is_disk_full_before_the_weights(env, hub, monkeypatch,
                                                                                           checkpoints):
    """An emptyDir's sizeLimit is enforced by eviction, not ENOSPC: the operator hands it to fetch-model."""
    weights = sum(p.stat().st_size for p in checkpoints[0][1].glob("*.safetensors"))
    monkeypatch.setenv("ADPFLEET_CACHE_SIZE_LIMIT", str(weights // 2))
    with pytest.raises(ModelSourceError) as err:
        resolve_model(f"hf://{REPO}")
    assert err.value.reason == "DiskFull" and "GB free" in str(err.value)
    assert not [p for m, p, _ in hub.log if m == "GET" and "/lfs-objects/" in p]
    monkeypatch.setenv("ADPFLEET_CACHE_SIZE_LIMIT", str(weights + 1_000_000))
    assert resolve_model(f"hf://{REPO}").revision == hub.latest


# ---- a hostile or broken hub -------------------------------------------------------------------------

@pytest.mark.parametrize("repo, name", [("acme/escape", ESCAPE), ("acme/backslash", BACKSLASH)])
def test_a_file_name_out_of_the_model_directory_exits_unsafe_file_name_with_a_termination_message(
        env, monkeypatch, capsys, repo, name):
    """Ours refuses '..' and absolute names before the weights; the client's own refusals (a
    Windows traversal) are the same reason, not a bare ValueError."""
    from adpfleet.cli import main

    monkeypatch.setenv("ADPFLEET_TERMINATION_LOG", str(env / "termination-log"))
    assert main(["fetch-model", f"hf://{repo}"]) == 25
    assert "UnsafeFileName" in capsys.readouterr().err
    failure = parse_termination_message((env / "termination-log").read_text())
    assert (failure.reason, failure.uri) == ("UnsafeFileName", f"hf://{repo}") and name in failure.message
    assert not (env / "escape").exists() and not list(env.rglob("evil.safetensors"))


def test_a_file_served_larger_than_listed_is_a_size_mismatch_naming_it(env, hub):
    hub.listed_size[SHARDS[2]] = 1
    try:
        with pytest.raises(ModelSourceError) as err:
            resolve_model(f"hf://{REPO}")
    finally:
        hub.listed_size.clear()
    assert err.value.reason == "SizeMismatch" and SHARDS[2] in str(err.value), err.value
    assert not list((env / "cache").glob(f"*/{COMPLETE_MARKER}"))


def test_a_shard_trickling_in_past_the_stall_deadline_ends_the_fetch_as_fetch_stalled(env, hub):
    """The issue's probe: a shard at 2 KB/s held the init container for ever. The process ends,
    though the stalled download is still in a socket read (its thread must not hold the exit)."""
    hub.throttle[SHARDS[-1]] = 500  # a minute for its 30 KB
    log = env / "termination-log"
    t0 = time.monotonic()
    proc = fetch_process(env, f"hf://{REPO}", ADPFLEET_FETCH_STALL_TIMEOUT="1", ADPFLEET_TERMINATION_LOG=str(log))
    try:
        out, err = proc.communicate(timeout=45)
    finally:
        proc.kill()
        del hub.throttle[SHARDS[-1]]
    assert proc.returncode == 27 and time.monotonic() - t0 < 30, err
    failure = parse_termination_message(log.read_text())
    assert failure.reason == "FetchStalled" and SHARDS[-1] in failure.message, failure.message
