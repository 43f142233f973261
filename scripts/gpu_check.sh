#!/usr/bin/env bash
# The whole GPU check as one plan that fits one 10-minute call: every figure as JSON into RESULTS_DIR, and a
# one-screen summary (RESULTS_DIR/summary.txt) rewritten after every step, so that a run stopped at any point
# leaves a readable record of what it did.
#
#   bash scripts/gpu_check.sh RESULTS_DIR
#
# 1. environment.json (scripts/gpu_check_env.py): the GPU and driver, onnxruntime's build and the CUDA, cuDNN and
#    TensorRT libraries it loaded (GPU libraries preloaded first, as every session does; torch imported after),
#    the providers that load, with onnxruntime's reason for those that do not, and what torch sees.
#    A machine with a GPU where the CUDA provider does not load FAILS here, at once.
# 2. Exports of SIZE (default gpt2, the 124M architecture) with seeded random weights, in parallel, not validated
#    (parity checks them on the GPU): one per precision in PRECISIONS, all with the same --fusion FUSION (ort) and
#    last-position logits; a --fusion tensorrt fp32 folder for TensorRT; a tiny int8 folder for the refusal below.
# 3. Refusals that must happen before any session: int8 on cuda (MatMulInteger on uint8 activations), and
#    com.microsoft ops on tensorrt: each exit 3, one line, naming the ops.
# 4. gpt2onnx parity per precision on PROVIDER (CASES randomized cases), then fp32 again with --tf32 (its own gates).
# 5. gpt2onnx bench per precision with the PyTorch baseline on the same GPU (torch in fp16 for the fp16 folder, TF32
#    matched to the session): batch 1 and 8, 128-token prompt, 64 new tokens; fp32 with --tf32 too.
# 6. TensorRT on the --fusion tensorrt folder: parity and bench where it loads; else its one-line error (exit 3).
# parity and bench run with --allow-fallback on GPU providers, so that their figures come even when nodes leave
# the GPU; the summary FAILS any row whose session did not run where it was asked (provider, compute nodes on the
# CPU, TF32 not matched) from the placement and TF32 the JSON records.
# Each step has its own timeout, and none starts past the check's DEADLINE (seconds from the start): what is left
# is recorded as out of time (a FAIL). The exit status: 0 when the verdict is pass, else 1.
#
# PROVIDER: auto (default: cuda where nvidia-smi lists a GPU, else cpu), cuda or cpu. Without a GPU the check runs
# on the cpu provider (tests/test_gpu_check.py rehearses it so, SIZE=tiny); PROVIDER=cuda there fails at step 1.
# Knobs (env): SIZE FUSION PRECISIONS="fp32 fp16 int4" CASES=20 BENCH_BATCHES=1,8 BENCH_PROMPT_LEN=128
#   BENCH_NEW_TOKENS=64 BENCH_WARMUP=2 BENCH_REPEAT=5 DEADLINE=480 EXPORT_TIMEOUT=300 PARITY_TIMEOUT=150
#   BENCH_TIMEOUT=150 TRT_TIMEOUT=240 TRT=1 (0: no TensorRT steps) MODELS_DIR=RESULTS_DIR/models
#   MIRROR_DIR (also keep summary.txt and gpu-check.json, everything in one object, there after every step)
#   PYTHON (the interpreter, default python3; `PYTHON -m gpt2onnx` must work with it)
#
# On the offline GPU machine (Python 3.12, torch with CUDA 13, transformers 5.x, no optimum, a CPU-only onnxruntime;
# ../shared/gpu/README.md): onnxruntime-gpu travels as four parts (.ortparts/, staged in the checkout the device
# tool sends by stage_ort_gpu.sh, about 48 MiB each: one part per call, 64 MiB a call). Three calls, each within
# the machine's 30 s of warmth after the last, carry .ortparts/ort.tar.xz.part0 (then 1, 2) with SHA256SUMS and
# ort_gpu.sh, and run `bash .ortparts/ort_gpu.sh keep`; the fourth carries part 3 and runs, with timeout_s 600:
#   bash .ortparts/ort_gpu.sh run env MIRROR_DIR=$OUT MODELS_DIR=/tmp/models bash scripts/gpu_check.sh /tmp/gpu
# ort_gpu.sh installs onnxruntime-gpu into /tmp/site, puts the checkout on PYTHONPATH and torch's CUDA 13 and cuDNN
# libraries on LD_LIBRARY_PATH. Two files come back, rewritten after every step (at most 8 return): $OUT/summary.txt
# and $OUT/gpu-check.json (every report, and the log tails of the steps that failed).
set -uo pipefail # not -e: a failing step is recorded and the check goes on

