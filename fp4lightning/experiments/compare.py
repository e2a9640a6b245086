"""``fp4lightning compare``: one recipe trained under several precisions and seeds, side by side.

The paper's claims (arXiv 2501.17116, sections 4-5) are comparisons: FP4 against BF16 on
the loss curve and zero-shot accuracy, and ablations that drop DGE or OCC or use direct
casts. This command trains the same recipe once per variant and seed. Within one seed every
variant starts from the same weights and sees the same batches in the same order (the
recipe's ``seed`` keys both the initialisation and the data order); ``--seeds N`` repeats
the whole set with seeds ``seed, seed+1, ..., seed+N-1``. It writes

* ``loss_curves.png`` - train (smoothed) and validation loss, the mean over seeds with a
  band of one standard deviation;
* ``comparison.md`` / ``comparison.json`` - final train/validation loss (mean, standard
  deviation and per-seed values) with the gap to the reference, paired by seed; the
  zero-shot table (lm-eval, offline tasks by default) with its spread; the OCC fidelity
  table (the paper's Table 1 analogue) on a trained model's real activations; and, with
  ``--dge-probe N``, the weights' quantization error and in-interval positions over
  training (``fp4lightning.experiments.dge_probe``);
* ``summary.json`` - the machine-readable core: ``{"recipe", "steps", "tokens", "run_set", "variants":
  {NAME: {"preset", "lr", "seeds", "final_val_loss", "mean", "std"}}}``; ``run_set`` is the resolved
  recipe without :data:`NOT_THE_RUN` and :data:`PER_RUN` (what ``compare-join`` checks).

``--reuse`` (:func:`reuse_decision`) reuses a finished run only when the recipe it recorded equals this
one's, resumes a cut-off run or one whose only difference is a larger ``schedule.max_steps``, and starts
any other over.

Variants: ``bf16`` (bf16-mixed), ``fp32`` (32-true), ``fp4`` (the ``paper`` preset), any FP4
preset name (``w4a4-direct``, ``fp4-no-dge``, ``fp4-no-occ``, ``paper``, and the block-scaled
``nvfp4``, ``mxfp4``, ``mxfp4-rht-sr``), an experiment from :data:`EXPERIMENT_VARIANTS`
(``fp4-dge-frozen``), or the rest of the paper's method on top of ``paper`` (:data:`METHOD_VARIANTS`:
``fp4+states`` E4M3/FP16 optimizer states, ``fp4+comm`` FP8 E4M3 gradient exchange, ``fp4+all`` both; every
other variant keeps the recipe's ``optimizer.states`` and ``trainer.grad_comm``). ``NAME@lr=X`` runs a
variant at peak learning rate X (``bf16@lr=1e-3,bf16@lr=4e-3``: one entry per rate). The reference for the
gaps is ``--reference``, by default the BF16 variant with the lowest mean validation loss
(the tuned baseline of a learning-rate sweep).

The modules that train and measure (torch, Lightning) are imported inside the functions that use them,
so ``compare-join`` and the variant parsing load in a fraction of a second.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from fp4lightning.config import PRESETS
from fp4lightning.errors import UsageError
from fp4lightning.experiments.stats import paired_t, verdict
from fp4lightning.eval.run import evaluate_checkpoint, headline_metrics, metric_kind
from fp4lightning.lightning.precision_names import HIGH_PRECISION_VARIANTS
from fp4lightning.train.fingerprint import disagreement, parts_set_apart, read_fingerprint
from fp4lightning.train.recipe import flat_recipe_dict, load_recipe, recipe_to_dict

__all__ = ["compare", "variant_overrides", "parse_variant", "Variant", "spread", "paired_gap", "paired_diff",
           "EXPERIMENT_VARIANTS", "METHOD_VARIANTS"]

#: variants that are an FP4 preset plus FP4Config overrides (the DGE experiments, docs/results.md)
EXPERIMENT_VARIANTS: dict[str, tuple[str, dict]] = {
    # STE times DGE's per-element factor frozen at initialisation (fp4lightning.experiments.dge_probe)
    "fp4-dge-frozen": ("fp4-no-dge", {"dge_frozen_factor": True}),
    # OCC's compensation folded into the activation operand in E4M3 (docs/perf.md, "OCC on the GPU")
    "fp4-occ-e4m3": ("paper", {"occ_fold_e4m3": True}),
}
#: the ``paper`` preset plus the method's other two parts (arXiv 2501.17116 section 4): reduced-precision
#: optimizer states and FP8 E4M3 gradient communication (on one device its rounding, fp4lightning.distributed.grad_comm_sim).
#: ``fp4+states`` / ``fp4+all`` use the LLaMA-2 recipes' states, both moments in FP16 (the paper's text);
#: the ``-fp8`` variants the released code's E4M3 first moment + FP16 second (``fp8-fp16``, MS-AMP O2).
#: Summaries written before the ``-fp8`` names existed used ``fp8-fp16`` under the plain names
#: (:data:`LEGACY_METHOD_OVERRIDES`); ``compare-join`` tells them apart by the overrides each summary records.
METHOD_VARIANTS: dict[str, dict[str, str]] = {
    "fp4+states": {"optimizer.states": "fp16"},
    "fp4+states-fp8": {"optimizer.states": "fp8-fp16"},
    "fp4+comm": {"trainer.grad_comm": "fp8-e4m3"},
    "fp4+all": {"optimizer.states": "fp16", "trainer.grad_comm": "fp8-e4m3"},
    "fp4+all-fp8": {"optimizer.states": "fp8-fp16", "trainer.grad_comm": "fp8-e4m3"},
}
#: what the method variants meant in a summary.json that records no overrides per variant
LEGACY_METHOD_OVERRIDES: dict[str, dict[str, str]] = {
    "fp4+states": {"optimizer.states": "fp8-fp16"},
    "fp4+comm": {"trainer.grad_comm": "fp8-e4m3"},
    "fp4+all": {"optimizer.states": "fp8-fp16", "trainer.grad_comm": "fp8-e4m3"},
}


@dataclass(frozen=True)
class Variant:
    """One column of the comparison: a precision/preset and optionally its own learning rate."""

    name: str  # as given on the command line, e.g. "bf16@lr=1e-3"
    base: str  # "bf16", "fp4", a preset or an experiment variant
    lr: float | None = None  # None: the recipe's

    @property
    def preset(self) -> str:
        """The FP4 preset (``paper`` for ``fp4``) or the high-precision name (``bf16``, ``fp32``)."""
        if self.base in HIGH_PRECISION_VARIANTS:
            return self.base
        if self.base in EXPERIMENT_VARIANTS or self.base in METHOD_VARIANTS:
            return self.base
        return "paper" if self.base == "fp4" else self.base

    @property
    def high_precision(self) -> bool:
        return self.base in HIGH_PRECISION_VARIANTS

    def overrides(self) -> list[str]:
        if self.base in HIGH_PRECISION_VARIANTS:
            out = [f"trainer.precision={HIGH_PRECISION_VARIANTS[self.base]}"]
        elif self.base in EXPERIMENT_VARIANTS:
            preset, changes = EXPERIMENT_VARIANTS[self.base]
            out = ["trainer.precision=fp4", f"fp4.preset={preset}",
                   *(f"fp4.overrides.{k}={json.dumps(v)}" for k, v in changes.items())]
        elif self.base in METHOD_VARIANTS:
            out = ["trainer.precision=fp4", "fp4.preset=paper",
                   *(f"{k}={v}" for k, v in METHOD_VARIANTS[self.base].items())]
        else:
            out = ["trainer.precision=fp4", f"fp4.preset={self.preset}"]
        if self.lr is not None:
            out.append(f"optimizer.lr={self.lr!r}")
        return out


def parse_variant(spec: str) -> Variant:
    """``NAME`` or ``NAME@lr=X`` -> :class:`Variant`; unknown names and settings fail naming them."""
    base, _, rest = spec.strip().partition("@")
    known = ("bf16", "fp32", "fp4", *sorted(PRESETS), *EXPERIMENT_VARIANTS, *METHOD_VARIANTS)
    if base not in known:
        raise UsageError(f"unknown variant {base!r}; choose from {', '.join(dict.fromkeys(known))}")
    lr = None
    if rest:
        key, _, value = rest.partition("=")
        if key != "lr" or not value:
            raise UsageError(f"variant {spec!r}: only '@lr=VALUE' may follow the name (e.g. bf16@lr=1e-3)")
        try:
            lr = float(value)
        except ValueError:
            raise UsageError(f"variant {spec!r}: learning rate {value!r} is not a number") from None
        if not lr > 0:
            raise UsageError(f"variant {spec!r}: learning rate must be positive")
    return Variant(spec.strip(), base, lr)


def variant_overrides(variant: str) -> list[str]:
    """Recipe overrides that select ``variant`` (``NAME`` or ``NAME@lr=X``)."""
    return parse_variant(variant).overrides()


def spread(values: list[float]) -> dict:
    """``{"mean", "std", "n", "values"}``; ``std`` is the sample standard deviation, None below 2 values."""
    vals = [float(v) for v in values]
    return {"mean": statistics.fmean(vals) if vals else float("nan"),
            "std": statistics.stdev(vals) if len(vals) > 1 else None, "n": len(vals), "values": vals}


def paired_gap(values: list[float], reference: list[float]) -> dict:
    """Relative gap ``v / ref - 1`` per seed (same seed, same start and data), with its spread."""
    if len(values) != len(reference):
        raise ValueError(f"paired_gap: {len(values)} values against {len(reference)} reference values")
    gaps = [v / r - 1 for v, r in zip(values, reference)]
    test = paired_t(gaps)
    return {**spread(gaps), **{k: test[k] for k in ("t", "df", "p", "ci95")}}


def paired_diff(values: list[float], reference: list[float]) -> dict:
    """Absolute difference ``v - ref`` per seed (e.g. FP4 minus BF16 loss, nats), with its spread."""
    if len(values) != len(reference):
        raise ValueError(f"paired_diff: {len(values)} values against {len(reference)} reference values")
    return spread([v - r for v, r in zip(values, reference)])


def _pm(s: dict, fmt: str = ".4f", scale: float = 1.0) -> str:
    """``mean ± std`` (just the mean for one seed)."""
    if s["std"] is None:
        return f"{scale * s['mean']:{fmt}}"
    return f"{scale * s['mean']:{fmt}} ± {scale * s['std']:{fmt.lstrip('+')}}"


def _resolved(g: dict) -> str:
    """Whether a paired gap is resolved (paired t-test, p < 0.05), with its p-value; where it is not, the
    difference its 95% interval rules out (:func:`fp4lightning.experiments.stats.verdict`)."""
    if g.get("std") is None:
        return "n/a (1 seed)"
    if g.get("p") is None:  # a gap recorded before the t-test was: test its per-seed values
        g = {**g, **paired_t(g["values"])}
    return verdict(g)


def _interval(g: dict) -> str:
    """The 95% confidence interval of a paired relative gap, in percent (``-`` for one seed)."""
    ci = g.get("ci95") or (paired_t(g["values"])["ci95"] if len(g.get("values", ())) > 1 else None)
    return "-" if ci is None else f"[{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]%"


#: resolved-recipe keys that say where a run writes, what it is called or how many threads and loader
#: workers it uses, not what it computes: a run folder copied under another ``--out``, run with other
#: thread counts or reading the same prepared corpus from another path is the same run
NOT_THE_RUN = ("name", "out_dir", "ckpt_path", "data.dir", "data.num_workers", "trainer.num_threads",
               "trainer.loggers", "trainer.peak_tflops")
#: set per run by ``compare`` itself (``seed``) or by each variant (recorded per variant as preset and lr):
#: left out of summary.json's ``run_set``, which says what all of a run set's runs share
PER_RUN = ("seed", "trainer.precision", "fp4.preset", "optimizer.lr")
#: the differences a resume can make up for: a longer schedule
_LONGER = {"schedule.max_steps", "schedule.max_tokens"}


def recipe_identity(cfg, leave_out: tuple[str, ...] = NOT_THE_RUN) -> dict:
    """The resolved recipe as flat ``{dotted key: value}`` (JSON values), without the keys in ``leave_out``
    (a key or any key under it)."""
    flat = json.loads(json.dumps(flat_recipe_dict(recipe_to_dict(cfg)), default=str))
    return {k: v for k, v in flat.items() if not any(k == x or k.startswith(x + ".") for x in leave_out)}


def _run_set(cfg) -> dict:
    """summary.json's ``run_set``: :func:`recipe_identity` without :data:`PER_RUN`, plus the corpus by
    content (``data.dir`` is left out by path: the same data may sit elsewhere; other data may not)."""
    from fp4lightning.data import data_fingerprint

    out = recipe_identity(cfg, NOT_THE_RUN + PER_RUN)
    fingerprint = data_fingerprint(cfg.data.dir)
    if fingerprint is not None:
        out["data.fingerprint"] = fingerprint
    return out


def _differences(old: dict, new: dict) -> dict[str, tuple]:
    """``{key: (old, new)}`` for every key whose value differs (``"(unset)"`` where a side lacks it)."""
    return {k: (old.get(k, "(unset)"), new.get(k, "(unset)")) for k in sorted(set(old) | set(new))
            if old.get(k, "(unset)") != new.get(k, "(unset)")}


def _say(diff: dict[str, tuple], limit: int = 6) -> str:
    items = [f"{k} {a} -> {b}" for k, (a, b) in diff.items()]
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def reuse_decision(run_dir: Path, cfg, need_probe: bool = False) -> tuple[str, str]:
    """What ``compare --reuse`` does with ``run_dir`` for the resolved recipe ``cfg``: ``("reuse", why)``,
    ``("resume", why)`` or ``("train", why)`` (start over).

    A run is reused only when the recipe it recorded (``config.yaml``, written by training) equals ``cfg``
    apart from :data:`NOT_THE_RUN` and it finished (``compare_wall.json``); with the same recipe but cut
    off, or finished with a shorter schedule (only ``schedule.max_steps`` / ``max_tokens`` differ, the new
    one longer), it is resumed from its ``last.ckpt``; anything else starts over."""
    from fp4lightning.train.resume import recorded_method_keys

    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return "train", f"no {last} to reuse"
    if need_probe and not (run_dir / "dge_probe.jsonl").exists():
        return "train", "starting over (the run has no DGE probe record)"
    recorded = run_dir / "config.yaml"
    if not recorded.exists():
        return "train", f"starting over (no {recorded.name} records the run's recipe)"
    try:
        old = recipe_identity(load_recipe(recorded))
        # a config.yaml from before optimizer.states / trainer.grad_comm: what that run trained with
        old.update(recorded_method_keys(yaml.safe_load(recorded.read_text()) or {})[0])
    except Exception as e:  # a recipe of another schema version: it cannot be shown to be the same run
        return "train", f"starting over ({recorded} cannot be read: {str(e).splitlines()[0]})"
    diff = _differences(old, recipe_identity(cfg))
    finished = (run_dir / "compare_wall.json").exists()
    if not diff:
        return ("reuse", "finished with the same recipe") if finished else \
            ("resume", "cut off, same recipe: continued from its last.ckpt")
    if set(diff) <= _LONGER and "schedule.max_steps" in diff and diff["schedule.max_steps"][1] > diff["schedule.max_steps"][0]:
        return "resume", (f"{_say(diff)}, otherwise the same recipe: continued to the new length from its last.ckpt "
                          "(the LR schedule is recomputed for the new length)")
    return "train", f"starting over ({_say(diff)})"

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


def _mean_curve(curves: list[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Steps every seed logged, the mean over seeds and the sample std (0 for one seed)."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    mean = [statistics.fmean(c[s] for c in curves) for s in steps]
    std = [statistics.stdev(c[s] for c in curves) if len(curves) > 1 else 0.0 for s in steps]
    return steps, mean, std


def plot_curves(metrics: dict[str, list[dict]], png: Path, title: str) -> Path:
    """Train (moving average) and validation loss per variant: mean over seeds, +-1 std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant, runs in metrics.items():
        for ax, key, style in ((ax_t, "train", "-"), (ax_v, "val", "o-")):
            curves = [r[key] for r in runs if r[key]]
            if not curves:
                continue
            if key == "train":  # smooth each seed, then average
                window = max(1, len(curves[0]) // 30)
                curves = [dict(zip(sorted(c), _smooth([c[s] for s in sorted(c)], window))) for c in curves]
            steps, mean, std = _mean_curve(curves)
            xs = steps  # optimizer steps taken, as logged (from 1)
            (line,) = ax.plot(xs, mean, style, label=variant, lw=1.2, ms=3)
            if len(curves) > 1:
                ax.fill_between(xs, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                                color=line.get_color(), alpha=0.2, lw=0)
    n = max((len(r) for r in metrics.values()), default=1)
    band = f"; mean over {n} seeds, band = 1 std" if n > 1 else ""
    for ax, name in ((ax_t, "train loss (moving average)"), (ax_v, "validation loss")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("cross-entropy (nats / token)")
        ax.set_title(name + band)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def loss_table(rows: list[dict], reference: str) -> str:
    """Markdown: final losses as mean ± std over seeds, the paired gap to ``reference``."""
    lines = [f"| variant | lr | seeds | final train loss | final val loss | val - {reference} | val vs {reference} "
             "| 95% interval | paired t-test | val ppl | wall time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("val_gap")
        if g is None:
            diff = gap = ci = resolved = "-"
        else:
            diff, gap, ci, resolved = _pm(r["val_diff"], "+.4f"), _pm(g, "+.2f", 100) + "%", _interval(g), _resolved(g)
            if r.get("numerics_vs_reference", "same") != "same":
                resolved += f"; numerics {r['numerics_vs_reference']}"
        lines.append(f"| {r['variant']} | {r['lr']:g} | {r['val_loss']['n']} | {_pm(r['train_loss'])} | "
                     f"{_pm(r['val_loss'])} | {diff} | {gap} | {ci} | {resolved} | "
                     f"{math.exp(r['val_loss']['mean']):.2f} | {r['wall_s']['mean'] / 60:.1f} min |")
    return "\n".join(lines)


def per_seed_table(rows: list[dict], seeds: list[int]) -> str:
    lines = ["| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---" * (len(seeds) + 1) + "|"]
    for r in rows:
        cells = [f"{v:.4f} / {t:.4f}" for v, t in zip(r["val_loss"]["values"], r["train_loss"]["values"])]
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def val_curve_table(metrics: dict[str, list[dict]]) -> str:
    """Validation loss (mean over seeds) against step."""
    steps = sorted(set.union(*(set(r["val"]) for runs in metrics.values() for r in runs)))
    lines = ["| step | " + " | ".join(str(s) for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
    for v, runs in metrics.items():
        cells = []
        for s in steps:
            vals = [r["val"][s] for r in runs if s in r["val"]]
            cells.append(f"{statistics.fmean(vals):.3f}" if len(vals) == len(runs) else "-")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zero_shot_table(evals: dict[str, list[dict]]) -> str:
    """Every task and metric, mean ± std over seeds, one column per variant; accuracies in percent (as
    ``fp4lightning eval``'s results.md), the other metrics as lm-eval reports them."""
    variants = list(evals)
    keys = list(dict.fromkeys((t, m) for runs in evals.values() for e in runs for t, ms in e.items() for m in ms))
    lines = ["| task | metric | " + " | ".join(variants) + " |", "|---|---" + "|---:" * len(variants) + "|"]
    for task, metric in keys:
        percent = metric_kind(task, metric) in ("acc", "acc_norm")  # as `fp4lightning eval`'s tables
        cells = []
        for v in variants:
            vals = [e[task][metric] for e in evals[v] if metric in e.get(task, {})]
            if not vals:
                cells.append("-")
            else:
                cells.append(_pm(spread(vals), ".2f", 100) if percent else _pm(spread(vals), ".4g"))
        label = f"{metric} (%)" if percent else metric
        lines.append(f"| {task} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: DGE probe columns: (record key, label, format, scale)
_PROBE_COLUMNS = (("rel_err", "weight quant. error (rel. MSE, %)", ".3f", 100.0),
                  ("mean_dist", "mean distance to grid (x delta)", ".4f", 1.0),
                  ("near_grid", "share within 0.1 delta of grid (%)", ".2f", 100.0),
                  ("dge_mean", "mean DGE factor f'", ".4f", 1.0))


def _probe_summary(probes: dict[str, list[list[dict]]]) -> tuple[dict, str]:
    """Per variant and probed step: each column's spread over seeds; and its markdown table."""
    out: dict[str, dict] = {}
    lines = ["| variant | step | " + " | ".join(c[1] for c in _PROBE_COLUMNS) + " |",
             "|---|---" + "|---" * len(_PROBE_COLUMNS) + "|"]
    for v, runs in probes.items():
        if not runs or not all(runs):
            continue
        steps = sorted(set.intersection(*({r["step"] for r in recs} for recs in runs)))
        out[v] = {}
        for step in steps:
            recs = [next(r for r in recs if r["step"] == step) for recs in runs]
            for r in recs:
                r["near_grid"] = r["position_hist"][0] + r["position_hist"][-1]
            out[v][step] = {key: spread([r[key] for r in recs]) for key, *_ in _PROBE_COLUMNS}
            out[v][step]["position_hist"] = [statistics.fmean(col) for col in zip(*(r["position_hist"] for r in recs))]
        shown = steps if len(steps) <= 6 else [steps[round(i * (len(steps) - 1) / 5)] for i in range(6)]
        for step in shown:
            lines.append(f"| {v} | {step} | " + " | ".join(_pm(out[v][step][k], f, sc) for k, _, f, sc in _PROBE_COLUMNS)
                         + " |")
    return out, "\n".join(lines)


def _plot_probe(summary: dict, png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for v, by_step in summary.items():
        steps = sorted(by_step)
        for ax, key in zip(axes[:2], ("rel_err", "near_grid")):
            mean = [by_step[s][key]["mean"] for s in steps]
            std = [by_step[s][key]["std"] or 0.0 for s in steps]
            (line,) = ax.plot(steps, mean, "o-", ms=3, lw=1.2, label=v)
            ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)],
                            color=line.get_color(), alpha=0.2, lw=0)
        hist = by_step[steps[-1]]["position_hist"]
        n = len(hist)
        axes[2].step([(i + 0.5) / n for i in range(n)], hist, where="mid", label=f"{v} (step {steps[-1]})")
    for ax, t in zip(axes, ("weight quantization error (relative MSE)", "share of weights within 0.1 delta of grid",
                            "position inside the E2M1 interval (final)")):
        ax.set_title(t)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("optimizer step")
    axes[2].set_xlabel("(|W s| - left grid point) / delta")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def compare(recipe: str | None, overrides: list[str], variants: list[str], out_dir: Path | None = None,
            eval_tasks: str | None = "offline", eval_limit: int | None = None, occ_report: bool = True,
            reuse: bool = False, seeds: int = 1, dge_probe: int = 0, reference: str | None = None,
            allow_mixed_numerics: bool = False) -> dict:
    """Train ``recipe`` under each variant and seed and write the comparison; returns its JSON summary.
    Gaps pair runs whose numerics fingerprints agree (:func:`check_pairs`; ``allow_mixed_numerics``
    pairs the others too, and the table says so)."""
    parsed = _check_variants(variants, seeds, reference)  # before hours of training
    base = load_recipe(recipe, overrides)
    from fp4lightning.experiments.dge_probe import read_probe  # torch, Lightning: once the recipe is known valid

    seed_list = [base.seed + i for i in range(seeds)]
    out_dir = Path(out_dir or f"runs/compare-{base.name}")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"recipe": recipe, "overrides": overrides, "seeds": seed_list, "variants": {},
                     "out_dir": str(out_dir)}
    metrics: dict[str, list[dict]] = {v.name: [] for v in parsed}
    probes: dict[str, list[list[dict]]] = {v.name: [] for v in parsed}
    lrs: dict[str, float] = {}
    for seed in seed_list:  # seed-major: a cut-off run still leaves complete seeds
        for v in parsed:
            run_dir = out_dir / v.name / f"seed{seed}"
            cfg = load_recipe(recipe, [*overrides, f"seed={seed}", f"name={base.name}-{v.name}-seed{seed}",
                                       f"out_dir={run_dir}", *v.overrides()])
            lrs[v.name] = cfg.optimizer.lr
            metrics[v.name].append(_run_variant(v, seed, cfg, run_dir, reuse, dge_probe))
            if dge_probe:
                probes[v.name].append(read_probe(run_dir / "dge_probe.jsonl"))
    rows = _aggregate(summary, parsed, metrics, lrs, seed_list, reference, allow_mixed_numerics)
    md, png = _loss_section(f"# Comparison: {recipe or 'tiny'} {' '.join(overrides)}", base, parsed, seed_list,
                            summary["reference"], rows, metrics, out_dir)
    if dge_probe:
        md += _probe_section(summary, probes, out_dir)
    if eval_tasks:
        md += _zero_shot_section(summary, metrics, out_dir, eval_tasks, eval_limit)
    if occ_report:
        md += _fidelity_sections(summary, parsed, metrics, base, seed_list[0])
    _write_outputs(out_dir, summary, _summary_core(recipe, base, parsed, lrs, seed_list, summary), md, png)
    return summary


def _check_variants(variants: list[str], seeds: int, reference: str | None) -> list[Variant]:
    """The parsed variants; a bad or repeated variant, seed count or reference fails naming it."""
    parsed = [parse_variant(v) for v in variants]
    if len({v.name for v in parsed}) != len(parsed) or not parsed:
        raise UsageError(f"variants must be distinct and at least one, got {variants}")
    if seeds < 1:
        raise UsageError(f"--seeds must be at least 1, got {seeds}")
    if reference is not None and reference not in {v.name for v in parsed}:
        raise UsageError(f"--reference {reference!r} is not one of the variants {[v.name for v in parsed]}")
    return parsed


def _run_variant(v: Variant, seed: int, cfg, run_dir: Path, reuse: bool, dge_probe: int) -> dict:
    """Train, resume or (``--reuse``) reuse one variant's run for one seed; its record: the checkpoint,
    final train / validation loss, wall time and the loss curves (:func:`read_losses`)."""
    from fp4lightning.train.loss_log import read_losses

    last = run_dir / "checkpoints" / "last.ckpt"
    action, why = reuse_decision(run_dir, cfg, need_probe=bool(dge_probe)) if reuse else ("train", "")
    if action == "reuse":
        print(f"[compare] {v.name} seed {seed}: reusing {last} ({why})", flush=True)
        wall = json.loads((run_dir / "compare_wall.json").read_text())["wall_s"]
    else:
        wall = _train_run(v, seed, cfg, run_dir, resume=action == "resume", why=why, dge_probe=dge_probe)
    m = read_losses(run_dir)
    if not m["val"]:
        raise RuntimeError(f"variant {v.name} seed {seed}: no validation loss was logged in {run_dir}/logs; "
                           "set trainer.val_every_n_steps so validation runs at least once")
    return {"seed": seed, "checkpoint": str(last), "train_loss": _final_train_loss(m["train"]),
            "val_loss": m["val"][max(m["val"])], "wall_s": wall, "numerics": read_fingerprint(run_dir), **m}


def _train_run(v: Variant, seed: int, cfg, run_dir: Path, resume: bool, why: str, dge_probe: int) -> float:
    """Train ``cfg`` into ``run_dir`` (``resume``: on from its last.ckpt, bit-exact); the run's wall time,
    a resumed run's being the finished part's plus this one (unknown, NaN, for a part that was cut off)."""
    from fp4lightning.experiments.dge_probe import DGEProbe
    from fp4lightning.train.run import train

    t0 = time.perf_counter()
    wall_file = run_dir / "compare_wall.json"  # written only when a run finished
    before = json.loads(wall_file.read_text())["wall_s"] if resume and wall_file.exists() else float("nan")
    print(f"[compare] {'resuming' if resume else 'training'} {v.name} seed {seed}"
          + (f": {why}" if why else f" ({' '.join(v.overrides())})"), flush=True)
    callbacks = [DGEProbe(run_dir / "dge_probe.jsonl", dge_probe)] if dge_probe else []
    # a run started over replaces what an earlier compare left in run_dir
    wall_file.unlink(missing_ok=True)  # finished again only when this training returns
    train(cfg, resume=resume, callbacks=callbacks, overwrite=not resume)
    wall = before + time.perf_counter() - t0 if resume else time.perf_counter() - t0
    wall_file.write_text(json.dumps({"wall_s": wall}))
    return wall


def check_pairs(name: str, reference: str, mine: dict[int, dict | None], theirs: dict[int, dict | None],
                allow_mixed: bool, overrides: tuple[list[str], list[str]] = ([], [])) -> str:
    """Whether the runs of ``name`` and ``reference`` of each seed both have computed the same numbers
    (:func:`~fp4lightning.train.fingerprint.disagreement` of their fingerprints, leaving out the parts their
    recipe ``overrides`` choose differently): ``"same"``; else a :class:`UsageError` naming the first
    difference, or with ``allow_mixed`` the words the table shows."""
    apart = parts_set_apart(*overrides)
    why = {seed: disagreement(mine[seed], theirs[seed], apart) for seed in mine if seed in theirs}
    bad = {seed: w for seed, w in why.items() if w}
    if not bad:
        return "same"
    seed, first = next(iter(bad.items()))
    if not allow_mixed:
        raise UsageError(f"{name} and {reference} seed {seed} did not compute the same numbers ({first}); pair "
                         "runs of one machine kind and one code's numerics, or pass --allow-mixed-numerics to "
                         "pair them anyway (the table then says so)")
    return f"mixed ({len(bad)} of {len(why)} seeds: {first})"


def _default_reference(means: dict[str, float], bf16: list[str]) -> str:
    """The BF16 variant with the lowest mean validation loss (the tuned baseline of a learning-rate
    sweep), else the first variant."""
    return min(bf16, key=means.__getitem__) if bf16 else next(iter(means))


def _aggregate(summary: dict, parsed: list[Variant], metrics: dict[str, list[dict]], lrs: dict[str, float],
               seed_list: list[int], reference: str | None, allow_mixed: bool = False) -> list[dict]:
    """Fill ``summary``'s variants (spreads over seeds; gaps to the reference paired by seed) and its
    ``reference``; returns the rows of the loss table."""
    for v in parsed:
        runs = metrics[v.name]
        summary["variants"][v.name] = {
            "preset": v.preset, "lr": lrs[v.name], "seeds": seed_list,
            "runs": [{k: r[k] for k in ("seed", "checkpoint", "train_loss", "val_loss", "wall_s", "numerics")}
                     for r in runs],
            **{k: spread([r[k] for r in runs]) for k in ("train_loss", "val_loss", "wall_s")},
        }
    if reference is None:
        reference = _default_reference({n: s["val_loss"]["mean"] for n, s in summary["variants"].items()},
                                       [v.name for v in parsed if v.base == "bf16"])
    summary["reference"] = reference
    ref = summary["variants"][reference]
    rows = []
    for v in parsed:
        s = summary["variants"][v.name]
        if v.name != reference:
            s["numerics_vs_reference"] = check_pairs(
                v.name, reference, {r["seed"]: r["numerics"] for r in s["runs"]},
                {r["seed"]: r["numerics"] for r in ref["runs"]}, allow_mixed,
                (v.overrides(), next(p for p in parsed if p.name == reference).overrides()))
            for key in ("train", "val"):
                s[f"{key}_gap"] = paired_gap(s[f"{key}_loss"]["values"], ref[f"{key}_loss"]["values"])
                s[f"{key}_diff"] = paired_diff(s[f"{key}_loss"]["values"], ref[f"{key}_loss"]["values"])
        rows.append({"variant": v.name, **s})
    return rows


def _loss_section(title: str, base, parsed: list[Variant], seed_list: list[int], reference: str, rows: list[dict],
                  metrics: dict[str, list[dict]], out_dir: Path) -> tuple[list[str], Path]:
    """The report's Markdown lines on the losses (tables and curves), and the plot it shows."""
    seeds_note = (f"{len(seed_list)} seeds ({', '.join(map(str, seed_list))}); values are mean ± sample standard "
                  f"deviation over seeds" if len(seed_list) > 1 else f"one seed ({seed_list[0]})")
    png = plot_curves({v: [{"train": r["train"], "val": r["val"]} for r in runs] for v, runs in metrics.items()},
                      out_dir / "loss_curves.png", f"{base.name}: {', '.join(v.name for v in parsed)}")
    md = [title, "",
          f"{base.schedule.max_steps} steps, {seeds_note}. Within a seed every variant starts from the same "
          f"weights and sees the same batches in the same order. Final train loss = mean over the last 10% of "
          f"logged steps. Gaps are relative to {reference}, computed per seed (paired) and then averaged; "
          "a gap is resolved at p < 0.05 (paired t-test over seeds); where it is not, its 95% interval says "
          "how large a difference the runs rule out.", "",
          loss_table(rows, reference), "", "Final validation / train loss per seed:", "", per_seed_table(rows, seed_list), "",
          "Validation loss against step (mean over seeds):", "",
          val_curve_table({v: [{"val": r["val"]} for r in runs] for v, runs in metrics.items()}), "",
          f"![loss curves]({png.name})", ""]
    return md, png


def _probe_section(summary: dict, probes: dict[str, list[list[dict]]], out_dir: Path) -> list[str]:
    """The DGE probe's table and plot (``--dge-probe``), recorded in ``summary``."""
    probe_summary, table = _probe_summary(probes)
    summary["dge_probe"] = {v: {str(k): s for k, s in by.items()} for v, by in probe_summary.items()}
    probe_png = _plot_probe(probe_summary, out_dir / "dge_probe.png")
    return ["## Weights inside their E2M1 intervals (DGE probe)", "",
            "Pooled over every FP4 layer (in BF16 runs: the layers FP4 would quantize, with the paper's "
            "per-channel scales). Positions are (|W s| - left grid point) / delta; DGE's factor f' is 1/k at "
            "grid points and peaks at mid-points.", "", table, "", f"![DGE probe]({probe_png.name})", ""]


def _zero_shot_section(summary: dict, metrics: dict[str, list[dict]], out_dir: Path, eval_tasks: str,
                       eval_limit: int | None) -> list[str]:
    """Every run's checkpoint evaluated with lm-eval (recorded per run in ``summary``); the table."""
    evals: dict[str, list[dict]] = {}
    for name, runs in metrics.items():
        evals[name] = []
        for r, run_s in zip(runs, summary["variants"][name]["runs"]):
            res = evaluate_checkpoint(r["checkpoint"], eval_tasks, limit=eval_limit,
                                      out_dir=out_dir / name / f"seed{r['seed']}" / "eval", verbose=False)
            run_s["zero_shot"] = headline_metrics(res)
            evals[name].append(run_s["zero_shot"])
    return ["## Zero-shot (lm-eval)", "", zero_shot_table(evals), ""]


def _fidelity_sections(summary: dict, parsed: list[Variant], metrics: dict[str, list[dict]], base,
                       seed: int) -> list[str]:
    """OCC fidelity and every format's SQNR on the first FP4 variant's (else the first variant's) trained
    model of ``seed``, the set's first seed; recorded in ``summary``."""
    from fp4lightning.experiments.format_fidelity import checkpoint_format_report, format_fidelity_table
    from fp4lightning.experiments.occ_fidelity import checkpoint_occ_report, format_occ_table

    src = next((v for v in parsed if not v.high_precision), parsed[0]).name
    checkpoint, data_dir = Path(metrics[src][0]["checkpoint"]), Path(base.data.dir)
    occ = checkpoint_occ_report(checkpoint, data_dir, base.data.seq_len)
    summary["occ_fidelity"] = {"variant": src, "seed": seed, "rows": occ}
    md = [f"## OCC fidelity on the trained {src} model's activations (seed {seed}, paper Table 1 analogue)", "",
          "Inputs of every FP4 linear layer on held-out batches, quantized per token; pooled over layers.", "",
          format_occ_table(occ), ""]
    act_rows, w_rows, g_rows = checkpoint_format_report(checkpoint, data_dir, base.data.seq_len, gradients=True)
    summary["block_fidelity"] = {"variant": src, "seed": seed, "activations": act_rows, "weights": w_rows,
                                 "gradients": g_rows}
    return md + [f"## Quantization fidelity of every FP4 format on the trained {src} model (SQNR)", "",
                 format_fidelity_table(act_rows, w_rows, g_rows), ""]


def _summary_core(recipe: str | None, base, parsed: list[Variant], lrs: dict[str, float], seed_list: list[int],
                  summary: dict) -> dict:
    """summary.json: the machine-readable core of the comparison (the module docstring has its schema)."""
    tokens = base.schedule.max_steps * base.data.global_batch_size * base.data.seq_len
    return {"recipe": recipe or "tiny", "steps": base.schedule.max_steps, "tokens": tokens,
            # what every run of the set shares: compare-join refuses a file whose record differs
            "run_set": _run_set(base),
            "variants": {v.name: {"preset": v.preset, "lr": lrs[v.name], "seeds": seed_list,
                                  "overrides": v.overrides(),
                                  "numerics": [r["numerics"] for r in summary["variants"][v.name]["runs"]],
                                  "final_val_loss": summary["variants"][v.name]["val_loss"]["values"],
                                  "mean": summary["variants"][v.name]["val_loss"]["mean"],
                                  "std": summary["variants"][v.name]["val_loss"]["std"]} for v in parsed}}


def _write_outputs(out_dir: Path, summary: dict, core: dict, md: list[str], png: Path) -> None:
    """summary.json, comparison.md and comparison.json; the report on stdout."""
    (out_dir / "summary.json").write_text(json.dumps(core, indent=2))
    (out_dir / "comparison.md").write_text("\n".join(md))
    (out_dir / "comparison.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n".join(md), flush=True)
    print(f"\n[compare] wrote {out_dir / 'comparison.md'}, {out_dir / 'comparison.json'}, "
          f"{out_dir / 'summary.json'}, {png}", flush=True)


# ----------------------------------------------------------------------------- joining summaries
def _same_recipe(a: str, b: str) -> bool:
    """Two recipe paths as written in summaries: the same string, file (resolved from here) or content."""
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if not (pa.is_file() and pb.is_file()):
        return False
    return pa.resolve() == pb.resolve() or pa.read_bytes() == pb.read_bytes()


def _with_legacy_method_keys(run_set: dict, path: Path) -> dict:
    """A ``run_set`` written before some recipe keys existed, with the values its runs trained with where
    they are known: ``optimizer.states`` fp32 (torch's AdamW); ``trainer.compile`` false (nothing was
    compiled); on one device ``trainer.grad_comm`` fp32 (no gradient exchange). Over several devices an FP4
    variant exchanged FP8 E4M3 and a BF16 one fp32, which one run set cannot record: left unset, so joining
    it with a newer summary is refused."""
    missing = [k for k in ("optimizer.states", "trainer.grad_comm", "trainer.compile") if k not in run_set]
    if not missing:
        return run_set
    world = run_set.get("trainer.devices", 1) * run_set.get("trainer.num_nodes", 1)
    known = {"optimizer.states": "fp32", "trainer.compile": False,
             **({"trainer.grad_comm": "fp32"} if world == 1 else {})}
    filled = {k: known[k] for k in missing if k in known}
    if filled:
        print(f"[compare-join] note: {path} predates {', '.join(missing)}; its runs trained with "
              f"{', '.join(f'{k}={v}' for k, v in filled.items())}", flush=True)
    return {**run_set, **filled}


def join_summaries(paths: list[Path], reference: str | None = None,
                   allow_mixed_numerics: bool = False) -> tuple[dict, str]:
    """Join ``summary.json`` files of one run set (seeds run on other machines or at other times, whose run
    folders are gone) into one summary of the same schema, and a Markdown table: every variant's final
    validation loss over all its seeds, and its gap to ``reference`` paired over the seeds both share.

    The files must agree on steps and tokens and on ``run_set``, the resolved recipe without the keys each
    run may set otherwise (:data:`NOT_THE_RUN`: names, folders, the corpus path, thread counts) or that
    are recorded per variant or seed (:data:`PER_RUN`); the refusal names the keys that differ. A file
    written before ``run_set`` was recorded is checked on its recipe path only (the same string, or the
    same file or content as seen from here), with a printed note. A variant must agree on its preset and
    learning rate; a seed that two files both report must have the same value (else they are different
    runs: refused). ``reference`` defaults, as in :func:`compare`, to the BF16 variant with the lowest mean.
    A variant must also agree on the recipe overrides it records (a file that records none is read with
    :data:`LEGACY_METHOD_OVERRIDES`). Gaps pair two runs only where their numerics fingerprints agree
    (:func:`check_pairs`): a run recorded without one cannot be shown to, and is paired only with
    ``allow_mixed_numerics``, which the table then says.
    """
    if not paths:
        raise UsageError("give at least one summary.json")
    joined: dict = {}
    seeds_of: dict[str, dict[int, float]] = {}
    numerics_of: dict[str, dict[int, dict | None]] = {}
    first_set: tuple[dict, Path] | None = None  # the first file's run_set, and that file
    for path in map(Path, paths):
        head, variants, run_set = _read_summary(path)
        joined = joined or {**head, "variants": {}}
        first_set = _check_run_set(path, joined, head, run_set, first_set)
        _add_seeds(path, joined, seeds_of, variants)
        for name, v in variants.items():
            numerics_of.setdefault(name, {}).update(zip(v["seeds"], v["numerics"]))
    if first_set is not None:
        joined["run_set"] = first_set[0]
    for name, got in seeds_of.items():
        seeds = sorted(got)
        s = spread([got[k] for k in seeds])
        joined["variants"][name].update(seeds=seeds, final_val_loss=s["values"], mean=s["mean"], std=s["std"],
                                        numerics=[numerics_of[name].get(k) for k in seeds])
    names = list(joined["variants"])
    if reference is None:
        reference = _default_reference({n: joined["variants"][n]["mean"] for n in names},
                                       [n for n in names if joined["variants"][n]["preset"] == "bf16"])
    elif reference not in names:
        raise UsageError(f"--reference {reference!r} is not one of the variants {names}")
    joined["reference"] = reference
    return joined, _joined_table(joined, seeds_of, numerics_of, reference, allow_mixed_numerics)


def _read_summary(path: Path) -> tuple[dict, dict, dict | None]:
    """``(head, variants, run_set)`` of one summary.json: recipe, steps and tokens; each variant's preset,
    lr, seeds and final validation losses; the run set (None in a file written before it was recorded,
    completed by :func:`_with_legacy_method_keys` in one written before the method keys)."""
    if not path.is_file():
        raise UsageError(f"{path} does not exist (a summary.json written by fp4lightning compare)")
    try:
        doc = json.loads(path.read_text())
        head = {k: doc[k] for k in ("recipe", "steps", "tokens")}
        variants = {name: {k: v[k] for k in ("preset", "lr", "seeds", "final_val_loss")}
                    for name, v in doc["variants"].items()}
        for name, v in variants.items():
            rec = doc["variants"][name]
            v["overrides"] = list(rec["overrides"]) if "overrides" in rec else _legacy_overrides(name)
            v["numerics"] = list(rec.get("numerics") or [None] * len(v["seeds"]))
        run_set = doc.get("run_set")
        if run_set is not None and not isinstance(run_set, dict):
            raise TypeError(f"run_set is a {type(run_set).__name__}, not a mapping")
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"{path} is not a compare summary.json ({type(e).__name__}: {e})") from e
    return head, variants, None if run_set is None else _with_legacy_method_keys(run_set, path)


def _check_run_set(path: Path, joined: dict, head: dict, run_set: dict | None,
                   first_set: tuple[dict, Path] | None) -> tuple[dict, Path] | None:
    """Refuse ``path`` unless it is of the run set joined so far (steps, tokens, and its ``run_set``, or
    its recipe path where it has none); returns the first run set seen (``first_set``, else this one)."""
    if any(joined[k] != head[k] for k in ("steps", "tokens")):
        raise UsageError(f"{path} is from another run set ({head}) than the first file "
                         f"({ {k: joined[k] for k in head} }); join summaries of one recipe and schedule only")
    if run_set is None:
        print(f"[compare-join] note: {path} has no run_set record (written before compare recorded one); "
              f"only its recipe path {head['recipe']!r}, steps and tokens are checked", flush=True)
        if not _same_recipe(joined["recipe"], head["recipe"]):
            raise UsageError(f"{path} is from another run set (recipe {head['recipe']!r}) than the first file "
                             f"(recipe {joined['recipe']!r}); join summaries of one recipe and schedule only")
        return first_set
    if first_set is None:
        return run_set, path
    diff = _differences(first_set[0], run_set)
    if diff:
        keys = "; ".join(f"{k}: {a!r} in {first_set[1]}, {b!r} here" for k, (a, b) in diff.items())
        raise UsageError(f"{path} is from another run set than {first_set[1]}: {keys}; join summaries "
                         "of one recipe and schedule only")
    return first_set


def _add_seeds(path: Path, joined: dict, seeds_of: dict[str, dict[int, float]], variants: dict) -> None:
    """Add one file's variants and per-seed final validation losses; refuse a variant at another preset
    or lr, or a seed reported twice with different values."""
    for name, v in variants.items():
        mine = joined["variants"].setdefault(name, {"preset": v["preset"], "lr": v["lr"], "overrides": v["overrides"]})
        if (mine["preset"], mine["lr"]) != (v["preset"], v["lr"]):
            raise UsageError(f"variant {name!r} is preset {v['preset']} at lr {v['lr']} in {path} "
                             f"but preset {mine['preset']} at lr {mine['lr']} before")
        if sorted(mine["overrides"]) != sorted(v["overrides"]):
            raise UsageError(f"variant {name!r} trained with {' '.join(v['overrides'])} in {path} but with "
                             f"{' '.join(mine['overrides'])} before (a summary that records no overrides "
                             "predates the current meaning of the method variants): join one meaning only")
        got = seeds_of.setdefault(name, {})
        for seed, val in zip(v["seeds"], v["final_val_loss"]):
            if seed in got and got[seed] != val:
                raise UsageError(f"seed {seed} of {name!r} is {val} in {path} but {got[seed]} in "
                                 "an earlier file: two different runs of one seed cannot be joined")
            got[seed] = val


def _legacy_overrides(name: str) -> list[str]:
    """The overrides a variant trained with in a summary.json that records none."""
    if name in LEGACY_METHOD_OVERRIDES:
        return ["trainer.precision=fp4", "fp4.preset=paper",
                *(f"{k}={v}" for k, v in LEGACY_METHOD_OVERRIDES[name].items())]
    try:
        return parse_variant(name).overrides()
    except UsageError:  # a variant name of an older version: its preset and lr are still checked
        return []


def _joined_table(joined: dict, seeds_of: dict[str, dict[int, float]], numerics_of: dict[str, dict],
                  reference: str, allow_mixed: bool) -> str:
    """Markdown: every variant's final validation loss over its seeds, the gap to ``reference`` paired over
    the seeds both have, its 95% interval and paired t-test (recorded in ``joined`` as
    ``val_gap_vs_reference``); pairs must have the same numerics (:func:`check_pairs`)."""
    ref = seeds_of[reference]
    lines = [f"| variant | lr | seeds | final val loss | val vs {reference} (paired) | per seed vs {reference} "
             "| 95% interval | paired t-test | numerics |", "|---|---|---|---|---|---|---|---|---|"]
    for name, v in joined["variants"].items():
        got = seeds_of[name]
        shared = [k for k in v["seeds"] if k in ref]
        gap_cell = per_seed = ci = resolved = numerics = "-"
        if name != reference and shared:
            numerics = check_pairs(name, reference, {k: numerics_of[name].get(k) for k in shared},
                                   {k: numerics_of[reference].get(k) for k in shared}, allow_mixed,
                                   (v.get("overrides", []), joined["variants"][reference].get("overrides", [])))
            g = paired_gap([got[k] for k in shared], [ref[k] for k in shared])
            gap_cell = _pm(g, "+.2f", 100) + f"% ({len(shared)} seed{'s' if len(shared) > 1 else ''})"
            per_seed = ", ".join(f"{100 * x:+.2f}%" for x in g["values"])
            ci, resolved = _interval(g), _resolved(g)
            v["val_gap_vs_reference"] = {"seeds": shared, **{k: g[k] for k in ("mean", "std", "values", "t", "p",
                                                                                 "ci95")}, "numerics": numerics}
        lines.append(f"| {name} | {v['lr']:g} | {', '.join(map(str, v['seeds']))} | "
                     f"{_pm({'mean': v['mean'], 'std': v['std']})} | {gap_cell} | {per_seed} | {ci} | {resolved} "
                     f"| {numerics} |")
    return "\n".join(lines)
