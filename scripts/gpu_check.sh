#!/usr/bin/env bash
# The whole GPU check, end to end: every figure as JSON into RESULTS_DIR, then a one-screen summary
# (RESULTS_DIR/summary.txt and stdout).
#
#   bash scripts/gpu_check.sh RESULTS_DIR
#
# 1. environment.json: versions, the providers that really load, whether torch sees CUDA.
# 2. Exports of the SIZE architecture (default gpt2, the 124M one) with seeded random weights: fp32 and fp16
#    with the ort fusion profile and last-position logits, and int4 (block-wise weights).
# 3. gpt2onnx parity per precision on the cuda provider (CASES randomized cases, default 30).
# 4. gpt2onnx bench per precision on cuda with the PyTorch baseline on the same GPU (torch in fp16 for the fp16
#    folder): batch 1 and 8, 128-token prompt, 64 new tokens. The runner keeps the K/V cache on the device
#    between steps (IO binding). CUDA graphs are not supported yet (the past grows by one position a step; they
#    need the static shared-cache profile): recorded as skipped, with the reason.
# 5. TensorRT: the one-line error (exit 3) where it cannot load, recorded; or that it loads.
# Without a working CUDA provider (a CPU-only machine) every step runs on the cpu provider, the CUDA-only
# ones are recorded as skipped, and the check still passes. The exit status is 0 when every export and parity
# passed and every bench ran; the summary is written either way.
#
# Uses `python -m gpt2onnx` from the current environment (PYTHON overrides the interpreter). Knobs (env):
#   SIZE=gpt2|tiny|...  CASES=N  BENCH_BATCHES=1,8  BENCH_PROMPT_LEN=128  BENCH_NEW_TOKENS=64
#   BENCH_WARMUP=2  BENCH_REPEAT=5  MODELS_DIR=RESULTS_DIR/models (the exports)
# tests/test_gpu_check.py runs it on the CPU with SIZE=tiny and tiny figures.
#
# On the offline GPU machine (Python 3.12, torch with CUDA 13, transformers 5.x, no optimum, a CPU-only
# onnxruntime; see /work/shared/gpu/README.md): from the checkout's root, with .ortparts/ staged here by
# stage_ort_gpu.sh and carried there,
#   pip install -e . --no-deps          # the machine already has the dependencies, except onnxruntime-gpu
#   bash .ortparts/ort_gpu.sh probe      # what the machine has
#   bash .ortparts/ort_gpu.sh run bash scripts/gpu_check.sh gpu-results
# ort_gpu.sh installs onnxruntime-gpu into a private folder and runs the command with it (and the checkout on
# PYTHONPATH, so the editable install is optional there).
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_check.sh RESULTS_DIR" >&2
    exit 2
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
RESULTS="$1"
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
SIZE="${SIZE:-gpt2}"
BENCH_BATCHES="${BENCH_BATCHES:-1,8}"
BENCH_PROMPT_LEN="${BENCH_PROMPT_LEN:-128}"
BENCH_NEW_TOKENS="${BENCH_NEW_TOKENS:-64}"
BENCH_WARMUP="${BENCH_WARMUP:-2}"
BENCH_REPEAT="${BENCH_REPEAT:-5}"
mkdir -p "$RESULTS/logs"
RESULTS="$(cd "$RESULTS" && pwd)"
MODELS_DIR="${MODELS_DIR:-$RESULTS/models}"
STEPS="$RESULTS/steps.jsonl"
: >"$STEPS"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# record STEP STATUS RC SECONDS DETAIL: one JSON line per step (status: ok, failed, skipped, expected-error)
record() {
    "$PYTHON" - "$@" >>"$STEPS" <<'EOF'
import json, sys
step, status, rc, seconds, detail = sys.argv[1:6]
print(json.dumps({"step": step, "status": status, "rc": int(rc), "seconds": float(seconds), "detail": detail}))
EOF
}

# run_step STEP LOG CMD...: run, time, record ok/failed; never stops the script
FAILED=0
run_step() {
    local step="$1" log="$2" start rc=0 seconds
    shift 2
    start=$(date +%s.%N)
    "$@" >"$log" 2>&1 || rc=$?
    seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    if [ "$rc" -eq 0 ]; then
        record "$step" ok 0 "$seconds" ""
        echo "  ok      $step (${seconds}s)"
    else
        FAILED=1
        record "$step" failed "$rc" "$seconds" "$(grep -v '^\s*$' "$log" | tail -n 1)"
        echo "  FAILED  $step (exit $rc, ${seconds}s): see $log"
    fi
}

echo "gpu_check: $SIZE, results in $RESULTS"
"$PYTHON" - "$RESULTS/environment.json" <<'EOF'
import json, platform, sys
from importlib.metadata import PackageNotFoundError, version

import onnxruntime as ort
import torch

from gpt2onnx.runtimes.providers import working_providers

