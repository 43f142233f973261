#!/usr/bin/env bash
# The tests again under transformers 5.x, in a second virtual environment (.venv-tf5) without optimum
# (optimum-onnx pins transformers<4.58, so its interop tests skip here and run in .venv).
# Only the tests of what depends on transformers' version (TF5_TESTS): loading checkpoints and configs, the
# reference model and its cache API, random initialisation, generate() and its decoding options, the tokenizer
# classes, training, eval and the torch baseline, the CLI, and the import of every module without optimum. The rest
# (fusions, precisions, runtimes, deploy targets, the browser, the bad-input corpus, portability) runs onnx and
# onnxruntime on files whatever made them, and runs once, in .venv. FutureWarning as an error catches transformers'
# next renames before they break.
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
TF5_TESTS=(test_checkpoint test_export_parity test_kv_path test_decoding test_generate test_generation_settings
  test_ort_generate test_tokenizer test_eval test_training test_api test_bench_torch test_cli test_architecture)
exec .venv-tf5/bin/python -m pytest -q -m 'not slow' -W error::FutureWarning $(printf "tests/%s.py " "${TF5_TESTS[@]}") "$@"
