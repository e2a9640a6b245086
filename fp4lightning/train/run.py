"""``fp4lightning train RECIPE [key=value ...] [--resume]``: pretrain a LLaMA from a recipe.

Builds the pieces from a resolved :class:`~fp4lightning.train.recipe.RecipeConfig`: the
:class:`~fp4lightning.data.TokenDataModule`, the
:class:`~fp4lightning.train.module.LlamaLightningModule` (AdamW + warmup/cosine, arXiv
2501.17116 section 7), a Lightning ``Trainer`` with the run's callbacks
(:mod:`fp4lightning.train.callbacks`) and loggers (:mod:`fp4lightning.train.loss_log`), and FP4
through :func:`precision_setup`; then fits it. Whether the run resumes, and from which checkpoint,
is :mod:`fp4lightning.train.resume`'s.

Run folder ``<out_dir>`` (``runs/<name>``)::

    config.yaml          resolved recipe (also inside every checkpoint)
    tokenizer.json       copy of the data's tokenizer (also inside every checkpoint)
    checkpoints/         step=NNNNNN.ckpt (latest) and last.ckpt
    logs/csv/version_N/metrics.csv, logs/tensorboard/version_N/  (step k: after optimizer step k)
    loss.png             train / validation loss curves
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from fp4lightning.config import FP4Config
from fp4lightning.console import program
from fp4lightning.data import TokenDataModule, prepare_command
from fp4lightning.distributed.comm import PeerLostError, lost_peer
from fp4lightning.errors import check_writable_dir
from fp4lightning.lightning.nonfinite import NonFiniteError
from fp4lightning.lightning.precision import FP4Precision
from fp4lightning.lightning.precision_names import FP4_PRECISIONS, MIXED_PRECISION
from fp4lightning.lightning.strategy import FP4DDPStrategy, FP4FSDPStrategy, is_fsdp
from fp4lightning.lightning.trainer import Trainer, quiet_lightning
from fp4lightning.train.callbacks import run_callbacks
from fp4lightning.train.checkpoint import AtomicCheckpointIO
from fp4lightning.train.fingerprint import record_fingerprint
from fp4lightning.train.loss_log import make_loggers, plot_losses, run_title
from fp4lightning.train.module import LlamaLightningModule
from fp4lightning.train.peers import (TIMEOUT_ENV, PeerTable, heard_lost_host, lost_host, process_group_timeout,
                                      tell_lost_host, timed_out)
from fp4lightning.train.recipe import WIRE_FORMAT, RecipeConfig, RecipeError, recipe_to_dict, recipe_to_yaml
from fp4lightning.train.resume import clear_for_start, describe_resume, latest_checkpoint, plan_start, resume_command
from fp4lightning.train.run_lock import run_lock

__all__ = ["train", "build", "make_module", "make_strategy", "precision_setup", "PrecisionSetup", "TrainResult"]


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
    """How ``trainer.precision`` is realised (see :func:`precision_setup`)."""

    trainer_precision: str | None  # Lightning's precision string (None when a plugin decides)
    plugins: tuple  # Trainer plugins
    fp4: FP4Config | None  # the recipe's FP4Config (RecipeConfig.fp4_config); None: high precision
    convert_in_module: bool  # True: LlamaLightningModule.configure_model applies convert_to_fp4


def precision_setup(cfg: RecipeConfig) -> PrecisionSetup:
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
    return PrecisionSetup(None, (FP4Precision(cfg.fp4_config, compute_dtype=compute,
                                              max_consecutive_skips=cfg.trainer.max_nonfinite_skips),),
                          cfg.fp4_config, False)


def make_strategy(cfg: RecipeConfig):
    """The strategy, carrying ``trainer.grad_comm`` as its gradient wire format (fp4lightning.distributed.comm)."""
    wire = WIRE_FORMAT[cfg.trainer.grad_comm]
    timeout = process_group_timeout()  # FP4LIGHTNING_DIST_TIMEOUT; None: Lightning's default
    extra = {"timeout": timeout} if timeout is not None else {}
    if not is_fsdp(cfg.trainer.strategy):
        if cfg.world_size > 1 and (wire != "fp32" or cfg.trainer.precision in FP4_PRECISIONS):
            # named explicitly: fp4lightning.Trainer alone would pick FP8 E4M3 for every FP4 run
            return FP4DDPStrategy(grad_format=wire, start_method="popen", **extra)
        if extra and cfg.world_size > 1 and cfg.trainer.strategy in ("auto", "ddp"):
            return DDPStrategy(start_method="popen", **extra)  # what "ddp" names, with the timeout
        return cfg.trainer.strategy
    # FSDP2 (fully_shard) applied by LlamaLightningModule.configure_model with FP4 weight all-gather;
    # every rank is a data-parallel rank (no tensor parallelism); sharded (DCP) checkpoint folders
    return FP4FSDPStrategy(data_parallel_size=cfg.trainer.devices * cfg.trainer.num_nodes, grad_format=wire, **extra)


def make_module(cfg: RecipeConfig, precision: PrecisionSetup | None = None, tokenizer_json: str | None = None):
    """The LightningModule for ``cfg`` (the model itself is built later, in ``configure_model``).

    Its ``hparams.recipe`` is the recipe as the run records it (``recipe_to_dict``, made here once):
    in every checkpoint, and the source of ``config.yaml`` and the loggers' run config."""
    precision = precision or precision_setup(cfg)
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


