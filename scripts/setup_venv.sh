#!/usr/bin/env bash
# Create (or reuse) the local virtualenv .venv and install fp4lightning into it
# through constraints.txt, which pins torch to the CPU build (any other torch
# spec pulls a multi-GB CUDA build). Idempotent: reinstalls only when pyproject.toml
# or constraints.txt changed. The test-only torchao oracle is not installed here
# (scripts/test.sh adds it): importing it prints CUDA-extension load failures.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.fp4lightning-installed"
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] creating $VENV and installing fp4lightning (first time: 3-4 minutes, about 2.3 GB)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip's own progress on a terminal; quiet in logs
quiet=(-q)
[ -t 1 ] && quiet=()
"$VENV/bin/python" -m pip install "${quiet[@]}" --disable-pip-version-check -c constraints.txt -e '.[dev]'
echo "$want" > "$stamp"
