"""End-to-end training with the real Lightning Trainer on real text: loss goes down,
stop + resume equals an uninterrupted run, interrupted runs leave resumable checkpoints,
checkpoints load back and export to Hugging Face, and the CLI reports bad input."""
from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from fp4lightning.train.checkpoint import LAST_CKPT, CheckpointError, load_checkpoint
from fp4lightning.cli import main as cli_main
from fp4lightning.train.recipe import load_recipe
from fp4lightning.train.run import train
from tests.test_data import prepared_test_corpus

pytestmark = pytest.mark.slow

#: minimum drop of the training loss over 20 steps (nats; mean of the last 3 vs the first 3 steps)
LOSS_DROP = 0.5


def tiny_overrides(data_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    """A ~0.1M-parameter LLaMA on 64-token windows: a few ms per step on CPU."""
    return [
        f"data.dir={data_dir}", f"out_dir={out_dir}", "data.source=tests",
        "model.vocab_size=512", "model.dim=64", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
        "model.ffn_dim=176", "model.max_seq_len=64",
        "data.seq_len=64", "data.micro_batch_size=4", "data.global_batch_size=4", "data.val_batches=2",
        "schedule.max_steps=20", "optimizer.lr=1e-2",
        "trainer.accelerator=cpu", "trainer.val_every_n_steps=10", "trainer.checkpoint_every_n_steps=10",
        # one thread: these matrices are too small to split, and 2 workers share 2 cores
        "trainer.log_every_n_steps=1", "trainer.num_threads=1", *extra,
    ]


class LossRecorder(L.Callback):
    """Per-optimizer-step training loss (accumulation is 1 in these runs); optionally sends
    this process a real signal after step ``stop_at``, which Lightning handles."""

    def __init__(self, stop_at: int | None = None, sig: int = signal.SIGTERM):
        self.losses: dict[int, float] = {}
        self.stop_at, self.sig = stop_at, sig

    def on_train_start(self, trainer, pl_module):
        from fp4lightning.nn.convert import fp4_modules

        self.fp4_layers = fp4_modules(pl_module.model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step] = outputs["loss"].item()
        if self.stop_at is not None and trainer.global_step == self.stop_at:
            os.kill(os.getpid(), self.sig)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory):
    """An uninterrupted 20-step FP4 run (shared by several tests)."""
    out = tmp_path_factory.mktemp("full")
    rec = LossRecorder()
    result = train(load_recipe(None, tiny_overrides(corpus, out)), callbacks=[rec])
    # it trained in FP4: every linear layer but the output head
    assert len(rec.fp4_layers) == 7 * 2 and "lm_head" not in rec.fp4_layers
    return result, rec.losses, out


def test_training_lowers_loss(full_run):
    result, losses, out = full_run
    assert sorted(losses) == list(range(1, 21))
    first, last = sum(losses[s] for s in range(1, 4)) / 3, sum(losses[s] for s in range(18, 21)) / 3
    assert losses[1] == pytest.approx(math.log(512), abs=0.3)  # starts near uniform over the vocabulary
    assert last < first - LOSS_DROP, losses  # measured: 0.7-0.8 nats
    assert result.val_loss is not None and result.val_loss < math.log(512) - LOSS_DROP
    # the run folder: config, tokenizer, checkpoint, CSV + TensorBoard logs, loss curve
    assert (out / "config.yaml").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "checkpoints" / LAST_CKPT).exists()
    assert list((out / "logs" / "csv").glob("version_*/metrics.csv"))
    assert list((out / "logs" / "tensorboard").glob("version_*/events.out.tfevents.*"))
    assert result.loss_png.is_file() and result.loss_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "logs" / "csv").glob("version_*/metrics.csv").__next__().read_text()
    assert "train/tokens_per_sec" in text and "val/ppl" in text


def test_last_validation_is_at_the_last_step(corpus, tmp_path, caplog, recwarn):
    # max_steps not a multiple of val_every_n_steps: Lightning validates at steps 4 and 8 only;
    # the run validates once more on its final weights (step 10), and that is the reported loss
    from fp4lightning.train.loss_log import read_losses

    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        result = train(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=10",
                                                        "trainer.val_every_n_steps=4")))
    # and none of Lightning's and torch's per-run noise reaches the user (run._quiet_lightning)
    assert caplog.records and not [r for r in caplog.records if "litlogger" in r.getMessage()]
    noise = [str(w.message) for w in recwarn if "model summary" in str(w.message) or "LeafSpec" in str(w.message)]
    assert not noise, noise
    val = read_losses(out)["val"]
    assert len(val) == 3, val
    last_step = max(val)
    assert last_step - sorted(val)[-2] == 2  # 8 -> 10, as 4 -> 8 is 4
    assert result.val_loss == pytest.approx(val[last_step])
    assert (out / "checkpoints" / LAST_CKPT).exists()


