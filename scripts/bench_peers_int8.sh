#!/usr/bin/env bash
# The 124M model beside the peers, int8's weight scheme now and before (docs/benchmarks.md, "int8 on every CPU"):
# a random checkpoint from the peers' make_random_gpt2.py, the two best fp32 peers (export_peers.py --only), ours in
# fp32 / int8 / int4 with --fusion ort --logits last, and int8 with the scheme before issue 26
# (INT8_SCHEMES["u8s8-tensor"]), all timed in one run of the peers' bench_decode.py.
#   bash scripts/bench_peers_int8.sh [WORK_DIR]      (about 12 minutes; PEERS=path/to/shared/peers)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONWARNINGS=ignore
ROOT=$PWD
PY=$ROOT/.venv/bin/python
G=$ROOT/.venv/bin/gpt2onnx
PEERS=${PEERS:-$ROOT/../shared/peers}
W=${1:-/tmp/peers}
mkdir -p "$W"
[ -d "$W/gpt2-small" ] || $PY "$PEERS/make_random_gpt2.py" --size small "$W/gpt2-small"
[ -f "$W/out/exports.json" ] || PATH=$ROOT/.venv/bin:$PATH $PY "$PEERS/export_peers.py" "$W/gpt2-small" "$W/out" \
    --only "torch.onnx.export dynamo=True" "ORT convert_to_onnx (patched, eager)"
[ -f "$W/fp32/model.onnx" ] || $G export -m "$W/gpt2-small" -o "$W/fp32" --fusion ort --logits last --force
[ -f "$W/int8/model.onnx" ] || $G optimize "$W/fp32" -o "$W/int8" --fusion none --quantize int8 --force
[ -f "$W/int4/model.onnx" ] || $G optimize "$W/fp32" -o "$W/int4" --fusion none --quantize int4 --force
[ -f "$W/int8-before/model.onnx" ] || $PY - "$W" <<'PYEOF'
import shutil
import sys
from pathlib import Path

import onnx

from gpt2onnx.precisions.int8 import INT8_SCHEMES
from gpt2onnx.precisions.quantize_options import QuantizeOptions
from gpt2onnx.precisions.weights import quantize

work = Path(sys.argv[1])
base, out = work / "fp32", work / "int8-before"
out.mkdir(exist_ok=True)
for f in base.glob("*.json"):
    if f.name != "gpt2onnx.json":
        shutil.copy(f, out / f.name)
before = INT8_SCHEMES["u8s8-tensor"]
model, _ = quantize(onnx.load(str(base / "model.onnx")), QuantizeOptions("int8"), int8_scheme=before)
onnx.save(model, str(out / "model.onnx"))
PYEOF
sync
sleep 5
$PY "$PEERS/bench_decode.py" --torch-model "$W/gpt2-small" --threads 2 --reps 20 --gen-reps 20 \
    --variant "gpt2onnx fp32=$W/fp32/model.onnx" \
    --variant "gpt2onnx int8 (u8s8 per channel, 7-bit: default)=$W/int8/model.onnx" \
    --variant "gpt2onnx int8 (u8s8 per tensor: before)=$W/int8-before/model.onnx" \
    --variant "gpt2onnx int4=$W/int4/model.onnx" \
    --variant "torch.onnx dynamo=$W/out/torch_dynamo/model.onnx" \
    --variant "ORT convert_to_onnx eager=$W/out/ortc_eager/gpt2_fp32_opt.onnx" \
    --json-out "$W/bench.json" 2> "$W/bench.stderr" | tee "$W/bench.out"
