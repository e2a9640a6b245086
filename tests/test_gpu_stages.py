"""The GPU check's stages on CPU (scripts/gpu_check.sh, scripts/gpu_stage.py, scripts/gpu_pack.sh).

A GPU session has minutes, so what can break without a GPU is checked here:

* packaging: with the GPU machine's package set (this venv's packages minus those the GPU image
  lacks: omegaconf, torchao, lm-eval; fp4lightning not installed), the carried wheels installed the
  way the check installs them make every module, benchmark script, recipe and data folder of the
  main stages and ``step-torchao`` importable (skipped until ``bash scripts/gpu_pack.sh`` has built
  ``.whl/``);
* the record: a step's figures reach ``docs/perf/h200.json`` (and ``$OUT``) while it runs, a step
  cut off by its limit keeps them and the other stages' parts, and the layer table carries the
  roofline's prediction beside each figure;
* the profile stage at a tiny shape on CPU, its figures in the record;
* the stage names ``gpu_check.sh`` takes, and the budgets: each step's limit over what it took on
  the H200, each stage's limits inside its budget, the two calls of the plan inside a task's GPU time.
"""
import csv
import importlib.util
import json
import os
import re
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
    got = subprocess.run([sys.executable, "-S", str(ROOT / "scripts" / "gpu_stage.py"), "imports", "profile", "layers",
                          "checks", "step", "train", "step-torchao"], env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "imports of profile, layers, checks, step, train, step-torchao: ok" in got.stdout
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


#: what steps took on the first H200 run of these stages (docs/perf.md, "GPU check"): the kernel checks
#: were cut at their 60 s limit ("total 50 s" printed, plus process start and JIT), the scaled_mm tests
#: took 44 s of 45, the 1.3B step with torchao compiled was still compiling at 140 s
H200_STEP_S = {("checks", "kernel_checks"): 60.2, ("checks", "scaled_mm_tests"): 44.0, ("layers", "table"): 54.0,
               ("step", "bf16-mixed"): 26.0, ("step", "fp4"): 34.0, ("step", "w4a4-direct"): 22.0,
               ("train", "train"): 82.0, ("step-torchao", "torchao-float8"): 140.0}
#: a limit's room over the time seen (the machine, its disk cache and the JIT vary between loans)
ROOM = 1.25


def test_each_step_s_limit_leaves_room_over_its_h200_time(stage):
    short = {f"{s}/{step}": (stage.STEP_LIMIT_S[s][step], took) for (s, step), took in H200_STEP_S.items()
             if stage.STEP_LIMIT_S[s][step] < ROOM * took}
    assert not short, f"(limit s, H200 s) under {ROOM}x: {short}"
    # the compiled torchao step has a stage of its own, outside the calls of the plan
    assert "torchao-float8" not in stage.STEP_LIMIT_S["step"] and "step-torchao" not in stage.MAIN_STAGES


def test_the_main_stages_fit_a_task_s_gpu_time_with_start_up(stage, monkeypatch):
    """The plan (``CALLS``): each call's budgets stay under the 600 s a call may run, with room for the
    wheels' install and the stages' start; the calls plus a minute of the machine's start-up stay under
    13 of the task's 15 minutes; no stage's step limits add up to more than its budget."""
    mod = stage
    monkeypatch.setattr(mod, "BUDGET_S", None)
    # first where the layers' time goes and the layer table, then correctness, the step, the user's command
    assert mod.CALLS == (("profile", "layers"), ("checks", "step", "train"))
    assert mod.MAIN_STAGES == ("profile", "layers", "checks", "step", "train")
    for call in mod.CALLS:
        assert sum(mod.STAGE_BUDGET_S[s] for s in call) <= 540, call
    assert sum(mod.STAGE_BUDGET_S[s] for s in mod.MAIN_STAGES) + 60 <= 13 * 60
    assert mod.STAGE_BUDGET_S["step-torchao"] <= 540  # an optional call of its own
    assert set(mod.STAGE_BUDGET_S) == set(mod.STEP_LIMIT_S) == set(mod.STAGES) == set(mod.KEYS) == set(mod.NEEDS)
    for name, limits in mod.STEP_LIMIT_S.items():
        assert sum(limits.values()) <= mod.STAGE_BUDGET_S[name], name
        assert min(limits.values()) >= mod.MIN_STEP_S, name
    for name, rows in mod.STEP_ROWS.items():
        assert [row for row, _ in rows] == list(mod.STEP_LIMIT_S[name]), name
    assert len(set(mod.KEYS.values())) == len(mod.KEYS)  # a stage never overwrites another's record
    assert mod.Stage("checks").budget_s == mod.STAGE_BUDGET_S["checks"]


def test_gpu_check_sh_runs_the_stages_gpu_stage_py_has():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    mod = _stage_module()
    main = re.search(r"^MAIN_STAGES=\((.*)\)$", text, re.M).group(1).split()
    every = re.search(r'^ALL_STAGES=" (.*) "$', text, re.M).group(1).split()
    assert tuple(main) == mod.MAIN_STAGES and set(every) == set(mod.STAGES)


def test_the_profile_stage_writes_each_layer_into_the_record(stage, monkeypatch):
    # the GPU's stage at a tiny shape on CPU: benchmarks/profile_linear.py as a step, its JSON polled
    monkeypatch.setattr(stage, "POLL_S", 0.2)
    monkeypatch.setattr(stage, "PROFILE_ARGS", ["--shapes", "64x128x256", "--iters", "2", "--profile-calls", "1",
                                                "--layers", "bf16,paper"])
    st = stage.Stage("profile")
    stage.stage_profile(st)
    assert st.finish() == 0
    rec = stage.read_record()["profile"]
    assert rec["status"] == "passed" and rec["runs"]["profile"]["status"] == "passed"
    assert rec["runs"]["profile"]["limit_s"] == stage.STEP_LIMIT_S["profile"]["profile"]
    layers = rec["result"]["shapes"]["128x256"]["layers"]
    assert list(layers) == ["bf16", "paper"]
    assert all(r["busy_ms"] > 0 and r["pred"]["ms"] > 0 and r["kernels"] for r in layers.values())
    assert "CPU op self time" in rec["result"]["busy_is"]
