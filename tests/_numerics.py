"""Shared numerics helpers for the tests."""
from __future__ import annotations

import functools
import json
import os
import sys

import pytest
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


@functools.lru_cache(maxsize=None)
def cpu_scaled_mm_refusal() -> str | None:
    """None where this torch's CPU ``torch._scaled_mm`` runs every row-wise kind the scaled_mm backend
    needs (the pinned torch does), else why not: older builds (2.11, the GPU image's) scale per tensor
    only on CPU, and there the backend refuses or falls back as ``tests/test_capability_probe.py`` checks."""
    from fp4lightning.ops import capability
    refused = {capability.kind_name(k): why for k, why in capability.probe(torch.device("cpu")).items() if why}
    if not refused:
        return None
    kind, why = next(iter(refused.items()))
    return f"torch {torch.__version__}'s CPU _scaled_mm refuses {len(refused)} row-wise kinds ({kind}: {why[:80]})"


def needs_cpu_scaled_mm(device: torch.device | None = None):
    """Skips a test that runs row-wise ``torch._scaled_mm`` on the CPU (or on ``device``, when that is
    the CPU) where this torch cannot."""
    why = None if device is not None and device.type != "cpu" else cpu_scaled_mm_refusal()
    return pytest.mark.skipif(why is not None, reason=why or "")


def heavy_tailed(m: int, k: int, outlier_frac: float = 0.01, outlier_scale: float = 20.0) -> torch.Tensor:
    """Activation-like data: Gaussian bulk plus sparse large outliers, a few hot channels."""
    x = torch.randn(m, k)
    mask = torch.rand(m, k) < outlier_frac
    x = torch.where(mask, x * outlier_scale, x)
    hot = torch.randperm(k)[: max(1, k // 64)]
    x[:, hot] *= 8.0
    return x


# --- Seeded thresholds -------------------------------------------------------------------------
# Every threshold whose outcome depends on the random draw goes through one of the three checks
# below. They assert as a plain ``assert`` would; with FP4_MARGIN_LOG=<file> set (the seed sweep,
# scripts/seed_sweep.py) each also appends the measured value and its bound to that file as one
# JSON line, so the audit can state how far the worst of 1,000 seeds stayed from each threshold
# (tests/README.md, "Threshold policy").

def _log_margin(op: str, value: float, bound: float, what: str | None, depth: int = 2) -> None:
    path = os.environ.get("FP4_MARGIN_LOG")
    if not path:
        return
    frame = sys._getframe(depth)
    site = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    rec = {"test": test, "site": site, "what": what or "", "op": op,
           "value": float(value), "bound": float(bound)}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def above(value: float, bound: float, what: str | None = None) -> None:
    """``assert value > bound`` (a lower threshold, e.g. an SQNR in dB); the margin is
    ``value - bound``."""
    value, bound = float(value), float(bound)
    _log_margin(">", value, bound, what)
    assert value > bound, f"{what or 'value'} {value:.6g} not above {bound:.6g}"


def below(value: float, bound: float, what: str | None = None) -> None:
    """``assert value < bound`` (an upper threshold, e.g. an error or a gap); the margin is
    ``bound - value``."""
    value, bound = float(value), float(bound)
    _log_margin("<", value, bound, what)
    assert value < bound, f"{what or 'value'} {value:.6g} not below {bound:.6g}"


def close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float,
          what: str | None = None) -> None:
    """``torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)`` for finite tensors
    of one shape, measured as the worst ratio ``|a - e| / (atol + rtol |e|)`` (passes at <= 1; the
    margin is how far below 1 the worst element stays)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all() and torch.isfinite(e).all(), f"{what or 'tensor'}: non-finite values"
    diff = (a - e).abs()
    ratio = torch.where(diff == 0, 0.0, diff / (atol + rtol * e.abs()))  # 0/0 (exact zeros) is a pass
    ratio = ratio.max().item() if a.numel() else 0.0
    _log_margin("<=", ratio, 1.0, what)
    assert ratio <= 1.0, (f"{what or 'tensor'}: worst |a - e| is {ratio:.4g}x the allowed "
                          f"atol + rtol |e| (rtol={rtol:g}, atol={atol:g})")
