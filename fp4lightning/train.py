"""``fp4lightning train RECIPE [key=value ...] [--resume]``: pretrain a LLaMA from a recipe.

Builds the pieces from a resolved :class:`~fp4lightning.recipe.RecipeConfig`: the
:class:`~fp4lightning.data.TokenDataModule`, the
:class:`~fp4lightning.module.LlamaLightningModule` (AdamW + warmup/cosine, arXiv
2501.17116 section 7), a Lightning ``Trainer`` with checkpointing, CSV and TensorBoard
loggers, and FP4 through :func:`_precision_setup`.

Run folder ``<out_dir>`` (``runs/<name>``)::

    config.yaml          resolved recipe (also inside every checkpoint)
    tokenizer.json       copy of the data's tokenizer (also inside every checkpoint)
    checkpoints/         step=NNNNNN.ckpt (latest) and last.ckpt
    logs/csv/version_N/metrics.csv, logs/tensorboard/version_N/
    loss.png             train / validation loss curves

Ctrl-C and SIGTERM stop after the current batch and save a checkpoint
(``ModelCheckpoint(save_on_exception=True)``); ``--resume`` (or ``ckpt_path=last``)
continues from ``checkpoints/last.ckpt`` with the same data order.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from fp4lightning.data import TokenDataModule, prepare_command
from fp4lightning.module import LlamaLightningModule, fp4_config_from_spec
from fp4lightning.recipe import RecipeConfig, RecipeError, load_recipe, recipe_to_dict, recipe_to_yaml
from fp4lightning.trainer import Trainer

__all__ = ["train", "build", "make_module", "PrecisionSetup", "TrainResult", "add_arguments", "run", "plot_losses"]

HELP = "pretrain a LLaMA from a recipe YAML"
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
    fp4: dict[str, Any] | None  # FP4 spec {"preset", "overrides"}, recorded in checkpoints
    convert_in_module: bool  # True: LlamaLightningModule.configure_model applies convert_to_fp4


def _precision_setup(cfg: RecipeConfig) -> PrecisionSetup:
    """The one place that decides how FP4 enters the Trainer.

    * ``fp4`` with ``auto``/``ddp``: :class:`~fp4lightning.precision.FP4Precision` as a Trainer
      plugin (it converts the linear layers and runs bf16 autocast around them, section 6);
      ``fp4lightning.Trainer`` adds FP8 gradient communication when there are several devices.
    * ``fp4`` with ``fsdp``: Lightning's FSDP accepts only its own precision plugin, so the
      Trainer runs ``bf16-mixed`` and the LightningModule converts the model in
      ``configure_model`` with ``convert_to_fp4`` (before sharding).
    * ``bf16-mixed`` / ``32-true``: Lightning's own.
    """
    if cfg.trainer.precision != "fp4":
        return PrecisionSetup(cfg.trainer.precision, (), None, False)
    spec = {"preset": cfg.fp4.preset, "overrides": dict(cfg.fp4.overrides)}
    if cfg.trainer.strategy == "fsdp":
        return PrecisionSetup("bf16-mixed", (), spec, True)
    from fp4lightning.precision import FP4Precision

    return PrecisionSetup(None, (FP4Precision(fp4_config_from_spec(spec)),), spec, False)


def _strategy(cfg: RecipeConfig):
    if cfg.trainer.strategy != "fsdp":
        return cfg.trainer.strategy
    from fp4lightning.strategy import FP4FSDPStrategy

    # FSDP2 (fully_shard) applied by LlamaLightningModule.configure_model with FP4 weight all-gather;
    # every rank is a data-parallel rank (no tensor parallelism); sharded (DCP) checkpoint folders
    return FP4FSDPStrategy(data_parallel_size=cfg.trainer.devices * cfg.trainer.num_nodes)


def _resolve_ckpt(cfg: RecipeConfig, resume: bool) -> str | None:
    ckpt = cfg.ckpt_path
    if resume and ckpt is None:
        ckpt = "last"
    if ckpt is None:
        return None
    path = Path(cfg.out_dir) / "checkpoints" / LAST_CKPT if ckpt == "last" else Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(
            f"cannot resume: checkpoint {path} does not exist (train without --resume / ckpt_path to start fresh)"
        )
    return str(path)


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
        fp4=precision.fp4,
        fp4_in_module=precision.convert_in_module,
        recipe=recipe_to_dict(cfg),
        tokenizer_json=tokenizer_json,
    )


def build(cfg: RecipeConfig, resume: bool = False, callbacks: list | None = None):
    """(trainer, module, datamodule, ckpt_path) for ``cfg``; no training happens.

    ``callbacks`` are added to the Trainer's own (tests use this to record losses).
    Raises ``DataNotPreparedError`` naming ``fp4lightning data prepare ...`` if the data is missing.
    """
    ckpt_path = _resolve_ckpt(cfg, resume)
    out = Path(cfg.out_dir)
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
    checkpoint = ModelCheckpoint(
        dirpath=out / "checkpoints",
        filename="step={step:06d}",
        auto_insert_metric_name=False,
        monitor="step",
        mode="max",
        save_top_k=1,  # keep only the newest numbered checkpoint (plus last.ckpt)
        save_last=True,
        every_n_train_steps=cfg.trainer.checkpoint_every_n_steps,
        save_on_exception=True,  # Ctrl-C / SIGTERM leave a resumable checkpoint
    )
    # Lightning's progress bar on a terminal; plain lines in logs (make, CI, nohup)
    interactive = sys.stdout.isatty()
    progress = [] if interactive else [LinePrinter(cfg.trainer.log_every_n_steps)]
    loggers = [
        CSVLogger(save_dir=out / "logs", name="csv"),
        TensorBoardLogger(save_dir=out / "logs", name="tensorboard", default_hp_metric=False),
    ]
    trainer = Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=_strategy(cfg),
        precision=precision.trainer_precision,
        plugins=list(precision.plugins) or None,
        max_steps=cfg.schedule.max_steps,
        gradient_clip_val=cfg.optimizer.grad_clip or None,
        accumulate_grad_batches=accum,
        # counted in micro-batches; None: validate inside the single long epoch
        val_check_interval=cfg.trainer.val_every_n_steps * accum,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        callbacks=[checkpoint, *progress, *(callbacks or [])],
        enable_progress_bar=interactive,
        logger=loggers,
        use_distributed_sampler=False,  # the DataModule shards positions by rank itself
        default_root_dir=out,
    )
    return trainer, module, dm, ckpt_path


def plot_losses(log_dir: Path, png: Path) -> Path | None:
    """Train and validation loss against step from every CSV log version; None if no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train: dict[int, float] = {}
    val: dict[int, float] = {}
    versions = sorted(log_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    for path in versions:  # later versions (resumed runs) overwrite earlier steps
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(row["step"])
                if row.get("train/loss"):
                    train[step] = float(row["train/loss"])
                if row.get("val/loss"):
                    val[step] = float(row["val/loss"])
    if not train and not val:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        xs = sorted(train)
        ax.plot([s + 1 for s in xs], [train[s] for s in xs], label="train loss", lw=1.2)
    if val:
        xs = sorted(val)
        ax.plot([s + 1 for s in xs], [val[s] for s in xs], "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(png.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def train(cfg: RecipeConfig, resume: bool = False, callbacks: list | None = None) -> TrainResult | None:
    """Train ``cfg``; prints the resolved config first and where the outputs are at the end.

    Returns the :class:`TrainResult` on rank 0 (None on other ranks). Re-raises the
    ``KeyboardInterrupt`` / ``SystemExit`` of an interrupted run after reporting it.
    """
    trainer, module, dm, ckpt_path = build(cfg, resume, callbacks)
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
    interrupted, result = False, None
    threads = torch.get_num_threads()
    try:
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
    except (KeyboardInterrupt, SystemExit):
        # Lightning turns SIGTERM into SIGTERMException and Ctrl-C into sys.exit(1), after
        # ModelCheckpoint(save_on_exception=True) has written the checkpoint
        interrupted = True
        if trainer.is_global_zero:
            print(f"\ninterrupted at step {trainer.global_step}; checkpoint saved. Resume with:\n"
                  f"  fp4lightning train ... --resume   (or ckpt_path={out / 'checkpoints' / LAST_CKPT})",
                  file=sys.stderr, flush=True)
        raise
    finally:
        torch.set_num_threads(threads)
        if trainer.is_global_zero:
            result = _report(trainer, out, interrupted)
    return result


def _report(trainer, out: Path, interrupted: bool) -> TrainResult:
    last = out / "checkpoints" / LAST_CKPT
    png = plot_losses(out / "logs" / "csv", out / "loss.png")
    val = trainer.callback_metrics.get("val/loss")
    val_loss = float(val) if val is not None else None
    logs = [out / "logs" / "csv", out / "logs" / "tensorboard"]
    ckpt = last.resolve() if last.exists() else None
    print("\n" + "=" * 72, flush=True)
    print(f"{'interrupted' if interrupted else 'finished'} after {trainer.global_step} steps"
          + (f"; validation loss {val_loss:.4f}" if val_loss is not None else ""))
    print(f"checkpoint : {last if ckpt else '(none)'}")
    print(f"config     : {out / 'config.yaml'}")
    print(f"logs       : {logs[0]} (CSV), {logs[1]} (TensorBoard: tensorboard --logdir {logs[1]})")
    print(f"loss curve : {png if png else '(no logged steps)'}")
    print("=" * 72, flush=True)
    return TrainResult(out, ckpt, logs, png, val_loss, interrupted)


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None,
                        help="recipe YAML (default: the built-in tiny recipe, same as recipes/tiny.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="recipe overrides, e.g. schedule.max_steps=50 trainer.precision=bf16-mixed")
    parser.add_argument("--resume", action="store_true",
                        help="continue from <out_dir>/checkpoints/last.ckpt (same as ckpt_path=last)")


def run(args: argparse.Namespace) -> int:
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        recipe, overrides = None, [recipe, *overrides]  # `fp4lightning train key=value`
    cfg = load_recipe(recipe, overrides)
    if os.environ.get("LOCAL_RANK", "0") == "0" and Path(cfg.out_dir).joinpath("checkpoints").exists() \
            and not args.resume and cfg.ckpt_path is None:
        print(f"note: {cfg.out_dir} already has checkpoints; this run starts from scratch "
              "(use --resume to continue)", flush=True)
    train(cfg, resume=args.resume)
    return 0
