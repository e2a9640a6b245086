"""``fp4lightning compare``: one recipe trained under several precisions, side by side.

The paper's claims (arXiv 2501.17116, sections 4-5) are comparisons: FP4 against BF16 on
the loss curve and zero-shot accuracy, and ablations that drop DGE or OCC or use direct
casts. This command trains the same recipe once per variant with the same seed, so every
variant starts from the same weights and sees the same batches in the same order, then
writes

* ``loss_curves.png`` - train (smoothed) and validation loss, one line per variant;
* ``comparison.md`` / ``comparison.json`` - final train/validation loss with the relative
  gap to BF16, the zero-shot table (lm-eval, offline tasks by default), and the OCC
  fidelity table (the paper's Table 1 analogue) on the trained model's real activations.

Variants: ``bf16`` (bf16-mixed), ``fp32`` (32-true), ``fp4`` (the ``paper`` preset), or any
FP4 preset name (``w4a4-direct``, ``fp4-no-dge``, ``fp4-no-occ``, ``paper``, and the block-scaled
``nvfp4``, ``mxfp4``, ``mxfp4-rht-sr``).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

from .config import PRESETS

__all__ = ["compare", "variant_overrides", "read_metrics", "add_arguments", "run", "HELP"]

HELP = "train one recipe under several precisions (BF16, FP4, ablations) and compare them"
DEFAULT_VARIANTS = "bf16,fp4,w4a4-direct,fp4-no-dge,fp4-no-occ"
HIGH_PRECISION = {"bf16": "bf16-mixed", "fp32": "32-true"}


def variant_overrides(variant: str) -> list[str]:
    """Recipe overrides that select ``variant``."""
    if variant in HIGH_PRECISION:
        return [f"trainer.precision={HIGH_PRECISION[variant]}"]
    preset = "paper" if variant == "fp4" else variant
    if preset not in PRESETS:
        raise ValueError(f"unknown variant {variant!r}; choose from bf16, fp32, fp4 or an FP4 preset "
                         f"({', '.join(sorted(PRESETS))})")
    return ["trainer.precision=fp4", f"fp4.preset={preset}"]


def read_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{"train": {step: loss}, "val": {step: loss}}`` from a run's CSV logs (resumes merged)."""
    out: dict[str, dict[int, float]] = {"train": {}, "val": {}}
    logs = sorted((run_dir / "logs" / "csv").glob("version_*/metrics.csv"),
                  key=lambda p: int(p.parent.name.split("_")[1]))
    for path in logs:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step = int(row["step"])
                for key, name in (("train", "train/loss"), ("val", "val/loss")):
                    if row.get(name):
                        out[key][step] = float(row[name])
    return out


