"""tools/k8s/build.sh, with a stand-in `go` on PATH: a build prints one line per binary (how far,
how long) and keeps Go's chatter in a log; a failure points at that log and quotes its end; a
cached run prints nothing but the directory."""

import os
import re
import subprocess
from pathlib import Path

from adpfleet.cluster.binaries import BUILD_SCRIPT

FAKE_GO = r"""#!/bin/bash
# Talks like a first `go build` (module downloads on stderr), then writes an executable at -o,
# unless the package is $FAKE_GO_FAILS.
for i in $(seq 1 60); do echo "go: downloading example.com/module$i v1.0.$i" >&2; done
pkg=${@: -1}
if [ "$pkg" = "${FAKE_GO_FAILS:-}" ]; then echo "compile error: the stand-in go fails $pkg" >&2; exit 2; fi
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then out=$2; fi; shift; done
printf '#!/bin/sh\n' > "$out" && chmod +x "$out"
"""
BUILT_IN_ORDER = ["etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm"]
PROGRESS = re.compile(r"build\.sh: \[(\d)/(\d)\] (\S+) \.\.\. (\d+ s|failed after \d+ s)")


def build(tmp_path: Path, *, go: bool = True, fails: str = "") -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "go").write_text(FAKE_GO)
    (bin_dir / "go").chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if k not in ("KUBEBUILDER_ASSETS", "TEST_ASSET_KUBE_APISERVER", "TEST_ASSET_ETCD")}
    env.update(ADPFLEET_CACHE=str(tmp_path / "cache"), FAKE_GO_FAILS=fails,
               PATH=(f"{bin_dir}:" if go else "") + "/usr/bin:/bin")
    return subprocess.run([str(BUILD_SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def progress(stderr: str) -> list[tuple[str, str, str, str]]:
    return [m.groups() for m in map(PROGRESS.fullmatch, stderr.splitlines()) if m]


def test_a_build_prints_one_line_per_binary_and_keeps_gos_output_in_a_log(tmp_path):
    first = build(tmp_path)
    assert first.returncode == 0, first.stderr
    directory = Path(first.stdout.strip())
    log = directory / "build.log"
    assert [(n, total, name) for n, total, name, _ in progress(first.stderr)] == \
        [(str(i), "5", name) for i, name in enumerate(BUILT_IN_ORDER, 1)]
    assert len(first.stderr.splitlines()) == 6 and f"Go's output: {log}" in first.stderr  # + one header
    assert "go: downloading" not in first.stderr
    assert log.read_text().count("go: downloading") == 5 * 60
    assert all((directory / name).is_file() for name in BUILT_IN_ORDER)

    cached = build(tmp_path)
    assert (cached.returncode, cached.stdout, cached.stderr) == (0, f"{directory}\n", "")


def test_a_failed_build_points_at_the_log_and_quotes_its_end(tmp_path):
    failed = build(tmp_path, fails="k8s.io/kubernetes/cmd/kube-controller-manager")
    assert failed.returncode == 1
    log = tmp_path / "cache" / "k8s"
    log = next(log.iterdir()) / "build.log"
    assert progress(failed.stderr)[-1][:3] == ("3", "5", "kube-controller-manager")
    assert progress(failed.stderr)[-1][3].startswith("failed after")
    assert f"Go's output is in {log}, which ends with:" in failed.stderr
    assert failed.stderr.rstrip().endswith(
        "compile error: the stand-in go fails k8s.io/kubernetes/cmd/kube-controller-manager")
    assert len(failed.stderr.splitlines()) < 40  # the end of the log, not all of it

    resumed = build(tmp_path)  # what was built stays built
    assert resumed.returncode == 0, resumed.stderr
    assert [name for _, _, name, _ in progress(resumed.stderr)] == ["kube-controller-manager", "kubectl", "helm"]


def test_without_go_it_says_what_it_needs_go_for(tmp_path):
    result = build(tmp_path, go=False)
    assert result.returncode == 1
    assert "go is not on PATH; it is needed to build etcd kube-apiserver" in result.stderr
