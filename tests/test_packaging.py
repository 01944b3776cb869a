"""One distribution, two towers: the operator side must install and import without torch."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_operator_extra_does_not_pull_torch():
    uv = Path(sys.executable).with_name("uv")
    out = subprocess.run([str(uv), "pip", "compile", "--quiet", "--no-header", "--extra", "operator",
                          str(ROOT / "pyproject.toml")], capture_output=True, text=True, check=True).stdout
    names = {line.split("==")[0].strip().lower() for line in out.splitlines() if "==" in line}
    assert "kopf" in names and "kubernetes" in names  # it did resolve the operator's dependencies
    assert not names & {"torch", "transformers", "safetensors", "nvidia-cuda-runtime-cu12"}


def test_bare_operator_import_from_the_repository_root_is_the_standard_library():
    code = ("import operator, adpfleet.operator as op; "
            "assert operator.itemgetter(1)([5, 6]) == 6; "
            "assert op.__name__ == 'adpfleet.operator'; print(operator.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_cli_help_lists_the_commands_without_importing_torch_or_the_crd_models():
    """Every command builds the whole parser: an import it pays there, every router, server and pod start pays
    (pydantic and the CRD's models took ~1 s of each `adpfleet router` start on 2 cores)."""
    code = ("import sys; from adpfleet.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'the CLI imported torch just to parse arguments'; "
            "assert 'pydantic' not in sys.modules, 'the CLI imported the CRD models just to parse arguments'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_wheel_carries_the_vendored_pod_schema(tmp_path):
    """`adpfleet crds` and the operator read operator/resource/pod_schema.json at import."""
    import zipfile
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("adpfleet-*.whl")
    assert "adpfleet/operator/resource/pod_schema.json" in zipfile.ZipFile(wheel).namelist()


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject lists packages by hand (the folders map to adpfleet.*): a new folder not listed is missing from the
    wheel and from the images, while the editable install used by the tests still finds it."""
    import tomllib
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_the_environments_pods_run_from_are_compiled_to_bytecode():
    """Pods run with PYTHONDONTWRITEBYTECODE=1, as the runtime image does (cluster/agent/podenv.py): what they
    import must be compiled by setup, as pip compiles an image's packages, or every server's rank forkserver,
    every operator and every vLLM start compiles torch and the rest from source (import torch: ~5 CPU-seconds
    on this machine, against ~2 from bytecode)."""
    import importlib.util

    from adpfleet.cluster import vllm_env
    from adpfleet.cluster.agent import podenv

    assert podenv.image_env()["PYTHONDONTWRITEBYTECODE"] == "1"  # why this test exists
    pythons = {"the project's": Path(sys.executable), "vLLM's": vllm_env.locate().python}
    probe = "import importlib.util as u, sys; print(u.find_spec(sys.argv[1]).submodule_search_locations[0])"
    for which, python in pythons.items():
        files = [("torch", "__init__.py"), ("torch", "nn/modules/linear.py"), ("transformers", "modeling_utils.py"),
                 ("kubernetes", "client/models/v1_pod.py") if which == "the project's" else
                 ("vllm", "engine/arg_utils.py")]
        where = {package: subprocess.run([str(python), "-I", "-c", probe, package], capture_output=True, text=True,
                                         check=True, cwd="/").stdout.strip()
                 for package in {package for package, _ in files}}  # one interpreter start per package
        sources = [Path(where[package], path) for package, path in files]
        assert all(s.is_file() for s in sources), sources
        missing = [str(s) for s in sources if not Path(importlib.util.cache_from_source(str(s))).is_file()]
        assert not missing, f"{which} environment ({python}) has no bytecode for {missing}: run scripts/setup"
