"""Outlier Clamping and Compensation for activations (arXiv 2501.17116, section 3.3).

Activations have long tails that a 6-level absmax grid cannot hold: one outlier
stretches the scale and flushes the rest of its row to zero. OCC clamps the
*signed* values of the activation tensor to its ``1 - alpha`` and ``alpha``
quantiles (both tails, so about ``2 (1 - alpha)`` of the entries change), quantizes
the clamped tensor, and keeps the sparse residual ``A - clamp(A)`` to add back in
high precision: ``Y = Q(A_c) Q(W)^T + (A - A_c) Q(W)^T``.

Finding the quantiles: the authors' code sorts every activation tensor every step.
Here ``method="sample"`` (the default for tensors over ``sample_size`` elements)
takes the exact quantile of a fixed sample of ``sample_size`` elements: the
multiplicative lattice ``i * P mod n`` with ``P`` a large prime. It needs no random
generator, so training's RNG stream is untouched, a resumed run and every data-parallel
rank pick the same elements, and it visits every column (channel) evenly because ``P``
is coprime with the row length. With 65,536 samples the clamped fraction stays within
1.98-2.02% at alpha=0.99 on a 2048x1024 activation (docs/design.md), at a cost independent
of the tensor size. ``method="exact"`` uses a selection (``kthvalue``), not a full
sort, and works above torch.quantile's 16M element limit.
"""
from __future__ import annotations

from typing import Literal

import torch

from fp4lightning.numerics.constants import E4M3_FOLD_MAX_SHIFT  # fold_e4m3's largest shift (re-exported here)
from fp4lightning.numerics.constants import F8E4M3_MAX

__all__ = ["occ_bounds", "occ_clamp", "fold_e4m3", "QUANTILE_METHODS", "lattice_stride", "quantile_positions",
           "CUDA_SORT_MIN"]

QUANTILE_METHODS = ("sample", "exact")
DEFAULT_SAMPLE_SIZE = 65536

#: Knuth's multiplicative-hash prime; i * P mod n scatters i over [0, n) like a random draw
_LATTICE_PRIME = 2654435761
#: largest tensor whose quantiles are read from one sort on CUDA (transient memory ~3x its size)
_SORT_MAX = 1 << 22
#: torch.sort on CUDA sorts more than this many elements with cub's radix sort (by the keys' bits: -NaN
#: first, +NaN last, -0.0 and +0.0 equal and kept in input order), fewer with a comparison sort
CUDA_SORT_MIN = 4096
_SAMPLE_INDEX: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def lattice_stride(n: int) -> int:
    """The sample's stride: element ``i`` of the sample of a tensor of ``n`` elements is ``i * stride mod n``."""
    p = _LATTICE_PRIME
    while n % p == 0:  # keep the stride coprime with n (practically never needed)
        p += 2
    return p


def quantile_positions(n: int, probs: tuple[float, ...]) -> list[tuple[int, float]]:
    """For each probability, the 0-based order statistic ``i`` and the fraction ``f`` of the way to the next
    one that linear interpolation (torch.quantile's default) takes: ``q = v_i + (v_{i+1} - v_i) f`` (in
    fp32, f rounded to fp32; no interpolation where f is 0 or ``i`` is the last)."""
    out = []
    for p in probs:
        pos = p * (n - 1)
        lo_i = int(pos)
        out.append((lo_i, pos - lo_i))
    return out


def _sample_index(n: int, size: int, device: torch.device) -> torch.Tensor:
    key = (n, size, device)
    if key not in _SAMPLE_INDEX:
        idx = (torch.arange(size, dtype=torch.int64) * lattice_stride(n)) % n
        _SAMPLE_INDEX[key] = idx.to(device)
        if len(_SAMPLE_INDEX) > 256:  # bounded: shapes change with sequence length
            _SAMPLE_INDEX.pop(next(iter(_SAMPLE_INDEX)))
    return _SAMPLE_INDEX[key]


