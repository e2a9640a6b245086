#!/usr/bin/env bash
# The main job on the embedded default: install, prepare the built-in corpus, pretrain
# the tiny LLaMA in FP4 on 2 CPU cores, and evaluate it zero-shot with lm-eval.
# Extra arguments are recipe overrides for the training step, e.g. `schedule.max_steps=50`.
# On a terminal each long stage shows progress (pip's, the training bar, lm-eval's bars);
# piped into a log it prints plain lines only.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "[main] 1/4 install (.venv; reused when up to date)"
bash scripts/setup_venv.sh
# OpenMP threads that spin while waiting make a busy 2-core machine 3-4x slower
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
FP4=.venv/bin/fp4lightning
echo "[main] 2/4 prepare the built-in corpus (data/builtin)"
"$FP4" data prepare --source builtin
# the main job trains runs/tiny from scratch each time: --overwrite deletes an earlier run's
# checkpoints and logs there (it says which); `fp4lightning train recipes/tiny.yaml --resume` continues one
echo "[main] 3/4 train the tiny LLaMA in FP4 (runs/tiny)"
"$FP4" train recipes/tiny.yaml "$@" --overwrite
echo "[main] 4/4 evaluate zero-shot on the offline tasks (runs/tiny/eval)"
"$FP4" eval runs/tiny/checkpoints/last.ckpt --tasks offline --out runs/tiny/eval
echo "[main] done: checkpoint runs/tiny/checkpoints/last.ckpt, loss curve runs/tiny/loss.png, eval runs/tiny/eval/results.md"
