#!/usr/bin/env bash
# .venv-tf5: torch, the project (with the serve extra) and transformers 5.x without optimum, for scripts/test-tf5.sh. scripts/setup.sh runs
# it beside the rest; safe to rerun (seconds when everything is there).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TF5_SPEC="${TF5_SPEC:-transformers>=5,<6}"
[ -x .venv-tf5/bin/python ] || "$PYTHON" -m venv .venv-tf5
.venv-tf5/bin/python -m pip install --quiet --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
flock .setup.lock .venv-tf5/bin/python -m pip install --quiet --disable-pip-version-check --upgrade -e '.[dev,eval,serve]' "$TF5_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
.venv-tf5/bin/python -c "
import importlib.util, transformers
assert transformers.__version__.startswith('5.'), transformers.__version__
print('transformers', transformers.__version__, '| optimum', 'present' if importlib.util.find_spec('optimum') else 'absent')"
