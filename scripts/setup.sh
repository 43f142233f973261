#!/usr/bin/env bash
# Set up everything: a virtual environment in .venv with torch, the project and its test tools.
# torch is installed first and pinned, so pip does not pull a multi-GB CUDA build where a CPU build is on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "^WARNING: Location" || true
# Runtimes beside onnxruntime (gpt2onnx --runtime): OpenVINO goes into .venv (it leaves onnxruntime-gpu alone);
# onnxruntime-genai gets its own .venv-genai, because its wheel installs the CPU onnxruntime over onnxruntime-gpu.
# gpt2onnx finds it there (or through GPT2ONNX_GENAI_PYTHON) and runs it in a worker process.
.venv/bin/python -m pip install --quiet --disable-pip-version-check openvino 2>&1 | grep -v "^WARNING: Location" || true
[ -x .venv-genai/bin/python ] || "$PYTHON" -m venv .venv-genai
.venv-genai/bin/python -m pip install --quiet --disable-pip-version-check onnxruntime-genai numpy 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import gpt2onnx, torch, onnxruntime; print('gpt2onnx', gpt2onnx.__version__, '| torch', torch.__version__, '| onnxruntime', onnxruntime.__version__)"
