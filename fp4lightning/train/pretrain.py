"""``fp4lightning train RECIPE [key=value ...] [--resume]``: pretrain a LLaMA from a recipe.

Builds the pieces from a resolved :class:`~fp4lightning.train.recipe.RecipeConfig`: the
:class:`~fp4lightning.data.TokenDataModule`, the
:class:`~fp4lightning.train.module.LlamaLightningModule` (AdamW + warmup/cosine, arXiv
2501.17116 section 7), a Lightning ``Trainer`` with checkpointing, CSV and TensorBoard
loggers, and FP4 through :func:`_precision_setup`.

Run folder ``<out_dir>`` (``runs/<name>``)::

    config.yaml          resolved recipe (also inside every checkpoint)
    tokenizer.json       copy of the data's tokenizer (also inside every checkpoint)
    checkpoints/         step=NNNNNN.ckpt (latest) and last.ckpt
    logs/csv/version_N/metrics.csv, logs/tensorboard/version_N/  (step k: after optimizer step k)
    loss.png             train / validation loss curves

Ctrl-C (:class:`StopAtStepEnd`) and SIGTERM stop after the current optimizer step and save
``last.ckpt`` (:class:`RunCheckpoint`); ``--resume`` (or ``ckpt_path=last``)
continues from ``checkpoints/last.ckpt`` with the same data order, and refuses a checkpoint
whose model, data-order settings (:data:`DATA_ORDER_KEYS`) or tokenizer differ from the
recipe's. A fresh run refuses an ``out_dir`` that holds an earlier run's checkpoints or logs
unless ``overwrite`` (``--overwrite``) deletes them first, so every folder holds one run.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import logging
import os
import shlex
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from fp4lightning.errors import InputNotFoundError, check_writable_dir
from fp4lightning.train.checkpoint import AtomicCheckpointIO, CheckpointError, remove_stale_temporaries, resume_candidates
from fp4lightning.data import TokenDataModule, data_fingerprint, prepare_command
from fp4lightning.train.module import LlamaLightningModule
from fp4lightning.config import FP4Config
from fp4lightning.lightning.nonfinite import NonFiniteError, NonFiniteGuard
from fp4lightning.lightning.precision_names import FP4_PRECISIONS, MIXED_PRECISION
from fp4lightning.lightning.strategy import is_fsdp
from fp4lightning.train.recipe import (WIRE_FORMAT, RecipeConfig, RecipeError, flat_recipe_dict, recipe_to_dict,
                                 recipe_to_yaml)
from fp4lightning.data.tokenizer import TOKENIZER_FILE, Tokenizer
from fp4lightning.lightning.trainer import Trainer

__all__ = ["train", "build", "make_module", "PrecisionSetup", "TrainResult", "plot_losses", "read_losses"]

LAST_CKPT = "last.ckpt"


@dataclass
class TrainResult:
    out_dir: Path
    checkpoint: Path | None
    logs: list[Path]
    loss_png: Path | None
    val_loss: float | None
    interrupted: bool


@dataclass(frozen=True)
class PrecisionSetup:
    """How ``trainer.precision`` is realised (see :func:`_precision_setup`)."""

    trainer_precision: str | None  # Lightning's precision string (None when a plugin decides)
    plugins: tuple  # Trainer plugins
    fp4: FP4Config | None  # the recipe's FP4Config (RecipeConfig.fp4_config); None: high precision
    convert_in_module: bool  # True: LlamaLightningModule.configure_model applies convert_to_fp4


def _precision_setup(cfg: RecipeConfig) -> PrecisionSetup:
    """The one place that decides how FP4 enters the Trainer.

    * ``fp4`` with ``auto``/``ddp``: :class:`~fp4lightning.lightning.precision.FP4Precision` as a Trainer
      plugin (it converts the linear layers and runs bf16 autocast around them, section 6);
      ``fp4lightning.Trainer`` adds FP8 gradient communication when there are several devices.
    * ``fp4`` with ``fsdp``: Lightning's FSDP accepts only its own precision plugin, so the
      Trainer runs ``bf16-mixed`` and the LightningModule converts the model in
      ``configure_model`` with ``convert_to_fp4`` (before sharding).
    * ``bf16-mixed`` / ``32-true``: Lightning's own.
    """
    if cfg.trainer.precision not in FP4_PRECISIONS:
        return PrecisionSetup(cfg.trainer.precision, (), None, False)
    compute = FP4_PRECISIONS[cfg.trainer.precision]  # "bf16" or "fp16" around the FP4 GeMMs
    if is_fsdp(cfg.trainer.strategy):
        return PrecisionSetup(MIXED_PRECISION[compute], (), cfg.fp4_config, True)
    from fp4lightning.lightning.precision import FP4Precision

    return PrecisionSetup(None, (FP4Precision(cfg.fp4_config, compute_dtype=compute,
                                              max_consecutive_skips=cfg.trainer.max_nonfinite_skips),),
                          cfg.fp4_config, False)


def _strategy(cfg: RecipeConfig):
    """The strategy, carrying ``trainer.grad_comm`` as its gradient wire format (fp4lightning.distributed.comm)."""
    wire = WIRE_FORMAT[cfg.trainer.grad_comm]
    if not is_fsdp(cfg.trainer.strategy):
        if cfg.world_size > 1 and (wire != "fp32" or cfg.trainer.precision in FP4_PRECISIONS):
            from fp4lightning.lightning.strategy import FP4DDPStrategy

            # named explicitly: fp4lightning.Trainer alone would pick FP8 E4M3 for every FP4 run
            return FP4DDPStrategy(grad_format=wire, start_method="popen")
        return cfg.trainer.strategy
    from fp4lightning.lightning.strategy import FP4FSDPStrategy

    # FSDP2 (fully_shard) applied by LlamaLightningModule.configure_model with FP4 weight all-gather;
    # every rank is a data-parallel rank (no tensor parallelism); sharded (DCP) checkpoint folders
    return FP4FSDPStrategy(data_parallel_size=cfg.trainer.devices * cfg.trainer.num_nodes, grad_format=wire)


def _grad_comm_simulation(cfg: RecipeConfig) -> list:
    """One device: the gradient exchange's rounding in ``trainer.grad_comm`` (fp4lightning.distributed.grad_comm_sim), so
    that the run trains on the gradients a multi-device run of the recipe would."""
    wire = WIRE_FORMAT[cfg.trainer.grad_comm]
    if cfg.world_size > 1 or wire == "fp32":
        return []
    from fp4lightning.distributed.grad_comm_sim import GradCommSimulation

    return [GradCommSimulation(wire)]


def _checkpoint_candidates(ckpt_dir: Path) -> list[Path]:
    """``last.ckpt`` and the numbered ``step=N.ckpt`` files, newest recorded step first (see resume_candidates)."""
    return resume_candidates(ckpt_dir)


class ResumeMismatchError(CheckpointError):
    """The checkpoint loads but belongs to another model, data order or tokenizer than the recipe's:
    no other checkpoint of the folder is tried instead."""


#: recipe keys that decide which samples each optimizer step reads (fp4lightning.data.sampling: the
#: sample at position ``p`` is a function of ``(seed, p)`` over the windows of ``data.seq_len + 1``
#: tokens of ``data.dir``, split into micro-batches per rank): a resumed run must keep them, or it
#: re-reads or skips data. ``WORLD_SIZE_KEY`` is ``trainer.devices * trainer.num_nodes``.
WORLD_SIZE_KEY = "trainer.devices x trainer.num_nodes"
DATA_ORDER_KEYS = ("data.dir", "data.seq_len", "data.micro_batch_size", "data.global_batch_size", WORLD_SIZE_KEY,
                   "seed")


def _data_order(recipe: dict) -> dict:
    """``DATA_ORDER_KEYS`` -> value of a nested recipe dict (the keys it records)."""
    flat = flat_recipe_dict(recipe)
    if "trainer.devices" in flat and "trainer.num_nodes" in flat:
        flat[WORLD_SIZE_KEY] = flat["trainer.devices"] * flat["trainer.num_nodes"]
    return {k: flat[k] for k in DATA_ORDER_KEYS if k in flat}


class RecordDataFingerprint(L.Callback):
    """Keep ``data_fingerprint(data.dir)`` in every checkpoint, so ``--resume`` can tell the same
    data under another path (allowed) from other data under the same path (refused)."""

    def __init__(self, fingerprint: str | None):
        self.fingerprint = fingerprint

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.fingerprint is not None:
            checkpoint["data_fingerprint"] = self.fingerprint


def _check_data_order(path: Path, ckpt: dict, cfg: RecipeConfig) -> list[str]:
    """Raise ResumeMismatchError naming every data-order key that changed since ``path`` was written;
    return the keys it does not record (a checkpoint from before this check).

    ``data.dir`` is compared by content where the checkpoint has a fingerprint (a moved corpus
    resumes, one prepared again in place does not), else by path."""
    recorded = ckpt["hyper_parameters"].get("recipe") or {}
    saved, now = _data_order(recorded), _data_order(recipe_to_dict(cfg))
    old_fp, new_fp = ckpt.get("data_fingerprint"), data_fingerprint(cfg.data.dir)
    same_dir = "data.dir" in saved and Path(saved["data.dir"]).resolve() == Path(now["data.dir"]).resolve()
    changed, fixes = [], []
    for key in saved:
        if key == "data.dir" and old_fp is not None and new_fp is not None:
            if old_fp == new_fp:
                continue  # the same tokens, wherever they are
            if same_dir:
                changed.append(f"data.dir = {now[key]!r} holds other tokens than when the checkpoint was written "
                               "(it was prepared again since)")
                fixes.append(f"{now[key]} prepared again as it was")
                continue
        elif saved[key] == now[key] or (key == "data.dir" and same_dir):
            continue
        changed.append(f"{key} = {saved[key]!r} in the checkpoint, {now[key]!r} now"
                       + (" (holding other data)" if key == "data.dir" and old_fp is not None else ""))
        trainer = recorded.get("trainer", {})
        fixes.append(f"trainer.devices={trainer.get('devices')} trainer.num_nodes={trainer.get('num_nodes')}"
                     if key == WORLD_SIZE_KEY else f"{key}={saved[key]}")
    if changed:
        raise ResumeMismatchError(
            f"cannot resume from {path}: the recipe changes how the data is read ({'; '.join(changed)}), so the "
            "resumed steps would re-read or skip samples. Resume with the settings that wrote it "
            f"({' '.join(fixes)}), start a new out_dir, or start from its weights in a new out_dir with "
            f"init.from_checkpoint={path} (a fresh optimizer and schedule)")
    return [k for k in DATA_ORDER_KEYS if k not in saved]


#: recipe keys a resumed run keeps: ``optimizer.states`` decides the optimizer state's layout in the checkpoint,
#: ``trainer.grad_comm`` how every gradient is rounded
METHOD_KEYS = ("optimizer.states", "trainer.grad_comm")


def recorded_method_keys(recorded: dict) -> tuple[dict, list[str]]:
    """``METHOD_KEYS`` -> the value a checkpoint's recorded recipe trained with, and the keys it does not
    record. A checkpoint from before they were keys trained torch's AdamW (fp32 states) and exchanged the
    gradients of an FP4 DDP run over several devices in FP8 E4M3 (what fp4lightning.Trainer chose), others in
    fp32 (one device: no exchange, the same as fp32)."""
    flat = flat_recipe_dict(recorded)
    world = flat.get("trainer.devices", 1) * flat.get("trainer.num_nodes", 1)
    fp4_ddp = flat.get("trainer.precision") in FP4_PRECISIONS and not is_fsdp(flat.get("trainer.strategy", "auto"))
    legacy = {"optimizer.states": "fp32", "trainer.grad_comm": "fp8-e4m3" if fp4_ddp and world > 1 else "fp32"}
    return {k: flat.get(k, legacy[k]) for k in METHOD_KEYS}, [k for k in METHOD_KEYS if k not in flat]


def _check_method_keys(path: Path, ckpt: dict, cfg: RecipeConfig) -> None:
    """Raise ResumeMismatchError naming ``optimizer.states`` / ``trainer.grad_comm`` if the recipe changes them
    since ``path`` was written; say so when the checkpoint predates them (their values are inferred)."""
    saved, unrecorded = recorded_method_keys(ckpt["hyper_parameters"].get("recipe") or {})
    now = {k: v for k, v in flat_recipe_dict(recipe_to_dict(cfg)).items() if k in METHOD_KEYS}
    why = {"optimizer.states": "the optimizer state's layout differs", "trainer.grad_comm": "the gradients would be "
           "rounded differently from the resumed step on"}
    changed = [f"{k} = {saved[k]!r} in the checkpoint{' (not recorded: inferred)' if k in unrecorded else ''}, "
               f"{now[k]!r} now ({why[k]})" for k in METHOD_KEYS if saved[k] != now[k]]
    if changed:
        fixes = " ".join(f"{k}={saved[k]}" for k in METHOD_KEYS if saved[k] != now[k])
        raise ResumeMismatchError(
            f"cannot resume from {path}: {'; '.join(changed)}. Resume with the settings that wrote it ({fixes}), "
            f"start a new out_dir, or start from its weights in a new out_dir with init.from_checkpoint={path} "
            "(a fresh optimizer)")
    if unrecorded and _is_rank_zero():
        print(f"note: {path} does not record {', '.join(unrecorded)} (written before they were recipe keys); it "
              f"trained with {', '.join(f'{k}={saved[k]}' for k in unrecorded)}, as the recipe asks",
              file=sys.stderr, flush=True)


def _check_tokenizer(path: Path, ckpt: dict, cfg: RecipeConfig) -> list[str]:
    """Raise ResumeMismatchError if ``data.dir`` was prepared with another tokenizer than the checkpoint's
    (the check ``init.*`` makes, fp4lightning.train.init_weights); ``["tokenizer"]`` if the checkpoint has none."""
    saved = ckpt.get("tokenizer")
    if not saved:
        return ["tokenizer"]
    data_tok = Path(cfg.data.dir) / TOKENIZER_FILE
    if not data_tok.is_file():
        return []  # not prepared: TokenDataModule names the command that prepares it
    from fp4lightning.train.init_weights import same_tokenizer

    ckpt_tok, new_tok = Tokenizer.from_str(saved), Tokenizer.from_file(data_tok)
    if not same_tokenizer(ckpt_tok, new_tok):
        raise ResumeMismatchError(
            f"cannot resume from {path}: it was trained with a different tokenizer ({ckpt_tok.vocab_size} tokens) "
            f"than {data_tok} ({new_tok.vocab_size} tokens); {cfg.data.dir} was prepared again since, and its token "
            f"ids mean other tokens. Prepare {cfg.data.dir} again with the arguments that made the checkpoint's "
            "tokenizer (`fp4lightning data prepare` with the same --source and --vocab-size), point data.dir at "
            "that data, or train from scratch on the new data in a new out_dir")
    return []


def _check_resumable(path: Path, cfg: RecipeConfig) -> list[str]:
    """Raise CheckpointError (naming the file) unless ``path`` is an fp4lightning checkpoint of this model,
    data order and tokenizer (ResumeMismatchError for the last three). Returns what it could not check:
    the keys a checkpoint written before these checks does not record."""
    from fp4lightning.train.checkpoint import read_checkpoint

    ckpt, _ = read_checkpoint(path)  # weights_only load; corrupt / foreign files raise CheckpointError
    missing = [k for k in ("optimizer_states", "loops", "global_step") if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} cannot resume training: it has no {', '.join(missing)} "
                              "(a weights-only or exported checkpoint)")
    saved = dict(ckpt["hyper_parameters"]["model"])
    if saved.get("n_kv_heads") is None:  # None and n_heads build the same model (LlamaConfig.normalized)
        saved["n_kv_heads"] = saved.get("n_heads")
    want = dataclasses.asdict(cfg.llama_config().normalized())
    diff = [f"{k}={saved.get(k)!r} (recipe: {v!r})" for k, v in want.items() if saved.get(k) != v]
    if diff:
        raise ResumeMismatchError(f"{path} holds a different model than the recipe: {', '.join(diff)}; "
                                  "resume with the recipe that wrote it or start a new out_dir")
    unchecked = _check_tokenizer(path, ckpt, cfg)  # first: the more specific message
    unchecked = _check_data_order(path, ckpt, cfg) + unchecked
    _check_method_keys(path, ckpt, cfg)
    return unchecked


def _note_unchecked(path: Path, unrecorded: list[str]) -> None:
    if unrecorded and _is_rank_zero():
        print(f"note: {path} does not record {', '.join(unrecorded)} (written before fp4lightning checked them); "
              "resuming without checking that they are unchanged", file=sys.stderr, flush=True)


def _resolve_ckpt(cfg: RecipeConfig, resume: bool) -> str | None:
    """The checkpoint to resume from, checked before Lightning loads it.

    ``--resume`` / ``ckpt_path=last`` take the checkpoint recording the newest step (``last.ckpt`` on a
    tie) or, if it does not load, the next newest that does (saying which and why). An explicit path must load.
    """
    ckpt = cfg.ckpt_path
    if resume and ckpt is None:
        ckpt = "last"
    if ckpt is None:
        return None
    if ckpt != "last":
        path = Path(ckpt)
        if not path.exists():
            raise InputNotFoundError(
                f"cannot resume: checkpoint {path} does not exist (train without --resume / ckpt_path to start fresh)")
        _note_unchecked(path, _check_resumable(path, cfg))
        return str(path)
    ckpt_dir = Path(cfg.out_dir) / "checkpoints"
    candidates = _checkpoint_candidates(ckpt_dir) if ckpt_dir.is_dir() else []
    if not candidates:
        raise InputNotFoundError(
            f"cannot resume: checkpoint {ckpt_dir / LAST_CKPT} does not exist and {ckpt_dir} has no step=N.ckpt "
            "(train without --resume / ckpt_path to start fresh)")
    problems = []
    for path in candidates:
        try:
            unrecorded = _check_resumable(path, cfg)
        except ResumeMismatchError:
            raise  # another model / data order / tokenizer: an older checkpoint is no better
        except CheckpointError as e:
            problems.append(f"{path.name}: {e}")
            continue
        if problems and _is_rank_zero():
            print("warning: skipped unusable checkpoints:\n  " + "\n  ".join(problems)
                  + f"\nresuming from {path} instead", file=sys.stderr, flush=True)
        _note_unchecked(path, unrecorded)
        return str(path)
    raise CheckpointError(f"cannot resume: no checkpoint in {ckpt_dir} loads ({'; '.join(problems)})")


def _is_rank_zero() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def _check_writable(out: Path) -> None:
    """Fail before any work if the run folder cannot be created or written."""
    check_writable_dir(out, "recipe key `out_dir` =", RecipeError, "choose another out_dir")


#: what a multi-node launcher sets (torchrun / torchelastic, SLURM, or Lightning's manual NODE_RANK +
#: MASTER_ADDR): with none of them, a ``num_nodes > 1`` run has no one to rendezvous with
_MULTINODE_LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "NODE_RANK", "MASTER_ADDR", "WORLD_SIZE")


def _check_devices(cfg: RecipeConfig) -> None:
    """The GPUs the recipe asks for exist here (before any data is read); not a recipe-load check,
    since ``data prepare --recipe`` reads GPU recipes on CPU machines."""
    acc = cfg.trainer.accelerator
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if acc in ("gpu", "cuda") and gpus == 0:
        raise RecipeError(f"recipe key `trainer.accelerator` = {acc!r} but this machine has no CUDA GPU visible to "
                          "torch; use trainer.accelerator=cpu (or auto)")
    if cfg.trainer.num_nodes > 1 and not any(v in os.environ for v in _MULTINODE_LAUNCH_VARS):
        raise RecipeError(
            f"recipe key `trainer.num_nodes` = {cfg.trainer.num_nodes} but this process was not started as part of a "
            "multi-node job (none of " + ", ".join(_MULTINODE_LAUNCH_VARS) + " is set), so it would wait for the "
            "other nodes forever; launch it on every node with torchrun or srun (docs/distributed.md), or set "
            "trainer.num_nodes=1")
    if (acc in ("gpu", "cuda") or (acc == "auto" and gpus)) and cfg.trainer.devices > gpus:
        raise RecipeError(f"recipe key `trainer.devices` = {cfg.trainer.devices} but this machine has {gpus} CUDA "
                          f"GPU(s); set trainer.devices={gpus} (and data.global_batch_size to match) or run where "
                          "there are more")


def _previous_run(out: Path) -> list[Path]:
    """What an earlier run left in ``out``: its ``checkpoints`` folder (if it holds a checkpoint), its ``logs``."""
    found = []
    ckpt_dir = out / "checkpoints"
    if ckpt_dir.is_dir() and _checkpoint_candidates(ckpt_dir):
        found.append(ckpt_dir)
    logs = out / "logs"
    if logs.is_dir() and any(logs.iterdir()):
        found.append(logs)
    return found


def _check_fresh_out_dir(out: Path, overwrite: bool) -> list[Path]:
    """A fresh run must not write into an earlier run's folder: its checkpoints would be replaced
    and its log versions merged into the new run's curve. Returns what ``overwrite`` will delete."""
    previous = _previous_run(out)
    if not previous or overwrite:
        return previous
    if previous[0].name == "checkpoints":
        raise RecipeError(
            f"recipe key `out_dir` = {out} already holds a run (checkpoints in {previous[0]}); pass --resume to "
            "continue it, --overwrite to delete its checkpoints and logs and start again, or choose another out_dir")
    raise RecipeError(
        f"recipe key `out_dir` = {out} already holds the logs of an earlier run ({previous[0]}; it left no "
        "checkpoint to resume); pass --overwrite to delete them and start again, or choose another out_dir")


