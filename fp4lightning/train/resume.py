"""Whether a run starts afresh or resumes, and from which checkpoint.

``--resume`` (or ``ckpt_path=last``) continues from the checkpoint of ``<out_dir>/checkpoints`` that
records the newest step and loads, and refuses one whose model, data order (:data:`DATA_ORDER_KEYS`),
data, tokenizer or method keys (:data:`METHOD_KEYS`) differ from the recipe's
(:class:`ResumeMismatchError`). A fresh run refuses an ``out_dir`` that holds an earlier run's
checkpoints or logs unless ``overwrite`` (``--overwrite``) deletes them first, so every folder
holds one run. The resume checks compare the typed recipe with the recipe the checkpoint recorded.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from fp4lightning.console import program
from fp4lightning.data import data_fingerprint
from fp4lightning.data.tokenizer import TOKENIZER_FILE, Tokenizer
from fp4lightning.errors import InputNotFoundError
from fp4lightning.lightning.precision_names import FP4_PRECISIONS
from fp4lightning.lightning.strategy import is_fsdp
from fp4lightning.train.checkpoint import (LAST_CKPT, CheckpointError, read_checkpoint, remove_stale_temporaries,
                                           resume_candidates)
from fp4lightning.train.init_weights import same_tokenizer
from fp4lightning.train.module import warmup_cosine
from fp4lightning.train.recipe import RecipeConfig, RecipeError, flat_recipe_dict

__all__ = ["ResumeMismatchError", "DATA_ORDER_KEYS", "METHOD_KEYS", "WORLD_SIZE_KEY", "check_resumable",
           "recorded_method_keys", "plan_start", "clear_for_start", "latest_checkpoint", "describe_resume",
           "resume_command", "loader_state"]


class ResumeMismatchError(CheckpointError):
    """The checkpoint loads but belongs to another model, data order or tokenizer than the recipe's:
    no other checkpoint of the folder is tried instead."""


#: recipe keys that decide which samples each optimizer step reads (fp4lightning.data.sampling: the
#: sample at position ``p`` is a function of ``(seed, p)`` over the windows of ``data.seq_len + 1``
#: tokens of ``data.dir``, split into micro-batches per rank): a resumed run must keep them, or it
#: re-reads or skips data. ``WORLD_SIZE_KEY`` is ``trainer.devices * trainer.num_nodes``; it may change
#: where the checkpoint's data loader recorded its global sample position (``samples_consumed``): the
#: resumed run continues there, every step reading the samples it would have read on the old world size
#: (docs/distributed.md, "Resuming on another world size").
WORLD_SIZE_KEY = "trainer.devices x trainer.num_nodes"
DATA_ORDER_KEYS = ("data.dir", "data.seq_len", "data.micro_batch_size", "data.global_batch_size", WORLD_SIZE_KEY,
                   "seed")

#: recipe keys a resumed run keeps: ``optimizer.states`` decides the optimizer state's layout in the checkpoint,
#: ``trainer.grad_comm`` how every gradient is rounded
METHOD_KEYS = ("optimizer.states", "trainer.grad_comm")


def _recipe_value(cfg: RecipeConfig, key: str):
    """The value of a dotted recipe key (or :data:`WORLD_SIZE_KEY`) in the typed recipe."""
    if key == WORLD_SIZE_KEY:
        return cfg.world_size
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _recorded_data_order(recorded: dict) -> dict:
    """``DATA_ORDER_KEYS`` -> value of a checkpoint's recorded recipe dict (the keys it records)."""
    flat = flat_recipe_dict(recorded)
    if "trainer.devices" in flat and "trainer.num_nodes" in flat:
        flat[WORLD_SIZE_KEY] = flat["trainer.devices"] * flat["trainer.num_nodes"]
    return {k: flat[k] for k in DATA_ORDER_KEYS if k in flat}


def loader_state(ckpt: dict) -> dict:
    """The training data loader's state a checkpoint holds (``ResumableDataLoader.state_dict``; ``{}`` if none)."""
    loops = ckpt.get("loops") or {}
    states = ((loops.get("fit_loop") or {}).get("state_dict") or {}).get("combined_loader") or []
    return states[0] if states and isinstance(states[0], dict) else {}


