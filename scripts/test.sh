#!/usr/bin/env bash
# The test command: set up .venv (if needed), add the test-only torchao oracle, and run the
# whole suite on CPU. Extra arguments go to pytest, e.g. `bash scripts/test.sh -k formats`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
VENV=${VENV:-.venv}
# the pyproject extra `oracle` (tests/test_block_formats.py compares against it), without its
# dependencies, which would pull a CUDA torch; kept out of setup_venv.sh, which scripts/main.sh uses
oracle=$(sed -n 's/^oracle = \["\(.*\)"\]$/\1/p' pyproject.toml)
[ -n "$oracle" ] || { echo "[test] error: no 'oracle = [\"...\"]' line in pyproject.toml" >&2; exit 1; }
stamp="$VENV/.oracle-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$oracle" ]; then
  echo "[test] installing the test-only oracle $oracle"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$oracle"
  echo "$oracle" > "$stamp"
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# one pytest-xdist worker per core, at most 8 (FP4_TEST_WORKERS overrides; 1 runs in this
# process); a test file stays on one worker, so its module-scoped fixtures (a trained run, a
# corpus) are built once
workers=${FP4_TEST_WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}
xdist=()
[ "$workers" -gt 1 ] && xdist=(-n "$workers" --dist loadfile)
exec "$VENV/bin/python" -m pytest -q --durations=15 "${xdist[@]}" "$@"
