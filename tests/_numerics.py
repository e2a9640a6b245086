"""Shared numerics helpers for the tests."""
from __future__ import annotations

import torch


def sqnr(actual: torch.Tensor, reference: torch.Tensor, dim: int | None = None):
    """Signal-to-quantization-noise ratio in dB of ``actual`` against ``reference`` (in float64):
    ``10 log10(sum ref^2 / sum (actual - ref)^2)``. The one SQNR of the tests: always
    ``(actual, reference)``. With ``dim``, one value per slice (the sums run along ``dim``),
    returned as a tensor; else a float."""
    ref = reference.double()
    err = actual.double() - ref
    if dim is None:
        return (10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum().clamp_min(1e-300))).item()
    return 10 * torch.log10(ref.pow(2).sum(dim) / err.pow(2).sum(dim).clamp_min(1e-300))


def heavy_tailed(m: int, k: int, outlier_frac: float = 0.01, outlier_scale: float = 20.0) -> torch.Tensor:
    """Activation-like data: Gaussian bulk plus sparse large outliers, a few hot channels."""
    x = torch.randn(m, k)
    mask = torch.rand(m, k) < outlier_frac
    x = torch.where(mask, x * outlier_scale, x)
    hot = torch.randperm(k)[: max(1, k // 64)]
    x[:, hot] *= 8.0
    return x
