#!/usr/bin/env bash
# Run the tests (set-up included): offline, CPU only, seeded tiny models plus one export of the 124M architecture.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
