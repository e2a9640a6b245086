#!/usr/bin/env bash
# The one GPU check of the FP4 kernels and GeMM paths (docs/perf.md, "FP4 Triton kernels").
#
#   bash scripts/gpu_check.sh            # from the repository root of a clone, on a CUDA machine
#   FP4LIGHTNING_COMMIT=<sha> bash scripts/gpu_check.sh   # a copy of the tree without .git
#
# 1. makes `fp4lightning` (with `kernels/` as `fp4lightning.kernels`) importable: uses
#    an existing install, else `pip install --no-deps -e .` (the README's install,
#    without touching dependencies); makes torchao importable for the float8 row from a wheel
#    carried in .whl/ (the GPU machine has no network: `pip download --no-deps torchao==0.18.0
#    -d .whl/` on a machine with one);
# 2. correctness first: every kernel against its reference (python benchmarks/bench_kernels.py
#    --checks-only, the scaled_mm GeMMs included) and all of tests/test_scaled_mm.py, compiled;
# 3. one table measured in one run: per layer (8192 tokens; 4096->4096, 4096->11008, 11008->4096)
#    the forward+backward of bf16 nn.Linear, torchao's row-wise float8 training, FP4Linear
#    w4a4-direct and paper on the scaled_mm and the Triton GeMM paths, each row printed as it is
#    measured (benchmarks/bench_linear.py --layer-table), written to docs/perf/h200.json (and to
#    $OUT/h200.json when $OUT is set);
# 4. the whole training step of the llama2-1.3b recipe's model: bf16-mixed, torchao float8
#    row-wise (compiled), fp4 (paper) and w4a4-direct side by side, each with its decoder blocks
#    compiled as the recipe's trainer.compile does (benchmarks/bench_train.py --recipe
#    recipes/llama2-1.3b.yaml --compile), added to docs/perf/h200.json as "step_1.3b"; then fp4 and
#    bf16-mixed eagerly, for the time split a compiled block cannot give ("step_1.3b_eager");
#    then, around the FP4 layers: one optimizer step of the 1.3B MLP layer with its weight quantized
#    per micro-batch against once per step (benchmarks/bench_weight_reuse.py, "weight_reuse" in the
#    json) and LowPrecisionAdamW's per-parameter loop against its foreach path (bench_optim.py);
# 5. the user's own path: `fp4lightning train recipes/llama2-1.3b.yaml` for a few steps on the
#    built-in corpus with a 32000-token vocabulary, prepared on a machine with network and carried
#    in (`fp4lightning data prepare --source builtin --vocab-size 32000 --out data/builtin-32k`;
#    carry data/builtin-32k); it prints tokens/s and MFU as a user sees them (the recipe compiles
#    its blocks: trainer.compile, the first step includes the compile);
# 6. only with GPU_CHECK_FULL=1: the GPU kernel tests at realistic sizes (pytest -m gpu
#    tests/test_kernels.py), the kernel benchmark's timing rows (benchmarks/bench_kernels.py)
#    and the rest of the kernel tests compiled.
# Everything goes to stdout and to $OUT/gpu_check.log (when $OUT is set) or
# /tmp/fp4lightning_gpu_check.log. Exit status: 0 if every test and check passed, 1 on any
# wrong result or crash, 2 if a step ran out of its time limit without a wrong result.
# Sized for about 8 minutes on one H100/H200 (steps 1-5), plus the blocks' first-step compile in
# steps 4 and 5 (their limits leave room for it). Each step has its own time limit, so a hang in one
# still leaves the others' output.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY=${PYTHON:-python3}
LOG=${OUT:+$OUT/gpu_check.log}
LOG=${LOG:-/tmp/fp4lightning_gpu_check.log}
mkdir -p "$(dirname "$LOG")"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
FAIL=()        # wrong results or crashes
INCOMPLETE=()  # steps cut off by their time limit (nothing wrong seen, but not all run)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
# add_to_record KEY FILE: FILE's json under KEY in docs/perf/h200.json (and its copy in $OUT)
add_to_record() {
  [ -f "$2" ] && [ -f docs/perf/h200.json ] || return 0
  "$PY" - "$1" "$2" <<'EOF'
import json, sys
rec = json.load(open("docs/perf/h200.json"))
rec[sys.argv[1]] = json.load(open(sys.argv[2]))
json.dump(rec, open("docs/perf/h200.json", "w"), indent=1)
print(sys.argv[1], "added to docs/perf/h200.json")
EOF
  if [ -n "${OUT:-}" ]; then cp docs/perf/h200.json "$OUT/h200.json"; fi
}

