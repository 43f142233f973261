#!/usr/bin/env bash
# Run the tests (set-up included): offline, CPU only, seeded tiny models plus one export of the 124M architecture,
# in .venv (transformers 4.x with optimum); then again under transformers 5.x (scripts/test-tf5.sh, .venv-tf5,
# no optimum, not the slow ones). Arguments go to both pytest runs; SKIP_TF5=1 runs the first only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# lint and format first: a violation fails the run (pyproject.toml [tool.ruff])
.venv/bin/ruff check gpt2onnx tests scripts
.venv/bin/ruff format --check gpt2onnx tests scripts
# two workers, a test file each at a time (--dist loadfile: a file's module fixtures are built once); -n 0 after the
# command's arguments runs them in this process
.venv/bin/python -m pytest -n 2 --dist loadfile "$@"
if [ "${SKIP_TF5:-0}" != 1 ]; then
    TF5_SET_UP=1 bash scripts/test-tf5.sh "$@"  # (scripts/setup.sh made .venv-tf5 above)
fi