def _datamodule(cfg: RecipeConfig, verify_data: bool) -> TokenDataModule:
    """The recipe's data (raises ``DataNotPreparedError`` naming the command that prepares it), whose
    tokenizer fits ``model.vocab_size``."""
    dm = TokenDataModule(
        cfg.data.dir,
        seq_len=cfg.data.seq_len,
        micro_batch_size=cfg.data.micro_batch_size,
        train_batches=cfg.schedule.max_steps * cfg.accumulate_grad_batches,
        val_batches=cfg.data.val_batches,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        prepare_hint=prepare_command(cfg.data.source, cfg.data.dir, cfg.data.vocab_size, cfg.data.val_fraction,
                                     cfg.data.max_tokens, cfg.data.text_key),
        verify=verify_data,
    )
    vocab = cfg.llama_config().vocab_size
    if dm.tokenizer.vocab_size > vocab:
        raise RecipeError(
            f"the tokenizer in {cfg.data.dir} has {dm.tokenizer.vocab_size} tokens but `model.vocab_size` is "
            f"{vocab}; set model.vocab_size={dm.tokenizer.vocab_size} or prepare the data with --vocab-size {vocab}")
    return dm


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
    check_writable_dir(out, "recipe key `out_dir` =", RecipeError, "choose another out_dir")
    ckpt_path, previous = plan_start(cfg, resume, overwrite)
    dm = _datamodule(cfg, verify_data)
    precision = precision_setup(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = make_module(cfg, precision, tokenizer_json=dm.tokenizer.to_str())
    interactive = sys.stdout.isatty()
    loggers = make_loggers(cfg, module.hparams.recipe)
    own_callbacks = run_callbacks(cfg, dm, ckpt_path, interactive)
    clear_for_start(out, previous)
    accum = cfg.accumulate_grad_batches
    trainer = Trainer(
        accelerator=cfg.trainer.accelerator,
        devices=cfg.trainer.devices,
        num_nodes=cfg.trainer.num_nodes,
        strategy=make_strategy(cfg),
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
        callbacks=[*own_callbacks, PeerTable(), *(callbacks or [])],
        enable_progress_bar=interactive,
        # the resolved recipe and the parameter count are printed instead: Lightning's table adds a FLOPs
        # column of zeros (it would need a forward pass of an example batch to count them)
        enable_model_summary=False,
        logger=loggers,
        use_distributed_sampler=False,  # the DataModule shards positions by rank itself
        default_root_dir=out,
    )
    return trainer, module, dm, ckpt_path


#: Messages Lightning prints on every run of this trainer that say nothing actionable to its users,
#: besides those fp4lightning.Trainer hides wherever it is used (``quiet_lightning``: a deprecated
#: pytree class, cloud-service tips, the checkpoint folder of a resume): the model summary cannot
#: size mixed precisions (it warns for Lightning's own "bf16-mixed" too). Silenced only inside
#: ``train`` (a library does not change its caller's warning filters).
_QUIET_WARNINGS = (r"Precision .* is not supported by the model summary",)


def _quiet_lightning():
    """Hide Lightning's noise (:func:`~fp4lightning.lightning.trainer.quiet_lightning`) and
    ``_QUIET_WARNINGS`` while ``train`` runs."""
    return quiet_lightning(extra_warnings=_QUIET_WARNINGS)


def train(cfg: RecipeConfig, resume: bool = False, callbacks: list | None = None,
          verify_data: bool = False, overwrite: bool = False,
          argv: Sequence[str] | None = None) -> TrainResult | None:
    """Train ``cfg``; prints the resolved config first and where the outputs are at the end.

    Returns the :class:`TrainResult` on rank 0 (None on other ranks). Re-raises the
    ``KeyboardInterrupt`` / ``SystemExit`` of an interrupted run after reporting it.
    ``overwrite``: start afresh in an ``out_dir`` holding an earlier run, deleting its
    checkpoints and logs (see :func:`build`). ``argv``: the recipe and overrides as given to
    ``fp4lightning train``, for the command an interrupted run prints
    (:func:`~fp4lightning.train.resume.resume_command`). ``out_dir`` is locked while the run lasts
    (:func:`~fp4lightning.train.run_lock.run_lock`): a run into a folder another run holds, with
    ``resume`` or ``overwrite`` too, raises ``RunInUseError`` naming that run's process first.
    """
    check_writable_dir(Path(cfg.out_dir), "recipe key `out_dir` =", RecipeError, "choose another out_dir")
    with _quiet_lightning(), run_lock(cfg.out_dir):
        return _train(cfg, resume, callbacks, verify_data, overwrite, argv)


def _record_run(cfg: RecipeConfig, module: LlamaLightningModule, dm: TokenDataModule, ckpt_path: str | None) -> None:
    """Rank 0, before fitting: print the resolved recipe and the model, write ``config.yaml`` (the recipe
    the checkpoints record) and the tokenizer beside the checkpoints, and say what a resume changes."""
    out = Path(cfg.out_dir)
    llama = cfg.llama_config()
    recorded = recipe_to_yaml(module.hparams.recipe)
    print(f"resolved recipe:\n{recorded}", flush=True)
    print(f"model: {llama} = {llama.num_params() / 1e6:.1f}M parameters; "
          f"gradient accumulation {cfg.accumulate_grad_batches}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(recorded)
    shutil.copyfile(dm.data.dir / "tokenizer.json", out / "tokenizer.json")
    if ckpt_path:
        print(f"resuming from {ckpt_path}", flush=True)
        for line in describe_resume(cfg, ckpt_path):
            print(line, flush=True)


def _train(cfg: RecipeConfig, resume: bool, callbacks: list | None, verify_data: bool,
           overwrite: bool, argv: Sequence[str] | None = None) -> TrainResult | None:
    trainer, module, dm, ckpt_path = build(cfg, resume, callbacks, verify_data=verify_data, overwrite=overwrite)
    out = Path(cfg.out_dir)
    if trainer.is_global_zero:
        _record_run(cfg, module, dm, ckpt_path)
    status, result, stopped_at = "failed", None, None
    threads = torch.get_num_threads()
    try:
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        if trainer.is_global_zero:  # at the run's thread count, before its first step
            record_fingerprint(cfg, trainer.strategy.root_device, out)
        # weights_only: a checkpoint never runs code when it is loaded (the resume checks,
        # fp4lightning.train.resume, load it the same way)
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
            result = _report(trainer, out, status, stopped_at, resume_command(cfg, argv), run_title(cfg))
    return result


def _peer_lost_error(exc: RuntimeError, trainer, out: Path):
    """A collective's error for a rank that went away (killed, crashed, its host gone) as one line naming
    that rank (its host's ranks where the error names an address: ``fp4lightning.train.peers``, else
    ``fp4lightning.distributed.comm.lost_peer``) and the last checkpoint; a collective past the process-group
    timeout as one line saying so; None for any other error."""
    table = next((c.peers for c in trainer.callbacks if isinstance(c, PeerTable)), [])
    peer = lost_host(exc, table, trainer.global_rank)
    if peer is not None:
        tell_lost_host(peer)  # for a survivor that sees only this rank leave
    else:
        peer = lost_peer(exc, trainer.global_rank, trainer.world_size)
        if peer == "another rank" and len({address for address, _ in table}) > 1:  # only hosts can be named
            peer = heard_lost_host() or peer
    if peer is None and not timed_out(exc):
        return None
    ckpt = latest_checkpoint(out)
    saved = (f"last checkpoint {ckpt} (continue with the same command and --resume)" if ckpt
             else "no checkpoint yet (the run has to start again)")
    at = f"at step {trainer.global_step}; {saved}"
    if peer is None:
        limit = process_group_timeout()
        waited = f"{TIMEOUT_ENV}={limit.total_seconds():g} s" if limit else f"30 min; set {TIMEOUT_ENV} to shorten it"
        return PeerLostError(f"a collective got no answer within the process-group timeout ({waited}): another "
                             f"rank's host is down, the network between the hosts is cut, or a rank hangs; so rank "
                             f"{trainer.global_rank} stopped {at}")
    return PeerLostError(f"{peer} of {trainer.world_size} stopped (killed or crashed; see its own output), so "
                         f"rank {trainer.global_rank} stopped too {at}")


def _validate_at_end(trainer, module, dm, cfg: RecipeConfig) -> None:
    """One more validation after the last step when ``max_steps`` is not a multiple of
    ``val_every_n_steps`` (Lightning validates only on those multiples), so the run's last
    validation loss - the closing banner's and ``compare``'s "final" one - is measured on the
    final weights, not up to ``val_every_n_steps - 1`` steps before them."""
    if not trainer.global_step or trainer.global_step % cfg.trainer.val_every_n_steps == 0:
        return
    # Lightning logs a validation inside fit at its count before the step that triggered it (the
    # loggers add one, fp4lightning.train.loss_log), and one run by validate() after fit at the count
    # after it; shift the counter back for this call so the final row lands at the last step, as inside fit
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    shift = loop is not None and isinstance(getattr(loop, "_batches_that_stepped", None), int)
    if shift:
        loop._batches_that_stepped -= 1
    try:
        trainer.validate(module, datamodule=dm, verbose=False)
    finally:
        if shift:
            loop._batches_that_stepped += 1


def _report(trainer, out: Path, status: str, stopped_at: int | None, resume: str, title: str) -> TrainResult:
    """The closing banner on success; on failure what was saved and the command that resumes (stderr).
    ``stopped_at``: the step that stopped the run (non-finite), else it names the steps completed."""
    png = plot_losses(out / "logs" / "csv", out / "loss.png", title)
    val = trainer.callback_metrics.get("val/loss")
    val_loss = float(val) if val is not None else None
    logs = [out / "logs" / "csv", out / "logs" / "tensorboard"]
    ckpt = latest_checkpoint(out)
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
    print(f"logs       : {logs[0]} (CSV), {logs[1]} (TensorBoard: {program('tensorboard')} --logdir {logs[1]})")
    print(f"loss curve : {png if png else '(no logged steps)'}")
    print("=" * 72, flush=True)
    return TrainResult(out, ckpt.resolve() if ckpt else None, logs, png, val_loss, False)
