#!/usr/bin/env bash
# Threshold audit (not part of CI): every seeded threshold of the numeric tests under N fixed seeds
# (default 1000), with each threshold's worst value and margin (tests/README.md, "Threshold policy").
# Usage: bash scripts/seed_sweep.sh [N=1000] [--jobs J] [--start S] [--out DIR]
# Failures print the seed; reproduce one with FP4_TEST_SEED=<seed> bash scripts/test.sh -k <test>.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python scripts/seed_sweep.py "$@"
