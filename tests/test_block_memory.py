"""benchmarks/bench_block_memory.py: what one decoder block saves for its backward, nn.Linear against
FP4Linear (the 1.3B step's memory on the H200, issue 47). No timing is checked."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_block_memory", ROOT / "benchmarks" / "bench_block_memory.py")
bbm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bbm)


def test_fp4_blocks_save_less_than_bf16_eagerly():
    got = bbm.measure("tiny", ("bf16", "w4a4-direct", "paper"), ("eager",), (64, 128), torch.device("cpu"))["eager"]
    bf16 = got["bf16"]
    # tiny: dim 192, ffn 512; nn.Linear saves autocast's bf16 copy of each fp32 input (q, k, v, gate, up)
    # and its bf16 weights; FP4Linear the packed E2M1 codes (half a byte) and scales
    for layer in ("w4a4-direct", "paper"):
        assert got[layer]["per_token_kb"] < bf16["per_token_kb"] - 1.5, got
        assert got[layer]["fixed_mb"] < bf16["fixed_mb"] / 3, got
    weights = sum(p.numel() for n, p in bbm._build("tiny", "bf16", "eager", torch.device("cpu"))[1].named_parameters()
                  if n.endswith("proj.weight"))
    assert bf16["fixed_mb"] == pytest.approx(2 * weights / 1e6, abs=0.02)  # autocast's bf16 weights
    assert bf16["saved_mb"][1] > bf16["saved_mb"][0] > 0


def test_projection_is_blocks_times_the_step():
    result = {"eager": {"bf16": {"per_token_kb": 10.0, "fixed_mb": 100.0},
                        "paper": {"per_token_kb": 12.0, "fixed_mb": 20.0}}}
    # 24 x (1000 tokens x 2 kB - 80 MB) = 24 x (-78 MB)
    assert bbm.project(result, 24, 1000) == {"eager": {"paper": pytest.approx(-1.872, abs=0.005)}}


def test_command_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "mem.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_block_memory.py"), "--model", "tiny", "--modes", "eager",
           "--layers", "bf16,w4a4-direct", "--tokens", "32,64", "--step-tokens", "1024", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["blocks"] == 4 and record["tokens"] == [32, 64] and set(record["saved"]["eager"]) == {"bf16", "w4a4-direct"}
    assert record["step_difference_gb"]["eager"]["w4a4-direct"] < 0
    assert "eager: w4a4-direct saves" in proc.stdout
    bad = subprocess.run(cmd[:2] + ["--modes", "jit"], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "unknown layer or mode ['jit']" in bad.stderr
    bad = subprocess.run(cmd[:2] + ["--memory-budget", "1.5"], capture_output=True, text=True, env=env, timeout=120,
                         cwd=ROOT)
    assert bad.returncode == 2 and "--memory-budget 1.5: give a fraction from 0 to 1" in bad.stderr
