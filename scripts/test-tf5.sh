#!/usr/bin/env bash
# The tests again under transformers 5.x, in a second virtual environment (.venv-tf5) without optimum
# (optimum-onnx pins transformers<4.58, so its interop tests skip here and run in .venv).
# Not the slow tests (one 124M export, version-independent), the bad-input corpus (minutes, version-independent)
# nor the browser tests (Chromium against onnxruntime on the same files, version-independent), nor the Triton server tests (the served
# model has no transformers in it): they run once, in .venv. FutureWarning as an error catches transformers' next renames before they break.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TF5_SPEC="${TF5_SPEC:-transformers>=5,<6}"
[ -x .venv-tf5/bin/python ] || "$PYTHON" -m venv .venv-tf5
.venv-tf5/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv-tf5/bin/python -m pip install --quiet --disable-pip-version-check --upgrade -e '.[dev,eval]' "$TF5_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv-tf5/bin/python -c "
import importlib.util, transformers
assert transformers.__version__.startswith('5.'), transformers.__version__
print('transformers', transformers.__version__, '| optimum', 'present' if importlib.util.find_spec('optimum') else 'absent')"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv-tf5/bin/python -m pytest -q -m 'not slow' -W error::FutureWarning --ignore tests/test_bad_input.py --ignore tests/test_web.py --ignore tests/test_triton.py "$@"
