#!/usr/bin/env bash
# Speed beside the engines, in one window: the engines of ../shared/peers/engines (llama.cpp, OpenVINO GenAI,
# CTranslate2; bench_engines.py, each row its own process), then, right after, our variants exported from the SAME
# random 124M checkpoint (the engines' gpt2-small) timed by the peers' bench_decode.py (prompt b1 x 128, decode b1
# and b8 at past 128, tok/s 32 + 64, greedy parity with transformers). The machine and its load are printed
# before and after each half.
#   bash scripts/bench_engines_speed.sh ENGINES_DIR [WORK_DIR]     (ENGINES_DIR: built by engines/prepare.sh)
# Our variants (exported once, reused): fp32 (--fusion ort --logits last), then optimize --fusion none to fp16,
# int8, int4 (the recipe: the tied head and embeddings at 8 bits, blocks of 128), int4 with everything at 4 bits in
# blocks of 32 (the recipe before) and of 128, int8-weights (its recipe: fp32 head
# and embeddings) and
# int8-weights with an 8-bit head and embeddings; int4's recipe and all-4-bit blocks of 128 with
# --prompt-kernel int8 (a prompt step of many rows on int8 kernels folded from the 4-bit weights at load).
# ENGINE_ROWS: a substring filter of the engines' rows (default: all); SKIP_ENGINES=1 times ours only;
# OURS: our variants to time, by name (default: all of them).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore
ROOT=$PWD
PY=$ROOT/.venv/bin/python
G="$PY -m gpt2onnx"
PEERS=${PEERS:-$ROOT/../shared/peers}
E=${1:?give the engines folder (bash ../shared/peers/engines/prepare.sh DIR builds it)}
W=${2:-/tmp/bench-engines-speed}
[ -f "$E/gpt2-small/model.safetensors" ] || { echo "$E/gpt2-small is missing: run prepare.sh first" >&2; exit 2; }
mkdir -p "$W"
[ -f "$W/fp32/model.onnx" ] || $G export -m "$E/gpt2-small" -o "$W/fp32" --fusion ort --logits last --force
declare -A RECIPES=(
  [fp16]="--dtype fp16"
  [int8]="--quantize int8"
  [int4]="--quantize int4"
  [int4-all4-b32]="--quantize int4 --block-size 32 --lm-head int4 --embeddings int4"
  [int4-all4-b128]="--quantize int4 --block-size 128 --lm-head int4 --embeddings int4"
  [int8-weights]="--quantize int8-weights"
  [int8-weights-8bit-head]="--quantize int8-weights --lm-head int8 --embeddings int8"
  [int4-prompt-int8]="--quantize int4 --prompt-kernel int8"
  [int4-all4-b128-prompt-int8]="--quantize int4 --block-size 128 --lm-head int4 --embeddings int4 --prompt-kernel int8"
)
ALL="fp32 fp16 int8 int4 int4-prompt-int8 int4-all4-b32 int4-all4-b128 int4-all4-b128-prompt-int8 int8-weights"
ALL="$ALL int8-weights-8bit-head"
OURS=${OURS:-$ALL}
for name in $OURS; do
  [ "$name" = fp32 ] && continue
  # shellcheck disable=SC2086
  [ -f "$W/$name/model.onnx" ] || $G optimize "$W/fp32" -o "$W/$name" --fusion none ${RECIPES[$name]} --force
done
machine() {
  $PY -c "import os, platform; from gpt2onnx.machine import describe_machine; print('machine:', describe_machine().short(), '|',
platform.node(), '| load average', os.getloadavg())"
}
sync
sleep 5
machine
if [ "${SKIP_ENGINES:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  (cd "$E" && venv/bin/python bench_engines.py --reps 7 --warmup 2 ${ENGINE_ROWS:+--only $ENGINE_ROWS} \
      --json-out "$W/engines.json" --md-out "$W/engines.md")
  cat "$W/engines.md"
  machine
fi
variants=()
for name in $OURS; do
  variants+=(--variant "gpt2onnx $name=$W/$name/model.onnx")
done
$PY "$PEERS/bench_decode.py" --torch-model "$E/gpt2-small" --threads 2 --reps 20 --gen-reps 10 --no-hf-generate \
    "${variants[@]}" --json-out "$W/ours.json" 2> "$W/ours.stderr" | tee "$W/ours.out"
machine
