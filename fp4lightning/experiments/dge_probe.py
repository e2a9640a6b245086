"""Measurements for explaining what DGE does to training (arXiv 2501.17116, section 3.2).

On the tiny recipe the ``paper`` preset beats both BF16 and ``fp4-no-dge`` (docs/results.md).
Three explanations are on the table, and this module holds the tools that test each:

1. *DGE pulls weights toward grid points.* ``weight_quant_stats`` measures, for one weight
   matrix, the relative quantization error ``||W - Q(W)||^2 / ||W||^2`` and where the scaled
   weights ``|W s_w|`` sit inside their E2M1 intervals (0 = left grid point, 1 = right grid
   point, as a histogram and as the mean distance to the nearest grid point in units of the
   interval width). ``DGEProbe`` is a Lightning callback that records these, pooled over every
   quantized layer, every N optimizer steps into ``dge_probe.jsonl``; run it on DGE and STE.
   DGE's factor ``f'`` is smallest (1/k) at grid points and largest at mid-points, so a weight
   near a grid point moves slowly: if that is what helps, DGE runs show positions piled up
   near 0 and 1 and a lower quantization error than STE runs.
2. *DGE's clamp acts as per-element learning-rate modulation.* ``numerics.dge.frozen_dge_factor`` is the
   factor ``f'(W_0 s_w0)`` of the initial weights, computed at the first backward pass and
   kept: with ``FP4Config(dge=False, dge_frozen_factor=True)`` the weight gradient is STE's
   times this frozen factor (``fp4lightning compare --variants fp4-dge-frozen``). If the
   frozen modulation alone recovers DGE's gain, the gain is not about tracking the grid.
3. *The effect fades with scale:* the same comparison on ``recipes/small.yaml``.

The frozen factor is cached on the weight ``Parameter`` itself, so it lives as long as the
model does; it is not written to checkpoints, so a resumed run would freeze the factor of
the resumed weights instead (the experiments train in one go). It needs the layer to see
the same ``Parameter`` object every step (single device or DDP); under FSDP, which rebuilds
the parameters, it would be recomputed and is not supported.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from fp4lightning.config import FP4Config
from fp4lightning.experiments.occ_fidelity import quantized_layers
from fp4lightning.numerics.dge import dge_derivative
from fp4lightning.numerics.constants import E2M1_MAX
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.numerics.absmax import compute_scale, fake_quantize

__all__ = ["interval_position", "weight_quant_stats", "model_weight_stats", "DGEProbe",
           "read_probe", "POSITION_BINS"]

#: histogram bins of the position inside an E2M1 interval, over [0, 1]
POSITION_BINS = 10


def interval_position(x_scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(position, delta)`` of each ``|x|`` inside its E2M1 interval, in the scaled domain.

    ``position`` is ``(|x| - left grid point) / delta`` in [0, 1); delta is 0.5 below 2, 1
    on [2, 4) and 2 on [4, 6]; |x| = 6 (the row maximum under absmax scaling) is the right
    end of the last interval, position 1.
    """
    a = x_scaled.float().abs().clamp(max=E2M1_MAX)
    delta = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    left = torch.where(a >= E2M1_MAX, torch.full_like(a, 4.0), torch.floor(a / delta) * delta)
    return (a - left) / delta, delta


def _scaled_weight(weight: torch.Tensor, cfg: FP4Config) -> torch.Tensor:
    w = weight.detach().float()
    if cfg.weight_granularity == "per_tensor":
        amax = w.abs().amax().reshape(1, 1)
    else:
        amax = w.abs().amax(dim=1, keepdim=True)
    return w * compute_scale(amax, cfg.scale_mode)