def _remove_previous_run(out: Path, previous: list[Path]) -> None:
    """``--overwrite``: delete the earlier run's checkpoints, logs, loss curve and evaluation
    (``fp4lightning eval ... --out <out_dir>/eval``: scores of a checkpoint that is gone), saying so."""
    removed = [*previous, *(p for p in (out / "loss.png", out / "eval") if p.exists())]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    print(f"--overwrite: removed the previous run's {', '.join(str(p) for p in removed)}", flush=True)


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


def make_module(cfg: RecipeConfig, precision: PrecisionSetup | None = None, tokenizer_json: str | None = None):
    """The LightningModule for ``cfg`` (the model itself is built later, in ``configure_model``)."""
    precision = precision or _precision_setup(cfg)
    return LlamaLightningModule(
        model=dataclasses.asdict(cfg.llama_config()),
        lr=cfg.optimizer.lr,
        beta1=cfg.optimizer.beta1,
        beta2=cfg.optimizer.beta2,
        eps=cfg.optimizer.eps,
        weight_decay=cfg.optimizer.weight_decay,
        max_steps=cfg.schedule.max_steps,
        warmup_fraction=cfg.schedule.warmup_fraction,
        min_lr_ratio=cfg.schedule.min_lr_ratio,
        fp4=cfg.fp4.spec() if precision.fp4 is not None else None,
        fp4_config=precision.fp4,
        fp4_in_module=precision.convert_in_module,
        recipe=recipe_to_dict(cfg),
        tokenizer_json=tokenizer_json,
        optimizer_states=cfg.optimizer.states,
    )