if [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_check.sh RESULTS_DIR" >&2
    exit 2
fi
HERE="$(cd "$(dirname "$0")" && pwd)"
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
SIZE="${SIZE:-gpt2}"
FUSION="${FUSION:-ort}"
PRECISIONS="${PRECISIONS:-fp32 fp16 int4}"
CASES="${CASES:-20}"
BENCH_BATCHES="${BENCH_BATCHES:-1,8}"
BENCH_PROMPT_LEN="${BENCH_PROMPT_LEN:-128}"
BENCH_NEW_TOKENS="${BENCH_NEW_TOKENS:-64}"
BENCH_WARMUP="${BENCH_WARMUP:-2}"
BENCH_REPEAT="${BENCH_REPEAT:-5}"
DEADLINE="${DEADLINE:-480}"
EXPORT_TIMEOUT="${EXPORT_TIMEOUT:-300}"
PARITY_TIMEOUT="${PARITY_TIMEOUT:-150}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
TRT_TIMEOUT="${TRT_TIMEOUT:-240}"
TRT="${TRT:-1}"
PROVIDER="${PROVIDER:-auto}"
case "$PROVIDER" in
    auto | cuda | cpu) ;;
    *)
        echo "PROVIDER must be auto, cuda or cpu, got '$PROVIDER' (TensorRT runs as its own rows)" >&2
        exit 2
        ;;
esac
mkdir -p "$1/logs"
RESULTS="$(cd "$1" && pwd)"
MODELS_DIR="${MODELS_DIR:-$RESULTS/models}"
STEPS="$RESULTS/steps.jsonl"
START=$(date +%s)
: >"$STEPS"
rm -f "$RESULTS"/parity-*.json "$RESULTS"/bench-*.json "$RESULTS"/tensorrt.json "$RESULTS"/summary.txt
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
G2O=(-m gpt2onnx)

# pip's TensorRT libraries on the loader's path: the loader reads LD_LIBRARY_PATH when a process starts
# (gpt2onnx also preloads them, with onnxruntime.preload_dlls(), before its first GPU session)
TRT_LIBS=$("$PYTHON" -c "import importlib.util as u; s = u.find_spec('tensorrt_libs'); print(next(iter(s.submodule_search_locations)) if s else '')" 2>/dev/null || true)
if [ -n "$TRT_LIBS" ]; then
    export LD_LIBRARY_PATH="$TRT_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

MIRROR=()
if [ -n "${MIRROR_DIR:-}" ]; then MIRROR=(--mirror "$MIRROR_DIR"); fi
summary() { "$PYTHON" "$HERE/gpu_check_summary.py" "$RESULTS" "${MIRROR[@]}" "$@"; }

# record STEP STATUS RC SECONDS DETAIL: one JSON line per step, then the summary again.
# STATUS: ok, failed, timeout, out-of-time, expected-error (a refusal that had to happen), skipped (not applicable)
record() {
    # one write(2) per line on an O_APPEND file: steps recorded by parallel exports cannot interleave
    "$PYTHON" -c 'import json, os, sys; s, st, rc, sec, d = sys.argv[1:6]; os.write(1, (json.dumps({"step": s, "status": st, "rc": int(rc), "seconds": float(sec), "detail": d}) + "\n").encode())' "$@" >>"$STEPS"
    summary >/dev/null 2>&1 || true
}

