"""Differentiable Gradient Estimator for the weight quantizer (arXiv 2501.17116, section 3.2).

Straight-through estimation treats the rounding step as the identity. DGE instead
back-propagates through a smooth stand-in for the step function. In one quantization
interval of width ``delta`` with ``u`` the offset from the interval's left grid point:

    f(u)  = delta/2 * (1 + sign(2u/delta - 1) * |2u/delta - 1|^(1/k))
    f'(u) = (1/k) * |2u/delta - 1|^(1/k - 1),  clamped to at most ``clamp``

so f' is 1/k at grid points and peaks (clamped) at interval mid-points. Over one
interval the *unclamped* f' integrates to exactly delta (mean factor 1); the clamp cuts
the integrable spike at each mid-point, so with k=5 and clamp 3 the mean factor over an
interval is ``c t + 1 - t^(1/k)`` with ``t = (c k)^(k/(1-k))``, about 0.594 (measured in
tests/test_dge.py): DGE as published shrinks weight gradients by about 40% on average
against straight-through. On the E2M1 grid (in the scaled domain) delta is 0.5 for
|x| < 2, 1 for 2 <= |x| < 4 and 2 for 4 <= |x| <= 6.

The interval is taken from the magnitude *saturated* to the quantizer's range,
``a = min(|x|, 6)``: beyond 6 the quantizer returns 6, a grid point, so f' = 1/k there.
This matters for the row maximum of an absmax-scaled weight, whose ``W * s_w`` lands an
fp32 ulp above 6 about half the time: with saturation no finite weight gets a zero
derivative (every value of f' is at least 1/k). Non-finite input (a NaN scale from a
non-finite weight row) gets f' = 0.

The weight gradient becomes ``dW = (dY^T A_q) * f'(W * s_w)`` element-wise: the
per-channel scale cancels (paper, appendix C.2).
"""
from __future__ import annotations

import torch

from fp4lightning.config import FP4Config
from fp4lightning.numerics.constants import E2M1_MAX

__all__ = ["dge_derivative", "dge_smooth", "frozen_dge_factor"]


def _interval(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left grid point and width of the E2M1 interval holding each magnitude ``a``."""
    delta = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    left = torch.floor(a / delta) * delta
    return left, delta


def dge_derivative(x_scaled: torch.Tensor, k: float = 5.0, clamp: float = 3.0) -> torch.Tensor:
    """DGE derivative ``f'`` at the scaled weights ``x_scaled = W * s_w`` (fp32 out).

    Symmetric in the sign of x (f is odd, so f' is even). Magnitudes beyond 6 saturate
    to the grid point 6 (f' = 1/k); NaN and +/-inf get 0; ``clamp`` bounds the spikes at
    interval mid-points.
    """
    if k <= 1.0:
        raise ValueError(f"dge_derivative: k must be > 1 (the paper uses 5), got {k}")
    if clamp <= 0:
        raise ValueError(f"dge_derivative: clamp must be positive, got {clamp}")
    xf = x_scaled.float()
    a = xf.abs().clamp(max=E2M1_MAX)
    # 2 (a - left) / delta - 1 with the interval's width delta a power of two: u = a / delta
    # is a * (1 / delta) exactly and (a - left) / delta = u - floor(u) exactly, so this is
    # _interval's formula bit for bit, in fewer passes
    u = a * torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))
    t = (2.0 * (u - torch.floor(u)) - 1.0).abs()
    # t == 0 (a mid-point) gives inf ** negative = inf, which the clamp caps.
    deriv = (1.0 / k) * t.pow(1.0 / k - 1.0)
    deriv = deriv.clamp(max=clamp)
    return torch.where(torch.isfinite(xf), deriv, torch.zeros_like(deriv))


def dge_smooth(x_scaled: torch.Tensor, k: float = 5.0) -> torch.Tensor:
    """The smooth quantizer ``f`` itself (for tests and plots), on the same grid."""
    xf = x_scaled.double() if x_scaled.dtype == torch.float64 else x_scaled.float()
    a = xf.abs().clamp(max=E2M1_MAX)
    left, delta = _interval(a)
    s = 2.0 * (a - left) / delta - 1.0
    out = left + delta / 2 * (1.0 + torch.sign(s) * s.abs().pow(1.0 / k))
    return torch.copysign(out, xf)


#: where frozen_dge_factor caches the initial factor, on the weight Parameter itself
_FROZEN_ATTR = "_fp4_dge_frozen_factor"


def frozen_dge_factor(weight: torch.Tensor, w_scale: torch.Tensor, cfg: FP4Config) -> torch.Tensor:
    """DGE's factor ``f'(W s_w)`` as it was at the first call, i.e. at initialisation (fp32).

    Called from ``FP4Linear``'s backward when ``cfg.dge_frozen_factor`` is set; the first
    backward pass runs before any optimizer step, so the cached factor is the initial
    weights'. Meant as STE times a fixed per-element modulation, hence ``dge`` must be off.
    """
    if cfg.dge:
        raise ValueError("FP4Config.dge_frozen_factor=True replaces DGE with STE times DGE's initial factor; "
                         "set dge=False too (e.g. fp4.preset=fp4-no-dge)")
    factor = getattr(weight, _FROZEN_ATTR, None)
    if factor is None or factor.shape != weight.shape or factor.device != weight.device:
        x = weight.detach().float() * w_scale.float().reshape(-1, 1)
        factor = dge_derivative(x, cfg.dge_k, cfg.dge_clamp)
        setattr(weight, _FROZEN_ATTR, factor)
    return factor
