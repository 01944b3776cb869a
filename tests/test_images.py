"""The container images cannot be built here (no Docker engine); check what can be checked."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"runtime": ROOT / "docker/runtime.Dockerfile", "operator": ROOT / "docker/operator.Dockerfile"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("image", IMAGES)
def test_the_dockerfile_parses_and_is_multi_stage_with_pinned_bases(image):
    ins = instructions(IMAGES[image])
    known = {"FROM", "WORKDIR", "COPY", "RUN", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "ARG", "LABEL"}
    assert all(word in known for word, _ in ins), [w for w, _ in ins if w not in known]
    bases = [args.split()[0] for word, args in ins if word == "FROM"]
    assert len(bases) >= 2, "multi-stage: a build stage and a slim final stage"
    for base in bases:
        name, _, tag = base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"unpinned base {base}"
    for word, args in ins:
        if word == "COPY" and not args.startswith("--from"):
            for src in args.split()[:-1]:
                assert (ROOT / src).exists(), f"COPY of a path that does not exist: {src}"


@pytest.mark.parametrize("image", IMAGES)
def test_the_final_stage_runs_as_a_non_root_user(image):
    ins = instructions(IMAGES[image])
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    users = [args for w, args in ins[last_from:] if w == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")


@pytest.mark.parametrize("image, extra", [("runtime", "runtime"), ("operator", "operator")])
def test_the_entrypoint_is_a_command_of_the_package(image, extra):
    ins = dict((w, a) for w, a in instructions(IMAGES[image]))
    import json

    entry = json.loads(ins["ENTRYPOINT"])
    assert entry[0] == "adpfleet"
    assert f"[{extra}]" in ins["RUN"]
    argv = entry[1:] + (json.loads(ins["CMD"]) if "CMD" in ins else [])
    # the command line parses with the real CLI (a typo'd flag would fail here)
    code = f"from adpfleet.cli import build_parser; build_parser().parse_args({argv + ['--help']!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout, out.stderr
