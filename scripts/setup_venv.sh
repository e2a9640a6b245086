#!/usr/bin/env bash
# Create (or reuse) the local virtualenv .venv and install fp4lightning into it
# through constraints.txt, which pins torch to the CPU build (any other torch
# spec pulls a multi-GB CUDA build). Idempotent: reinstalls only when pyproject.toml
# or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.fp4lightning-installed"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $VENV and installing fp4lightning (first time: ~2 minutes)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
# the test-only torchao oracle (pyproject extra `oracle`), without its dependencies
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps 'torchao==0.18.0'
echo "$want" > "$stamp"
