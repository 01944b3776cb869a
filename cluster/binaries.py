"""Where the control-plane binaries are: built (or linked) by `tools/k8s/build.sh`.

The script is the one place that knows the pinned versions, the cache layout and the
KUBEBUILDER_ASSETS / TEST_ASSET_* overrides; Python only runs it and reads the directory it prints.
It skips every binary already present, so calling it on each `cluster up` costs milliseconds.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO_ROOT / "tools" / "k8s" / "build.sh"
VERSIONS_FILE = REPO_ROOT / "tools" / "k8s" / "versions.env"


class BinariesUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Binaries:
    directory: Path

    def __getattr__(self, name: str) -> Path:
        # binaries.kube_apiserver -> <dir>/kube-apiserver
        if name.startswith("_"):
            raise AttributeError(name)
        return self.directory / name.replace("_", "-")


def kubernetes_version() -> str:
    for line in VERSIONS_FILE.read_text().splitlines():
        if line.startswith("KUBERNETES_VERSION="):
            return line.split("=", 1)[1].strip()
    raise BinariesUnavailable(f"{VERSIONS_FILE} has no KUBERNETES_VERSION line")


def ensure_binaries() -> Binaries:
    """Build what is missing (minutes, once per version) and return the directory."""
    if not BUILD_SCRIPT.exists():
        raise BinariesUnavailable(
            f"{BUILD_SCRIPT} is missing: `adpfleet cluster` needs a source checkout of adpfleet "
            "(the build script is not part of the wheel)")
    proc = subprocess.run([str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise BinariesUnavailable(
            f"building the control-plane binaries failed ({BUILD_SCRIPT}, exit {proc.returncode}):\n"
            f"{proc.stderr.strip()[-3000:]}\n"
            "It needs Go (see tools/k8s/kube/go.mod for the version) and the Go module proxy; or point "
            "KUBEBUILDER_ASSETS (a directory with etcd and kube-apiserver) at binaries you already have.")
    binaries = Binaries(Path(proc.stdout.strip().splitlines()[-1]))
    missing = [n for n in ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
               if not (binaries.directory / n).exists()]
    if missing:
        raise BinariesUnavailable(f"{BUILD_SCRIPT} succeeded but {', '.join(missing)} "
                                  f"is missing from {binaries.directory}")
    return binaries
