#!/usr/bin/env bash
# The main job on the embedded default: install, prepare the built-in corpus, pretrain
# the tiny LLaMA in FP4 on 2 CPU cores, and evaluate it.
# Extra arguments are recipe overrides for the training step, e.g. `trainer.max_steps=50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
FP4=.venv/bin/fp4lightning
if ! "$FP4" --help >/dev/null 2>&1; then
  echo "[main] the fp4lightning command line is not built yet (see the README's status table)" >&2
  exit 1
fi
"$FP4" data prepare --source builtin
"$FP4" train recipes/tiny.yaml "$@"
