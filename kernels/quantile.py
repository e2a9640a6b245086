"""OCC's two quantiles of a bf16 activation in one launch, of an fp32 one in two (arXiv 2501.17116,
section 3.3; issue 47).

``fp4lightning.numerics.occ.occ_bounds`` on CUDA gathers its sample, converts it to fp32, sorts it
(``torch.sort``: cub's radix sort, seven launches) and interpolates two pairs of order statistics in
a dozen more small launches. A bf16 value has 16 bits, so a histogram of 2^16 bins holds the sample's
exact order statistics: every program gathers a chunk of the sample (the same lattice ``i * P mod n``,
computed in place) and counts each element's bin with one atomic add; the program that finishes last
walks the histogram, reads the four order statistics, interpolates them as ``occ_bounds`` does (fp32,
no FMA contraction) and writes ``[lo, hi]``, then zeroes the histogram and its counter for the next
launch (no memset launch).

The order is the bits' (cub's): -NaN below -inf, +NaN above +inf, NaNs by payload, as the sort puts
them. -0.0 and +0.0 share a bin (cub ranks them equal), read back as +0.0: the sign of a zero order
statistic never reaches the result when it is interpolated with a non-zero fraction of at least 2^-16
(zero plus or minus zero times it is +0.0, and a bf16 value times it does not underflow), which
``occ_quantiles_supported`` requires; other cases keep the sort.

An fp32 activation (under bf16 autocast the LLaMA models' q, k, v, gate and up projections get one:
the residual stream and the RMSNorm are fp32) has 32-bit keys: a two-pass radix select. The first
launch counts the high 16 bits of each sample element's key; its last program finds the bin of each
of the four order statistics and its rank inside that bin. The second launch gathers the sample
again and counts the low 16 bits of the elements in those bins (one histogram per order statistic);
its last program reads the four values, interpolates them and zeroes what it used. The key is the
sort's (fp32 bits, negatives' magnitude bits flipped, -0.0 with +0.0), so the values are the sort's.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from fp4lightning.numerics.occ import CUDA_SORT_MIN, lattice_stride, quantile_positions

from ._common import check_device

__all__ = ["triton_occ_quantiles", "occ_quantiles_supported"]

#: sample elements per program, histogram bins the last program reads per step
CHUNK = 1024
SCAN = 4096
BINS = 1 << 16
#: the largest sample one launch takes (torch.sort's range on CUDA in occ_bounds)
MAX_N = 1 << 22
#: below this the fraction's product with a bf16 value could underflow and the sign of a zero matter
MIN_FRAC = 2.0 ** -16


@triton.jit
def _bf16_key(b):
    """bf16 bit patterns (int32, 0..65535) -> histogram bins 0..65535 in the bits' order, -0.0 with +0.0."""
    s = (b << 16) >> 16  # sign-extended
    key = s ^ ((s >> 15) & 0x7FFF)
    return tl.where(key == -1, 0, key) + 32768


@triton.jit
def _bin_value(bin):
    """The fp32 value of a bin (the bf16 value, exactly; +0.0 for the zeros' bin)."""
    key = bin - 32768
    b = (key ^ ((key >> 15) & 0x7FFF)) & 0xFFFF
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_key(b):
    """fp32 bit patterns (int32) -> int32 keys in the bits' order (signed), -0.0 with +0.0."""
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(key == -1, 0, key)


@triton.jit
def _f32_of_key(key):
    """The fp32 value of a key (its bits, exactly; +0.0 for the zeros' key)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _find(c, h_sum, acc, r, b0, found):
    """The bin of order statistic ``r`` if this step's bins (inclusive counts ``c``) hold it, else ``found``."""
    here = (acc <= r) & (r < acc + h_sum)
    return tl.where(here, b0 + tl.sum((c <= r).to(tl.int32), axis=0), found)


