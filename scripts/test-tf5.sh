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
[ "${TF5_SET_UP:-0}" = 1 ] || bash scripts/setup-tf5.sh  # (scripts/test.sh's set-up makes it beside the rest)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TF5_TESTS=(pytorch/test_checkpoint exporters/test_export_parity verify/test_kv_path decoding/test_decoding
  decoding/test_generate decoding/test_generation_settings targets/test_ort_generate artifact/test_tokenizer
  verify/test_eval test_training test_api benchmarks/test_bench_torch cli/test_cli test_architecture)
exec .venv-tf5/bin/python -m pytest -q -n 2 --dist loadfile -m 'not slow' -W error::FutureWarning $(printf "tests/%s.py " "${TF5_TESTS[@]}") "$@"
