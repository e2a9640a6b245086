"""A run's logs: the loggers, at optimizer steps counted from 1, and the loss read back from the CSV log
(:func:`read_losses`, ``loss.png``).

Run folder ``<out_dir>``: ``logs/csv/version_N/metrics.csv``, ``logs/tensorboard/version_N/`` (step k:
after optimizer step k; a resumed run adds a version), ``loss.png`` (train and validation loss curves).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from fp4lightning.lightning.precision_names import FP4_PRECISIONS
from fp4lightning.train.recipe import RecipeConfig

__all__ = ["make_loggers", "read_losses", "plot_losses", "run_title"]


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


def make_loggers(cfg: RecipeConfig, recorded: dict) -> list:
    """The loggers named by ``trainer.loggers`` (csv, tensorboard, wandb), all writing under ``<out_dir>/logs``,
    at steps counted from 1 (:class:`_StepsFromOne`). ``recorded``: the recipe as the run records it
    (``recipe_to_dict``), wandb's run config."""
    logs = Path(cfg.out_dir) / "logs"
    make = {"csv": lambda: _CSVLogger(save_dir=logs, name="csv"),
            "tensorboard": lambda: _TensorBoardLogger(save_dir=logs, name="tensorboard", default_hp_metric=False),
            "wandb": lambda: _WandbLogger(name=cfg.name, save_dir=str(logs), config=recorded)}
    names = [n.strip() for n in cfg.trainer.loggers.split(",") if n.strip()]
    return [make[name]() for name in names if name in make]


#: loss.png's curves -> the CSV log's column
_LOSS_COLUMNS = (("train", "train/loss"), ("val", "val/loss"))


def _csv_rows(log_dir: Path) -> Iterator[dict]:
    """The rows of every CSVLogger version under ``log_dir``, oldest version first."""
    versions = sorted(log_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1]))
    for path in versions:
        with open(path, newline="") as f:
            yield from csv.DictReader(f)


def _read_csv_losses(log_dir: Path) -> dict[str, dict[int, float]]:
    """``{"train": {step: loss}, "val": {step: loss}}`` (step: optimizer steps taken, from 1) from every
    CSVLogger version under ``log_dir``:
    the versions of one run (its start and its resumes: ``train`` refuses to start another run in a
    folder with logs unless ``--overwrite`` deletes them); later versions overwrite earlier steps."""
    out: dict[str, dict[int, float]] = {"train": {}, "val": {}}
    for row in _csv_rows(log_dir):
        step = int(row["step"])
        for key, column in _LOSS_COLUMNS:
            if row.get(column):
                out[key][step] = float(row[column])
    return out


def read_losses(run_dir: Path) -> dict[str, dict[int, float]]:
    """Train and validation loss per step of the run in ``run_dir`` (its ``logs/csv``, resumes merged)."""
    return _read_csv_losses(Path(run_dir) / "logs" / "csv")


def run_title(cfg: RecipeConfig) -> str:
    """What a run's plots are titled: its folder, precision and, for FP4, the preset and the keys
    overridden (``tiny: fp4, preset paper``; ``tiny-bf16: bf16-mixed``)."""
    title = f"{Path(cfg.out_dir).name}: {cfg.trainer.precision}"
    if cfg.trainer.precision not in FP4_PRECISIONS:
        return title
    changed = cfg.fp4.changes()
    return title + f", preset {cfg.fp4.preset}" + (f" + {', '.join(sorted(changed))}" if changed else "")


def plot_losses(log_dir: Path, png: Path, title: str | None = None) -> Path | None:
    """Train and validation loss against step from every CSV log version (the run and its resumes);
    None if no data. ``title`` (default: the run folder's name; :func:`run_title` names the
    precision and preset) heads the plot and is the PNG's ``Title`` metadata."""
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
    title = title or png.parent.name
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110, metadata={"Title": title})
    plt.close(fig)
    return png
