"""What users of litgpt / HF / Lightning expect from `fp4lightning train`, through the real
Trainer on real text: recipe precisions as the Trainer's, a token budget, logger choice, MFU and
TFLOP/s in the logs, resume reporting a changed schedule, and starting from existing weights
(init.from_checkpoint / init.from_hf, `fp4lightning import-hf`, export-hf of what it wrote)."""
from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from fp4lightning.cli import main as cli_main
from fp4lightning.train.recipe import RecipeError, load_recipe
from fp4lightning.train.run import train
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


class Probe(L.Callback):
    """The precision plugin in use, the model's weights at the first step, and the losses."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_start(self, trainer, pl_module):
        self.plugin = trainer.precision_plugin
        self.start = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _csv_rows(out: Path) -> list[dict]:
    rows = []
    for path in sorted((out / "logs" / "csv").glob("version_*/metrics.csv")):
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    return rows


def test_recipe_precisions_token_budget_loggers_and_mfu(corpus, tmp_path):
    from fp4lightning.lightning.precision import FP4Precision

    for p in ("fp4-fp16", "fp4-bf16", "bf16-true", "16-mixed"):
        assert load_recipe(None, [f"trainer.precision={p}"]).trainer.precision == p
    with pytest.raises(RecipeError, match="`trainer.loggers` = 'mlflow'"):
        load_recipe(None, ["trainer.loggers=csv,mlflow"])
    # 1000 tokens at 4 x 64 tokens per step: 4 steps
    out = tmp_path / "run"
    probe = Probe()
    cfg = load_recipe(None, tiny_overrides(corpus, out, "schedule.max_tokens=1000", "trainer.precision=fp4-fp16",
                                           "trainer.loggers=csv", "trainer.peak_tflops=0.002",
                                           "trainer.val_every_n_steps=100"))
    assert cfg.schedule.max_steps == 4
    train(cfg, callbacks=[probe])
    assert isinstance(probe.plugin, FP4Precision) and probe.plugin.precision == "fp4-fp16"
    assert probe.plugin.loss_scale is not None and len(probe.losses) == 4
    assert not (out / "logs" / "tensorboard").exists()
    rows = [r for r in _csv_rows(out) if r.get("train/mfu")]
    assert len(rows) == 3  # every step but the first (no interval to time yet)
    from fp4lightning.train.throughput import flops_per_token

    ratios = []
    for r in rows:
        tflops, mfu, tps = float(r["train/tflops"]), float(r["train/mfu"]), float(r["train/tokens_per_sec"])
        assert mfu == pytest.approx(tflops / 0.002, rel=1e-5)
        assert tflops > 0 and tps > 0
        ratios.append(tflops * 1e12 / flops_per_token(cfg.llama_config(), 64) / tps)
    # the same steps timed twice (module and callback, at slightly different points of a step of a
    # few ms): tokens/s x FLOPs/token agree; the median, since one step's two intervals can differ
    # by a scheduling hiccup on a loaded machine
    assert sorted(ratios)[len(ratios) // 2] == pytest.approx(1.0, rel=0.5), ratios


def test_resume_reports_schedule_change_and_init_from_weights(corpus, tmp_path, capsys):
    pytest.importorskip("transformers")
    base = tmp_path / "base"
    train(load_recipe(None, tiny_overrides(corpus, base, "schedule.max_steps=4", "trainer.loggers=csv",
                                           "trainer.val_every_n_steps=100", "trainer.checkpoint_every_n_steps=2")))
    capsys.readouterr()
    # resume with a longer schedule and another peak LR: the change and its effect on the LR are
    # printed, and the resumed steps run at the LRs printed (the checkpoint's restored LRs must not win)
    cfg = load_recipe(None, tiny_overrides(corpus, base, "schedule.max_steps=6", "optimizer.lr=0.02",
                                           "trainer.loggers=csv", "trainer.val_every_n_steps=100"))
    train(cfg, resume=True)
    printed = capsys.readouterr().out
    assert "resume: schedule.max_steps changed 4 -> 6 since the checkpoint" in printed
    assert "resume: optimizer.lr changed" in printed and "-> 0.02 since the checkpoint" in printed
    said = re.search(r"the first resumed step, 5, runs at LR ([0-9.e+-]+) \(the checkpoint's schedule would give "
                     r"[0-9.e+-]+\); it decays to 2\.000e-03 by step 6", printed)
    assert said, printed[printed.find("resuming"):][:800]
    from fp4lightning.train.module import warmup_cosine

    warmup = max(1, math.ceil(cfg.schedule.warmup_fraction * 6))
    logged = {int(r["step"]): float(r["train/lr"]) for r in _csv_rows(base) if r.get("train/lr")}
    for step in (5, 6):  # the two resumed steps, each at the LR the scheduler gives after step - 1 steps
        assert logged[step] == pytest.approx(0.02 * warmup_cosine(step - 1, 6, warmup, cfg.schedule.min_lr_ratio),
                                             rel=1e-6), (step, logged)
    assert logged[5] == pytest.approx(float(said.group(1)), rel=1e-3)

    # HF folder -> import-hf -> checkpoint -> init.from_checkpoint, and init.from_hf directly
    ckpt = base / "checkpoints" / "last.ckpt"
    hf_dir = tmp_path / "hf"
    assert cli_main(["export-hf", str(ckpt), str(hf_dir)]) == 0
    imported = tmp_path / "imported.ckpt"
    assert cli_main(["import-hf", str(hf_dir), str(imported)]) == 0
    printed = capsys.readouterr().out
    assert f"init.from_checkpoint={imported}" in printed and "tokenizer: included" in printed
    from fp4lightning.train.checkpoint import load_checkpoint

    want = load_checkpoint(ckpt).model.state_dict()
    for key in (f"init.from_checkpoint={imported}", f"init.from_hf={hf_dir}"):
        probe = Probe()
        train(load_recipe(None, tiny_overrides(corpus, tmp_path / key.split("=")[0], key, "schedule.max_steps=1",
                                               "trainer.loggers=csv", "trainer.val_every_n_steps=100")),
              callbacks=[probe])
        assert probe.start.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(probe.start[k], want[k], rtol=0, atol=0, msg=f"{key}: {k}")
    # export-hf takes what import-hf wrote
    assert cli_main(["export-hf", str(imported), str(tmp_path / "hf2")]) == 0
    # a recipe whose model does not match the weights names the keys to set
    with pytest.raises(RecipeError, match=r"differs from the recipe's in dim.*set model.dim=64"):
        train(load_recipe(None, tiny_overrides(corpus, tmp_path / "bad", f"init.from_hf={hf_dir}", "model.dim=128",
                                               "model.ffn_dim=352")))