def build(cfg: RecipeConfig, resume: bool = False, callbacks: list | None = None, verify_data: bool = False,
          overwrite: bool = False):
    """(trainer, module, datamodule, ckpt_path) for ``cfg``; no training happens.

    ``callbacks`` are added to the Trainer's own (tests use this to record losses). ``verify_data``
    re-hashes every shard against the sha256 in ``meta.json`` (sizes are always checked).
    Raises ``DataNotPreparedError`` naming ``fp4lightning data prepare ...`` if the data is missing.
    A fresh run (no ``resume`` / ``ckpt_path``) raises RecipeError if ``out_dir`` holds an earlier
    run's checkpoints or logs, unless ``overwrite``: then they are deleted (after every other check).
    """
    out = Path(cfg.out_dir)
    _check_devices(cfg)
    _check_writable(out)
    ckpt_path = _resolve_ckpt(cfg, resume)
    if overwrite and ckpt_path is not None:
        raise RecipeError("--overwrite starts a new run in out_dir; it cannot be combined with --resume / "
                          "recipe key `ckpt_path`")
    # rank 0 alone: ranks Lightning launches later find the folder as rank 0 left it
    previous = _check_fresh_out_dir(out, overwrite) if ckpt_path is None and _is_rank_zero() else []
    accum = cfg.accumulate_grad_batches
    llama = cfg.llama_config()
    dm = TokenDataModule(
        cfg.data.dir,
        seq_len=cfg.data.seq_len,
        micro_batch_size=cfg.data.micro_batch_size,
        train_batches=cfg.schedule.max_steps * accum,
        val_batches=cfg.data.val_batches,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        prepare_hint=prepare_command(cfg.data.source, cfg.data.dir, cfg.data.vocab_size, cfg.data.val_fraction,
                                     cfg.data.max_tokens, cfg.data.text_key),
        verify=verify_data,
    )
    if dm.tokenizer.vocab_size > llama.vocab_size:
        raise RecipeError(
            f"the tokenizer in {cfg.data.dir} has {dm.tokenizer.vocab_size} tokens but `model.vocab_size` is "
            f"{llama.vocab_size}; set model.vocab_size={dm.tokenizer.vocab_size} or prepare the data with "
            f"--vocab-size {llama.vocab_size}"
        )
    precision = _precision_setup(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = make_module(cfg, precision, tokenizer_json=dm.tokenizer.to_str())
    checkpoint = RunCheckpoint(
        dirpath=out / "checkpoints",
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
    # a progress bar on a terminal; plain lines in logs (make, CI, nohup). tqdm's: Lightning's default (rich)
    # bar titles a run bounded by max_steps "Epoch 0/-2"
    interactive = sys.stdout.isatty()
    progress = [TQDMProgressBar()] if interactive else [LinePrinter(cfg.trainer.log_every_n_steps)]
    loggers = _loggers(cfg, out)
    extra = _throughput_and_init_callbacks(cfg, dm, ckpt_path)
    if previous:
        _remove_previous_run(out, previous)
    if _is_rank_zero():
        remove_stale_temporaries(out / "checkpoints")  # left by a save that was killed
    guard = NonFiniteGuard(cfg.trainer.max_nonfinite_skips)
    trainer = Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=_strategy(cfg),
        precision=precision.trainer_precision,
        plugins=[*precision.plugins, AtomicCheckpointIO()],
        max_steps=cfg.schedule.max_steps,
        gradient_clip_val=cfg.optimizer.grad_clip or None,
        accumulate_grad_batches=accum,
        # counted in micro-batches; None: validate inside the single long epoch
        val_check_interval=cfg.trainer.val_every_n_steps * accum,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        callbacks=[checkpoint, SaveFinalState(checkpoint, out / "checkpoints" / LAST_CKPT), StepCounter(),
                   StopAtStepEnd(), guard,
                   RecordDataFingerprint(data_fingerprint(cfg.data.dir)), *_grad_comm_simulation(cfg), *progress,
                   *extra, *(callbacks or [])],
        enable_progress_bar=interactive,
        # the resolved recipe and the parameter count are printed instead: Lightning's table adds a FLOPs
        # column of zeros (it would need a forward pass of an example batch to count them)
        enable_model_summary=False,
        logger=loggers,
        use_distributed_sampler=False,  # the DataModule shards positions by rank itself
        default_root_dir=out,
    )
    return trainer, module, dm, ckpt_path


class _StepsFromOne:
    """Logger mixin: optimizer step k's metrics, and a validation run after it, are recorded at step k.

    Lightning passes its count of the steps taken before (k - 1: a fresh run's rows were 0..N-1)
    while checkpoint names (``step=N.ckpt``), the validation schedule, the progress lines and
    ``schedule.max_steps`` count k; the logs, ``loss.png`` and ``compare`` count as they do.
    """

    def log_metrics(self, metrics, step=None):
        super().log_metrics(metrics, None if step is None else step + 1)


class _CSVLogger(_StepsFromOne, CSVLogger):
    pass


class _TensorBoardLogger(_StepsFromOne, TensorBoardLogger):
    pass


class _WandbLogger(_StepsFromOne, WandbLogger):
    pass


def _loggers(cfg: RecipeConfig, out: Path) -> list:
    """The loggers named by ``trainer.loggers`` (csv, tensorboard, wandb), all writing under ``out/logs``,
    at steps counted from 1 (:class:`_StepsFromOne`)."""
    names = [n.strip() for n in cfg.trainer.loggers.split(",") if n.strip()]
    loggers = []
    for name in names:
        if name == "csv":
            loggers.append(_CSVLogger(save_dir=out / "logs", name="csv"))
        elif name == "tensorboard":
            loggers.append(_TensorBoardLogger(save_dir=out / "logs", name="tensorboard", default_hp_metric=False))
        elif name == "wandb":
            loggers.append(_WandbLogger(name=cfg.name, save_dir=str(out / "logs"), config=recipe_to_dict(cfg)))
    return loggers


def _throughput_and_init_callbacks(cfg: RecipeConfig, dm, ckpt_path: str | None) -> list:
    """train/tflops and train/mfu (fp4lightning.train.throughput); the initial weights of ``init.*`` on a fresh start."""
    from fp4lightning.train.throughput import ThroughputMetrics, flops_per_token

    out = [ThroughputMetrics(flops_per_token(cfg.llama_config(), cfg.data.seq_len), cfg.trainer.peak_tflops)]
    if (cfg.init.from_hf or cfg.init.from_checkpoint) and ckpt_path is None:
        from fp4lightning.train.init_weights import InitWeights, check_tokenizer, load_init_weights

        if is_fsdp(cfg.trainer.strategy):
            raise RecipeError("recipe keys `init.*` are not supported with trainer.strategy=fsdp yet; "
                              "use ddp, or start from a checkpoint written by an fsdp run with --resume")
        state, _, tok, source = load_init_weights(cfg)
        check_tokenizer(tok, dm.tokenizer, source, str(cfg.data.dir))
        out.append(InitWeights(state, source))
    return out


def describe_resume(cfg: RecipeConfig, ckpt_path: str) -> list[str]:
    """Lines saying how the recipe's schedule differs from the one the checkpoint trained with, and the effect."""
    from fp4lightning.train.checkpoint import read_checkpoint

    ckpt, _ = read_checkpoint(ckpt_path)
    hp = ckpt.get("hyper_parameters", {})
    step = int(ckpt.get("global_step", 0))
    lines = []
    old = {k: hp.get(k) for k in ("max_steps", "warmup_fraction", "min_lr_ratio", "lr")}
    new = {"max_steps": cfg.schedule.max_steps, "warmup_fraction": cfg.schedule.warmup_fraction,
           "min_lr_ratio": cfg.schedule.min_lr_ratio, "lr": cfg.optimizer.lr}
    names = {"lr": "optimizer.lr"}
    changed = [k for k in new if old[k] is not None and old[k] != new[k]]
    if not changed:
        return lines
    import math

    from fp4lightning.train.module import warmup_cosine

    def lr_at(h: dict) -> float:
        warmup = max(1, math.ceil(h["warmup_fraction"] * h["max_steps"]))  # as LlamaLightningModule
        return h["lr"] * warmup_cosine(step, h["max_steps"], warmup, h["min_lr_ratio"])

    for k in changed:
        lines.append(f"resume: {names.get(k, 'schedule.' + k)} changed {old[k]} -> {new[k]} since the checkpoint")
    lines.append(f"resume: the warmup + cosine LR schedule is recomputed for the new values: the first resumed step, "
                 f"{step + 1}, runs at LR {lr_at(new):.3e} (the checkpoint's schedule would give {lr_at(old):.3e}); "
                 f"it decays to {new['min_lr_ratio'] * new['lr']:.3e} by step {new['max_steps']}")
    return lines


def _read_csv_losses(log_dir: Path) -> dict[str, dict[int, float]]:
    """``{"train": {step: loss}, "val": {step: loss}}`` (step: optimizer steps taken, from 1) from every
    CSVLogger version under ``log_dir``:
    the versions of one run (its start and its resumes: ``train`` refuses to start another run in a
    folder with logs unless ``--overwrite`` deletes them); later versions overwrite earlier steps."""
    out: dict[str, dict[int, float]] = {"train": {}, "val": {}}
    versions = sorted(log_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    for path in versions:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(row["step"])
                for key, name in (("train", "train/loss"), ("val", "val/loss")):
                    if row.get(name):
                        out[key][step] = float(row[name])
    return out


def read_losses(run_dir: Path) -> dict[str, dict[int, float]]:
    """Train and validation loss per step of the run in ``run_dir`` (its ``logs/csv``, resumes merged)."""
    return _read_csv_losses(Path(run_dir) / "logs" / "csv")


def plot_losses(log_dir: Path, png: Path) -> Path | None:
    """Train and validation loss against step from every CSV log version (the run and its resumes);
    None if no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = _read_csv_losses(log_dir)
    train, val = losses["train"], losses["val"]
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        xs = sorted(train)
        ax.plot(xs, [train[s] for s in xs], label="train loss", lw=1.2)
    if val:
        xs = sorted(val)
        ax.plot(xs, [val[s] for s in xs], "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(png.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


#: Messages Lightning and torch print on every run of this trainer that say nothing actionable to
#: its users: the model summary cannot size mixed precisions (it warns for Lightning's own
#: "bf16-mixed" too), torch 2.13 deprecates a pytree class Lightning still builds, and an
#: advertisement for a cloud logger. Silenced only inside ``train`` (a library does not change
#: its caller's warning filters).
_QUIET_WARNINGS = (r"Precision .* is not supported by the model summary",
                   r"`isinstance\(treespec, LeafSpec\)` is deprecated")
_QUIET_LOG_SUBSTRINGS = ("litlogger",)


class _DropMessages(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in _QUIET_LOG_SUBSTRINGS)


@contextlib.contextmanager
def _quiet_lightning():
    """Hide ``_QUIET_WARNINGS`` and ``_QUIET_LOG_SUBSTRINGS`` while ``train`` runs."""
    drop = _DropMessages()
    log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    log.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for pattern in _QUIET_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        log.removeFilter(drop)


def train(cfg: RecipeConfig, resume: bool = False, callbacks: list | None = None,
          verify_data: bool = False, overwrite: bool = False,
          argv: Sequence[str] | None = None) -> TrainResult | None:
    """Train ``cfg``; prints the resolved config first and where the outputs are at the end.

    Returns the :class:`TrainResult` on rank 0 (None on other ranks). Re-raises the
    ``KeyboardInterrupt`` / ``SystemExit`` of an interrupted run after reporting it.
    ``overwrite``: start afresh in an ``out_dir`` holding an earlier run, deleting its
    checkpoints and logs (see :func:`build`). ``argv``: the recipe and overrides as given to
    ``fp4lightning train``, for the command an interrupted run prints (:func:`resume_command`).
    """
    with _quiet_lightning():
        return _train(cfg, resume, callbacks, verify_data, overwrite, argv)


def resume_command(cfg: RecipeConfig, argv: Sequence[str] | None = None) -> str:
    """The shell command that continues the run of ``cfg``, ready to copy and paste.

    ``argv`` (the recipe and ``key=value`` overrides the run was started with) is repeated as
    given, without a ``ckpt_path=...``, then ``--resume``; without it (``train`` called from
    Python) the run's own ``config.yaml``. Where the run named a checkpoint (``ckpt_path``, which
    ``--resume`` does not override, and the recipe file may set) it ends in ``ckpt_path=last``.
    """
    words = ([w for w in argv if w.split("=", 1)[0].strip() != "ckpt_path"] if argv is not None
             else [str(Path(cfg.out_dir) / "config.yaml")])
    return shlex.join(["fp4lightning", "train", *words, "--resume" if cfg.ckpt_path is None else "ckpt_path=last"])


def _train(cfg: RecipeConfig, resume: bool, callbacks: list | None, verify_data: bool,
           overwrite: bool, argv: Sequence[str] | None = None) -> TrainResult | None:
    trainer, module, dm, ckpt_path = build(cfg, resume, callbacks, verify_data=verify_data, overwrite=overwrite)
    out = Path(cfg.out_dir)
    if trainer.is_global_zero:
        llama = cfg.llama_config()
        print(f"resolved recipe:\n{recipe_to_yaml(cfg)}", flush=True)
        print(f"model: {llama} = {llama.num_params() / 1e6:.1f}M parameters; "
              f"gradient accumulation {cfg.accumulate_grad_batches}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(recipe_to_yaml(cfg))
        shutil.copyfile(dm.data.dir / "tokenizer.json", out / "tokenizer.json")
        if ckpt_path:
            print(f"resuming from {ckpt_path}", flush=True)
            for line in describe_resume(cfg, ckpt_path):
                print(line, flush=True)
    status, result, stopped_at = "failed", None, None
    threads = torch.get_num_threads()
    try:
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        # weights_only: a checkpoint never runs code when it is loaded (the checks in
        # _resolve_ckpt load it the same way)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
        _validate_at_end(trainer, module, dm, cfg)
        status = "finished"
    except (KeyboardInterrupt, SystemExit):
        # Lightning turns SIGTERM into SIGTERMException and Ctrl-C into sys.exit(1), after
        # ModelCheckpoint(save_on_exception=True) has written the checkpoint
        status = "interrupted"
        raise
    except NonFiniteError as e:
        status, stopped_at = "stopped", e.step  # the step its message names
        raise
    except RuntimeError as e:
        lost = _peer_lost_error(e, trainer, out)
        if lost is None:
            raise
        status = "peer lost"
        raise lost from e
    finally:
        torch.set_num_threads(threads)
        if trainer.is_global_zero and status != "peer lost":  # its one line names the checkpoint
            result = _report(trainer, out, status, stopped_at, resume_command(cfg, argv))
    return result


def _peer_lost_error(exc: RuntimeError, trainer, out: Path):
    """A collective's error for a rank that went away (killed, crashed) as one line naming that rank
    and the last checkpoint (``fp4lightning.distributed.comm.lost_peer``); None for any other error."""
    from fp4lightning.distributed.comm import PeerLostError, lost_peer

    peer = lost_peer(exc, trainer.global_rank, trainer.world_size)
    if peer is None:
        return None
    ckpt = _latest_checkpoint(out)
    saved = (f"last checkpoint {ckpt} (continue with the same command and --resume)" if ckpt
             else "no checkpoint yet (the run has to start again)")
    return PeerLostError(f"{peer} of {trainer.world_size} stopped (killed or crashed; see its own output), so "
                         f"rank {trainer.global_rank} stopped too at step {trainer.global_step}; {saved}")


def _validate_at_end(trainer, module, dm, cfg: RecipeConfig) -> None:
    """One more validation after the last step when ``max_steps`` is not a multiple of
    ``val_every_n_steps`` (Lightning validates only on those multiples), so the run's last
    validation loss - the closing banner's and ``compare``'s "final" one - is measured on the
    final weights, not up to ``val_every_n_steps - 1`` steps before them."""
    if not trainer.global_step or trainer.global_step % cfg.trainer.val_every_n_steps == 0:
        return
    # Lightning logs a validation inside fit at its count before the step that triggered it (the
    # loggers add one, _StepsFromOne), and one run by validate() after fit at the count after it;
    # shift the counter back for this call so the final row lands at the last step, as inside fit
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    shift = loop is not None and isinstance(getattr(loop, "_batches_that_stepped", None), int)
    if shift:
        loop._batches_that_stepped -= 1
    try:
        trainer.validate(module, datamodule=dm, verbose=False)
    finally:
        if shift:
            loop._batches_that_stepped += 1


def _latest_checkpoint(out: Path) -> Path | None:
    ckpt_dir = out / "checkpoints"
    candidates = _checkpoint_candidates(ckpt_dir) if ckpt_dir.is_dir() else []
    return candidates[0] if candidates else None


def _report(trainer, out: Path, status: str, stopped_at: int | None, resume: str) -> TrainResult:
    """The closing banner on success; on failure what was saved and the command that resumes (stderr).
    ``stopped_at``: the step that stopped the run (non-finite), else it names the steps completed."""
    png = plot_losses(out / "logs" / "csv", out / "loss.png")
    val = trainer.callback_metrics.get("val/loss")
    val_loss = float(val) if val is not None else None
    logs = [out / "logs" / "csv", out / "logs" / "tensorboard"]
    ckpt = _latest_checkpoint(out)
    if status != "finished":
        saved = (f"latest checkpoint: {ckpt}\nresume with: {resume}" if ckpt
                 else "no checkpoint was saved; the run has to start again")
        where = f"at step {stopped_at}" if stopped_at is not None else f"after step {trainer.global_step}"
        print(f"\ntraining {status} {where}; {saved}", file=sys.stderr, flush=True)
        return TrainResult(out, ckpt.resolve() if ckpt else None, logs, png, val_loss, True)
    print("\n" + "=" * 72, flush=True)
    print(f"finished after {trainer.global_step} steps"
          + (f"; validation loss {val_loss:.4f}" if val_loss is not None else ""))
    print(f"checkpoint : {ckpt if ckpt else '(none)'}")
    print(f"config     : {out / 'config.yaml'}")
    print(f"logs       : {logs[0]} (CSV), {logs[1]} (TensorBoard: tensorboard --logdir {logs[1]})")
    print(f"loss curve : {png if png else '(no logged steps)'}")
    print("=" * 72, flush=True)
    return TrainResult(out, ckpt.resolve() if ckpt else None, logs, png, val_loss, False)
