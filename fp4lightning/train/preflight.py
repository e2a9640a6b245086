"""Checks of the files a command names, made before torch, Lightning and lm-eval are imported.

Importing those takes 5-20 s on a small machine, so a missing data folder or checkpoint found only
where it is read is reported that late. The command line (``train``, ``compare``, ``eval``,
``export-hf``) calls these first: each is a ``stat``, and fails in one line that says how to fix it.
The thorough checks stay where the files are read (a damaged shard, a checkpoint that does not
load); these only bring the common mistakes forward.
"""

from __future__ import annotations

from pathlib import Path

from fp4lightning.data.manifest import prepare_command, require_prepared
from fp4lightning.errors import InputNotFoundError

__all__ = ["check_checkpoint_path", "check_recipe_inputs"]

#: what a checkpoint argument may name, said where one is missing
CHECKPOINT_FORMS = ("a checkpoint written by `fp4lightning train`: runs/<name>/checkpoints/last.ckpt, "
                    "another .ckpt beside it, or the run folder runs/<name>")


def check_checkpoint_path(path: str | Path, what: str = "checkpoint") -> None:
    """Raise :class:`~fp4lightning.errors.InputNotFoundError` naming ``what`` (the argument or
    recipe key) when ``path`` does not exist."""
    if not Path(path).exists():
        raise InputNotFoundError(f"{what} {path} not found; pass {CHECKPOINT_FORMS}")


def check_recipe_inputs(cfg) -> None:
    """The files recipe ``cfg`` reads exist: an explicit ``ckpt_path``, ``init.from_checkpoint`` /
    ``init.from_hf``, and the prepared data in ``data.dir`` (else the command that prepares it, with
    the recipe's data settings)."""
    if cfg.ckpt_path not in (None, "last") and not Path(cfg.ckpt_path).exists():
        raise InputNotFoundError(f"cannot resume: recipe key `ckpt_path` = {cfg.ckpt_path} does not exist "
                                 "(train without --resume / ckpt_path to start fresh)")
    if cfg.init.from_checkpoint:
        check_checkpoint_path(cfg.init.from_checkpoint, "recipe key `init.from_checkpoint` =")
    if cfg.init.from_hf and not Path(cfg.init.from_hf).is_dir():
        raise InputNotFoundError(f"recipe key `init.from_hf` = {cfg.init.from_hf} is not a folder; name a Hugging "
                                 "Face LlamaForCausalLM folder (config.json and weights)")
    d = cfg.data
    require_prepared(d.dir, prepare_command(d.source, d.dir, d.vocab_size, d.val_fraction, d.max_tokens, d.text_key))
