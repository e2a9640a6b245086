"""The Lightning callbacks of a pretraining run (:func:`run_callbacks` puts them together).

Checkpoints: ``step=NNNNNN.ckpt`` (the newest) and ``last.ckpt`` (:class:`RunCheckpoint`, and
:class:`SaveFinalState` at the end), each recording the data's fingerprint
(:class:`RecordDataFingerprint`). Ctrl-C (:class:`StopAtStepEnd`) and SIGTERM stop after the
current optimizer step and save ``last.ckpt``. One step counter (:class:`StepCounter`); progress
as a bar on a terminal, as lines (:class:`LinePrinter`) in logs; non-finite steps, the gradient
exchange's rounding on one device, throughput and the initial weights of ``init.*``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

from fp4lightning.data import TokenDataModule, data_fingerprint
from fp4lightning.distributed.grad_comm_sim import GradCommSimulation
from fp4lightning.lightning.nonfinite import NonFiniteGuard
from fp4lightning.lightning.strategy import is_fsdp
from fp4lightning.train.checkpoint import LAST_CKPT
from fp4lightning.train.init_weights import InitWeights, check_init_tokenizer, load_init_weights
from fp4lightning.train.recipe import WIRE_FORMAT, RecipeConfig, RecipeError
from fp4lightning.train.throughput import ThroughputMetrics, flops_per_token

__all__ = ["run_callbacks", "grad_comm_simulation", "RecordDataFingerprint", "LinePrinter", "SaveFinalState",
           "RunCheckpoint", "StepCounter", "StopAtStepEnd"]


class RecordDataFingerprint(L.Callback):
    """Keep ``data_fingerprint(data.dir)`` in every checkpoint, so ``--resume`` can tell the same
    data under another path (allowed) from other data under the same path (refused)."""

    def __init__(self, fingerprint: str | None):
        self.fingerprint = fingerprint

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.fingerprint is not None:
            checkpoint["data_fingerprint"] = self.fingerprint


class LinePrinter(L.Callback):
    """One line every ``every`` steps, for logs (stdout not a terminal) instead of a progress bar."""

    def __init__(self, every: int):
        self.every = every
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if not trainer.is_global_zero or step % self.every or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        m = trainer.callback_metrics
        parts = [f"step {step}/{trainer.max_steps}"]
        for key, fmt in (("train/loss", "loss {:.4f}"), ("train/tokens_per_sec", "{:.0f} tok/s"), ("train/lr", "lr {:.2e}")):
            if key in m:
                parts.append(fmt.format(float(m[key])))
        parts.append(f"{time.perf_counter() - self.t0:.0f}s")
        print("  ".join(parts), flush=True)

    def on_validation_end(self, trainer, pl_module):
        m = trainer.callback_metrics
        if trainer.is_global_zero and not trainer.sanity_checking and "val/loss" in m:
            print(f"step {trainer.global_step}: val loss {float(m['val/loss']):.4f}  ppl {float(m['val/ppl']):.1f}",
                  flush=True)


class SaveFinalState(L.Callback):
    """Write ``last.ckpt`` at the end of training if ModelCheckpoint did not save the final step.

    Lightning's ``ModelCheckpoint`` defers a save due on the last batch to a validation that
    may never come, and its end-of-training save of ``last`` only happens when no checkpoint
    was written before, so a finished run could leave ``last.ckpt`` some steps behind.
    """

    def __init__(self, checkpoint: ModelCheckpoint, path: Path):
        self.checkpoint, self.path = checkpoint, path

    def on_train_end(self, trainer, pl_module):
        if self.checkpoint._last_global_step_saved != trainer.global_step:
            trainer.save_checkpoint(self.path, weights_only=False)  # a full, resumable checkpoint


class RunCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose save on Ctrl-C, SIGTERM or a crash writes ``last.ckpt`` alone.

    Lightning's also writes a numbered ``step=N.ckpt`` then, outside the set it keeps
    (``save_top_k``): the file stayed for good, and a resumed run's folder held other checkpoint
    names than an uninterrupted run's. ``--resume`` reads ``last.ckpt``.
    """

    def on_exception(self, trainer, pl_module, exception):
        if self._should_save_on_exception(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class StepCounter(L.Callback):
    """Keep the step Lightning logs at equal to the optimizer steps taken, as checkpoint names,
    the validation schedule and the progress lines count them.

    Lightning logs at its own count, ``_batches_that_stepped``, which must equal ``global_step``
    while a step runs. A resume can leave it one ahead (Lightning adds one on restart unless the
    checkpoint was saved just after a validation, and again when the first resumed batch passes
    over a validation the interrupted run already ran), so the resumed run's CSV rows were one
    step ahead of an uninterrupted run's. Set at every micro-batch, it cannot drift.
    """

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step


class StopAtStepEnd(L.Callback):
    """Ctrl-C finishes the optimizer step under way (its log row, a validation due after it)
    and then stops, and Lightning saves the checkpoint (docs/training.md, "Interrupting and
    resuming"): a run interrupted anywhere resumes as if never stopped. A second Ctrl-C stops at
    once. Single-process runs only: the ranks of a data-parallel run would have to agree on the
    step first; there Ctrl-C stops at once, as before.
    """

    def __init__(self):
        self._pressed = False
        self._previous = None

    def on_train_start(self, trainer, pl_module):
        self._pressed = False
        if (trainer.world_size > 1 or threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
            return  # SIGINT ignored (a background job) or handled by the caller: leave it so
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        if self._pressed:
            self._restore()
            raise KeyboardInterrupt
        self._pressed = True
        print("\nCtrl-C: stopping after this step and saving a checkpoint (Ctrl-C again stops at once)",
              file=sys.stderr, flush=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._pressed and batch_idx % trainer.accumulate_grad_batches == 0:
            self._restore()
            raise KeyboardInterrupt  # Lightning saves the checkpoint (RunCheckpoint) and exits with 1

    def _restore(self):
        # only while it is still ours: after a Ctrl-C Lightning ignores SIGINT while it saves and exits
        if self._previous is not None and signal.getsignal(signal.SIGINT) == self._on_sigint:
            signal.signal(signal.SIGINT, self._previous)
        self._previous = None

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def on_exception(self, trainer, pl_module, exception):
        self._restore()


def grad_comm_simulation(cfg: RecipeConfig) -> list:
    """One device: the gradient exchange's rounding in ``trainer.grad_comm`` (fp4lightning.distributed.grad_comm_sim), so
    that the run trains on the gradients a multi-device run of the recipe would."""
    wire = WIRE_FORMAT[cfg.trainer.grad_comm]
    if cfg.world_size > 1 or wire == "fp32":
        return []
    return [GradCommSimulation(wire)]


def _run_checkpoint(cfg: RecipeConfig, ckpt_dir: Path) -> RunCheckpoint:
    return RunCheckpoint(
        dirpath=ckpt_dir,
        filename="step={step:06d}",
        auto_insert_metric_name=False,
        monitor="step",
        mode="max",
        save_top_k=1,  # keep only the newest numbered checkpoint (plus last.ckpt)
        save_last=True,
        every_n_train_steps=cfg.trainer.checkpoint_every_n_steps,
        save_on_exception=True,  # Ctrl-C / SIGTERM leave a resumable checkpoint
        # overwrite (atomically) rather than write last-v1.ckpt beside a damaged or moved last.ckpt
        enable_version_counter=False,
    )


def _throughput_and_init_callbacks(cfg: RecipeConfig, dm: TokenDataModule, ckpt_path: str | None) -> list:
    """train/tflops and train/mfu (fp4lightning.train.throughput); the initial weights of ``init.*`` on a fresh start."""
    out = [ThroughputMetrics(flops_per_token(cfg.llama_config(), cfg.data.seq_len), cfg.trainer.peak_tflops)]
    if (cfg.init.from_hf or cfg.init.from_checkpoint) and ckpt_path is None:
        if is_fsdp(cfg.trainer.strategy):
            raise RecipeError("recipe keys `init.*` are not supported with trainer.strategy=fsdp yet; "
                              "use ddp, or start from a checkpoint written by an fsdp run with --resume")
        state, _, tok, source = load_init_weights(cfg)
        check_init_tokenizer(tok, dm.tokenizer, source, str(cfg.data.dir))
        out.append(InitWeights(state, source))
    return out


def run_callbacks(cfg: RecipeConfig, dm: TokenDataModule, ckpt_path: str | None, interactive: bool) -> list:
    """The run's callbacks, in the order Lightning calls them. Loads the initial weights of ``init.*``
    (and refuses them, naming the key) on a fresh start. ``interactive``: a progress bar, else plain lines.
    """
    ckpt_dir = Path(cfg.out_dir) / "checkpoints"
    checkpoint = _run_checkpoint(cfg, ckpt_dir)
    # a progress bar on a terminal; plain lines in logs (make, CI, nohup). tqdm's: Lightning's default (rich)
    # bar titles a run bounded by max_steps "Epoch 0/-2"
    progress = TQDMProgressBar() if interactive else LinePrinter(cfg.trainer.log_every_n_steps)
    extra = _throughput_and_init_callbacks(cfg, dm, ckpt_path)
    return [checkpoint, SaveFinalState(checkpoint, ckpt_dir / LAST_CKPT), StepCounter(), StopAtStepEnd(),
            NonFiniteGuard(cfg.trainer.max_nonfinite_skips), RecordDataFingerprint(data_fingerprint(cfg.data.dir)),
            *grad_comm_simulation(cfg), progress, *extra]
