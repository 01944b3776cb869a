#!/usr/bin/env bash
# The CUDA path, checked in one go (under 10 minutes on one H200):
#   1. what is installed, and the GPU;
#   2. the kernel, metadata and parity tests on the device, in float32 and in bfloat16
#      (tolerances: tests/runtime/test_parity.py and test_paged_attention.py say them; the
#      multi-process ADP parity test is the suite's: gloo ranks on the CPU);
#   3. `adpfleet serve --device <device>` answering a completion;
#   4. bench/engine_throughput.py on the device: the engine against transformers `generate`
#      on the same GPU, tok/s, % of the compute limit and decode's % of the memory-bandwidth limit.
#
#   bench/gpu_check.sh                  # GPU: --device cuda, bfloat16, a random 1.24 B Llama (Llama 3.2 1B's shape)
#   bench/gpu_check.sh --device cpu     # the same steps on the CPU in float32, small model, quick workload
#   bench/gpu_check.sh --device cpu --steps 1,3,4
#                                       # the suite's run (tests/test_gpu_check.py): step 2 would rerun
#                                       # tests the suite runs itself
#
# Needs Python >= 3.11 with torch (a CUDA build for cuda) and transformers, the rest of the
# runtime extra, pytest, psutil and cryptography (the test suite's fixtures import them). A GPU
# machine usually has torch and transformers only; from the repository root:
#     python -m pip install -e ".[runtime]" pytest pytest-timeout psutil cryptography
# (pip keeps the torch that is there: it satisfies torch>=2.4). Step 1 names what is missing.
# PYTHON picks the interpreter (default .venv/bin/python if present, else python3); results go to
# OUT_DIR (default bench/results/gpu_check-<device>/): test logs, the completion, the benchmark JSON.
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda
steps=1,2,3,4
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    *) echo "usage: bench/gpu_check.sh [--device cuda|cpu] [--steps 1,2,3,4]" >&2; exit 2 ;;
  esac
done
[[ "$steps" =~ ^[1-4](,[1-4])*$ ]] ||
  { echo "gpu_check: --steps takes step numbers 1-4 separated by commas, got '$steps'" >&2; exit 2; }
wanted() { [[ ",$steps," == *",$1,"* ]]; }
case "$device" in
  cuda) dtype=bfloat16; bench_args=(--model 1b --rounds 1) ;;
  cpu) dtype=float32; bench_args=(--model small --quick --hf-batch-sizes 16 --decode-split) ;;
  *) echo "gpu_check: --device must be cuda or cpu, got '$device'" >&2; exit 2 ;;
esac
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
out=${OUT_DIR:-bench/results/gpu_check-$device}
mkdir -p "$out"
step() { echo; echo "== $* ($(date +%T))"; }

if wanted 1; then
step "1/4 installed packages and the device"
"$py" - "$device" <<'EOF'
import importlib, sys
need = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers",
        "numpy": "numpy", "fastapi": "fastapi", "uvicorn": "uvicorn", "httpx": "httpx",
        "prometheus_client": "prometheus-client", "jinja2": "jinja2", "yaml": "pyyaml", "pytest": "pytest",
        "pytest_timeout": "pytest-timeout", "psutil": "psutil", "cryptography": "cryptography",
        "adpfleet.runtime.engine": "adpfleet (this repository, installed: pip install -e .)"}
missing = []
for module, package in need.items():
    try:
        importlib.import_module(module)
    except ImportError:
        missing.append(package)
if missing:
    sys.exit("gpu_check: missing " + ", ".join(missing) + ". From the repository root:\n"
             '    python -m pip install -e ".[runtime]" pytest pytest-timeout psutil cryptography')
import torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: torch sees no CUDA device (a CPU-only torch build, or no driver)")
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")
else:
    from adpfleet.runtime.model import kernels
    print(f"CPU decode attention kernel: {'built' if kernels.available() else 'NOT built (torch fallback)'}")
EOF
fi

if wanted 2; then
for test_dtype in float32 bfloat16; do
  step "2/4 kernel, metadata and parity tests on $device in $test_dtype"
  "$py" -m pytest -q -p no:cacheprovider tests/runtime/test_paged_attention.py \
    tests/runtime/test_attention_metadata.py tests/runtime/test_parity.py \
    --device "$device" --dtype "$test_dtype" -m "not multiproc" 2>&1 | tee "$out/tests-$test_dtype.log" | tail -3
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: tests failed in $test_dtype (log: $out/tests-$test_dtype.log)" >&2; exit 1; }
done
fi

if wanted 3; then
step "3/4 adpfleet serve --device $device --dtype $dtype answers a completion"
"$py" - "$device" "$dtype" "$out" <<'EOF'
import json, os, signal, socket, subprocess, sys, time
import httpx
device, dtype, out = sys.argv[1:4]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cmd = [sys.executable, "-m", "adpfleet", "serve", "--model", "tiny", "--device", device, "--dtype", dtype,
       "--host", "127.0.0.1", "--port", str(port), "--kv-blocks", "256"]
log = open(os.path.join(out, "serve.log"), "wb")
proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
url = f"http://127.0.0.1:{port}"
try:
    deadline = time.monotonic() + 180
    while True:  # wait for the server to answer /health (model load, rank start)
        if proc.poll() is not None:
            sys.exit(f"gpu_check: adpfleet serve exited with {proc.returncode} (log: {out}/serve.log)")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"gpu_check: adpfleet serve not healthy within 180 s (log: {out}/serve.log)")
        time.sleep(0.2)
    body = {"model": "tiny", "prompt": "The GPU says", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    answer = r.json()
    with open(os.path.join(out, "completion.json"), "w") as f:
        json.dump(answer, f, indent=2)
    if r.status_code != 200 or answer["usage"]["completion_tokens"] != 8:
        sys.exit(f"gpu_check: the completion failed: HTTP {r.status_code} {answer}")
    print(f"completion: {answer['choices'][0]['text']!r} ({answer['usage']['completion_tokens']} tokens)")
finally:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
EOF
fi

if wanted 4; then
step "4/4 bench/engine_throughput.py --device $device --dtype $dtype ${bench_args[*]}"
"$py" bench/engine_throughput.py --device "$device" --dtype "$dtype" "${bench_args[@]}" \
  --out "$out/engine_throughput.json" 2>&1 | tee "$out/engine_throughput.log" | grep -v "^  "
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: the benchmark failed (log: $out/engine_throughput.log)" >&2; exit 1; }
fi

step "done: results in $out"