def _check_data_order(path: Path, ckpt: dict, cfg: RecipeConfig) -> list[str]:
    """Raise ResumeMismatchError naming every data-order key that changed since ``path`` was written;
    return the keys it does not record (a checkpoint from before this check).

    ``data.dir`` is compared by content where the checkpoint has a fingerprint (a moved corpus
    resumes, one prepared again in place does not), else by path. The world size may change where
    the checkpoint's loader recorded its global sample position (see :data:`DATA_ORDER_KEYS`)."""
    recorded = ckpt["hyper_parameters"].get("recipe") or {}
    saved = _recorded_data_order(recorded)
    now = {k: _recipe_value(cfg, k) for k in DATA_ORDER_KEYS}
    continues = "samples_consumed" in loader_state(ckpt)  # at its global sample position, on any world size
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
        elif saved[key] == now[key] or (key == "data.dir" and same_dir) or (key == WORLD_SIZE_KEY and continues):
            continue
        changed.append(f"{key} = {saved[key]!r} in the checkpoint, {now[key]!r} now"
                       + (" (holding other data)" if key == "data.dir" and old_fp is not None else "")
                       + (" (its data loader predates recording the global sample position, which another world "
                          "size continues from)" if key == WORLD_SIZE_KEY else ""))
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
    now = {k: _recipe_value(cfg, k) for k in METHOD_KEYS}
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


def _check_resume_tokenizer(path: Path, ckpt: dict, cfg: RecipeConfig) -> list[str]:
    """Raise ResumeMismatchError if ``data.dir`` was prepared with another tokenizer than the checkpoint's
    (the check ``init.*`` makes: fp4lightning.train.init_weights.check_init_tokenizer); ``["tokenizer"]`` if the
    checkpoint has none."""
    saved = ckpt.get("tokenizer")
    if not saved:
        return ["tokenizer"]
    data_tok = Path(cfg.data.dir) / TOKENIZER_FILE
    if not data_tok.is_file():
        return []  # not prepared: TokenDataModule names the command that prepares it
    ckpt_tok, new_tok = Tokenizer.from_str(saved), Tokenizer.from_file(data_tok)
    if not same_tokenizer(ckpt_tok, new_tok):
        raise ResumeMismatchError(
            f"cannot resume from {path}: it was trained with a different tokenizer ({ckpt_tok.vocab_size} tokens) "
            f"than {data_tok} ({new_tok.vocab_size} tokens); {cfg.data.dir} was prepared again since, and its token "
            f"ids mean other tokens. Prepare {cfg.data.dir} again with the arguments that made the checkpoint's "
            "tokenizer (`fp4lightning data prepare` with the same --source and --vocab-size), point data.dir at "
            "that data, or train from scratch on the new data in a new out_dir")
    return []


def _check_layout(path: Path, ckpt: dict, cfg: RecipeConfig) -> None:
    """Raise ResumeMismatchError for a sharded checkpoint folder (what FSDP saves) under a recipe whose strategy
    resumes from checkpoint files only: Lightning would fail on it inside ``fit`` (IsADirectoryError)."""
    if not Path(path).is_dir() or is_fsdp(cfg.trainer.strategy):
        return
    wrote = ((ckpt["hyper_parameters"].get("recipe") or {}).get("trainer") or {}).get("strategy")
    wrote = wrote if isinstance(wrote, str) and is_fsdp(wrote) else "fsdp"
    raise ResumeMismatchError(
        f"cannot resume from {path}: it is a sharded checkpoint folder (what trainer.strategy={wrote} saves), which "
        f"trainer.strategy={cfg.trainer.strategy} cannot resume from; resume with trainer.strategy={wrote}, or start "
        f"from its weights in a new out_dir with init.from_checkpoint={path} (a fresh optimizer and schedule)")


