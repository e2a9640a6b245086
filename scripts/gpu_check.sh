#!/usr/bin/env bash
# The GPU check, in stages that each fit one call of the lent GPU machine (docs/perf.md, "GPU check").
#
#   bash scripts/gpu_check.sh STAGE [STAGE ...]    # from the repository root, on a CUDA machine
#   bash scripts/gpu_check.sh all                  # profile layers checks step train, one after the other
#
# On a lent machine, two calls (scripts/gpu_stage.py CALLS): `profile layers`, then `checks step train`.
# Stages (each ends within its budget, 120-280 s, scripts/gpu_stage.py STAGE_BUDGET_S; what it measures goes into
# docs/perf/h200.json under its key as soon as it is measured, and to $OUT/h200.json when $OUT is set):
#   profile       where the layers' time goes at the 7B shapes, 8192 tokens: bf16, w4a4-direct, paper,
#                 torchao float8; synced and back-to-back wall time, the host's time to issue a call,
#                 the kernels' time (torch.profiler) beside the roofline's launches, a CUDA graph replay
#                 (benchmarks/profile_linear.py)
#   layers        the layer table at the 7B shapes, 8192 tokens: bf16 nn.Linear, torchao float8
#                 row-wise, FP4Linear w4a4-direct and paper on the scaled_mm and Triton paths, each
#                 figure beside the roofline's prediction (benchmarks/roofline.py)
#   checks        the device, the capability probe of torch._scaled_mm (which kinds run, where the
#                 others go), every kernel against its reference (benchmarks/bench_kernels.py
#                 --checks-only), tests/test_scaled_mm.py and tests/test_capability_probe.py compiled
#   step          one training step of the llama2-1.3b recipe's model, blocks compiled: bf16-mixed,
#                 fp4 (paper), w4a4-direct (benchmarks/bench_train.py)
#   train         the user's command: fp4lightning train recipes/llama2-1.3b.yaml, 12 steps on the
#                 carried built-in corpus (data/builtin), tokens/s and MFU as logged
#   step-torchao  the same step with torchao float8 row-wise, compiled (a long compile: optional)
#   extras        the eager 1.3B step's time split, the weight quantized once per step, the optimizer
#   kernels       the kernel tests compiled (GPU tests at realistic sizes, then the small shapes)
#   kernel-bench  the kernel benchmark's timing rows, autotuning on
#   memory        what one llama2-1.3b block saves for its backward, eager and compiled, bf16 against
#                 the FP4 layers (benchmarks/bench_block_memory.py: the 1.3B step's extra memory)
#
# What the GPU machine lacks travels in the device tool's `carry`: scripts/gpu_pack.sh (here, with
# network) downloads the wheels (omegaconf, torchao) into .whl/, checks data/builtin and the size,
# and prints the carry list. This script installs the wheels with pip --no-index --no-deps --target
# and makes this checkout importable without installing it (scripts/gpu_site/sitecustomize.py).
# Everything printed also goes to $OUT/gpu_check.log (or /tmp/fp4lightning_gpu_check.log).
# Exit status: 0 every stage passed, 1 a wrong result, crash or import error, 2 a step ran out of
# its time (nothing wrong seen).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
MAIN_STAGES=(profile layers checks step train)
ALL_STAGES=" profile layers checks step train step-torchao extras kernels kernel-bench memory "
if [ $# -eq 0 ]; then
  echo "usage: bash scripts/gpu_check.sh STAGE [STAGE ...]; STAGE:${ALL_STAGES}or all" >&2
  exit 2
fi
STAGES=()
for s in "$@"; do
  if [ "$s" = all ]; then STAGES+=("${MAIN_STAGES[@]}");
  elif [[ "$ALL_STAGES" == *" $s "* ]]; then STAGES+=("$s");
  else echo "unknown stage '$s'; choose from:${ALL_STAGES}or all" >&2; exit 2; fi
done
LOG=${OUT:+$OUT/gpu_check.log}
LOG=${LOG:-/tmp/fp4lightning_gpu_check.log}
mkdir -p "$(dirname "$LOG")"
exec > >(tee -a "$LOG") 2>&1

echo "=== gpu_check $* ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null \
  || echo "(no nvidia-smi)"
SITE=${GPU_CHECK_SITE:-/tmp/fp4lightning-site}
"$PY" scripts/gpu_stage.py wheels --target "$SITE" || { echo "FATAL: installing the carried wheels failed"; exit 1; }
export PYTHONPATH="$PWD/scripts/gpu_site:$SITE${PYTHONPATH:+:$PYTHONPATH}"

worst=0
for s in "${STAGES[@]}"; do
  "$PY" scripts/gpu_stage.py stage "$s"
  rc=$?
  if [ $rc -eq 1 ] || { [ $rc -ne 0 ] && [ $worst -ne 1 ]; }; then worst=$rc; fi
done
case $worst in
  0) echo "GPU CHECK PASSED: ${STAGES[*]}" ;;
  2) echo "GPU CHECK INCOMPLETE (no wrong result seen; a step ran out of its time): ${STAGES[*]}" ;;
  *) echo "GPU CHECK FAILED: ${STAGES[*]} (see the stage summaries above)" ;;
esac
exit $worst
