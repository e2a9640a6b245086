"""One step counter: a run stopped three ways and resumed each time logs the same CSV rows, runs
the same validations and leaves the same checkpoint names as an uninterrupted run, all counting
optimizer steps from 1 (the numbers ``step=N.ckpt`` and ``schedule.max_steps`` use)."""
from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch

from fp4lightning.train.checkpoint import LAST_CKPT
from fp4lightning.train.loss_log import read_losses
from fp4lightning.train.run import train
from fp4lightning.train.recipe import load_recipe
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow

#: validation every 3 steps (3, 6, 9, and 10: the last step), a numbered checkpoint every 4 (4, 8)
STEPS = ("schedule.max_steps=10", "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=4")


class Stop(L.Callback):
    """Stops the run at ``step`` (optimizer steps taken), the way ``how`` says:

    * ``sigterm``: SIGTERM after the step (a validation step: Lightning validates, then stops);
    * ``interrupt``: a KeyboardInterrupt inside the next step's backward, as a second Ctrl-C
      (or Ctrl-C in a data-parallel run) stops a run at once;
    * ``ctrl-c``: a real SIGINT inside the next step's backward, which finishes that step first.
    """

    def __init__(self, step: int, how: str):
        self.step, self.how = step, how
        self.losses: dict[int, float] = {}

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step != self.step:
            return
        if self.how == "interrupt":
            raise KeyboardInterrupt
        if self.how == "ctrl-c":
            os.kill(os.getpid(), signal.SIGINT)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()
        if self.how == "sigterm" and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _rows(out: Path) -> list[int]:
    """The step of every CSV row holding a training loss, in the order written (all versions)."""
    steps = []
    for path in sorted((out / "logs" / "csv").glob("version_*/metrics.csv")):
        with open(path, newline="") as f:
            steps += [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    return steps


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("*.ckpt"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


def test_resumed_run_counts_steps_as_an_uninterrupted_run(corpus, tmp_path, capsys):
    full = Stop(-1, "")
    train(load_recipe(None, tiny_overrides(corpus, tmp_path / "full", *STEPS)), callbacks=[full])
    assert _rows(tmp_path / "full") == list(range(1, 11))
    assert sorted(read_losses(tmp_path / "full")["val"]) == [3, 6, 9, 10]
    assert _checkpoints(tmp_path / "full") == [LAST_CKPT, "step=000008.ckpt"]

    cut = tmp_path / "cut"
    cfg = load_recipe(None, tiny_overrides(corpus, cut, *STEPS))
    handler = signal.getsignal(signal.SIGINT)
    # Ctrl-C from a terminal reaches Python's default handler; a job a non-interactive shell starts
    # in the background inherits SIGINT ignored, and the run would not see it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stops = [Stop(3, "sigterm"), Stop(5, "interrupt"), Stop(6, "ctrl-c")]
    try:
        for i, stop in enumerate(stops):
            with pytest.raises(SystemExit):
                train(cfg, resume=i > 0, callbacks=[stop])
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning ignores SIGINT after a Ctrl-C
    finally:
        signal.signal(signal.SIGINT, handler)
    # the real Ctrl-C inside step 7 let step 7 finish, said so, and saved it
    assert max(stops[2].losses) == 7
    assert "Ctrl-C: stopping after this step" in capsys.readouterr().err
    assert torch.load(cut / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)["global_step"] == 7
    last = Stop(-1, "")
    train(cfg, resume=True, callbacks=[last])

    # each step's row written once, at the step's number; validations after steps 3, 6, 9 and 10
    assert _rows(cut) == list(range(1, 11))
    assert sorted(read_losses(cut)["val"]) == [3, 6, 9, 10]
    assert _checkpoints(cut) == [LAST_CKPT, "step=000008.ckpt"]
    ckpt = torch.load(cut / "checkpoints" / "step=000008.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 8
    assert ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == 8
    # and they are the same steps: the same losses
    full_losses, cut_losses = read_losses(tmp_path / "full"), read_losses(cut)
    for key in ("train", "val"):
        for step, loss in full_losses[key].items():
            assert cut_losses[key][step] == pytest.approx(loss, rel=1e-5, abs=1e-5), (key, step)


class NaNGradients(L.Callback):
    """A NaN in a gradient of every optimizer step from ``first`` on."""

    def __init__(self, first: int):
        self.first = first

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step + 1 >= self.first:
            next(pl_module.parameters()).grad.view(-1)[0] = float("nan")


def test_nonfinite_stop_names_one_step(corpus, tmp_path, capsys):
    # steps 4 and 5 are skipped, and two in a row stop the run: at step 5, says every line (the
    # banner said "stopped at step 4", the steps completed, next to the error's "the last at step 5")
    from fp4lightning.lightning.nonfinite import NonFiniteError

    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, "schedule.max_steps=8", "trainer.max_nonfinite_skips=2"))
    with pytest.raises(NonFiniteError) as e:
        train(cfg, callbacks=[NaNGradients(first=4)])
    err = capsys.readouterr().err
    assert e.value.step == 5 and "(the last at step 5)" in str(e.value)
    assert "step 4: non-finite" in err and "step 5: non-finite" in err
    assert "training stopped at step 5;" in err, err[-2000:]
