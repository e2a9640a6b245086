#!/usr/bin/env bash
# Builds what the GPU check carries to the lent GPU machine and prints the device tool's `carry` list
# (docs/perf.md, "GPU check"). Run here, where PyPI is reachable:
#
#   bash scripts/gpu_pack.sh
#
# 1. .whl/ (ignored): the wheels the GPU image lacks, for its Python 3.12 on x86-64: omegaconf
#    (train/recipe.py; the version installed here, whose only requirement, PyYAML, the image has)
#    and torchao 0.18.0 (pyproject's `oracle` extra: the torchao float8 rows of the layer table and
#    the 1.3B step). Any other requirement of these wheels stops the script: add it below.
# 2. .whl/roofline.json: benchmarks/roofline.py --json, when that script exists (the layers stage
#    puts its predictions beside the measurements; without it the stage runs it on the GPU machine).
# 3. data/builtin (ignored): the prepared built-in corpus the `train` stage trains on (prepared
#    here if missing: fp4lightning data prepare --source builtin).
# 4. the size of what travels (the tree git does not ignore + the carried paths): at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
MIB=$((1024 * 1024))
LIMIT=$((64 * MIB))
CARRY=(.whl data/builtin)
# the GPU image's Python packages that the wheels below may require (the device README's list)
GPU_HAS=" pyyaml torch numpy packaging typing-extensions "

omegaconf=$("$PY" -c "import importlib.metadata as m; print(m.version('omegaconf'))" 2>/dev/null || echo 2.4.0)
torchao=$(sed -n 's/.*"torchao==\([0-9.]*\)".*/\1/p' pyproject.toml | head -1)
WANT=("omegaconf==$omegaconf" "torchao==${torchao:-0.18.0}")

echo "[pack] wheels for Python 3.12 manylinux x86_64: ${WANT[*]}"
mkdir -p .whl
for spec in "${WANT[@]}"; do  # one version of each in .whl/ (two would stop the install there)
  name=${spec%%==*}
  for old in .whl/"$name"-*.whl; do
    if [ -e "$old" ] && [[ "$old" != .whl/"$name-${spec##*==}-"* ]]; then rm -f "$old"; fi
  done
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WANT[@]}"
"$PY" - "$GPU_HAS" <<'EOF2'
import re, sys, zipfile
from pathlib import Path
have = set(sys.argv[1].split())
wheels = sorted(Path(".whl").glob("*.whl"))
carried = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in wheels}
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        name = re.sub(r"[-_.]+", "-", re.match(r"Requires-Dist:\s*([A-Za-z0-9_.-]+)", line).group(1)).lower()
        if name not in have | carried:
            sys.exit(f"[pack] {w.name} requires {name}, which neither the GPU image nor .whl/ has: "
                     "add it to WANT in scripts/gpu_pack.sh")
EOF2

if [ -f benchmarks/roofline.py ]; then
  echo "[pack] the roofline's predictions: benchmarks/roofline.py --json > .whl/roofline.json"
  if timeout 900 "$PY" benchmarks/roofline.py --json > .whl/roofline.json.tmp \
     && "$PY" -c "import json,sys; d=json.load(open('.whl/roofline.json.tmp')); sys.exit(0 if 'shapes' in d else 1)"; then
    mv .whl/roofline.json.tmp .whl/roofline.json
  else
    rm -f .whl/roofline.json.tmp .whl/roofline.json
    echo "[pack] (benchmarks/roofline.py --json failed: the layers stage runs it on the GPU machine instead)"
  fi
else
  rm -f .whl/roofline.json
  echo "[pack] (no benchmarks/roofline.py yet: the layer table's predictions will read null)"
fi

if [ ! -f data/builtin/meta.json ]; then
  echo "[pack] preparing the built-in corpus into data/builtin"
  "$PY" -m fp4lightning.cli data prepare --source builtin --out data/builtin
fi

tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
carried=$(du -sb "${CARRY[@]}" | awk '{s += $1} END {print s + 0}')
total=$((tree + carried))
awk -v t="$tree" -v c="$carried" -v what="${CARRY[*]}" 'BEGIN {m = 1048576;
  printf "[pack] travels: tree %.1f MiB + %s %.1f MiB = %.1f MiB (limit 64 MiB)\n", t / m, what, c / m, (t + c) / m}'
if [ "$total" -gt "$LIMIT" ]; then
  echo "[pack] over the device tool's 64 MiB: ignore or remove untracked files, or carry less" >&2
  exit 1
fi
ls -l .whl/
echo "carry: [\"${CARRY[0]}\", \"${CARRY[1]}\"]"