@pytest.mark.parametrize("sig,stop_at", [(signal.SIGTERM, 10), (signal.SIGINT, 7)], ids=["SIGTERM", "Ctrl-C"])
def test_interrupt_and_resume_matches_uninterrupted(full_run, corpus, tmp_path, capsys, sig, stop_at):
    _, full_losses, _ = full_run
    rec = LossRecorder(stop_at=stop_at, sig=sig)
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path))
    sigint_handler = signal.getsignal(signal.SIGINT)
    # a user's terminal delivers Ctrl-C to Python's default handler; a job started in the
    # background by a non-interactive shell inherits SIGINT ignored, and the test would not see it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # SIGTERM: Lightning raises SIGTERMException after the batch; Ctrl-C: KeyboardInterrupt,
        # then sys.exit(1). Either way ModelCheckpoint(save_on_exception=True) saves first.
        with pytest.raises(SystemExit):
            train(cfg, callbacks=[rec])
    finally:
        signal.signal(signal.SIGINT, sigint_handler)  # Lightning ignores SIGINT after a Ctrl-C
    assert max(rec.losses) == stop_at
    assert "--resume" in capsys.readouterr().err
    ckpt = torch.load(tmp_path / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == stop_at
    rec2 = LossRecorder()
    train(cfg, resume=True, callbacks=[rec2])
    assert sorted(rec2.losses) == list(range(stop_at + 1, 21))
    resumed = {**rec.losses, **rec2.losses}
    for step in range(1, 21):  # same data order, weights, optimizer and schedule state
        assert resumed[step] == pytest.approx(full_losses[step], rel=1e-6, abs=1e-6), step


class MicroBatchRecorder(L.Callback):
    """Loss of every micro-batch, keyed by its index in the run; SIGTERM after optimizer step ``stop_at``."""

    def __init__(self, stop_at: int | None = None):
        self.losses: dict[int, float] = {}
        self.stop_at = stop_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[batch_idx] = outputs["loss"].item()
        at_boundary = (batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if self.stop_at is not None and at_boundary and trainer.global_step == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_resume_with_gradient_accumulation(corpus, tmp_path):
    extra = ("data.global_batch_size=8", "schedule.max_steps=8", "trainer.checkpoint_every_n_steps=100")
    full = MicroBatchRecorder()
    train(load_recipe(None, tiny_overrides(corpus, tmp_path / "full", *extra)), callbacks=[full])
    assert sorted(full.losses) == list(range(16))  # 8 steps x 2 micro-batches
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path / "cut", *extra))
    first = MicroBatchRecorder(stop_at=3)
    with pytest.raises(SystemExit):
        train(cfg, callbacks=[first])
    second = MicroBatchRecorder()
    train(cfg, resume=True, callbacks=[second])
    assert sorted(first.losses) == list(range(6)) and sorted(second.losses) == list(range(6, 16))
    resumed = {**first.losses, **second.losses}
    for i in range(16):
        assert resumed[i] == pytest.approx(full.losses[i], rel=1e-6, abs=1e-6), i