def weight_quant_stats(weight: torch.Tensor, cfg: FP4Config | None = None, bins: int = POSITION_BINS) -> dict:
    """Quantization error and in-interval positions of one weight matrix (out x in).

    Returns sums (so layers pool by adding): ``n``, ``err2`` = sum (W - Q(W))^2,
    ``norm2`` = sum W^2, ``dist`` = sum of the distance to the nearest grid point in units
    of delta (0 at a grid point, 0.5 at a mid-point), ``dge`` = sum of f'(W s_w), and
    ``hist`` = counts of positions in ``bins`` equal bins over [0, 1].
    """
    cfg = cfg or FP4Config()
    w = weight.detach().float()
    granularity = "per_tensor" if cfg.weight_granularity == "per_tensor" else "per_token"  # rows = channels
    q = fake_quantize(w, granularity, cfg.scale_mode)
    pos, _ = interval_position(_scaled_weight(w, cfg))
    hist = torch.histc(pos, bins=bins, min=0.0, max=1.0)
    return {
        "n": w.numel(),
        "err2": float((w - q).double().pow(2).sum()),
        "norm2": float(w.double().pow(2).sum()),
        "dist": float(torch.minimum(pos, 1 - pos).double().sum()),
        "dge": float(dge_derivative(_scaled_weight(w, cfg), cfg.dge_k, cfg.dge_clamp).double().sum()),
        "hist": [int(c) for c in hist.tolist()],
    }


def _probed_layers(model: nn.Module, cfg: FP4Config) -> list[tuple[str, nn.Linear]]:
    """FP4 layers, or in a high-precision model the Linear layers FP4 would convert."""
    fp4 = [(n, m) for n, m in model.named_modules() if isinstance(m, FP4Linear)]
    return fp4 or quantized_layers(model, cfg)


def model_weight_stats(model: nn.Module, cfg: FP4Config | None = None, bins: int = POSITION_BINS) -> dict:
    """``weight_quant_stats`` pooled over every quantized layer of ``model``.

    Adds the ratios: ``rel_err`` (sum err2 / sum norm2), ``sqnr_db``, ``mean_dist``,
    ``dge_mean`` and ``position_hist`` (fractions). FP4 layers are measured with their own
    config; layers of a high-precision model with ``cfg`` (default: the paper's).
    """
    cfg = cfg or FP4Config()
    layers = _probed_layers(model, cfg)
    if not layers:
        raise ValueError("model_weight_stats: the model has no linear layers that FP4 would quantize")
    tot = {"n": 0, "err2": 0.0, "norm2": 0.0, "dist": 0.0, "dge": 0.0, "hist": [0] * bins}
    for _, layer in layers:
        s = weight_quant_stats(layer.weight, getattr(layer, "config", cfg), bins)
        for k in ("n", "err2", "norm2", "dist", "dge"):
            tot[k] += s[k]
        tot["hist"] = [a + b for a, b in zip(tot["hist"], s["hist"])]
    rel = tot["err2"] / tot["norm2"] if tot["norm2"] > 0 else float("nan")
    return {
        "layers": len(layers),
        "n": tot["n"],
        "rel_err": rel,
        "sqnr_db": -10 * math.log10(rel) if rel > 0 else float("inf"),
        "mean_dist": tot["dist"] / tot["n"],
        "dge_mean": tot["dge"] / tot["n"],
        "position_hist": [c / tot["n"] for c in tot["hist"]],
    }


class DGEProbe(Callback):
    """Lightning callback: ``model_weight_stats`` every ``every_n_steps`` optimizer steps.

    Appends one JSON line per measurement (``{"step", ...stats}``) to ``path``; step 0 is
    the initial weights. The measurement is a few element-wise passes over the weights,
    cheap next to a training step.
    """

    def __init__(self, path: str | Path, every_n_steps: int = 25, cfg: FP4Config | None = None):
        if every_n_steps < 1:
            raise ValueError(f"DGEProbe: every_n_steps must be at least 1, got {every_n_steps}")
        self.path, self.every, self.cfg = Path(path), every_n_steps, cfg
        self._last = -1

    def _record(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if step == self._last or trainer.global_rank != 0:
            return
        self._last = step
        rec = {"step": step, **model_weight_stats(pl_module, self.cfg)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run: do not mix with an earlier one's records
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            self._record(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module)


def read_probe(path: str | Path) -> list[dict]:
    """The records a ``DGEProbe`` wrote, in step order."""
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return sorted(recs, key=lambda r: r["step"])
