"""``benchmarks/bench_train.py`` runs a recipe's training step end to end on CPU and reports every row
(no timings are checked: no timed tests). On a GPU the same script fills docs/perf's step figures."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_train.py")
ROWS = ("bf16-mixed", "torchao-float8", "fp4", "w4a4-direct")


def _run(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", FP4LIGHTNING_COMPILE="0")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_step_benchmark_on_the_tiny_recipe_prints_every_row_and_writes_json(tmp_path):
    out = tmp_path / "step.json"
    # a recipe override (two blocks) keeps it quick and shows key=value reaches the recipe
    proc = _run("--recipe", "recipes/tiny.yaml", "--steps", "2", "--micro-batch", "1", "--seq", "32",
                "--peak-tflops", "1", "--json", str(out), "model.n_layers=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = {line.split("|")[1].strip().split(" ")[0]: line for line in lines if line.startswith("| ")}
    for name in ("bf16-mixed", "fp4", "w4a4-direct"):
        cells = [c.strip() for c in table[name].split("|")[1:-1]]
        assert len(cells) == 12 and all(cells), table[name]
        assert cells[1] == "1"  # the micro-batch given
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0  # step ms, tokens/s, MFU
        assert "scaled_dot_product" in cells[11]  # the attention kernel SDPA dispatched to
    assert "skipped: needs an FP8 GPU" in table["torchao-float8"]
    assert "fp4 (paper)" in table["fp4"]
    assert any("peak 1 TFLOP/s" in line for line in lines)
    assert any("analytic: params + grads + optimizer state + saved activations" in line for line in lines)

    data = json.loads(out.read_text())
    assert set(ROWS) <= set(data) and data["torchao-float8"] == {"skipped": "needs an FP8 GPU"}
    for name in ("bf16-mixed", "fp4", "w4a4-direct"):
        row = data[name]
        for key in ("tokens_per_s", "peak_mem_gb", "mfu", "step_ms", "micro_batch", "split_ms"):
            assert key in row, (name, key)
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0 and row["mfu"] > 0
        assert set(row["split_ms"]) == {"linears", "attention", "other", "optimizer"}
        # the hooks split one step: every part took time; the FP4 rows' linears are FP4Linear
        assert all(v > 0 for v in row["split_ms"].values()), row["split_ms"]
    # FP4 saves its activations as packed codes: fewer bytes than bf16 for the same model and batch
    assert data["fp4"]["saved_activation_bytes"] < data["bf16-mixed"]["saved_activation_bytes"]
    assert data["setup"]["seq_len"] == 32 and data["setup"]["peak_tflops"] == 1


def test_unknown_row_is_a_one_line_error():
    proc = _run("--precisions", "bf16-mixed,fp5", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --precisions: ['fp5'] not among bf16-mixed, torchao-float8, fp4, w4a4-direct"]
