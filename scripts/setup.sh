#!/usr/bin/env bash
# Set up everything: a virtual environment in .venv with torch, the project and its test tools.
# torch is installed first and pinned, so pip does not pull a multi-GB CUDA build where a CPU build is on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev,optimum]' 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import gpt2onnx, torch, onnxruntime; print('gpt2onnx', gpt2onnx.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
