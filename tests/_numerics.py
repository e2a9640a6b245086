"""Shared numerics helpers for the tests."""
import torch


def sqnr(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB of ``actual`` against ``reference`` (float64)."""
    ref = reference.double()
    err = actual.double() - ref
    return (10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum().clamp_min(1e-300))).item()


def heavy_tailed(m: int, k: int, outlier_frac: float = 0.01, outlier_scale: float = 20.0) -> torch.Tensor:
    """Activation-like data: Gaussian bulk plus sparse large outliers, a few hot channels."""
    x = torch.randn(m, k)
    mask = torch.rand(m, k) < outlier_frac
    x = torch.where(mask, x * outlier_scale, x)
    hot = torch.randperm(k)[: max(1, k // 64)]
    x[:, hot] *= 8.0
    return x