def test_ctrl_c_prints_the_command_that_resumes(corpus, tmp_path):
    """Ctrl-C on `fp4lightning train RECIPE key=value ...` (a real SIGINT to the installed console script,
    started by its path with the environment not on PATH, as scripts/main.sh starts it) finishes the
    step under way and prints the whole command that resumes, as typed plus --resume; that command,
    run as printed by a shell with the same PATH, finishes the run, every step logged once."""
    from fp4lightning.train.loss_log import read_losses

    recipe = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
    out = tmp_path / "my run"  # a space: the printed command must quote it
    args = ["train", str(recipe), *tiny_overrides(corpus, out, "schedule.max_steps=40", "trainer.loggers=csv")]
    venv_bin = Path(sys.executable).parent
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != venv_bin.resolve())
    env = {**os.environ, "FP4LIGHTNING_COMPILE": "0", "PATH": path}
    script = venv_bin / "fp4lightning"
    start = [str(script)] if script.exists() else [sys.executable, "-m", "fp4lightning.cli"]
    # SIGINT as a terminal delivers it: to Python's own handler even if this test runs with it ignored
    proc = subprocess.Popen([*start, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if line.startswith("step 2/40"):
            proc.send_signal(signal.SIGINT)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    assert "Ctrl-C: stopping after this step" in err, err[-3000:]
    command = err.split("resume with: ", 1)[1].splitlines()[0]
    assert shlex.split(command)[-len(args) - 1:] == [*args, "--resume"], command
    stopped = torch.load(out / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)["global_step"]
    assert f"training interrupted after step {stopped};" in err and 2 <= stopped < 40
    resumed = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, (command, resumed.stderr[-3000:])
    assert "finished after 40 steps" in resumed.stdout
    assert sorted(read_losses(out)["train"]) == list(range(1, 41))


def test_load_checkpoint_and_export_hf(full_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, _, out = full_run
    model, tok, recipe = load_checkpoint(out)  # a run folder resolves to checkpoints/last.ckpt
    assert recipe.model.dim == 64 and recipe.trainer.precision == "fp4"
    assert model.config.n_kv_heads == 1 and not model.training
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    # the FP4 variant computes with the run's FP4 layers
    fp4_model, _, _ = load_checkpoint(out / "checkpoints" / LAST_CKPT, fp4=True)
    from fp4lightning.nn.linear import FP4Linear

    assert isinstance(fp4_model.layers[0].mlp.up_proj, FP4Linear)
    assert not isinstance(fp4_model.lm_head, FP4Linear)
    # export-hf through the CLI, then transformers loads it and agrees
    assert cli_main(["export-hf", str(out), str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, logits, rtol=1e-5, atol=1e-5)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    # the export prepends BOS as training did (docs/evaluation.md)
    assert hf_tok("The quick brown fox")["input_ids"] == tok.encode("The quick brown fox")


def test_corrupt_or_missing_checkpoint_names_file(full_run, tmp_path, capsys):
    _, _, out = full_run
    good = (out / "checkpoints" / LAST_CKPT).read_bytes()
    bad = tmp_path / "broken.ckpt"
    bad.write_bytes(good[: len(good) // 3])  # a truncated copy, as after a crash mid-write
    with pytest.raises(CheckpointError, match="broken.ckpt.*corrupt"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="nope.ckpt not found"):
        load_checkpoint(tmp_path / "nope.ckpt")
    assert cli_main(["export-hf", str(bad), str(tmp_path / "hf")]) == 2
    assert "broken.ckpt" in capsys.readouterr().err


def test_cli_bad_input(corpus, tmp_path, capsys):
    # unknown key, naming the dotted key and the valid ones
    assert cli_main(["train", "model.n_layer=3"]) == 2
    err = capsys.readouterr().err
    assert "model.n_layer" in err and "model.n_layers" in err
    # wrong type
    assert cli_main(["train", "schedule.max_steps=many"]) == 2
    assert "schedule.max_steps" in capsys.readouterr().err
    # missing data directory: says which command prepares it
    assert cli_main(["train", f"data.dir={tmp_path / 'no_data'}", f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert f"fp4lightning data prepare --source builtin --out {tmp_path / 'no_data'}" in err
    # ... with the recipe's own data settings, so the prepared folder matches the recipe
    assert cli_main(["train", str(Path(__file__).parents[1] / "recipes" / "llama2-7b.yaml"),
                     f"data.dir={tmp_path / 'dclm'}", "trainer.accelerator=cpu"]) == 2  # (a GPU is checked first)
    assert (f"fp4lightning data prepare --source hf:mlfoundations/dclm-baseline-1.0 --out {tmp_path / 'dclm'} "
            "--vocab-size 32000 --val-fraction 0.0005 --max-tokens 100000000000") in capsys.readouterr().err
    # --resume without a checkpoint
    assert cli_main(["train", *tiny_overrides(corpus, tmp_path / "fresh"), "--resume"]) == 2
    assert "last.ckpt does not exist" in capsys.readouterr().err


def test_console_script_data_prepare_is_idempotent(corpus, tmp_path_factory):
    """The installed `fp4lightning` entry point, in a subprocess, on an already prepared folder."""
    src = tmp_path_factory.getbasetemp() / "stdlib_text"
    exe = Path(sys.executable).with_name("fp4lightning")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "fp4lightning.cli"]
    proc = subprocess.run(cmd + ["data", "prepare", "--source", str(src), "--out", str(corpus),
                                 "--vocab-size", "512", "--val-fraction", "0.05"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "up to date" in proc.stdout
