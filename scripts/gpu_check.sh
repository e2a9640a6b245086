#!/usr/bin/env bash
# The one GPU check of the FP4 Triton kernels (docs/perf.md, "FP4 Triton kernels").
#
#   bash scripts/gpu_check.sh            # from the repository root of a clone, on a CUDA machine
#
# 1. makes `fp4lightning` (with `kernels/` as `fp4lightning.kernels`) importable: uses
#    an existing install, else `pip install --no-deps -e .` (the README's install,
#    without touching dependencies);
# 2. runs the GPU tests of tests/test_kernels.py (compiled kernels, default configs);
# 3. runs the full benchmark (python -m fp4lightning.kernels.bench): kernel-vs-reference
#    checks first, then every timing row printed as soon as it is measured;
# 4. runs the rest of tests/test_kernels.py and tests/test_block_kernels.py compiled on the GPU.
# Everything goes to stdout and to $OUT/gpu_check.log (when $OUT is set) or
# /tmp/fp4lightning_gpu_check.log. Exit status: 0 if every test and check passed, 1 on any
# wrong result or crash, 2 if a step ran out of its time limit without a wrong result.
# Sized for about 8 minutes on one H100/H200; each step has its own time limit, so a
# hang in one still leaves the others' output.
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

# Order: the realistic-size GPU tests, then the benchmark (which checks every kernel
# against its reference before timing), then the rest of the kernel tests (the small
# odd-shaped cases the CPU suite runs under the interpreter, here compiled).
step "GPU tests at realistic sizes (pytest -m gpu tests/test_kernels.py; default configs)"
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 150 "$PY" -m pytest -v -p no:cacheprovider -o addopts="" -rfE --durations=5 \
  -m "gpu" tests/test_kernels.py
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("gpu tests (ran out of their 150 s)"); elif [ $rc -ne 0 ]; then FAIL+=("gpu tests (rc=$rc)"); fi

step "benchmark + kernel checks (python -m fp4lightning.kernels.bench; autotuning on)"
timeout -k 10 270 "$PY" -m fp4lightning.kernels.bench
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("bench (ran out of its 270 s; the rows above were measured)"); elif [ $rc -ne 0 ]; then FAIL+=("bench (rc=$rc: a kernel check failed or it crashed; see above)"); fi

step "the remaining kernel tests, compiled (pytest -m 'not gpu and not slow' tests/test_kernels.py tests/test_block_kernels.py)"
FP4LIGHTNING_AUTOTUNE=0 timeout -k 10 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfE --durations=5 \
  -m "not gpu and not slow" tests/test_kernels.py tests/test_block_kernels.py
rc=$?
if [ $rc -eq 124 ]; then INCOMPLETE+=("small-shape tests (ran out of their 120 s)"); elif [ $rc -ne 0 ]; then FAIL+=("small-shape tests (rc=$rc)"); fi

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