def _kth_quantiles(flat: torch.Tensor, probs: tuple[float, float]) -> torch.Tensor:
    """Linear-interpolated quantiles (torch.quantile's default) by selection."""
    n = flat.numel()
    # On CUDA one sort of a sample-sized tensor replaces four kthvalue selections, each run by
    # a single thread block (docs/perf.md, "Measured design choices"): the same order statistics.
    srt = flat.sort().values if flat.is_cuda and n <= _SORT_MAX else None
    ranks = sorted({r for p in probs for r in (int(p * (n - 1)), int(p * (n - 1)) + 1) if r < n})
    low = [r for r in ranks if 2 * r < n]
    high = [r for r in ranks if 2 * r >= n]
    # Elsewhere the order statistics come from one partial sort per tail (topk, sorted): 2.5x
    # faster on CPU than one kthvalue per rank, which copies the input every call. Same values.
    # (A selection stays faster where a tail is a large share of the tensor.)
    small = max(64, n // 8)
    lows = (torch.topk(flat, low[-1] + 1, largest=False).values
            if srt is None and low and low[-1] + 1 <= small else None)
    highs = (torch.topk(flat, n - high[0], largest=True).values
             if srt is None and high and n - high[0] <= small else None)

    def kth(i):  # the i-th smallest value, 0-based
        if srt is not None:
            return srt[i]
        if 2 * i < n and lows is not None:
            return lows[i]
        if 2 * i >= n and highs is not None:
            return highs[n - 1 - i]
        return flat.kthvalue(i + 1).values

    out = []
    for lo_i, frac in quantile_positions(n, probs):
        v_lo = kth(lo_i)
        if frac > 0 and lo_i + 1 < n:
            v_hi = kth(lo_i + 1)
            v_lo = v_lo + (v_hi - v_lo) * frac
        out.append(v_lo)
    return torch.stack(out)


def occ_bounds(
    x: torch.Tensor,
    alpha: float = 0.99,
    method: Literal["sample", "exact"] = "sample",
    sample_size: int = DEFAULT_SAMPLE_SIZE,
) -> torch.Tensor:
    """Return ``tensor([lo, hi])`` (fp32): the ``1-alpha`` and ``alpha`` quantiles of ``x``."""
    if not 0.5 < alpha < 1.0:
        raise ValueError(f"occ alpha must be in (0.5, 1), got {alpha}")
    if method not in QUANTILE_METHODS:
        raise ValueError(f"unknown quantile method {method!r}; choose one of {QUANTILE_METHODS}")
    flat = x.detach().reshape(-1)
    if flat.numel() == 0:
        raise ValueError("occ_bounds: empty tensor")
    if method == "sample" and flat.numel() > sample_size:
        flat = flat[_sample_index(flat.numel(), sample_size, flat.device)]  # sample, then convert: same values
    return _kth_quantiles(flat.float(), (1.0 - alpha, alpha))


def occ_clamp(x: torch.Tensor, bounds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clamp ``x`` to ``bounds = [lo, hi]``; return ``(x_clamped, residual)`` (both dense).

    The residual is non-zero only where clamping changed a value. ``x_clamped + residual``
    gives back ``x`` up to one rounding of ``x - x_clamped`` in x's dtype: exact for most
    entries, and in fp32 within 2^-24 relative; in bf16 the rounding of the residual can
    cost up to about 0.4% of an outlier's value (measured up to 0.36% on heavy-tailed data).
    """
    lo = bounds[0].to(x.dtype)
    hi = bounds[1].to(x.dtype)
    xc = torch.clamp(x, lo, hi)
    return xc, x - xc


def fold_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the FP4 operand with OCC's residual folded in to E4M3: ``(e, shift)``, ``v ~ e * 2^shift``.

    ``v`` (rows x K, fp32) is ``s_a (A_q / s_a + R) = A_q + s_a R`` in the quantizer's scaled
    domain: E2M1 values, except at the ~2% outlier entries, where it is the scaled outlier. Each
    row is shifted down by the smallest power of two ``2^shift`` (0 <= shift <= 8) that brings its
    absmax within E4M3's 448, then rounded to E4M3 (nearest, ties to even; entries still above
    448 after the largest shift saturate). The E2M1 entries stay exact; only the outliers are
    rounded, to 3 mantissa bits. This is what a GPU could feed the forward's FP8 GeMM instead
    of running the compensation ``R W^T`` as a second, bf16 GeMM (docs/perf.md, "OCC on the GPU");
    ``fp4lightning.experiments.occ_fidelity`` measures what it costs in activation SNR.
    """
    v = v.float()
    amax = v.abs().amax(1, keepdim=True)
    _, e = torch.frexp(amax)  # amax = m 2^e, 0.5 <= m < 1; 448 = 0.875 x 2^9
    shift = (e - 9).clamp(0, E4M3_FOLD_MAX_SHIFT)
    shift = torch.where(torch.ldexp(amax, -shift) > F8E4M3_MAX, shift + 1, shift).clamp_max(E4M3_FOLD_MAX_SHIFT)
    e4 = torch.ldexp(v, -shift).clamp(-F8E4M3_MAX, F8E4M3_MAX).to(torch.float8_e4m3fn).float()
    return e4, shift.squeeze(1)