def _final_train_loss(train: dict[int, float], frac: float = 0.1) -> float:
    """Mean train loss over the last ``frac`` of logged steps (single steps are noisy)."""
    steps = sorted(train)
    tail = steps[-max(1, int(len(steps) * frac)):]
    return sum(train[s] for s in tail) / len(tail)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_curves(metrics: dict[str, dict], png: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, m in metrics.items():
        if m["train"]:
            xs = sorted(m["train"])
            window = max(1, len(xs) // 30)
            ax_t.plot([s + 1 for s in xs], _smooth([m["train"][s] for s in xs], window), label=variant, lw=1.2)
        if m["val"]:
            xs = sorted(m["val"])
            ax_v.plot([s + 1 for s in xs], [m["val"][s] for s in xs], "o-", label=variant, lw=1.2, ms=3)
    for ax, name in ((ax_t, "train loss (moving average)"), (ax_v, "validation loss")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def loss_table(rows: list[dict]) -> str:
    lines = ["| variant | final train loss | vs BF16 | final val loss | vs BF16 | val ppl | wall time |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def gap(key):
            g = r.get(f"{key}_gap")
            return "-" if g is None else f"{100 * g:+.2f}%"
        lines.append(f"| {r['variant']} | {r['train_loss']:.4f} | {gap('train')} | {r['val_loss']:.4f} | "
                     f"{gap('val')} | {math.exp(r['val_loss']):.2f} | {r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def _occ_report(checkpoint: Path, data_dir: Path, seq_len: int, batches: int = 4, batch_size: int = 8) -> list[dict]:
    import torch

    from .analysis import capture_linear_inputs, occ_fidelity_report
    from .checkpoint import load_checkpoint
    from .data import PreparedData, ValWindowDataset

    model, _, _ = load_checkpoint(checkpoint)  # high-precision weights: capture what FP4 would see
    data = PreparedData(data_dir)
    ds = ValWindowDataset(data.shards("val"), seq_len, batches * batch_size)
    windows = [ds[i][:-1] for i in range(len(ds))]
    batch_list = [torch.stack(windows[i:i + batch_size]) for i in range(0, len(windows), batch_size)]
    acts = capture_linear_inputs(model, batch_list)
    return occ_fidelity_report(acts)


def compare(recipe: str | None, overrides: list[str], variants: list[str], out_dir: Path | None = None,
            eval_tasks: str | None = "offline", eval_limit: int | None = None, occ_report: bool = True,
            reuse: bool = False) -> dict:
    """Train ``recipe`` under each variant and write the comparison; returns its JSON summary."""
    from .eval.run import compare_table, evaluate_checkpoint, headline_metrics, results_table
    from .recipe import load_recipe
    from .train import train

    for v in variants:  # fail on a bad variant before hours of training
        variant_overrides(v)
    base = load_recipe(recipe, overrides)
    out_dir = Path(out_dir or f"runs/compare-{base.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"recipe": recipe, "overrides": overrides, "variants": {}, "out_dir": str(out_dir)}
    metrics: dict[str, dict] = {}
    for v in variants:
        run_dir = out_dir / v
        cfg = load_recipe(recipe, [*overrides, f"name={base.name}-{v}", f"out_dir={run_dir}", *variant_overrides(v)])
        last = run_dir / "checkpoints" / "last.ckpt"
        t0 = time.perf_counter()
        if reuse and last.exists():
            print(f"[compare] {v}: reusing {last}", flush=True)
            wall = json.loads((run_dir / "compare_wall.json").read_text())["wall_s"] \
                if (run_dir / "compare_wall.json").exists() else float("nan")
        else:
            print(f"[compare] training variant {v} ({' '.join(variant_overrides(v))})", flush=True)
            train(cfg)
            wall = time.perf_counter() - t0
            (run_dir / "compare_wall.json").write_text(json.dumps({"wall_s": wall}))
        metrics[v] = read_metrics(run_dir)
        if not metrics[v]["val"]:
            raise RuntimeError(f"variant {v}: no validation loss was logged in {run_dir}/logs; "
                               "set trainer.val_check_interval so validation runs at least once")
        summary["variants"][v] = {
            "checkpoint": str(last),
            "train_loss": _final_train_loss(metrics[v]["train"]),
            "val_loss": metrics[v]["val"][max(metrics[v]["val"])],
            "wall_s": wall,
        }
    ref = "bf16" if "bf16" in summary["variants"] else variants[0]
    rows = []
    for v, s in summary["variants"].items():
        r = {"variant": v, **s}
        if v != ref:
            for key in ("train", "val"):
                r[f"{key}_gap"] = s[f"{key}_loss"] / summary["variants"][ref][f"{key}_loss"] - 1
        rows.append(r)
    summary["reference"] = ref
    png = plot_curves(metrics, out_dir / "loss_curves.png", f"{base.name}: {', '.join(variants)}")
    md = [f"# Comparison: {recipe or 'tiny'} {' '.join(overrides)}", "",
          f"Same seed ({base.seed}), initial weights and batch order for every variant. "
          f"Final train loss = mean over the last 10% of steps; gaps are relative to {ref}.", "",
          loss_table(rows), "", f"![loss curves]({png.name})", ""]
    if eval_tasks:
        evals = {}
        for v in variants:
            res = evaluate_checkpoint(summary["variants"][v]["checkpoint"], eval_tasks, limit=eval_limit,
                                      out_dir=out_dir / v / "eval", verbose=False)
            evals[v] = headline_metrics(res)
            summary["variants"][v]["zero_shot"] = evals[v]
        md += ["## Zero-shot (lm-eval)", ""]
        for v in variants:
            md += [f"### {v}", "", results_table(evals[v]), ""]
        fp4 = next((v for v in variants if v not in HIGH_PRECISION), None)
        if fp4 and ref in evals and fp4 != ref:
            md += [f"### {fp4} against {ref}", "", compare_table(evals[fp4], evals[ref], fp4, ref), ""]
    if occ_report:
        from .analysis import format_occ_table

        src = next((v for v in variants if v not in HIGH_PRECISION), variants[0])
        occ = _occ_report(Path(summary["variants"][src]["checkpoint"]), Path(base.data.dir), base.data.seq_len)
        summary["occ_fidelity"] = {"variant": src, "rows": occ}
        md += [f"## OCC fidelity on the trained {src} model's activations (paper Table 1 analogue)", "",
               "Inputs of every FP4 linear layer on held-out batches, quantized per token; pooled over layers.", "",
               format_occ_table(occ), ""]
        from .block_analysis import checkpoint_report, format_block_table  # every format, same tensors

        act_rows, w_rows = checkpoint_report(Path(summary["variants"][src]["checkpoint"]), Path(base.data.dir),
                                             base.data.seq_len)
        summary["block_fidelity"] = {"variant": src, "activations": act_rows, "weights": w_rows}
        md += [f"## Quantization fidelity of every FP4 format on the trained {src} model (SQNR)", "",
               format_block_table(act_rows, w_rows), ""]
    (out_dir / "comparison.md").write_text("\n".join(md))
    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n".join(md), flush=True)
    print(f"\n[compare] wrote {out_dir / 'comparison.md'}, {out_dir / 'comparison.json'}, {png}", flush=True)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", nargs="?", default=None, help="recipe YAML (default: the tiny recipe)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides shared by every variant")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated: bf16, fp32, fp4, or FP4 presets (default: {DEFAULT_VARIANTS})")
    parser.add_argument("--out", default=None, help="output folder (default: runs/compare-<recipe name>)")
    parser.add_argument("--eval-tasks", default="offline",
                        help="lm-eval tasks for the zero-shot table (offline | paper | ...); 'none' skips it")
    parser.add_argument("--eval-limit", type=int, default=None, help="at most this many items per eval task")
    parser.add_argument("--no-occ-report", action="store_true", help="skip the OCC fidelity table")
    parser.add_argument("--reuse", action="store_true",
                        help="reuse variants whose checkpoint already exists in the output folder")


def run(args: argparse.Namespace) -> int:
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not Path(recipe).exists():
        recipe, overrides = None, [recipe, *overrides]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(set(variants)) != len(variants) or not variants:
        raise ValueError(f"--variants must list distinct variants, got {args.variants!r}")
    compare(recipe, overrides, variants, Path(args.out) if args.out else None,
            None if args.eval_tasks == "none" else args.eval_tasks, args.eval_limit,
            not args.no_occ_report, args.reuse)
    return 0
