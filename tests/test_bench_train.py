"""``benchmarks/bench_train.py`` runs a recipe's training step end to end on CPU and reports every row
(no timings are checked: no timed tests). On a GPU the same script fills docs/perf's step figures.

What its figures must mean is checked: the time split is of the reported step and sums to it, every
ratio is against the named fastest high-precision row, and the spread of the timed steps is printed."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_train.py")
ROWS = ("bf16-mixed", "torchao-float8", "fp4", "w4a4-direct", "fp32")
MEASURED = ("bf16-mixed", "fp4", "w4a4-direct", "fp32")
PARTS = ("linears", "attention", "other_fwd_bwd", "optimizer")
STEPS = 3
#: the split's parts are clock readings inside the same step: they sum to it up to float rounding
SUM_TOL_MS = 0.05


def _run(*args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", FP4LIGHTNING_COMPILE="0")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One run of every row on a two-block tiny model (the recipe override also shows that key=value
    reaches the recipe): (stdout lines, the table's rows by precision, the JSON)."""
    out = tmp_path_factory.mktemp("bench") / "step.json"
    proc = _run("--recipe", "recipes/tiny.yaml", "--steps", str(STEPS), "--micro-batch", "1", "--seq", "32",
                "--peak-tflops", "1", "--json", str(out), "model.n_layers=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    table = {line.split("|")[1].strip().split(" ")[0]: [c.strip() for c in line.split("|")[1:-1]]
             for line in lines if line.startswith("| ") and not line.startswith("| precision")}
    return lines, table, json.loads(out.read_text())


def test_step_benchmark_on_the_tiny_recipe_prints_every_row_and_writes_json(tiny_run):
    lines, table, data = tiny_run
    for name in MEASURED:
        cells = table[name]
        assert len(cells) == 14 and all(cells), cells
        assert cells[1] == "1"  # the micro-batch given
        assert float(cells[3]) > 0 and float(cells[5]) > 0  # tokens/s, MFU
        assert "scaled_dot_product" in cells[13]  # the attention kernel SDPA dispatched to
    assert "skipped: needs an FP8 GPU" in table["torchao-float8"][1]
    assert table["fp4"][0] == "fp4 (paper)"
    assert any("peak 1 TFLOP/s" in line for line in lines)
    assert any("analytic: params + grads + optimizer state + saved activations" in line for line in lines)

    assert set(ROWS) <= set(data) and data["torchao-float8"] == {"skipped": "needs an FP8 GPU"}
    for name in MEASURED:
        row = data[name]
        for key in ("tokens_per_s", "peak_mem_gb", "mfu", "step_ms", "micro_batch", "split_ms"):
            assert key in row, (name, key)
        assert row["tokens_per_s"] > 0 and row["peak_mem_gb"] > 0 and row["mfu"] > 0
        assert set(row["split_ms"]) == {*PARTS, "unattributed"}
        # the hooks split the step: every part took time; the FP4 rows' linears are FP4Linear
        assert all(row["split_ms"][k] > 0 for k in PARTS), row["split_ms"]
    # FP4 saves its activations as packed codes: fewer bytes than bf16 for the same model and batch
    assert data["fp4"]["saved_activation_bytes"] < data["bf16-mixed"]["saved_activation_bytes"]
    assert data["setup"]["seq_len"] == 32 and data["setup"]["peak_tflops"] == 1


def test_time_split_sums_to_the_reported_step(tiny_run):
    """Measured inside the timed steps, not in a separate step: the parts plus ``unattributed`` are the
    median step's time, in the JSON and in the printed row; on CPU the hooks leave nothing unattributed."""
    _, table, data = tiny_run
    for name in MEASURED:
        row = data[name]
        split = row["split_ms"]
        assert abs(sum(split.values()) - row["step_ms"]) < SUM_TOL_MS, (name, split, row["step_ms"])
        assert abs(split["unattributed"]) < SUM_TOL_MS, (name, split)
        printed = [float(c) for c in table[name][7:12]]  # linears .. unattributed, rounded to 0.1 ms
        median = float(table[name][2].split(" / ")[1])
        assert abs(sum(printed) - median) <= 0.05 * 5 + 0.05, (name, printed, median)