def check_resumable(path: Path, cfg: RecipeConfig) -> list[str]:
    """Raise CheckpointError (naming the file) unless ``path`` is an fp4lightning checkpoint of this model,
    data order and tokenizer (ResumeMismatchError for the last three). Returns what it could not check:
    the keys a checkpoint written before these checks does not record."""
    ckpt, _ = read_checkpoint(path)  # weights_only load; corrupt / foreign files raise CheckpointError
    _check_layout(path, ckpt, cfg)
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
    unchecked = _check_resume_tokenizer(path, ckpt, cfg)  # first: the more specific message
    unchecked = _check_data_order(path, ckpt, cfg) + unchecked
    _check_method_keys(path, ckpt, cfg)
    return unchecked


def _note_unchecked(path: Path, unrecorded: list[str]) -> None:
    if unrecorded and _is_rank_zero():
        print(f"note: {path} does not record {', '.join(unrecorded)} (written before fp4lightning checked them); "
              "resuming without checking that they are unchanged", file=sys.stderr, flush=True)


def _newest_resumable(ckpt_dir: Path, cfg: RecipeConfig) -> Path:
    """The checkpoint of ``ckpt_dir`` recording the newest step (``last.ckpt`` on a tie) that loads, saying
    which ones it skipped and why."""
    candidates = resume_candidates(ckpt_dir) if ckpt_dir.is_dir() else []
    if not candidates:
        raise InputNotFoundError(
            f"cannot resume: checkpoint {ckpt_dir / LAST_CKPT} does not exist and {ckpt_dir} has no step=N.ckpt "
            "(train without --resume / ckpt_path to start fresh)")
    problems = []
    for path in candidates:
        try:
            unrecorded = check_resumable(path, cfg)
        except ResumeMismatchError:
            raise  # another model / data order / tokenizer: an older checkpoint is no better
        except CheckpointError as e:
            problems.append(f"{path.name}: {e}")
            continue
        if problems and _is_rank_zero():
            print("warning: skipped unusable checkpoints:\n  " + "\n  ".join(problems)
                  + f"\nresuming from {path} instead", file=sys.stderr, flush=True)
        _note_unchecked(path, unrecorded)
        return path
    raise CheckpointError(f"cannot resume: no checkpoint in {ckpt_dir} loads ({'; '.join(problems)})")


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
    if ckpt == "last":
        return str(_newest_resumable(Path(cfg.out_dir) / "checkpoints", cfg))
    path = Path(ckpt)
    if not path.exists():
        raise InputNotFoundError(
            f"cannot resume: checkpoint {path} does not exist (train without --resume / ckpt_path to start fresh)")
    _note_unchecked(path, check_resumable(path, cfg))
    return str(path)


def _is_rank_zero() -> bool:
    """Whether this process is the launch's first (read from the launcher's variables: it may run before
    Lightning has set up the ranks)."""
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def _previous_run(out: Path) -> list[Path]:
    """What an earlier run left in ``out``: its ``checkpoints`` folder (if it holds a checkpoint), its ``logs``."""
    found = []
    ckpt_dir = out / "checkpoints"
    if ckpt_dir.is_dir() and resume_candidates(ckpt_dir):
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


def plan_start(cfg: RecipeConfig, resume: bool, overwrite: bool) -> tuple[str | None, list[Path]]:
    """``(checkpoint to resume from or None, what an earlier run left that --overwrite deletes)``, checked
    before anything is built; nothing is deleted yet (:func:`clear_for_start`)."""
    ckpt_path = _resolve_ckpt(cfg, resume)
    if overwrite and ckpt_path is not None:
        raise RecipeError("--overwrite starts a new run in out_dir; it cannot be combined with --resume / "
                          "recipe key `ckpt_path`")
    # rank 0 alone: ranks Lightning launches later find the folder as rank 0 left it
    previous = _check_fresh_out_dir(Path(cfg.out_dir), overwrite) if ckpt_path is None and _is_rank_zero() else []
    return ckpt_path, previous


