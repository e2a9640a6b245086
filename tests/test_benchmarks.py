"""The CPU benchmark scripts run end to end (no timings are checked: no timed tests).

``benchmarks/bench_linear.py`` produces the FP4Linear figures in docs/perf.md; a script that
breaks would otherwise first show when someone reruns it for the docs.
"""
import os
import subprocess
import sys

import pytest
import torch

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


@pytest.mark.slow
def test_bench_linear_layer_table_writes_its_json(tmp_path):
    # the per-layer table scripts/gpu_check.sh measures on a GPU (docs/perf/h200.json), in its CPU
    # form: the scaled_mm and reference paths at a tiny shape
    import json
    out = tmp_path / "table.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("FP4LIGHTNING_BACKEND", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_linear.py"), "--layer-table",
                           "--shapes", "32x32x48", "--iters", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert {"date", "commit", "torch", "triton", "layers"} <= set(rec)
    row = rec["layers"]["32x48"]
    assert list(row) == ["bf16", "w4a4-direct", "paper", "torchao-float8", "w4a4-direct reference",
                         "paper reference"]
    assert all(v is None or v > 0 for v in row.values()) and row["bf16"] > 0 and row["paper"] > 0
    assert proc.stdout.count("| 32x48 | 32 |") == 6  # every row printed as it was measured


def test_bench_weight_reuse_runs_and_checks_its_bits(tmp_path):
    # scripts/gpu_check.sh times it on the 1.3B recipe's MLP shape; here a tiny shape on CPU
    import json
    out = tmp_path / "reuse.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_weight_reuse.py"), "--device", "cpu",
                           "--tokens", "16", "--in-features", "64", "--out-features", "32", "--accum", "2",
                           "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["same_bits"] is True and got["accum"] == 2 and "quantized once per step" in proc.stdout


def test_bench_comm_codec_times_the_fp8_hooks_buckets():
    """``bench_comm.py --codec`` runs the W = 2 FP8 hook's encode and decode on the model's DDP buckets
    and prints one row per model; the buckets hold every parameter once, in reverse order, cut at 25 MiB."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_comm
    from fp4lightning.models.llama import Llama, llama_config

    overrides, _, seq = bench_comm.MODELS["mid"]
    with torch.device("meta"):
        sizes = [p.numel() for p in Llama(llama_config("tiny", max_seq_len=seq, **overrides)).parameters()]
    buckets = bench_comm._buckets("mid")
    assert [n for b in buckets for n in b] == sizes[::-1] and len(buckets) > 1
    assert all(4 * sum(b) >= 25 * 2**20 for b in buckets[:-1])
    env = dict(os.environ, OMP_NUM_THREADS="1", FP4LIGHTNING_COMPILE="0")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_comm.py"), "--codec",
                           "--models", "tiny", "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = [line for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert len(row) == 1 and float(row[0].split("|")[5]) > 0, proc.stdout