def installed(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None

working = working_providers()
env = {
    "python": platform.python_version(),
    "platform": platform.platform(),
    "versions": {n: installed(n) for n in ("gpt2onnx", "torch", "transformers", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "optimum-onnx")},
    "onnxruntime_available_providers": ort.get_available_providers(),
    "working_providers": working,
    "cuda_provider": "cuda" in working,
    "torch_cuda": torch.cuda.is_available(),
    "torch_cuda_version": torch.version.cuda,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
}
with open(sys.argv[1], "w") as fh:
    json.dump(env, fh, indent=2)
print(f"  providers that load: {', '.join(working)}; torch sees CUDA: {env['torch_cuda']} ({env['gpu']})")
EOF
read -r CUDA TORCH_CUDA < <("$PYTHON" -c "import json, sys; e = json.load(open(sys.argv[1])); print(int(e['cuda_provider']), int(e['torch_cuda']))" "$RESULTS/environment.json")
if [ "$CUDA" = 1 ]; then
    PROVIDER=cuda
    CASES="${CASES:-30}"
else
    PROVIDER=cpu
    CASES="${CASES:-8}"
    for p in fp32 fp16 int4; do
        record "parity-cuda-$p" skipped 0 0 "the CUDA provider does not load here: parity ran on the cpu provider"
    done
    record "bench-cuda" skipped 0 0 "the CUDA provider does not load here: bench ran on the cpu provider"
fi
if [ "$TORCH_CUDA" != 1 ]; then
    record "torch-baseline-on-gpu" skipped 0 0 "torch sees no CUDA device here: the PyTorch baseline ran on the CPU"
fi
# The runner has no CUDA graph path: capture needs fixed shapes and addresses, and the past grows each step.
record "bench-cuda-graphs" skipped 0 0 "CUDA graphs are not supported by the runner yet (the past grows by one position a step); they need the static shared-cache profile"

declare -A EXPORT_FLAGS=(
    [fp32]="--fusion ort --logits last"
    [fp16]="--fusion ort --logits last --dtype fp16"
    [int4]="--quantize int4 --logits last"
)
for p in fp32 fp16 int4; do
    # shellcheck disable=SC2086  # the flags are words
    run_step "export-$p" "$RESULTS/logs/export-$p.log" \
        "$PYTHON" -m gpt2onnx export -m "$SIZE" --random-init --out "$MODELS_DIR/$SIZE-$p" --force ${EXPORT_FLAGS[$p]}
done

for p in fp32 fp16 int4; do
    if [ ! -f "$MODELS_DIR/$SIZE-$p/model.onnx" ]; then
        FAILED=1
        record "parity-$p" failed 1 0 "no export to check"
        continue
    fi
    run_step "parity-$p" "$RESULTS/logs/parity-$p.log" \
        "$PYTHON" -m gpt2onnx parity "$MODELS_DIR/$SIZE-$p" --provider "$PROVIDER" --cases "$CASES" --json "$RESULTS/parity-$p.json"
done

for p in fp32 fp16 int4; do
    [ -f "$MODELS_DIR/$SIZE-$p/model.onnx" ] || continue
    run_step "bench-$p" "$RESULTS/logs/bench-$p.log" \
        "$PYTHON" -m gpt2onnx bench "$MODELS_DIR/$SIZE-$p" --provider "$PROVIDER" --baseline torch \
        --batch "$BENCH_BATCHES" --prompt-len "$BENCH_PROMPT_LEN" --new-tokens "$BENCH_NEW_TOKENS" \
        --warmup "$BENCH_WARMUP" --repeat "$BENCH_REPEAT" --json "$RESULTS/bench-$p.json"
done

# TensorRT: expected to fail with the one-line error and exit 3 where it cannot load; recorded either way.
TRT_FOLDER="$MODELS_DIR/$SIZE-fp32"
rc=0
"$PYTHON" -m gpt2onnx generate "$TRT_FOLDER" --ids 1,2 --max-new-tokens 2 --provider tensorrt >"$RESULTS/logs/tensorrt.log" 2>&1 || rc=$?
"$PYTHON" - "$RESULTS/tensorrt.json" "$rc" "$RESULTS/logs/tensorrt.log" <<'EOF'
import json, sys
path, rc, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = [line.strip() for line in open(log, errors="replace") if line.strip()]
clear = rc == 3 and len(lines) == 1 and "Traceback" not in lines[0]
status = "loads" if rc == 0 else "clear-error" if clear else "unclear-error"
json.dump({"status": status, "exit_code": rc, "message": lines[-1] if lines else "", "lines": len(lines)}, open(path, "w"), indent=2)
EOF
TRT_STATUS=$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['status'])" "$RESULTS/tensorrt.json")
case "$TRT_STATUS" in
    loads) record tensorrt ok 0 0 "TensorRT loads here" ;;
    clear-error) record tensorrt expected-error "$rc" 0 "$(tail -n 1 "$RESULTS/logs/tensorrt.log")" ;;
    *) FAILED=1; record tensorrt failed "$rc" 0 "not the one-line error with exit 3: see logs/tensorrt.log" ;;
esac

"$PYTHON" "$HERE/gpu_check_summary.py" "$RESULTS"
exit "$FAILED"