def test_ratios_are_against_the_named_fastest_high_precision_row(tiny_run):
    lines, table, data = tiny_run
    fastest = max(("bf16-mixed", "fp32"), key=lambda n: data[n]["tokens_per_s"])
    assert data["setup"]["baseline"] == fastest
    header = [line for line in lines if line.startswith("# baseline: ")]
    assert header == [f"# baseline: {data['setup']['baseline_why']}"]
    assert header[0].startswith(f"# baseline: {fastest}, the faster high-precision row (median tokens/s: ")
    # why bf16 is (or is not) the fair baseline here: native or emulated GeMMs, and the CPU's features
    gemms = [line for line in lines if line.startswith("# bf16-mixed's GeMMs: ")]
    assert len(gemms) == 1 and "CPU: " in gemms[0] and "avx2" in gemms[0]
    base_tps = data[fastest]["tokens_per_s"]
    for name in MEASURED:
        ratio = data[name]["tokens_per_s"] / base_tps
        assert data[name]["vs_baseline"] == pytest.approx(ratio)
        assert table[name][4] == f"{ratio:.2f}"
        lo, hi = data[name]["vs_baseline_steps"]
        assert lo <= hi
    assert table[fastest][0] == f"{fastest} (baseline)" and table[fastest][4] == "1.00"
    closing = [line for line in lines if line.startswith("tokens/s over the baseline ")]
    assert len(closing) == 1 and closing[0].startswith(f"tokens/s over the baseline {fastest} (")
    assert f"fp4 {data['fp4']['vs_baseline']:.2f}x (per step " in closing[0]


def test_min_median_max_of_the_timed_steps_are_printed(tiny_run):
    _, table, data = tiny_run
    for name in MEASURED:
        row = data[name]
        assert len(row["steps_ms"]) == STEPS
        lo, med, hi = (float(v) for v in table[name][2].split(" / "))
        assert lo <= med <= hi
        assert (lo, med, hi) == tuple(round(v, 1) for v in (min(row["steps_ms"]), row["step_ms"], max(row["steps_ms"])))
        assert row["step_ms"] in row["steps_ms"]  # the median is a measured step (whose split is reported)


def _bench():
    spec = importlib.util.spec_from_file_location("bench_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_baseline_choice_and_its_reason():
    bench = _bench()
    rows = {"bf16-mixed": {"tokens_per_s": 900.0}, "fp4": {"tokens_per_s": 1200.0}, "fp32": {"tokens_per_s": 1000.0}}
    assert bench.choose_baseline(rows) == ("fp32", "fp32, the faster high-precision row "
                                                   "(median tokens/s: bf16-mixed 900, fp32 1000)")
    base, why = bench.choose_baseline({"bf16-mixed": {"tokens_per_s": 900.0}, "fp4": {"tokens_per_s": 1200.0}})
    assert base == "bf16-mixed" and "add fp32 to --precisions" in why
    assert bench.choose_baseline({"fp4": {"tokens_per_s": 1.0}})[0] is None


def test_bf16_gemms_line_says_emulated_or_native(monkeypatch):
    bench = _bench()
    cpu = torch.device("cpu")
    monkeypatch.setenv("FP4LIGHTNING_CPU_BF16_GEMM", "emulate")
    assert bench.bf16_gemms(cpu).startswith("emulated: emulate_bf16_linears")
    monkeypatch.setenv("FP4LIGHTNING_CPU_BF16_GEMM", "native")
    assert bench.bf16_gemms(cpu).startswith("native: oneDNN bf16 kernels")


def test_unknown_row_is_a_one_line_error():
    proc = _run("--precisions", "bf16-mixed,fp5", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --precisions: ['fp5'] not among bf16-mixed, torchao-float8, fp4, w4a4-direct, fp32"]