def clear_for_start(out: Path, previous: list[Path]) -> None:
    """After every other check: ``--overwrite`` deletes the earlier run (:func:`plan_start`), and the
    temporary files of a save that was killed go."""
    if previous:
        _remove_previous_run(out, previous)
    if _is_rank_zero():
        remove_stale_temporaries(out / "checkpoints")


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


def latest_checkpoint(out: Path) -> Path | None:
    """The checkpoint of run folder ``out`` that ``--resume`` tries first; None if it has none."""
    ckpt_dir = out / "checkpoints"
    candidates = resume_candidates(ckpt_dir) if ckpt_dir.is_dir() else []
    return candidates[0] if candidates else None


def describe_resume(cfg: RecipeConfig, ckpt_path: str) -> list[str]:
    """Lines saying how the recipe's schedule differs from the one the checkpoint trained with, and the effect."""
    ckpt, _ = read_checkpoint(ckpt_path)
    hp = ckpt.get("hyper_parameters", {})
    step = int(ckpt.get("global_step", 0))
    old = {k: hp.get(k) for k in ("max_steps", "warmup_fraction", "min_lr_ratio", "lr")}
    new = {"max_steps": cfg.schedule.max_steps, "warmup_fraction": cfg.schedule.warmup_fraction,
           "min_lr_ratio": cfg.schedule.min_lr_ratio, "lr": cfg.optimizer.lr}
    names = {"lr": "optimizer.lr"}
    changed = [k for k in new if old[k] is not None and old[k] != new[k]]
    world = _describe_world_size(cfg, ckpt)
    if not changed:
        return world

    def lr_at(h: dict) -> float:
        warmup = max(1, math.ceil(h["warmup_fraction"] * h["max_steps"]))  # as LlamaLightningModule
        return h["lr"] * warmup_cosine(step, h["max_steps"], warmup, h["min_lr_ratio"])

    lines = world + [f"resume: {names.get(k, 'schedule.' + k)} changed {old[k]} -> {new[k]} since the checkpoint"
                     for k in changed]
    lines.append(f"resume: the warmup + cosine LR schedule is recomputed for the new values: the first resumed step, "
                 f"{step + 1}, runs at LR {lr_at(new):.3e} (the checkpoint's schedule would give {lr_at(old):.3e}); "
                 f"it decays to {new['min_lr_ratio'] * new['lr']:.3e} by step {new['max_steps']}")
    return lines


def _describe_world_size(cfg: RecipeConfig, ckpt: dict) -> list[str]:
    """A line saying what a resume on another world size does to the data (docs/distributed.md)."""
    state = loader_state(ckpt)
    saved_world = state.get("world_size")
    if "samples_consumed" not in state or saved_world is None or saved_world == cfg.world_size:
        return []
    step, batch = int(ckpt.get("global_step", 0)), cfg.data.global_batch_size
    return [f"resume: {cfg.world_size} rank(s) continue the run of {saved_world} (gradient accumulation "
            f"{state.get('accumulate')} -> {cfg.accumulate_grad_batches}) at global sample {state['samples_consumed']}: "
            f"step {step + 1} reads samples {step * batch}..{(step + 1) * batch - 1}, as on {saved_world} rank(s), "
            "each rank other ones of them"]


def resume_command(cfg: RecipeConfig, argv: Sequence[str] | None = None) -> str:
    """The shell command that continues the run of ``cfg``, ready to copy and paste (it starts with
    :func:`~fp4lightning.console.program`, so it runs where the environment is not activated).

    ``argv`` (the recipe and ``key=value`` overrides the run was started with) is repeated as
    given, without a ``ckpt_path=...``, then ``--resume``; without it (``train`` called from
    Python) the run's own ``config.yaml``. Where the run named a checkpoint (``ckpt_path``, which
    ``--resume`` does not override, and the recipe file may set) it ends in ``ckpt_path=last``.
    """
    words = ([w for w in argv if w.split("=", 1)[0].strip() != "ckpt_path"] if argv is not None
             else [str(Path(cfg.out_dir) / "config.yaml")])
    return f'{program()} {shlex.join(["train", *words, "--resume" if cfg.ckpt_path is None else "ckpt_path=last"])}'
