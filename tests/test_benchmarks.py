"""The CPU benchmark scripts run end to end (no timings are checked: no timed tests).

``benchmarks/bench_linear.py`` produces the FP4Linear figures in docs/perf.md; a script that
breaks would otherwise first show when someone reruns it for the docs.
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_linear_runs_with_fold_and_breakdown():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_linear.py"), "--iters", "1",
                           "--fold", "--breakdown", "--shapes", "64x64x96"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    row = next(line for line in out.splitlines() if line.startswith("| 64x64->96 |"))
    assert row.count("|") == 12, row  # every column filled
    assert "FP4Config.occ_fold_e4m3:" in out and "`paper`'s)" in out  # the folded layer's row
    assert "Where the `paper` FP4Linear forward+backward spends its time" in out
    assert "64x64->96: whole" in out and "OCC quantile (sampled)" in out
