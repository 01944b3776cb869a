"""C++ kernels for the CPU, built once with torch's extension builder and loaded as `torch.ops.adpfleet`.

`./scripts/setup` builds them (`python -m adpfleet.runtime.model.kernels`): a C++17 compiler and
ninja compile `paged_attention.cpp` and `elementwise.cpp` against the installed torch in 10-15 s (2 cores), into
~/.cache/adpfleet/kernels/<torch version>-<source hash>/ (`ADPFLEET_KERNEL_DIR` moves it). Later
processes only load the built library: no compiler is needed to run. A process that finds
nothing built tries to build it itself; if that fails (no compiler), `available()` is False,
a warning says why, and attention runs the plain-torch path. The runtime image builds it while
it has g++ (docker/runtime.Dockerfile).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

NAME = "adpfleet_kernels"
SOURCES = (Path(__file__).with_name("paged_attention.cpp"), Path(__file__).with_name("elementwise.cpp"))
HEADERS = (Path(__file__).with_name("vector_exp.h"),)  # included by the sources: part of a build's identity
# -fno-math-errno lets exp() vectorise; OpenMP for torch's intra-op threads (at::parallel_for).
CFLAGS = ("-O3", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded; the message says what is missing."""


def build_dir() -> Path:
    """Where the library for this torch and these sources lives (a new source or torch gets a new one)."""
    digest = hashlib.sha256()
    for src in SOURCES + HEADERS:
        digest.update(src.read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    root = Path(os.environ.get("ADPFLEET_KERNEL_DIR", Path.home() / ".cache" / "adpfleet" / "kernels"))
    return root / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


def load(verbose: bool = False) -> Path:
    """Load the kernels, compiling them first if this torch has no build of these sources yet."""
    library = build_dir() / f"{NAME}.so"
    if not library.exists():
        _compile(library.parent, verbose)
    torch.ops.load_library(str(library))
    return library


def _compile(directory: Path, verbose: bool) -> None:
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    # ninja from the runtime extra lives next to this interpreter, which need not be on PATH.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    try:
        cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                           is_python_module=False, verbose=verbose)
    except (RuntimeError, OSError, ImportError) as e:
        raise KernelBuildError(
            f"building the adpfleet C++ kernels in {directory} failed: {e}. They need a C++17 compiler "
            f"(Debian: apt-get install g++) and ninja (pip install ninja; the runtime extra has it); "
            f"`./scripts/setup` builds them") from None


@functools.cache
def available() -> bool:
    """Whether torch.ops.adpfleet.* can run here (built, or buildable now); warns once if not."""
    try:
        load()
        return True
    except KernelBuildError as e:
        warnings.warn(f"{e}. Decode attention falls back to a padded gather and SDPA (slower).", stacklevel=2)
        return False
