"""Nothing lost, nothing silent: non-finite steps, atomic checkpoints, resume fallbacks, exit codes.

Every test drives the real Trainer / CLI on CPU with the tiny test model (tests/test_train.py).
Faults are injected the way they happen: a NaN put into a gradient, into dY, into an
activation or into the embedding output by hooks on the real model; a process killed with
SIGKILL while it writes a checkpoint; an ENOSPC raised by the write path of the real
checkpoint writer.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from fp4lightning.checkpoint import AtomicCheckpointIO, CheckpointError, read_checkpoint
from fp4lightning.cli import main as cli_main
from fp4lightning.nonfinite import NonFiniteError, NonFiniteGuard
from fp4lightning.recipe import load_recipe
from fp4lightning.train import EXIT_NONFINITE, LAST_CKPT, build, train
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
STAGES = ("gradient", "dY", "activation", "embedding")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


class Injector(L.Callback):
    """Puts an inf/NaN into one stage of a step: ``plan`` maps optimizer step -> stage.

    ``from_step``: poison every step from there on (stage ``gradient``); ``rank``: only on that rank.
    Records every step's parameters and optimizer state (the tiny model is ~0.1M parameters).
    """

    def __init__(self, plan: dict[int, str] | None = None, from_step: int | None = None, rank: int | None = None):
        self.plan, self.from_step, self.rank = dict(plan or {}), from_step, rank
        self.params: dict[int, list[torch.Tensor]] = {}
        self.opt: dict[int, list[torch.Tensor]] = {}

    def _stage(self, trainer) -> str | None:
        if self.rank is not None and trainer.global_rank != self.rank:
            return None
        step = trainer.global_step + 1  # the step being computed
        if self.from_step is not None and step >= self.from_step:
            return "gradient"
        return self.plan.get(step)

    def on_train_start(self, trainer, pl_module):
        model = pl_module.model
        self.params[0] = [p.detach().clone() for p in model.parameters()]

        def poison_output(stage):
            def hook(module, args, out):
                if self._stage(trainer) == stage:
                    out = out.clone()
                    out.view(-1)[0] = float("nan")
                return out
            return hook

        def poison_dy(module, grad_output):
            if self._stage(trainer) == "dY":
                g = grad_output[0].clone()
                g.view(-1)[0] = float("inf")
                return (g,)
            return None

        model.embed_tokens.register_forward_hook(poison_output("embedding"))
        model.layers[0].register_forward_hook(poison_output("activation"))
        model.layers[-1].mlp.down_proj.register_full_backward_pre_hook(poison_dy)

    def on_after_backward(self, trainer, pl_module):
        if self._stage(trainer) == "gradient":
            p = next(p for p in pl_module.model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.params[step] = [p.detach().clone() for p in pl_module.model.parameters()]
        state = trainer.optimizers[0].state
        self.opt[step] = [v.detach().clone() for s in state.values() for v in s.values() if torch.is_tensor(v)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _all_finite(ckpt_path: Path) -> bool:
    ckpt, _ = read_checkpoint(ckpt_path)
    return all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def _logged_skips(out: Path) -> list[float]:
    rows = []
    for path in (out / "logs" / "csv").glob("version_*/metrics.csv"):
        with open(path, newline="") as f:
            rows += [float(r["train/nonfinite_skips"]) for r in csv.DictReader(f) if r.get("train/nonfinite_skips")]
    return rows


def _fit_with_trainer(corpus: Path, out: Path, precision: str, callbacks: list, max_steps: int):
    """fp4lightning.Trainer(precision=...) with the same module, data and checkpointing as the CLI."""
    from fp4lightning.trainer import Trainer

    cfg = load_recipe(None, tiny_overrides(corpus, out, f"schedule.max_steps={max_steps}"))
    _, module, dm, _ = build(cfg)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)
    trainer = Trainer(precision=precision, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, plugins=[AtomicCheckpointIO()], callbacks=[ckpt, *callbacks])
    trainer.fit(module, datamodule=dm)
    return trainer


# ------------------------------------------------------------------ 1. non-finite steps
PLAN = {2: "gradient", 3: "dY", 5: "activation", 6: "embedding"}


@pytest.mark.parametrize("precision", ["fp4", "fp4-bf16", "fp4-fp16"])
def test_nonfinite_step_is_skipped_at_every_stage(corpus, tmp_path, precision, one_thread):
    inj = Injector(PLAN)
    if precision == "fp4":  # the recipe's default precision, through fp4lightning.train
        cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, "schedule.max_steps=7"))
        result = train(cfg, callbacks=[inj])
        assert not result.interrupted
        assert _logged_skips(tmp_path)[-1] == len(PLAN)
        plugin_counter = None
    else:
        trainer = _fit_with_trainer(corpus, tmp_path, precision, [inj], max_steps=7)
        plugin_counter = trainer.precision_plugin.nonfinite
        assert plugin_counter.total == len(PLAN) and plugin_counter.consecutive == 0
    for step in range(1, 8):
        if step in PLAN:  # skipped: weights and optimizer state exactly as before
            assert _same(inj.params[step], inj.params[step - 1]), (precision, PLAN[step])
            assert _same(inj.opt[step], inj.opt[step - 1]), (precision, PLAN[step])
        else:
            assert not _same(inj.params[step], inj.params[step - 1]), (precision, step)
    assert all(torch.isfinite(p).all() for p in inj.params[7])
    assert _all_finite(tmp_path / "checkpoints" / LAST_CKPT)


def test_persistent_nonfinite_stops_naming_step_and_checkpoint(corpus, tmp_path, capsys, one_thread):
    # a good checkpoint at step 2, then every step from 4 on is poisoned: stop after 3 skips, at step 6
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, "schedule.max_steps=20",
                                           "trainer.checkpoint_every_n_steps=2", "trainer.max_nonfinite_skips=3"))
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row.*step 6") as e:
        train(cfg, callbacks=[Injector(from_step=4)])
    assert e.value.step == 6
    err = capsys.readouterr().err
    # the banner counts completed steps: step 6 never completed
    assert "training stopped at step 5" in err and "latest checkpoint" in err and "--resume" in err
    assert "finished after" not in err
    ckpts = list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert ckpts and all(_all_finite(p) for p in ckpts)
    assert read_checkpoint(tmp_path / "checkpoints" / LAST_CKPT)[0]["global_step"] <= 6


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    io = AtomicCheckpointIO()
    good = {"state_dict": {"w": torch.ones(3)}, "global_step": 1}
    io.save_checkpoint(good, tmp_path / "last.ckpt")
    bad = {"state_dict": {"w": torch.tensor([1.0, float("nan"), 2.0])}, "global_step": 2}
    with pytest.raises(NonFiniteError, match=r"last.ckpt: weight w holds inf/NaN"):
        io.save_checkpoint(bad, tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1


DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    sys.path.insert(0, {root!r})
    from fp4lightning.nonfinite import NonFiniteError
    from fp4lightning.recipe import load_recipe
    from fp4lightning.train import train, EXIT_NONFINITE
    from tests.test_reliability import Injector
    from tests.test_train import tiny_overrides

    corpus, out = sys.argv[1], sys.argv[2]
    cfg = load_recipe(None, tiny_overrides(corpus, out, "trainer.devices=2", "trainer.strategy=ddp",
                                           "data.global_batch_size=8", "schedule.max_steps=20",
                                           "trainer.checkpoint_every_n_steps=2", "trainer.max_nonfinite_skips=3"))
    # rank 1 alone: a NaN in a gradient after synchronisation at step 2, then every step from 4 on
    inj = Injector({{2: "gradient", 3: "embedding"}}, from_step=5, rank=1)
    code = 0
    try:
        train(cfg, callbacks=[inj])
    except NonFiniteError as e:
        code = EXIT_NONFINITE
        msg = str(e)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    digest = {{s: float(sum(p.double().sum() * (i + 1) for i, p in enumerate(ps))) for s, ps in inj.params.items()}}
    Path = __import__("pathlib").Path
    Path(out, f"rank{{rank}}.json").write_text(json.dumps({{"digest": digest, "msg": msg if code else ""}}))
    sys.exit(code)
""")


def test_ddp_ranks_skip_and_stop_together(corpus, tmp_path):
    script = tmp_path / "ddp_nonfinite.py"
    script.write_text(DDP_SCRIPT.format(root=str(ROOT)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == EXIT_NONFINITE, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["digest"] == r1["digest"]  # identical weights on both ranks at every step
    d = r0["digest"]
    assert d["2"] == d["1"] and d["3"] == d["2"] and d["4"] != d["3"]  # steps 2 and 3 skipped on both ranks
    for r in (r0, r1):
        assert "3 optimizer steps in a row" in r["msg"] and "step 7" in r["msg"]
    ckpts = list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert ckpts and all(_all_finite(p) for p in ckpts)