# the timeout for a step that wants WANT seconds: less near the deadline; 0 when under 20 s are left
limit() {
    local left=$((DEADLINE - ($(date +%s) - START) - 10))
    if [ "$left" -lt 20 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# run_step STEP WANT EXPECT LOG CMD...: run CMD under its timeout and record it. EXPECT: ok (exit 0), or
# refused:REGEX (exit 3, one line matching REGEX: a refusal that must happen).
run_step() {
    local step="$1" t expect="$3" log="$4" start rc=0 seconds last status
    t=$(limit "$2")
    shift 4
    if [ "$t" = 0 ]; then
        record "$step" out-of-time 0 0 "not started: the check's deadline (${DEADLINE} s) was too close"
        echo "  OUT OF TIME $step"
        return
    fi
    start=$(date +%s.%N)
    timeout -k 10 "$t" "$@" >"$log" 2>&1 || rc=$?
    seconds=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-400)
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        status=timeout
        last="stopped after ${t} s (its timeout)"
    elif [ "$expect" = ok ]; then
        if [ "$rc" = 0 ]; then status=ok; last=""; else status=failed; fi
    elif [ "$rc" = 3 ] && [ "$(grep -cv '^\s*$' "$log")" = 1 ] && grep -Eq "${expect#refused:}" "$log"; then
        status=expected-error
    else
        status=failed
        last="expected a one-line refusal (exit 3) matching '${expect#refused:}', got exit $rc: $last"
    fi
    record "$step" "$status" "$rc" "$seconds" "$last"
    printf '  %-14s %s (%s s)\n' "$status" "$step" "$seconds"
}

echo "gpu_check: $SIZE, results in $RESULTS"
run_step environment 90 ok "$RESULTS/logs/environment.log" "$PYTHON" "$HERE/gpu_check_env.py" "$RESULTS/environment.json"
if [ ! -f "$RESULTS/environment.json" ]; then
    summary --final
    exit 1
fi
read -r GPU CUDA TENSORRT TORCH_CUDA < <("$PYTHON" -c "import json, sys; e = json.load(open(sys.argv[1])); print(*(int(x) for x in (e['gpu_present'], e['cuda_provider'], 'tensorrt' in e['working_providers'], e['torch']['sees_cuda'])))" "$RESULTS/environment.json")
if [ "$PROVIDER" = auto ]; then
    if [ "$GPU" = 1 ]; then PROVIDER=cuda; else PROVIDER=cpu; fi
fi
"$PYTHON" -c 'import json, sys; json.dump({"provider": sys.argv[2], "size": sys.argv[3], "fusion": sys.argv[4], "precisions": sys.argv[5].split(), "cases": int(sys.argv[6]), "deadline_s": int(sys.argv[7])}, open(sys.argv[1], "w"), indent=2)' \
    "$RESULTS/plan.json" "$PROVIDER" "$SIZE" "$FUSION" "$PRECISIONS" "$CASES" "$DEADLINE"
if [ "$PROVIDER" = cuda ] && [ "$CUDA" != 1 ]; then
    REASON=$("$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['refused_providers'].get('cuda', 'no reason given'))" "$RESULTS/environment.json")
    where=$([ "$GPU" = 1 ] && echo "this machine has a GPU" || echo "no GPU here")
    record cuda-provider failed 3 0 "the cuda provider was asked for ($where) and does not load: $REASON"
    echo "  FAILED         cuda-provider: $REASON"
    summary --final
    exit 1
fi
FALLBACK=()
TF32_ROWS=()
if [ "$PROVIDER" != cpu ]; then
    FALLBACK=(--allow-fallback) # the summary judges placement from the JSON; the figures still come
    TF32_ROWS=(fp32-tf32)
else
    why=$([ "$GPU" = 1 ] && echo "PROVIDER=cpu, on a machine with a GPU" || echo "no GPU here")
    record gpu-rows skipped 0 0 "the cuda provider was not asked for ($why): parity and bench ran on the cpu provider, without the TF32 rows"
fi
if [ "$PROVIDER" != cpu ] && [ "$TORCH_CUDA" != 1 ]; then
    record torch-baseline-on-gpu failed 0 0 "torch sees no CUDA device: the PyTorch baseline would run on the CPU"
fi
# The runner has no CUDA graph path: capture needs fixed shapes and addresses, and the past grows each step.
record bench-cuda-graphs skipped 0 0 "CUDA graphs are not supported by the runner yet (the past grows by one position a step); they need the static shared-cache profile"

# -- exports, in parallel ---------------------------------------------------------------------------------------
declare -A FLAGS=([fp32]="" [fp16]="--dtype fp16" [int4]="--quantize int4" [int8]="--quantize int8")
folder() { echo "$MODELS_DIR/$SIZE-$1"; }
pids=()
for p in $PRECISIONS; do
    # shellcheck disable=SC2086  # the flags are words
    run_step "export-$p" "$EXPORT_TIMEOUT" ok "$RESULTS/logs/export-$p.log" "$PYTHON" "${G2O[@]}" export -m "$SIZE" \
        --random-init --out "$(folder "$p")" --force --fusion "$FUSION" --logits last --no-validate ${FLAGS[$p]} &
    pids+=($!)
done
if [ "$TRT" = 1 ]; then
    run_step export-trt "$EXPORT_TIMEOUT" ok "$RESULTS/logs/export-trt.log" "$PYTHON" "${G2O[@]}" export -m "$SIZE" \
        --random-init --out "$(folder trt)" --force --fusion tensorrt --logits last --no-validate &
    pids+=($!)
fi
run_step export-int8-tiny "$EXPORT_TIMEOUT" ok "$RESULTS/logs/export-int8-tiny.log" "$PYTHON" "${G2O[@]}" export \
    -m tiny --random-init --out "$MODELS_DIR/tiny-int8" --force --quantize int8 --logits last --no-validate &
pids+=($!)
wait "${pids[@]}"
exported() { [ -f "$(folder "$1")/model.onnx" ]; }

# -- refusals that must come before any session -----------------------------------------------------------------
if [ -f "$MODELS_DIR/tiny-int8/model.onnx" ]; then
    run_step refusal-int8-on-cuda 60 "refused:cannot run this model.s MatMulInteger" "$RESULTS/logs/refusal-int8-on-cuda.log" \
        "$PYTHON" "${G2O[@]}" generate "$MODELS_DIR/tiny-int8" --ids 1,2 --max-new-tokens 2 --provider cuda
fi
first=${PRECISIONS%% *}
if [[ "$FUSION" == ort* ]] && exported "$first"; then
    run_step refusal-contrib-on-tensorrt 60 "refused:com.microsoft.*--fusion tensorrt" "$RESULTS/logs/refusal-contrib-on-tensorrt.log" \
        "$PYTHON" "${G2O[@]}" generate "$(folder "$first")" --ids 1,2 --max-new-tokens 2 --provider tensorrt
fi

# -- parity and bench per precision ---------------------------------------------------------------------------
# row NAME: the folder and the extra flags of a parity or bench row (fp32-tf32: the fp32 folder with --tf32)
row_folder() { folder "${1%-tf32}"; }
row_flags() { [[ "$1" == *-tf32 ]] && echo "--tf32" || true; }
ROWS=()
for p in $PRECISIONS; do ROWS+=("$p"); done
if [[ " $PRECISIONS " == *" fp32 "* ]]; then ROWS+=("${TF32_ROWS[@]}"); fi
for r in "${ROWS[@]}"; do
    if ! exported "${r%-tf32}"; then
        record "parity-$r" failed 1 0 "no export to check"
        continue
    fi
    # shellcheck disable=SC2046  # the flags are words
    run_step "parity-$r" "$PARITY_TIMEOUT" ok "$RESULTS/logs/parity-$r.log" "$PYTHON" "${G2O[@]}" parity "$(row_folder "$r")" \
        --provider "$PROVIDER" --cases "$CASES" --json "$RESULTS/parity-$r.json" "${FALLBACK[@]}" $(row_flags "$r")
done
for r in "${ROWS[@]}"; do
    exported "${r%-tf32}" || continue
    # shellcheck disable=SC2046
    run_step "bench-$r" "$BENCH_TIMEOUT" ok "$RESULTS/logs/bench-$r.log" "$PYTHON" "${G2O[@]}" bench "$(row_folder "$r")" \
        --provider "$PROVIDER" --baseline torch --batch "$BENCH_BATCHES" --prompt-len "$BENCH_PROMPT_LEN" \
        --new-tokens "$BENCH_NEW_TOKENS" --warmup "$BENCH_WARMUP" --repeat "$BENCH_REPEAT" \
        --json "$RESULTS/bench-$r.json" "${FALLBACK[@]}" $(row_flags "$r")
done

# -- TensorRT, on its own fusion --------------------------------------------------------------------------------
if [ "$TRT" = 1 ] && exported trt; then
    if [ "$TENSORRT" = 1 ]; then
        run_step parity-trt "$TRT_TIMEOUT" ok "$RESULTS/logs/parity-trt.log" "$PYTHON" "${G2O[@]}" parity "$(folder trt)" \
            --provider tensorrt --cases "$CASES" --json "$RESULTS/parity-trt.json" --allow-fallback
        run_step bench-trt "$BENCH_TIMEOUT" ok "$RESULTS/logs/bench-trt.log" "$PYTHON" "${G2O[@]}" bench "$(folder trt)" \
            --provider tensorrt --baseline torch --batch "$BENCH_BATCHES" --prompt-len "$BENCH_PROMPT_LEN" \
            --new-tokens "$BENCH_NEW_TOKENS" --warmup "$BENCH_WARMUP" --repeat "$BENCH_REPEAT" \
            --json "$RESULTS/bench-trt.json" --allow-fallback
    else # where it cannot load: the one-line error, exit 3, with onnxruntime's reason
        run_step tensorrt 60 "refused:provider 'tensorrt'" "$RESULTS/logs/tensorrt.log" \
            "$PYTHON" "${G2O[@]}" generate "$(folder trt)" --ids 1,2 --max-new-tokens 2 --provider tensorrt
    fi
fi

summary --final
