"""The GPU check's stages on CPU (scripts/gpu_check.sh, scripts/gpu_stage.py, scripts/gpu_pack.sh).

A GPU session has minutes, so what can break without a GPU is checked here:

* packaging: with the GPU machine's package set (this venv's packages minus those the GPU image
  lacks: omegaconf, torchao, lm-eval; fp4lightning not installed), the carried wheels installed the
  way the check installs them make every module, benchmark script, recipe and data folder of the
  four stages importable (skipped until ``bash scripts/gpu_pack.sh`` has built ``.whl/``);
* the record: a step's figures reach ``docs/perf/h200.json`` (and ``$OUT``) while it runs, a step
  cut off by its limit keeps them and the other stages' parts, and the layer table carries the
  roofline's prediction beside each figure;
* the stage names ``gpu_check.sh`` takes.
"""
import csv
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHEELS = sorted((ROOT / ".whl").glob("*.whl"))
#: distributions this venv has and the GPU machine's image does not (docs/perf.md, "GPU check")
NOT_IN_GPU_IMAGE = ("omegaconf", "antlr4", "torchao", "lm_eval", "fp4lightning", "__editable__")


def _stage_module():
    spec = importlib.util.spec_from_file_location("gpu_stage_under_test", ROOT / "scripts" / "gpu_stage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def stage(tmp_path, monkeypatch):
    mod = _stage_module()
    monkeypatch.setattr(mod, "RECORD", tmp_path / "h200.json")
    monkeypatch.setenv("GPU_CHECK_TMP", str(tmp_path / "work"))
    monkeypatch.setenv("OUT", str(tmp_path))
    return mod


def _gpu_image_site(tmp_path: Path) -> Path:
    """This venv's site-packages without what the GPU image lacks (links, no .pth files: run with -S)."""
    site, shadow = Path(sysconfig.get_paths()["purelib"]), tmp_path / "gpu-image-site"
    shadow.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if entry.suffix == ".pth" or name.startswith(NOT_IN_GPU_IMAGE) or name.startswith("__pycache__"):
            continue
        (shadow / entry.name).symlink_to(entry)
    return shadow


@pytest.mark.skipif(not WHEELS, reason="no .whl/*.whl: run `bash scripts/gpu_pack.sh` to build the carried wheels")
def test_every_stage_imports_with_the_gpu_package_set_and_the_carried_wheels(tmp_path):
    shadow, target = _gpu_image_site(tmp_path), tmp_path / "site"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(shadow))
    hidden = subprocess.run([sys.executable, "-S", "-c", "import omegaconf"], env=env, capture_output=True, text=True)
    assert hidden.returncode != 0 and "No module named 'omegaconf'" in hidden.stderr  # the GPU image, as simulated
    # the carried wheels, installed as scripts/gpu_check.sh installs them
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_stage.py"), "wheels", "--target", str(target)],
                   check=True, env=env, cwd=tmp_path)
    env["PYTHONPATH"] = f"{target}{os.pathsep}{shadow}"
    got = subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "gpu_stage.py"), "imports", "checks", "layers",
                          "step", "train"], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "imports of checks, layers, step, train: ok" in got.stdout
    assert "torchao.float8 does not import" not in got.stdout  # the float8 rows will run


def test_a_step_writes_its_figures_as_it_runs_and_a_cut_keeps_them(stage, tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "MIN_STEP_S", 0.5)
    monkeypatch.setattr(stage, "POLL_S", 0.1)
    stage.update("checks", {"status": "passed"})  # an earlier stage's part
    out = tmp_path / "rows.json"
    child = ("import json, sys, time\n"
             f"open({str(out)!r}, 'w').write(json.dumps({{'rows': 1}}))\n"
             "print('row 1 measured', flush=True)\n"
             "time.sleep(60)\n")
    st = stage.Stage("layers", budget_s=30)

    def poll():
        got = stage._read_json(out)
        return None if got is None else ("layers/table", got)

    assert st.run("table", [sys.executable, "-c", child], 2.0, poll=poll) is not None
    rec = json.loads((tmp_path / "h200.json").read_text())
    assert rec["checks"] == {"status": "passed"}
    assert rec["layers"]["table"] == {"rows": 1}
    run = rec["layers"]["runs"]["table"]
    assert run["status"] == "timed out" and run["seconds"] < 20 and "row 1 measured" in run["tail"]
    assert st.finish() == 2 and stage.read_record()["layers"]["status"] == "incomplete"
    assert json.loads((tmp_path / "h200.json").read_text()) == json.loads(Path(os.environ["OUT"], "h200.json").read_text())