step "environment"
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "(no nvidia-smi)"
"$PY" - <<'EOF' || FAIL+=("environment")
import sys, torch, triton
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__)
print("cuda available:", torch.cuda.is_available(),
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
sys.exit(0 if torch.cuda.is_available() else 1)
EOF
git log -1 --format='commit %H %s' 2>/dev/null || true

step "install (if fp4lightning.kernels is not importable yet)"
if ! "$PY" -c "import fp4lightning.kernels.fp4_triton" 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . \
    || "$PY" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check \
         --break-system-packages -e . \
    || echo "(pip install -e . failed: falling back to an import hook for this run only)"
fi
if ! "$PY" -c "import fp4lightning.kernels.fp4_triton" 2>/dev/null; then
  # No install possible (e.g. setuptools without bdist_wheel): map kernels/ -> fp4lightning.kernels
  # and eval/ -> fp4lightning.eval, as pyproject.toml's package-dir does, with a sitecustomize
  # on PYTHONPATH (also seen by pytest and every subprocess).
  HOOK=$(mktemp -d)
  cat > "$HOOK/sitecustomize.py" <<HOOKEOF
import importlib.abc, importlib.util, os, sys
_ROOT = "$PWD"
_MAP = {"fp4lightning.kernels": "kernels", "fp4lightning.eval": "eval"}
class _PackageDir(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _MAP:
            return None
        d = os.path.join(_ROOT, _MAP[name])
        return importlib.util.spec_from_file_location(name, os.path.join(d, "__init__.py"),
                                                      submodule_search_locations=[d])
sys.meta_path.insert(0, _PackageDir())
HOOKEOF
  export PYTHONPATH="$HOOK:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import fp4lightning.kernels.fp4_triton as k; print('fp4lightning.kernels from', k.__file__)"; then
  echo "FATAL: cannot import fp4lightning.kernels (install with: pip install -e .)"
  exit 2
fi

step "torchao (the float8 row of the layer table), from .whl/ if it is not importable yet"
if ! "$PY" -c "import torchao" 2>/dev/null; then
  WHL=$(ls .whl/torchao-*.whl 2>/dev/null | head -1)
  if [ -z "$WHL" ]; then
    echo "(no torchao and no .whl/torchao-*.whl: the table's torchao-float8 row will read n/a)"
  elif ! "$PY" -m pip install -q --no-deps --no-index --disable-pip-version-check "$WHL" 2>/dev/null \
       && ! "$PY" -m pip install -q --no-deps --no-index --disable-pip-version-check --break-system-packages "$WHL"; then
    # no pip install possible: a wheel is a zip, importable once unpacked onto the path
    TAO=$(mktemp -d)
    "$PY" -m zipfile -e "$WHL" "$TAO" && export PYTHONPATH="$TAO${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
"$PY" -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | grep -v -i "warn\|pytree\|register" | tail -1

# Correctness first (a wrong result shows even if the timings run out of time), then the table.
step "kernels and GeMM paths against their references (python benchmarks/bench_kernels.py --checks-only)"
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 120 "$PY" benchmarks/bench_kernels.py --checks-only
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("kernel checks (ran out of their 120 s)"); elif [ $rc -ne 0 ]; then FAIL+=("kernel checks (rc=$rc)"); fi

step "the scaled_mm backend, compiled (pytest tests/test_scaled_mm.py)"
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfE --durations=5 \
  tests/test_scaled_mm.py
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("scaled_mm tests (ran out of their 120 s)"); elif [ $rc -ne 0 ]; then FAIL+=("scaled_mm tests (rc=$rc)"); fi

# The Triton GeMMs run their default configs here (no autotuning: its compiles would take the
# step's time); the table records it.
step "the layer table (benchmarks/bench_linear.py --layer-table), written to docs/perf/h200.json"
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 200 "$PY" benchmarks/bench_linear.py --layer-table --iters 30 \
  --json docs/perf/h200.json
rc=$?
if [ -n "${OUT:-}" ] && [ -f docs/perf/h200.json ]; then cp docs/perf/h200.json "$OUT/h200.json"; fi
if [ $rc -eq 124 ]; then INCOMPLETE+=("layer table (ran out of its 200 s; the rows above were measured)"); elif [ $rc -ne 0 ]; then FAIL+=("layer table (rc=$rc)"); fi

step "the llama2-1.3b training step (benchmarks/bench_train.py --recipe recipes/llama2-1.3b.yaml --compile)"
STEP_JSON=${OUT:-/tmp}/step_1.3b.json
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 240 "$PY" benchmarks/bench_train.py --recipe recipes/llama2-1.3b.yaml \
  --steps 5 --start-micro-batch 16 --compile --compile-torchao --json "$STEP_JSON"
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("1.3B step (ran out of its 240 s)"); elif [ $rc -ne 0 ]; then FAIL+=("1.3B step (rc=$rc)"); fi
add_to_record step_1.3b "$STEP_JSON"
# the time split (FP4 layers, attention, the rest, the optimizer) needs hooks a compiled block cannot
# have: one eager run of fp4 and bf16-mixed gives it, and what compiling the blocks gains
SPLIT_JSON=${OUT:-/tmp}/step_1.3b_eager.json
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 120 "$PY" benchmarks/bench_train.py --recipe recipes/llama2-1.3b.yaml \
  --steps 2 --start-micro-batch 16 --precisions bf16-mixed,fp4 --json "$SPLIT_JSON"
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("1.3B eager step (ran out of its 120 s)"); elif [ $rc -ne 0 ]; then FAIL+=("1.3B eager step (rc=$rc)"); fi
add_to_record step_1.3b_eager "$SPLIT_JSON"

step "around the FP4 layers: weight quantized once per step (bench_weight_reuse.py), LowPrecisionAdamW loop vs foreach"
REUSE_JSON=${OUT:-/tmp}/weight_reuse.json
timeout -k 10 60 "$PY" benchmarks/bench_weight_reuse.py --device cuda --tokens 8192 --accum 4 --json "$REUSE_JSON"
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("weight reuse (ran out of its 60 s)"); elif [ $rc -ne 0 ]; then FAIL+=("weight reuse (rc=$rc)"); fi
add_to_record weight_reuse "$REUSE_JSON"
timeout -k 10 60 "$PY" benchmarks/bench_optim.py --step-time --step-params 200 --step-steps 10
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("optimizer step (ran out of its 60 s)"); elif [ $rc -ne 0 ]; then FAIL+=("optimizer step (rc=$rc)"); fi

step "the user's path: fp4lightning train recipes/llama2-1.3b.yaml (built-in corpus, 32000-token BPE)"
if [ -f data/builtin-32k/meta.json ]; then
  FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 180 "$PY" -m fp4lightning.cli train recipes/llama2-1.3b.yaml \
    data.source=builtin data.dir=data/builtin-32k trainer.devices=1 trainer.strategy=auto \
    data.global_batch_size=8 schedule.max_steps=12 trainer.log_every_n_steps=2 \
    out_dir="${OUT:-/tmp}/run-1.3b" --overwrite
  rc=$?
  if [ $rc -eq 124 ]; then INCOMPLETE+=("1.3B train (ran out of its 180 s)"); elif [ $rc -ne 0 ]; then FAIL+=("1.3B train (rc=$rc)"); fi
else
  echo "(no data/builtin-32k: prepare it on a machine with network and carry it in; step skipped)"
  INCOMPLETE+=("1.3B train (no data/builtin-32k carried in)")
fi

if [ "${GPU_CHECK_FULL:-0}" = "1" ]; then
  step "GPU tests at realistic sizes (pytest -m gpu tests/test_kernels.py; default configs)"
  FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 150 "$PY" -m pytest -v -p no:cacheprovider -o addopts="" -rfE --durations=5 \
    -m "gpu" tests/test_kernels.py
  rc=$?
  if [ $rc -eq 124 ]; then INCOMPLETE+=("gpu tests (ran out of their 150 s)"); elif [ $rc -ne 0 ]; then FAIL+=("gpu tests (rc=$rc)"); fi

  step "kernel benchmark timings (python benchmarks/bench_kernels.py --skip-checks; autotuning on)"
  timeout -k 10 270 "$PY" benchmarks/bench_kernels.py --skip-checks
  rc=$?
  if [ $rc -eq 124 ]; then INCOMPLETE+=("bench (ran out of its 270 s; the rows above were measured)"); elif [ $rc -ne 0 ]; then FAIL+=("bench (rc=$rc)"); fi

  step "the remaining kernel tests, compiled (pytest -m 'not gpu and not slow' tests/test_kernels.py tests/test_block_kernels.py)"
  FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfE --durations=5 \
    -m "not gpu and not slow" tests/test_kernels.py tests/test_block_kernels.py
  rc=$?
  if [ $rc -eq 124 ]; then INCOMPLETE+=("small-shape tests (ran out of their 120 s)"); elif [ $rc -ne 0 ]; then FAIL+=("small-shape tests (rc=$rc)"); fi
fi

step "done in $(( $(date +%s) - T0 )) s"
if [ ${#FAIL[@]} -ne 0 ]; then
  echo "GPU CHECK FAILED: ${FAIL[*]}${INCOMPLETE[*]:+; also incomplete: ${INCOMPLETE[*]}}"
  exit 1
fi
if [ ${#INCOMPLETE[@]} -ne 0 ]; then
  echo "GPU CHECK INCOMPLETE (no wrong result seen): ${INCOMPLETE[*]}"
  exit 2
fi
echo "GPU CHECK PASSED"
exit 0