@triton.jit
def _sample_src(N, n, STRIDE, SAMPLED: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk of the sample: element offsets into x (the lattice ``i * STRIDE mod N``), and
    which lanes hold one."""
    i = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    src = (i.to(tl.int64) * STRIDE) % N if SAMPLED else i.to(tl.int64)
    return src, i < n


@triton.jit
def _occ_quantile_kernel(x_ptr, hist_ptr, ctr_ptr, out_ptr, N, n, STRIDE, R0, R1, R2, R3, F0, F1,
                         SAMPLED: tl.constexpr, INTERP0: tl.constexpr, INTERP1: tl.constexpr,
                         CHUNK: tl.constexpr, SCAN: tl.constexpr, BINS: tl.constexpr):
    # --- every program: its chunk of the sample into the histogram
    src, ok = _sample_src(N, n, STRIDE, SAMPLED, CHUNK)
    b = tl.load(x_ptr + src, mask=ok, other=0).to(tl.int32) & 0xFFFF
    tl.atomic_add(hist_ptr + _bf16_key(b), 1, mask=ok)
    done = tl.atomic_add(ctr_ptr, 1)
    # --- the last program: the order statistics, the interpolation, the histogram zeroed again
    if done == tl.num_programs(0) - 1:
        acc = tl.full([], 0, tl.int32)
        f0 = tl.full([], 0, tl.int32)
        f1 = f0
        f2 = f0
        f3 = f0
        ar = tl.arange(0, SCAN)
        for b0 in range(0, BINS, SCAN):
            h = tl.load(hist_ptr + b0 + ar, volatile=True)
            c = tl.cumsum(h, axis=0) + acc
            h_sum = tl.sum(h, axis=0)
            f0 = _find(c, h_sum, acc, R0, b0, f0)
            f1 = _find(c, h_sum, acc, R1, b0, f1)
            f2 = _find(c, h_sum, acc, R2, b0, f2)
            f3 = _find(c, h_sum, acc, R3, b0, f3)
            acc += h_sum
            tl.store(hist_ptr + b0 + ar, tl.zeros([SCAN], tl.int32))
        lo = _bin_value(f0)
        if INTERP0:
            lo = lo + (_bin_value(f1) - lo) * F0.to(tl.float32, bitcast=True)
        hi = _bin_value(f2)
        if INTERP1:
            hi = hi + (_bin_value(f3) - hi) * F1.to(tl.float32, bitcast=True)
        tl.store(out_ptr, lo)
        tl.store(out_ptr + 1, hi)
        tl.atomic_xchg(ctr_ptr, 0)


@triton.jit
def _find_in(h, c, h_sum, acc, r, b0, ar, found, before):
    """As ``_find``, with the count of elements below the bin (``before``) where this step holds ``r``."""
    here = (acc <= r) & (r < acc + h_sum)
    idx = tl.sum((c <= r).to(tl.int32), axis=0)
    below = acc + tl.sum(tl.where(ar < idx, h, 0), axis=0)
    return tl.where(here, b0 + idx, found), tl.where(here, below, before)


@triton.jit
def _sample_keys(x_ptr, N, n, STRIDE, SAMPLED: tl.constexpr, CHUNK: tl.constexpr):
    """This program's chunk of the sample as fp32 keys, and which lanes hold one."""
    src, ok = _sample_src(N, n, STRIDE, SAMPLED, CHUNK)
    return _f32_key(tl.load(x_ptr + src, mask=ok, other=0)), ok


@triton.jit
def _occ_quantile32_hi_kernel(x_ptr, hist_ptr, ctr_ptr, sel_ptr, N, n, STRIDE, R0, R1, R2, R3,
                              SAMPLED: tl.constexpr, CHUNK: tl.constexpr, SCAN: tl.constexpr, BINS: tl.constexpr):
    # --- every program: the high 16 bits of its chunk's keys into the histogram
    key, ok = _sample_keys(x_ptr, N, n, STRIDE, SAMPLED, CHUNK)
    tl.atomic_add(hist_ptr + (key >> 16) + 32768, 1, mask=ok)
    done = tl.atomic_add(ctr_ptr, 1)
    # --- the last program: each order statistic's bin and its rank in it; the histogram zeroed again
    if done == tl.num_programs(0) - 1:
        acc = tl.full([], 0, tl.int32)
        f0 = tl.full([], 0, tl.int32)
        f1, f2, f3, p0, p1, p2, p3 = f0, f0, f0, f0, f0, f0, f0
        ar = tl.arange(0, SCAN)
        for b0 in range(0, BINS, SCAN):
            h = tl.load(hist_ptr + b0 + ar, volatile=True)
            c = tl.cumsum(h, axis=0) + acc
            h_sum = tl.sum(h, axis=0)
            f0, p0 = _find_in(h, c, h_sum, acc, R0, b0, ar, f0, p0)
            f1, p1 = _find_in(h, c, h_sum, acc, R1, b0, ar, f1, p1)
            f2, p2 = _find_in(h, c, h_sum, acc, R2, b0, ar, f2, p2)
            f3, p3 = _find_in(h, c, h_sum, acc, R3, b0, ar, f3, p3)
            acc += h_sum
            tl.store(hist_ptr + b0 + ar, tl.zeros([SCAN], tl.int32))
        tl.store(sel_ptr + 0, f0)
        tl.store(sel_ptr + 1, R0 - p0)
        tl.store(sel_ptr + 2, f1)
        tl.store(sel_ptr + 3, R1 - p1)
        tl.store(sel_ptr + 4, f2)
        tl.store(sel_ptr + 5, R2 - p2)
        tl.store(sel_ptr + 6, f3)
        tl.store(sel_ptr + 7, R3 - p3)
        tl.atomic_xchg(ctr_ptr, 0)


@triton.jit
def _low_select(hist_ptr, sel_ptr, J: tl.constexpr, SCAN: tl.constexpr, BINS: tl.constexpr):
    """Order statistic ``J``'s value from its low-bits histogram (zeroed again as it is read)."""
    hi = tl.load(sel_ptr + 2 * J)
    r = tl.load(sel_ptr + 2 * J + 1)
    acc = tl.full([], 0, tl.int32)
    found = tl.full([], 0, tl.int32)
    ar = tl.arange(0, SCAN)
    for b0 in range(0, BINS, SCAN):
        h = tl.load(hist_ptr + J * BINS + b0 + ar, volatile=True)
        c = tl.cumsum(h, axis=0) + acc
        h_sum = tl.sum(h, axis=0)
        found = _find(c, h_sum, acc, r, b0, found)
        acc += h_sum
        tl.store(hist_ptr + J * BINS + b0 + ar, tl.zeros([SCAN], tl.int32))
    return _f32_of_key(((hi - 32768) << 16) | found)


@triton.jit
def _occ_quantile32_lo_kernel(x_ptr, hist_ptr, ctr_ptr, sel_ptr, out_ptr, N, n, STRIDE, F0, F1,
                              SAMPLED: tl.constexpr, CHUNK: tl.constexpr, SCAN: tl.constexpr, BINS: tl.constexpr):
    # --- every program: the low 16 bits of its chunk's keys in each order statistic's bin
    key, ok = _sample_keys(x_ptr, N, n, STRIDE, SAMPLED, CHUNK)
    hi, lo = (key >> 16) + 32768, key & 0xFFFF
    for j in tl.static_range(4):
        tl.atomic_add(hist_ptr + j * BINS + lo, 1, mask=ok & (hi == tl.load(sel_ptr + 2 * j)))
    done = tl.atomic_add(ctr_ptr, 1)
    # --- the last program: the four values, the interpolation (fp32, no FMA contraction; both bounds
    # interpolate: occ_quantiles_supported asks a fraction of at least 2^-16)
    if done == tl.num_programs(0) - 1:
        lo_v = _low_select(hist_ptr, sel_ptr, 0, SCAN, BINS)
        lo_v = lo_v + (_low_select(hist_ptr, sel_ptr, 1, SCAN, BINS) - lo_v) * F0.to(tl.float32, bitcast=True)
        hi_v = _low_select(hist_ptr, sel_ptr, 2, SCAN, BINS)
        hi_v = hi_v + (_low_select(hist_ptr, sel_ptr, 3, SCAN, BINS) - hi_v) * F1.to(tl.float32, bitcast=True)
        tl.store(out_ptr, lo_v)
        tl.store(out_ptr + 1, hi_v)
        tl.atomic_xchg(ctr_ptr, 0)


#: per (device, is_meta[, "fp32"]): the histograms and the arrival counters, zero between launches
_WORKSPACE: dict[tuple, torch.Tensor] = {}
#: the fp32 select's workspace: the high bits' histogram and counter, the four low bits' histograms and
#: their counter, then each order statistic's (bin, rank in it), which the first launch writes
WS32_LOW = BINS + 1
WS32_SEL = WS32_LOW + 4 * BINS + 1
WS32 = WS32_SEL + 8


def _workspace(like: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """Zeroed int32: BINS + 1 (the histogram, then the counter), or ``WS32`` for an fp32 input; fresh
    while a CUDA graph is captured. Launches on one device share it: they run one after another on its
    stream, as FP4Linear's do."""
    size = WS32 if fp32 else BINS + 1
    if like.is_cuda and not like.is_meta and torch.cuda.is_current_stream_capturing():
        return torch.zeros(size, dtype=torch.int32, device=like.device)
    key = (str(like.device), like.is_meta) + (("fp32",) if fp32 else ())
    if key not in _WORKSPACE:
        _WORKSPACE[key] = torch.zeros(size, dtype=torch.int32, device=like.device)
    return _WORKSPACE[key]


def _plan(numel: int, alpha: float, method: str, sample_size: int):
    """``(sample size, sampled, [(order statistic, fraction)] of the two bounds)`` as occ_bounds takes them."""
    sampled = method == "sample" and numel > sample_size
    n = sample_size if sampled else numel
    return n, sampled, quantile_positions(n, (1.0 - alpha, alpha))


def occ_quantiles_supported(x: torch.Tensor, alpha: float, method: str, sample_size: int) -> bool:
    """Whether ``triton_occ_quantiles`` gives ``occ_bounds``'s bits for these arguments: a contiguous bf16
    or fp32 ``x`` whose sample occ_bounds would sort with cub's radix sort on CUDA (more than 4096 elements, at
    most 2^22), each bound interpolated with a fraction of at least 2^-16."""
    if x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous() or not 0.5 < alpha < 1.0:
        return False
    n, _, pos = _plan(x.numel(), alpha, method, sample_size)
    return CUDA_SORT_MIN < n <= MAX_N and all(MIN_FRAC <= f and i + 1 < n for i, f in pos)


def _f32_bits(f: float) -> int:
    """The fp32 bit pattern (int32) of ``f`` rounded to fp32, as torch rounds a Python float multiplier."""
    return struct.unpack("<i", struct.pack("<f", f))[0]


def triton_occ_quantiles(x: torch.Tensor, alpha: float = 0.99, method: str = "sample",
                         sample_size: int = 65536) -> torch.Tensor:
    """``fp4lightning.numerics.occ.occ_bounds(x, alpha, method, sample_size)`` as it runs on CUDA (the sample
    sorted by torch.sort), bit for bit, in one launch (two for fp32): ``tensor([lo, hi])`` fp32. Only where
    ``occ_quantiles_supported`` says so (a ValueError otherwise)."""
    check_device("x", x)
    if not occ_quantiles_supported(x, alpha, method, sample_size):
        raise ValueError("triton_occ_quantiles: needs a contiguous bf16 or fp32 tensor whose sample has 4097..2^22 "
                         f"elements and interpolated bounds (got {x.dtype}, {x.numel()} elements, "
                         f"alpha={alpha}, method={method!r}, sample_size={sample_size})")
    n, sampled, ((r0, f0), (r2, f1)) = _plan(x.numel(), alpha, method, sample_size)
    out = torch.empty(2, dtype=torch.float32, device=x.device)
    if x.dtype == torch.float32:
        return _quantiles_fp32(x, out, n, sampled, r0, f0, r2, f1)
    ws = _workspace(x)
    _occ_quantile_kernel[(triton.cdiv(n, CHUNK),)](
        x.view(torch.int16).reshape(-1), ws, ws[BINS:], out, x.numel(), n, lattice_stride(x.numel()),
        r0, r0 + 1, r2, r2 + 1, _f32_bits(f0), _f32_bits(f1), SAMPLED=sampled, INTERP0=f0 > 0, INTERP1=f1 > 0,
        CHUNK=CHUNK, SCAN=SCAN, BINS=BINS, num_warps=4, enable_fp_fusion=False)
    return out


def _quantiles_fp32(x: torch.Tensor, out: torch.Tensor, n: int, sampled: bool, r0: int, f0: float, r2: int,
                    f1: float) -> torch.Tensor:
    """``triton_occ_quantiles`` of an fp32 ``x``: the two-pass select (module docstring)."""
    ws = _workspace(x, fp32=True)
    bits, grid, stride = x.view(torch.int32).reshape(-1), (triton.cdiv(n, CHUNK),), lattice_stride(x.numel())
    sel = ws[WS32_SEL:]  # each order statistic's (high-bits bin, rank in it), from the first launch
    _occ_quantile32_hi_kernel[grid](bits, ws[:BINS], ws[BINS:WS32_LOW], sel, x.numel(), n, stride,
                                    r0, r0 + 1, r2, r2 + 1, SAMPLED=sampled, CHUNK=CHUNK, SCAN=SCAN, BINS=BINS,
                                    num_warps=4)
    _occ_quantile32_lo_kernel[grid](bits, ws[WS32_LOW:WS32_SEL - 1], ws[WS32_SEL - 1:WS32_SEL], sel, out,
                                    x.numel(), n, stride, _f32_bits(f0), _f32_bits(f1), SAMPLED=sampled,
                                    CHUNK=CHUNK, SCAN=SCAN, BINS=BINS, num_warps=4, enable_fp_fusion=False)
    return out
