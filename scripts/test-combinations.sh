#!/usr/bin/env bash
# The whole product of the registered choices, end to end (tests/test_combinations.py: every export the resolver
# allows, each with every runtime, provider, strategy, the engine and every target; every refusal in one line).
# CI runs a seeded sample of it; this runs all of it (tens of minutes on 2 cores). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 GPT2ONNX_COMBINATIONS=all
exec .venv/bin/python -m pytest tests/test_combinations.py -q -p no:cacheprovider "$@"
