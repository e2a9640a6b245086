#!/usr/bin/env bash
# The test command: set up .venv (if needed) and run the whole suite on CPU.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k formats`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