def test_a_failing_step_fails_the_stage_and_a_step_without_time_is_skipped(stage, monkeypatch):
    monkeypatch.setattr(stage, "MIN_STEP_S", 5)
    monkeypatch.setattr(stage, "POLL_S", 0.1)
    st = stage.Stage("checks", budget_s=12)
    assert st.run("crash", [sys.executable, "-c", "raise SystemExit(3)"], 30) == 3
    assert st.run("late", [sys.executable, "-c", "pass"], 30) is None or st.remaining() > 10
    st.budget_s = 0
    assert st.run("later", [sys.executable, "-c", "pass"], 30) is None
    runs = stage.read_record()["checks"]["runs"]
    assert runs["crash"]["status"] == "failed" and runs["later"]["status"] == "skipped"
    assert st.finish() == 1


def test_layer_table_carries_the_roofline_prediction_beside_each_figure(stage):
    table = {"paths": ["scaled_mm", "triton"], "device": "NVIDIA H200",
             "layers": {"4096x4096": {"bf16": 1.0, "w4a4-direct": 0.6, "paper": 0.8, "torchao-float8": None,
                                      "w4a4-direct triton": 2.3}}}
    pred = {"shapes": {"4096x4096": {"bf16": {"launches": 8, "pred_ms": 1.2},
                                     "w4a4-direct": {"launches": 12, "pred_ms": 0.78},
                                     "paper": {"launches": 16, "pred_ms": 0.9},
                                     "torchao-float8": {"launches": 13, "pred_ms": 0.96}}}}
    cells = stage.with_predictions(table, pred)["layers"]["4096x4096"]
    assert cells["w4a4-direct"] == {"ms": 0.6, "x_bf16": 0.6, "pred_ms": 0.78, "pred_x_bf16": 0.65,
                                    "pred_launches": 12}
    assert cells["torchao-float8"]["ms"] is None and cells["torchao-float8"]["pred_ms"] == 0.96
    assert cells["w4a4-direct triton"]["pred_ms"] is None  # the roofline models the default path only
    unpredicted = stage.with_predictions(table, None)["layers"]["4096x4096"]
    assert all(c["pred_ms"] is None for c in unpredicted.values())
    # on a GPU without the scaled_mm path the unsuffixed FP4 rows ran on Triton: no prediction for them
    triton_only = stage.with_predictions({**table, "paths": ["triton"]}, pred)["layers"]["4096x4096"]
    assert triton_only["paper"]["pred_ms"] is None and triton_only["bf16"]["pred_ms"] == 1.2


def test_train_metrics_read_as_lightning_logs_them(stage, tmp_path):
    log = tmp_path / "run" / "logs" / "csv" / "version_0" / "metrics.csv"
    log.parent.mkdir(parents=True)
    with open(log, "w", newline="") as f:
        w = csv.DictWriter(f, ["epoch", "step", "train/loss", "train/lr", "train/mfu", "train/tflops",
                               "train/tokens_per_sec"])
        w.writeheader()
        for step, tps in ((2, 900.0), (4, 30000.0), (6, 31000.0), (8, 29000.0)):
            w.writerow({"epoch": 0, "step": step, "train/loss": 10.0 - step, "train/lr": 1e-4,
                        "train/mfu": tps / 1e5, "train/tflops": 1.0, "train/tokens_per_sec": tps})
            w.writerow({"epoch": 0, "step": step, "train/lr": 1e-4})  # another logger call's row
    got = stage.train_metrics(tmp_path / "run")
    assert [x["step"] for x in got["logged"]] == [2, 4, 6, 8]
    assert got["tokens_per_s"] == 30000.0 and got["mfu"] == 0.3  # median after the compile's step
    assert stage.train_metrics(tmp_path / "nothing") is None


def test_gpu_check_takes_only_known_stages():
    for args, message in (([], "usage: bash scripts/gpu_check.sh STAGE"), (["layer"], "unknown stage 'layer'")):
        got = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True)
        assert got.returncode == 2 and message in got.stderr


def test_the_main_stages_fit_a_task_s_gpu_time_with_start_up(stage, monkeypatch):
    """The four main stages' budgets leave a lent machine's start-up (a few minutes) inside the task's
    15 minutes of GPU time, two stages fit one 600 s call, and no step's limit exceeds its stage's."""
    mod = stage
    monkeypatch.setattr(mod, "BUDGET_S", None)
    main = ("checks", "layers", "step", "train")
    assert sum(mod.STAGE_BUDGET_S[s] for s in main) <= 12 * 60
    assert mod.STAGE_BUDGET_S["checks"] + mod.STAGE_BUDGET_S["layers"] <= 540
    assert mod.STAGE_BUDGET_S["step"] + mod.STAGE_BUDGET_S["train"] <= 540
    assert sum(limit for _, limit, _ in mod.STEP_ROWS) <= mod.STAGE_BUDGET_S["step"]
    assert mod.Stage("checks").budget_s == mod.STAGE_BUDGET_S["checks"]
