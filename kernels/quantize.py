"""Fused row-wise FP4 quantization and FP8 gradient quantization in Triton (arXiv 2501.17116, 3.1).

``triton_quantize_rows`` is the kernel twin of ``fp4lightning.numerics.absmax.quantize_rows_reference``: one
program reads a block of rows, takes each row's absmax, forms the fp32 scale
``6 / max(amax, 2^-124)`` (optionally rounded down to a power of two by masking the
exponent bits), rounds ``x * scale`` to E2M1 with ties to even, and writes two codes
per byte (element ``2j`` in the low nibble) plus the fp32 scale. Rows containing NaN
or +/-inf get a NaN scale and zero codes, exactly as the reference. Codes and scales
are bit-identical to the reference: the scale is computed as torch computes it
(an IEEE reciprocal, ``div_rn``, then a multiply) and the rounding is exact fp32
arithmetic (``_common.minifloat_bits``). ``quantize_rows_clamped`` fuses OCC's clamp
(section 3.3) into the same pass and writes the residual.

Rows up to ``2 * MAX_SINGLE_PASS_KH`` elements are held in registers and read once;
longer rows take two passes over the row (amax, then encode), the second mostly from L2.

``quantize_fp8`` is the twin of ``fp4lightning.ops.gemm.quantize_fp8_reference`` (the
dY quantizer of the backward GeMMs, docs/method.md section 3): absmax FP8 E4M3/E5M2 with
one fp32 scale per row or per column, saturating, round-to-nearest-even, emitted as
FP8 bit patterns computed arithmetically.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4lightning.numerics.constants import (E4M3_FOLD_MAX_SHIFT, F8E4M3_EMIN, F8E4M3_MANT_BITS, F8E4M3_MAX, F8E5M2_EMIN,
                                    F8E5M2_MANT_BITS, F8E5M2_MAX)

from ._common import (
    AMAX_EPS_C,
    E2M1_MAX_C,
    F8E4M3_MAX_C,
    INTERPRET_C,
    F32_MAX_C,
    FLOAT_DTYPES,
    FP8_AMAX_EPS_C,
    INTERPRET,
    check_rows,
    check_same_device,
    check_vector,
    e2m1_bits,
    minifloat_bits,
    sign_bit,
)

__all__ = ["triton_quantize_rows", "triton_quantize_rows_clamped", "triton_quantize_rows_folded", "triton_quantize_fp8",
           "MAX_SINGLE_PASS_KH"]

#: Longest packed row (bytes; 2x elements) one program keeps in registers in one pass.
MAX_SINGLE_PASS_KH = 4096
#: Longest row (elements) the per-row FP8 quantizer keeps in registers in one pass.
MAX_SINGLE_PASS_FP8 = 8192
# FP8 formats: (max, mantissa bits, smallest normal exponent), per torch.finfo.
E4M3_FOLD_MAX_SHIFT_C = tl.constexpr(E4M3_FOLD_MAX_SHIFT)
_FP8 = {
    "e4m3": (F8E4M3_MAX, F8E4M3_MANT_BITS, F8E4M3_EMIN, torch.float8_e4m3fn),
    "e5m2": (F8E5M2_MAX, F8E5M2_MANT_BITS, F8E5M2_EMIN, torch.float8_e5m2),
}


# --------------------------------------------------------------------------- FP4
@triton.jit
def _fp4_scale(amax, POW2: tl.constexpr):
    """fp32 ``6 / max(amax, eps)`` (pow2: exponent bits only), NaN where amax is not finite."""
    # torch evaluates ``6 / t`` (Python scalar over tensor) as ``t.reciprocal() * 6``:
    # two IEEE roundings, mirrored here so the scales agree bit for bit.
    one = tl.full(amax.shape, 1.0, tl.float32)
    scale = tl.math.div_rn(one, tl.maximum(amax, AMAX_EPS_C)) * E2M1_MAX_C
    if POW2:
        # 2^floor(log2(scale)) exactly: keep the exponent bits, zero the mantissa.
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax <= F32_MAX_C, scale, float("nan"))


@triton.jit
def _row_amax(x):
    """Row absmax of a [rows, cols] fp32 tile, NaN for rows holding NaN or +/-inf."""
    xa = tl.abs(x)
    finite = xa <= F32_MAX_C
    amax = tl.max(tl.where(finite, xa, 0.0), axis=1)
    bad = tl.max(tl.where(finite, 0, 1), axis=1)
    return tl.where(bad > 0, float("nan"), amax)


@triton.jit
def _encode_fp4_store(x, scale, q_ptrs, mask, BLOCK_M: tl.constexpr, BLOCK_KH: tl.constexpr, e_ptrs, e_mask,
                      E4M3: tl.constexpr):
    """E2M1-encode a [BLOCK_M, 2*BLOCK_KH] fp32 tile with per-row ``scale`` and store packed bytes;
    with E4M3 also each code's exact E4M3 byte at ``e_ptrs`` (the scaled_mm backend's GeMM operand)."""
    s = scale[:, None]
    y = x * s
    y = tl.where(s == s, y, 0.0)  # NaN-scale rows: zero codes (the reference's nan_to_num)
    mag = minifloat_bits(tl.minimum(tl.abs(y), E2M1_MAX_C), 1, 0)
    code = mag | (sign_bit(y) << 3)
    if E4M3:
        tl.store(e_ptrs, e2m1_bits(code, 3, 0x30, 7).to(tl.uint8), mask=e_mask)
    even, odd = tl.split(code.reshape(BLOCK_M, BLOCK_KH, 2))
    tl.store(q_ptrs, (even | (odd << 4)).to(tl.uint8), mask=mask)


@triton.jit
def _load_block(x_rows, r_rows, k0, ke, row_ok, K, lo, hi, CLAMP: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """Load elements [k0, k0 + 2*BLOCK_KH) of a row block as fp32; with CLAMP apply the OCC
    clamp to [lo, hi] and (STORE_RESIDUAL) write the residual ``x - clamp(x)``."""
    mask = row_ok[:, None] & (k0 + ke < K)[None, :]
    x = tl.load(x_rows + k0 + ke[None, :], mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        # torch.clamp semantics, min(max(x, lo), hi) (so hi wins if lo > hi): NaN stays NaN, a NaN
        # bound makes everything NaN
        xc = tl.where(x < lo, lo, x)
        xc = tl.where(xc > hi, hi, xc)
        xc = tl.where((lo != lo) | (hi != hi), float("nan"), xc)
        if STORE_RESIDUAL:
            tl.store(r_rows + k0 + ke[None, :], (x - xc).to(r_rows.dtype.element_ty), mask=mask)
        x = xc
    return x


@triton.jit
def _quantize_fp4_kernel(
    # pointers (r_ptr, bounds_ptr: OCC residual out and [lo, hi], used when CLAMP; e_ptr: the E4M3
    # operand out, used when E4M3; i_ptr: 1 / scale out, used when STORE_INV; b_ptr, bo_ptr: one fp32
    # value a row in, its bf16 bits out, used when BIAS_BF16)
    x_ptr, q_ptr, s_ptr, amax_ptr, r_ptr, bounds_ptr, e_ptr, i_ptr, b_ptr, bo_ptr,
    # sizes
    M, K, KH,
    # strides (the inner stride is 1)
    stride_xm, stride_qm, stride_rm, stride_em,
    # meta-parameters
    POW2: tl.constexpr, GIVEN_AMAX: tl.constexpr, SINGLE_PASS: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KH: tl.constexpr, E4M3: tl.constexpr = False, STORE_INV: tl.constexpr = False,
    BIAS_BF16: tl.constexpr = False,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
    r_rows = r_ptr + rows.to(tl.int64)[:, None] * stride_rm
    e_rows = e_ptr + rows.to(tl.int64)[:, None] * stride_em
    ke = tl.arange(0, 2 * BLOCK_KH)  # element offsets in one block
    kb = tl.arange(0, BLOCK_KH)  # byte offsets in one block
    lo = 0.0
    hi = 0.0
    if CLAMP:
        lo = tl.load(bounds_ptr)
        hi = tl.load(bounds_ptr + 1)
    if GIVEN_AMAX:  # per-tensor scaling: the amax (NaN if non-finite) comes from outside
        amax = tl.zeros([BLOCK_M], tl.float32) + tl.load(amax_ptr)

    # --- one pass: the whole row block sits in registers
    if SINGLE_PASS:
        x = _load_block(x_rows, r_rows, 0, ke, row_ok, K, lo, hi, CLAMP, True)
        if not GIVEN_AMAX:
            amax = _row_amax(x)
        scale = _fp4_scale(amax, POW2)
        _encode_fp4_store(x, scale, q_rows + kb[None, :], row_ok[:, None] & (kb < KH)[None, :], BLOCK_M, BLOCK_KH,
                          e_rows + ke[None, :], row_ok[:, None] & (ke < K)[None, :], E4M3)
    # --- two passes: absmax over the row, then encode
    else:
        if not GIVEN_AMAX:
            amax = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, 2 * BLOCK_KH):
                x = _load_block(x_rows, r_rows, k0, ke, row_ok, K, lo, hi, CLAMP, False)
                # NaN-propagating running max (tl.maximum would drop NaN on the GPU)
                blk = _row_amax(x)
                amax = tl.where((blk != blk) | (amax != amax), float("nan"), tl.maximum(amax, blk))
        scale = _fp4_scale(amax, POW2)
        for k0 in range(0, K, 2 * BLOCK_KH):
            x = _load_block(x_rows, r_rows, k0, ke, row_ok, K, lo, hi, CLAMP, True)
            h0 = k0 // 2
            _encode_fp4_store(x, scale, q_rows + h0 + kb[None, :], row_ok[:, None] & (h0 + kb < KH)[None, :],
                              BLOCK_M, BLOCK_KH, e_rows + k0 + ke[None, :], row_ok[:, None] & (k0 + ke < K)[None, :],
                              E4M3)

    _store_scale(s_ptr, i_ptr, rows, scale, row_ok, STORE_INV)
    if BIAS_BF16:  # the weight's quantizer casts the layer's bias for the GeMM's epilogue: no cast launch
        tl.store(bo_ptr + rows, _bf16_bits(tl.load(b_ptr + rows, mask=row_ok, other=0.0)), mask=row_ok)


@triton.jit
def _bf16_bits(x):
    """fp32 -> the bf16 bit patterns (int16) torch's cast gives: nearest-even, NaN -> 0x7FC0. Integer
    arithmetic, so the interpreter (whose bf16 stores truncate) gives the same bits as a GPU."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r).to(tl.int16)


def fp4_launch_params(kh: int, block_kh: int | None = None) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_KH, SINGLE_PASS, num_warps) for rows of ``kh`` packed bytes (also what
    kernels/compile_check.py compiles).

    Heuristic rather than autotuned: the kernel is bandwidth-bound, so what matters is
    a few thousand elements per program (enough loads in flight) and no register
    spills; a program covers 2 * BLOCK_M * BLOCK_KH elements, ~8-16K for long rows.
    """
    if block_kh is None:
        block_kh = min(triton.next_power_of_2(kh), MAX_SINGLE_PASS_KH)
    elif block_kh < 1 or block_kh & (block_kh - 1):
        raise ValueError(f"block_kh must be a positive power of two, got {block_kh}")
    single = block_kh >= kh
    block_m = max(1, min(64, 2048 // block_kh))
    if INTERPRET:
        return block_m, block_kh, single, 4
    num_warps = 8 if 2 * block_m * block_kh >= 8192 else 4
    return block_m, block_kh, single, num_warps


def _check_input(x2d, scale_mode, bounds):
    x2d = check_rows("x2d", x2d, FLOAT_DTYPES, "the tensor to quantize, one scale per row")
    check_same_device(x2d=x2d, bounds=bounds)
    if scale_mode not in ("float", "pow2"):
        raise ValueError(f"unknown scale_mode {scale_mode!r}; choose 'float' or 'pow2'")
    return x2d


def _clamp_bounds(x2d, bounds):
    """OCC's ``[lo, hi]`` as the kernels read them: fp32 holding the bounds cast to x's dtype, which
    is what the reference clamps with (fp4lightning.numerics.occ.occ_clamp)."""
    if not isinstance(bounds, torch.Tensor) or bounds.shape != (2,) or not bounds.is_floating_point():
        raise ValueError("bounds must be a floating-point tensor([lo, hi]) as occ_bounds returns, got "
                         f"{bounds if not isinstance(bounds, torch.Tensor) else tuple(bounds.shape)}")
    return bounds.to(x2d.dtype).float().contiguous()


def _tensor_amax(x2d, lohi):
    """Per-tensor scaling's absmax (1 element, fp32) of x, or of clamp(x, lo, hi) with ``lohi``;
    NaN-propagating, inf -> NaN (the kernels only test finiteness)."""
    if lohi is None:
        amax = torch.linalg.vector_norm(x2d, float("inf")).float().reshape(1)
    else:
        # the clamped tensor spans [clamp(min), clamp(max)]: its absmax without materialising it
        ends = torch.clamp(torch.stack(torch.aminmax(x2d)).float(), lohi[0], lohi[1])
        amax = ends.abs().amax().reshape(1)
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("nan")))


def _quantize_fp4(x2d, scale_mode, per_tensor, bounds, block_kh, e4m3=False, inverse=False, bias=None):
    x2d = _check_input(x2d, scale_mode, bounds)
    m, k = x2d.shape
    kh = (k + 1) // 2
    q = torch.empty(m, kh, dtype=torch.uint8, device=x2d.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2d.device)
    resid = scale  # placeholder pointers when unused
    lohi = None
    if bounds is not None:
        lohi = _clamp_bounds(x2d, bounds)
        resid = torch.empty(m, k, dtype=x2d.dtype, device=x2d.device)
    # the E4M3 operand's rows padded to 16 bytes (what _scaled_mm and the FP8 GeMMs load)
    e = torch.empty(m, (k + 15) // 16 * 16, dtype=torch.uint8, device=x2d.device) if e4m3 else q
    amax = _tensor_amax(x2d, lohi) if per_tensor else scale
    inv = torch.empty_like(scale) if inverse else scale  # placeholder pointer when unused
    if bias is not None:
        bias = check_vector("bias", bias, m, (torch.float32,), "one fp32 value per row: the layer's bias")
        check_same_device(x2d=x2d, bias=bias)
    b16 = torch.empty(m, dtype=torch.bfloat16, device=x2d.device) if bias is not None else None
    block_m, blk, single, warps = fp4_launch_params(kh, block_kh)
    _quantize_fp4_kernel[(triton.cdiv(m, block_m),)](
        x2d, q, scale, amax, resid, scale if lohi is None else lohi, e, inv, scale if bias is None else bias,
        scale if b16 is None else b16.view(torch.int16), m, k, kh, x2d.stride(0), q.stride(0), resid.stride(0),
        e.stride(0),
        POW2=scale_mode == "pow2", GIVEN_AMAX=per_tensor, SINGLE_PASS=single, CLAMP=bounds is not None,
        BLOCK_M=block_m, BLOCK_KH=blk, E4M3=e4m3, STORE_INV=inverse, BIAS_BF16=bias is not None, num_warps=warps,
    )
    outs = (q, scale, (resid if bounds is not None else None), (e.view(torch.float8_e4m3fn)[:, :k] if e4m3 else None))
    return outs + ((inv,) if inverse else ()) + ((b16,) if bias is not None else ())


def triton_quantize_rows(x2d: torch.Tensor, scale_mode: str = "float", per_tensor: bool = False, *,
                  block_kh: int | None = None, e4m3: bool = False, inverse: bool = False,
                  bias_bf16: torch.Tensor | None = None):
    """Row-wise FP4 quantization: ``(packed uint8 (M, ceil(K/2)), scale fp32 (M,))``.

    Bit-identical to ``fp4lightning.numerics.absmax.quantize_rows_reference(x2d, scale_mode, per_tensor)``
    (codes, padding nibble and scales, NaN scales for non-finite rows included).
    ``x2d``: fp32/bf16/fp16, 2-D, contiguous rows, on CUDA (or CPU under the
    interpreter). ``block_kh`` (bytes per block, power of two) is a tuning/testing
    override; rows longer than it are quantized in two passes. With ``e4m3`` the same pass
    also writes the codes' exact E4M3 values, ``(packed, scale, e4 (M, K))`` (row stride padded
    to 16 bytes): the scaled_mm backend's forward operand, next to the packed codes kept for
    backward. With ``inverse`` the same pass also writes ``1 / scale`` (IEEE, ``torch.reciprocal``'s
    bits; NaN where the scale is NaN), appended last: what ``_scaled_mm`` multiplies by and what the
    backward's dY quantizers fold in, so neither takes a reciprocal launch. ``bias_bf16`` (fp32, one value
    per row: a weight's layer bias) appends ``bias_bf16.to(torch.bfloat16)``, bit for bit, written by the
    same pass: the bias the GeMM's bf16 epilogue adds, without a cast launch.
    """
    q, scale, _, e, *extra = _quantize_fp4(x2d, scale_mode, per_tensor, None, block_kh, e4m3, inverse, bias_bf16)
    return (q, scale) + ((e,) if e4m3 else ()) + tuple(extra)


def triton_quantize_rows_clamped(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                          per_tensor: bool = False, *, block_kh: int | None = None, e4m3: bool = False):
    """OCC clamp fused into the FP4 quantizer (section 3.3): ``(packed, scale, residual)``.

    Equals ``occ_clamp(x2d, bounds)`` followed by ``triton_quantize_rows`` on the clamped
    tensor: ``bounds = tensor([lo, hi])`` (from ``occ_bounds``) is cast to x's dtype
    as the reference does, the codes and scales are bit-identical, and ``residual``
    (dense, x's dtype) is ``x - clamp(x)``, computed in fp32 and rounded once to x's
    dtype (as torch rounds the bf16/fp16 subtraction). One read of x instead of three
    tensors' worth of traffic (clamp write, residual write, quantizer read). ``e4m3``: also the
    E4M3 operand, ``(packed, scale, residual, e4)`` (as ``triton_quantize_rows``).
    """
    q, scale, resid, e = _quantize_fp4(x2d, scale_mode, per_tensor, bounds, block_kh, e4m3)
    return (q, scale, resid, e) if e4m3 else (q, scale, resid)


# --------------------------------------------------------------------------- FP4 + OCC folded in E4M3
# Written for few instructions per element (kernels/compile_check.py counts them): the kernel reads
# 2 bytes and writes 1 per element, so it keeps up with HBM only below ~30 SASS instructions per
# element on an H200. Maxima are taken on the fp32 bit patterns with the sign cleared (non-negative
# floats order like their bits, NaN above inf: one integer max, NaN-propagating); E2M1 rounding is
# bit arithmetic; on a GPU the bf16 rounding and the E4M3 encode are single conversions
# (cvt.rn.bf16.f32, cvt.rn.satfinite.e4m3x2.f32: nearest-even, saturating), under the interpreter
# (whose casts truncate, docs/kernels.md) the same roundings in integer arithmetic.
@triton.jit
def _round_like(r, DT: tl.constexpr):
    """fp32 ``r`` rounded to the float dtype DT (nearest-even) and back, as torch's arithmetic in DT rounds."""
    if DT == tl.bfloat16:
        if INTERPRET_C:
            b = r.to(tl.int32, bitcast=True)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        else:
            r = r.to(tl.bfloat16).to(tl.float32)
    elif DT == tl.float16:
        r = r.to(tl.float16).to(tl.float32)
    return r


@triton.jit
def _clamp(x, lo, hi):
    """torch.clamp(x, lo, hi): NaN propagates, a NaN bound makes everything NaN."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _fold_load(x_rows, k0, ke, row_ok, K, lo, hi):
    """``(clamp(x), R, mask)`` of elements [k0, k0 + BLOCK) of a row block, fp32; R = ``x - clamp(x)``
    rounded to x's dtype as torch's subtraction in that dtype rounds it."""
    mask = row_ok[:, None] & (k0 + ke < K)[None, :]
    x = tl.load(x_rows + k0 + ke[None, :], mask=mask, other=0.0).to(tl.float32)
    xc = _clamp(x, lo, hi)
    return xc, _round_like(x - xc, x_rows.dtype.element_ty), mask


@triton.jit
def _order_key(v):
    """fp32 -> int32 whose signed order is the floats' order (an involution): +NaN above +inf,
    -NaN (sign bit set, x86's default NaN) below -inf, so a max and a min catch every NaN."""
    i = v.to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _abs_bits_max(v):
    """Row max of ``|v|`` as fp32 bit patterns (int32): NaN above inf above every finite value."""
    return tl.max(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)


@triton.jit
def _folded_values(xc, r, s):
    """``A_q + s R`` (fp32), as ``fp4lightning.numerics.cpu_fused.fp4_rows_unpacked(fold=True)`` computes it: the
    E2M1 value of ``clamp(x) * s`` (nearest, ties to even, saturating at 6) plus ``R * s``, the
    product and the sum rounded separately (the kernel is launched without FMA contraction).
    Non-decreasing in x (every step is): the two-pass path for long rows relies on it."""
    y = xc * s
    a = tl.minimum(tl.abs(y), E2M1_MAX_C)
    b = a.to(tl.int32, bitcast=True)
    normal = ((b + 0x1FFFFF + ((b >> 22) & 1)) & -4194304).to(tl.float32, bitcast=True)  # 1 mantissa bit
    sub = (a + 4194304.0) - 4194304.0  # below 1: multiples of 0.5 (the ulp of 2^22)
    q = tl.where(a < 1.0, sub, normal).to(tl.int32, bitcast=True)
    q = (q | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)  # y's sign, -0.0 too
    return q + r * s


@triton.jit
def _fold_factor(shift):
    """2^-shift (fp32, exact, from the exponent bits) for an int32 shift in 0..126: the power of two
    the folded operand is scaled by (``cpu_fused._pow2_neg`` on the CPU path)."""
    return ((127 - shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fold_shift(famax):
    """fp4lightning.numerics.occ.fold_e4m3's per-row shift (int32 0..8) of a finite row absmax."""
    e = ((famax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126  # frexp's exponent (normal numbers)
    shift = tl.minimum(tl.maximum(e - 9, 0), E4M3_FOLD_MAX_SHIFT_C)
    return tl.minimum(tl.where(famax * _fold_factor(shift) > F8E4M3_MAX_C, shift + 1, shift), E4M3_FOLD_MAX_SHIFT_C)


@triton.jit
def _fold_encode_store(v, shift, bad, e_ptrs, mask, MANT: tl.constexpr, EMIN: tl.constexpr):
    """E4M3 bit patterns of ``v * 2^-shift`` (saturating, nearest-even); zeros in ``bad`` rows."""
    y = tl.where(bad[:, None], 0.0, v * _fold_factor(shift)[:, None])
    if INTERPRET_C:
        mag = minifloat_bits(tl.minimum(tl.abs(y), F8E4M3_MAX_C), MANT, EMIN)
        bits = (mag | (sign_bit(y) << 7)).to(tl.uint8)
    else:
        bits = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(e_ptrs, bits, mask=mask)


@triton.jit
def _fold_compact(r, rows, k0, ke, mask, K, i_ptr, v_ptr, ctr_ptr, CAP, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile's non-zeros of R (NaN included, as ``r != 0`` counts them) into the compact residual's next
    free slots: one atomic on the slot counter per tile, then the flat indices and values in the tile's
    row-major order from there. Non-zeros past the capacity ``CAP`` are counted, not written."""
    nz = (mask & (r != 0.0)).to(tl.int32)
    per_row = tl.sum(nz, axis=1)
    base = tl.atomic_add(ctr_ptr, tl.sum(per_row, axis=0).to(tl.int64))
    # each row's first slot, then each element's: scans along the rows, in the tile's own layout; the
    # slots are int32 (a capacity under 2^31), the count int64 (all of R's non-zeros)
    first = tl.minimum(base + (tl.cumsum(per_row, axis=0) - per_row).to(tl.int64), CAP).to(tl.int32)
    slot = first[:, None] + tl.cumsum(nz, axis=1) - nz
    ok = (nz != 0) & (slot < CAP)
    flat = rows.to(i_ptr.dtype.element_ty)[:, None] * K + (k0 + ke)[None, :]
    tl.store(i_ptr + slot, flat, mask=ok)
    tl.store(v_ptr + slot, r.to(v_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fold_compact_close(ctr_ptr, n_ptr, o_ptr, CAP):
    """The last program to finish: the compact residual's count and overflow flag out, and both counters
    (slots taken, programs done) back to zero for the next launch (no memset launch before it)."""
    done = tl.atomic_add(ctr_ptr + 1, 1)
    if done == tl.num_programs(0) - 1:
        total = tl.atomic_xchg(ctr_ptr, 0)
        tl.store(n_ptr, total)
        tl.store(o_ptr, total > CAP)
        tl.atomic_xchg(ctr_ptr + 1, 0)


@triton.jit
def _fold_save(xc, r, scale, q_rows, r_rows, k0, ke, mask, row_ok, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               COMPACT: tl.constexpr, rows, i_ptr, v_ptr, ctr_ptr, CAP):
    """What the scaled_mm backend keeps for backward of the clamped tile: its packed E2M1 codes
    (those of ``triton_quantize_rows_clamped``) and the residual R in x's dtype, dense, or (COMPACT) its
    non-zeros in the compact residual's slots."""
    if COMPACT:
        _fold_compact(r, rows, k0, ke, mask, K, i_ptr, v_ptr, ctr_ptr, CAP, BLOCK_M, BLOCK_K)
    else:
        tl.store(r_rows + k0 + ke[None, :], r.to(r_rows.dtype.element_ty), mask=mask)
    s = scale[:, None]
    y = tl.where(s == s, xc * s, 0.0)  # NaN-scale rows: zero codes
    code = minifloat_bits(tl.minimum(tl.abs(y), E2M1_MAX_C), 1, 0) | (sign_bit(y) << 3)
    even, odd = tl.split(code.reshape(BLOCK_M, BLOCK_K // 2, 2))
    kb = tl.arange(0, BLOCK_K // 2)
    h0 = k0 // 2
    tl.store(q_rows + h0 + kb[None, :], (even | (odd << 4)).to(tl.uint8),
             mask=row_ok[:, None] & (h0 + kb < (K + 1) // 2)[None, :])


# one function: a kernel is one launch, and each row block's amax, shift and encode share registers
@triton.jit
def _quantize_fp4_fold_kernel(
    x_ptr, e_ptr, s_ptr, amax_ptr, bounds_ptr,
    M, K,
    stride_xm, stride_em,
    POW2: tl.constexpr, GIVEN_AMAX: tl.constexpr, SINGLE_PASS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MANT: tl.constexpr = F8E4M3_MANT_BITS,
    EMIN: tl.constexpr = F8E4M3_EMIN,
    # SAVE (the scaled_mm backend's `paper`): also the packed codes, s_a and the residual R
    q_ptr=None, sa_ptr=None, r_ptr=None, stride_qm=0, stride_rm=0, SAVE: tl.constexpr = False,
    # COMPACT (with SAVE): R as the compact residual instead, slots i_ptr / v_ptr (capacity CAP), its
    # count n_ptr and overflow flag o_ptr, through the zeroed counters ctr_ptr (slots taken, programs done)
    i_ptr=None, v_ptr=None, n_ptr=None, o_ptr=None, ctr_ptr=None, CAP=0, COMPACT: tl.constexpr = False,
    # ROUND_BOUNDS: bounds_ptr holds OCC's fp32 bounds, clamped with as x's dtype rounds them (occ_clamp)
    ROUND_BOUNDS: tl.constexpr = False,
):
    # OCC clamp, FP4 scale, E2M1 rounding, residual folded back in, per-row power-of-two shift,
    # E4M3 encode. SINGLE_PASS: the row block sits in registers, x is read once. Otherwise two
    # walks along the row: the first takes each row's largest and smallest x; since clamping and
    # every step of the fold are non-decreasing in x, the clamped absmax is that of clamp(x_max)
    # and clamp(x_min), and the folded row's absmax that of the two folded extremes (exactly: the
    # same arithmetic on the same values); the second walk encodes.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    e_rows = e_ptr + rows.to(tl.int64)[:, None] * stride_em
    if SAVE:
        q_rows = q_ptr + rows.to(tl.int64)[:, None] * stride_qm
        r_rows = r_ptr + rows.to(tl.int64)[:, None] * stride_rm
    ke = tl.arange(0, BLOCK_K)
    lo = tl.load(bounds_ptr)
    hi = tl.load(bounds_ptr + 1)
    if ROUND_BOUNDS:
        lo = _round_like(lo, x_ptr.dtype.element_ty)
        hi = _round_like(hi, x_ptr.dtype.element_ty)
    if SINGLE_PASS:
        xc, r, mask = _fold_load(x_rows, 0, ke, row_ok, K, lo, hi)
        if GIVEN_AMAX:
            amax = tl.zeros([BLOCK_M], tl.float32) + tl.load(amax_ptr)
        else:
            amax = _abs_bits_max(xc).to(tl.float32, bitcast=True)
        scale = _fp4_scale(amax, POW2)
        v = _folded_values(xc, r, scale[:, None])
        fbits = _abs_bits_max(v)
        bad = (scale != scale) | (fbits >= 0x7F800000)  # NaN, or +/-inf in the folded row
        shift = _fold_shift(tl.where(bad, 0.0, fbits.to(tl.float32, bitcast=True)))
        _fold_encode_store(v, shift, bad, e_rows + ke[None, :], mask, MANT, EMIN)
        if SAVE:
            _fold_save(xc, r, scale, q_rows, r_rows, 0, ke, mask, row_ok, K, BLOCK_M, BLOCK_K, COMPACT, rows, i_ptr,
                       v_ptr, ctr_ptr, CAP)
    else:
        kmax = tl.full([BLOCK_M], -2147483648, tl.int32)
        kmin = tl.full([BLOCK_M], 2147483647, tl.int32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (k0 + ke < K)[None, :]
            key = _order_key(tl.load(x_rows + k0 + ke[None, :], mask=mask, other=0.0).to(tl.float32))
            kmax = tl.maximum(kmax, tl.max(tl.where(mask, key, -2147483648), axis=1))
            kmin = tl.minimum(kmin, tl.min(tl.where(mask, key, 2147483647), axis=1))
        x_hi = _order_key(kmax).to(tl.float32, bitcast=True)  # the row's largest x (or +NaN)
        x_lo = _order_key(kmin).to(tl.float32, bitcast=True)  # smallest (or -NaN)
        c_hi = _clamp(x_hi, lo, hi)
        c_lo = _clamp(x_lo, lo, hi)
        if GIVEN_AMAX:
            amax = tl.zeros([BLOCK_M], tl.float32) + tl.load(amax_ptr)
        else:
            amax = tl.maximum(c_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF,
                              c_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        scale = _fp4_scale(amax, POW2)
        dt = x_ptr.dtype.element_ty
        v_hi = _folded_values(c_hi, _round_like(x_hi - c_hi, dt), scale)
        v_lo = _folded_values(c_lo, _round_like(x_lo - c_lo, dt), scale)
        fbits = tl.maximum(v_hi.to(tl.int32, bitcast=True) & 0x7FFFFFFF, v_lo.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        bad = (scale != scale) | (fbits >= 0x7F800000)
        shift = _fold_shift(tl.where(bad, 0.0, fbits.to(tl.float32, bitcast=True)))
        for k0 in range(0, K, BLOCK_K):
            xc, r, mask = _fold_load(x_rows, k0, ke, row_ok, K, lo, hi)
            _fold_encode_store(_folded_values(xc, r, scale[:, None]), shift, bad, e_rows + k0 + ke[None, :], mask,
                               MANT, EMIN)
            if SAVE:
                _fold_save(xc, r, scale, q_rows, r_rows, k0, ke, mask, row_ok, K, BLOCK_M, BLOCK_K, COMPACT, rows,
                           i_ptr, v_ptr, ctr_ptr, CAP)
    tl.store(s_ptr + rows, tl.where(bad, float("nan"), scale * _fold_factor(shift)), mask=row_ok)  # s_a 2^-shift
    if SAVE:
        tl.store(sa_ptr + rows, scale, mask=row_ok)
    if COMPACT:
        _fold_compact_close(ctr_ptr, n_ptr, o_ptr, CAP)


def fold_launch_params(k: int, block_k: int | None = None) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_K, SINGLE_PASS, num_warps) of the folded quantizer for rows of ``k``
    elements (also what kernels/compile_check.py compiles): the FP4 quantizer's tiles, whose
    packed bytes are two elements each."""
    if block_k is not None and (block_k < 2 or block_k & (block_k - 1)):
        raise ValueError(f"block_k must be a power of two >= 2, got {block_k}")
    block_m, bkh, single, warps = fp4_launch_params((k + 1) // 2, None if block_k is None else block_k // 2)
    return block_m, 2 * bkh, single, warps


#: per (device, is_meta): the fold kernel's two counters (compact residual slots taken, programs done), zero
#: between launches (the last program of each launch puts them back), so no memset launch precedes it
_FOLD_COUNTERS: dict[tuple[str, bool], torch.Tensor] = {}


def _fold_counters(like: torch.Tensor) -> torch.Tensor:
    """The zeroed counters the compact-residual fold kernel claims its slots with; a fresh pair while a CUDA
    graph is captured (its memory would belong to the graph). Launches on one device share them: they
    run one after another on its stream, as FP4Linear's do."""
    if like.is_cuda and not like.is_meta and torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int64, device=like.device)
    key = (str(like.device), like.is_meta)
    if key not in _FOLD_COUNTERS:
        _FOLD_COUNTERS[key] = torch.zeros(2, dtype=torch.int64, device=like.device)
    return _FOLD_COUNTERS[key]


def _fold_bounds(x2d, bounds, per_tensor):
    """``(bounds as the kernel reads them, whether it rounds them to x's dtype itself)``: fp32 bounds go in
    as they are (no cast launches); other dtypes, and per-tensor scaling (whose absmax needs them), as
    ``_clamp_bounds`` casts them."""
    if (per_tensor or not isinstance(bounds, torch.Tensor) or bounds.dtype != torch.float32
            or bounds.shape != (2,)):
        return _clamp_bounds(x2d, bounds), False
    return bounds.contiguous(), x2d.dtype != torch.float32


def _compact_outputs(m, k, capacity, like):
    """The compact residual's buffers: flat indices (int32 where M K fits), values in x's dtype, the
    overflow flag (0-dim bool) and the count (0-dim int64), all written by the kernel."""
    n = m * k
    if not 0 < capacity <= min(n, 2**31 - 2**16):  # the kernel's slots are int32
        raise ValueError(f"capacity must be in [1, min(M K, 2^31 - 2^16)] (M K = {n}), got {capacity}")
    idx = torch.empty(capacity, dtype=torch.int32 if n < 2**31 - 1 else torch.int64, device=like.device)
    vals = torch.empty(capacity, dtype=like.dtype, device=like.device)
    return (idx, vals, torch.empty((), dtype=torch.bool, device=like.device),
            torch.empty((), dtype=torch.int64, device=like.device))


def triton_quantize_rows_folded(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                                per_tensor: bool = False, *, block_k: int | None = None, save: bool = False,
                                capacity: int | None = None):
    """OCC folded into the activation operand in E4M3 (``FP4Config.occ_fold_e4m3``): ``(e4, scale)``.

    One pass over x does what the reference does in three steps: ``quantize_fp4_clamped(x2d,
    bounds, fold=True)`` (clamp, row-wise FP4 scale ``s_a``, E2M1 values ``A_q`` plus the scaled
    residual, ``A_q + s_a R``), then ``fp4lightning.numerics.occ.fold_e4m3`` (each row shifted down by the
    smallest power of two ``2^shift``, 0 <= shift <= 8, that brings it within E4M3's 448, rounded
    to E4M3), with ``scale = s_a 2^-shift`` so that ``x ~ e4 / scale`` and the forward GeMM needs
    no compensation term (docs/perf.md, "OCC on the GPU"). Bit-identical to that reference
    (``fp4lightning.ops.gemm.quantize_fp4_folded``). Rows whose folded values are not
    finite (NaN or +/-inf in x, or a NaN bound) get a NaN scale and zero codes, so the GeMM's
    output row is NaN and loss scaling sees it.

    ``e4`` is (M, K) ``torch.float8_e4m3fn``, a view of a buffer whose row stride is a
    multiple of 16 bytes (16-byte aligned loads and TMA in the FP8 GeMM). ``block_k`` (power
    of two) is a testing override; longer rows take the two-pass path.

    ``save`` (the scaled_mm backend's ``paper``): the same pass also writes what backward rebuilds
    the operand from (``ops.gemm.refold_operand``), ``(e4, scale, packed, s_a, residual)``: the
    packed codes and scale of ``triton_quantize_rows_clamped`` and the residual ``x - clamp(x)`` in
    x's dtype, bit-identical to it. With ``capacity`` (and ``save``) the residual comes as the compact
    residual instead, ``(flat indices (int32 where M K fits), values in x's dtype, overflow, count)``:
    its non-zeros (``r != 0``, NaN included) in the first ``min(count, capacity)`` slots, in no fixed
    order, the other slots unwritten; ``overflow`` (0-dim bool) is ``count > capacity``. The same set
    as ``nn.linear._compact_residual`` of the dense residual (which fills its slots in row-major order),
    so ``scaled_mm.triton_refold(count=)`` rebuilds the same bytes from either.
    """
    x2d = _check_input(x2d, scale_mode, bounds)
    m, k = x2d.shape
    lohi, round_bounds = _fold_bounds(x2d, bounds, per_tensor)
    buf = torch.empty(m, (k + 15) // 16 * 16, dtype=torch.uint8, device=x2d.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2d.device)
    amax = _tensor_amax(x2d, lohi) if per_tensor else scale
    compact = save and capacity is not None
    if save:
        q = torch.empty(m, (k + 1) // 2, dtype=torch.uint8, device=x2d.device)
        s_a = torch.empty(m, dtype=torch.float32, device=x2d.device)
        resid = _compact_outputs(m, k, capacity, x2d) if compact else torch.empty(m, k, dtype=x2d.dtype,
                                                                                  device=x2d.device)
    else:  # placeholders, never touched
        q, s_a, resid = buf, scale, buf
    dense = buf if compact else resid  # placeholder pointer where R is compact
    i, v, o, n = resid if compact else (buf, buf, buf, buf)
    block_m, blk, single, warps = fold_launch_params(k, block_k)
    _quantize_fp4_fold_kernel[(triton.cdiv(m, block_m),)](
        x2d, buf, scale, amax, lohi, m, k, x2d.stride(0), buf.stride(0),
        POW2=scale_mode == "pow2", GIVEN_AMAX=per_tensor, SINGLE_PASS=single, BLOCK_M=block_m, BLOCK_K=blk,
        q_ptr=q, sa_ptr=s_a, r_ptr=dense, stride_qm=q.stride(0), stride_rm=dense.stride(0), SAVE=save,
        i_ptr=i, v_ptr=v, n_ptr=n, o_ptr=o, ctr_ptr=_fold_counters(x2d) if compact else buf,
        CAP=capacity if compact else 0, COMPACT=compact, ROUND_BOUNDS=round_bounds,
        num_warps=warps, enable_fp_fusion=False,
    )
    e4 = buf.view(torch.float8_e4m3fn)[:, :k]
    return (e4, scale, q, s_a, resid) if save else (e4, scale)


# --------------------------------------------------------------------------- FP8
@triton.jit
def _fp8_tile(x_ptr, stride_xm, rows, cols, M, N, r_ptr, DIV: tl.constexpr):
    """An fp32 tile of x; DIV=1 multiplies each column by r[col], DIV=2 each row by r[row], where
    ``r`` holds the IEEE reciprocals of the divisors: the FP4 scale folded into dY (section 3)
    as one fp32 multiply per element, ``x * (1 / d)`` in torch (an IEEE division per element
    cost ~20 SASS instructions of the quantizer's ~50, kernels/compile_check.py)."""
    ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return _fp8_div(x, rows, cols, M, N, r_ptr, DIV), mask


@triton.jit
def _fp8_div(x, rows, cols, M, N, r_ptr, DIV: tl.constexpr):
    """``_fp8_tile``'s multiply of a loaded tile by the divisors' reciprocals (none for DIV=0)."""
    if DIV == 1:
        x = x * tl.load(r_ptr + cols, mask=cols < N, other=1.0)[None, :]
    elif DIV == 2:
        x = x * tl.load(r_ptr + rows, mask=rows < M, other=1.0)[:, None]
    return x


@triton.jit
def _line_amax(x, AXIS: tl.constexpr):
    """Absmax along ``AXIS`` of an fp32 tile, NaN for lines holding NaN or +/-inf."""
    xa = tl.abs(x)
    finite = xa <= F32_MAX_C
    amax = tl.max(tl.where(finite, xa, 0.0), axis=AXIS)
    bad = tl.max(tl.where(finite, 0, 1), axis=AXIS)
    return tl.where(bad > 0, float("nan"), amax)


@triton.jit
def _fp8_encode_store(x, scale, q_ptr, stride_qm, stride_qn, rows, cols, mask, AXIS: tl.constexpr,
                      FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Scale (per line along ``AXIS``), saturate and round a tile to FP8; store the bit patterns."""
    s = tl.expand_dims(scale, AXIS)
    y = tl.where(s == s, x * s, 0.0)  # the reference's nan_to_num(nan=0)
    mag = minifloat_bits(tl.minimum(tl.abs(y), FMAX), MANT, EMIN)
    bits = (mag | (sign_bit(y) << 7)).to(tl.uint8)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols.to(tl.int64)[None, :] * stride_qn, bits, mask=mask)


@triton.jit
def _fp8_scale(amax, FMAX: tl.constexpr):
    one = tl.full(amax.shape, 1.0, tl.float32)
    # torch's fmax / t, see _fp4_scale
    scale = tl.math.div_rn(one, tl.maximum(amax, FP8_AMAX_EPS_C)) * FMAX
    return tl.where(amax <= F32_MAX_C, scale, float("nan"))


@triton.jit
def _store_scale(s_ptr, i_ptr, idx, scale, mask, STORE_INV: tl.constexpr):
    """The scales, and with STORE_INV their IEEE reciprocals (``div_rn``: torch.reciprocal's bits),
    which ``_scaled_mm`` multiplies by: no separate reciprocal launch."""
    tl.store(s_ptr + idx, scale, mask=mask)
    if STORE_INV:
        tl.store(i_ptr + idx, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), mask=mask)


@triton.jit
def _quantize_fp8_rows_kernel(
    # pointers (q_ptr is a uint8 view of the FP8 output; i_ptr takes 1 / scale with STORE_INV; with
    # COL_AMAX e_ptr holds the column pass's per-row multipliers and c_ptr takes its column absmax)
    x_ptr, d_ptr, q_ptr, s_ptr, i_ptr, e_ptr, c_ptr,
    # sizes (ROWS: rows per program with COL_AMAX, a multiple of BLOCK_M)
    M, N, ROWS,
    # strides
    stride_xm, stride_qm,
    # meta-parameters
    FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, DIV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr = False, STORE_INV: tl.constexpr = False,
    COL_AMAX: tl.constexpr = False,
):
    # One scale per row: a program owns BLOCK_M rows. SINGLE_PASS (BLOCK_N >= N): the rows sit
    # in registers, read and divided once; otherwise it walks along N twice (absmax, encode).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_N)
    if COL_AMAX and SINGLE_PASS:  # ROWS rows a program, and the column pass's absmax on the way
        _fp8_rows_col_amax(x_ptr, d_ptr, q_ptr, s_ptr, i_ptr, e_ptr, c_ptr, M, N, ROWS, stride_xm, stride_qm, FMAX,
                           MANT, EMIN, DIV, BLOCK_M, BLOCK_N, STORE_INV)
        return
    if SINGLE_PASS:
        x, mask = _fp8_tile(x_ptr, stride_xm, rows, c, M, N, d_ptr, DIV)
        scale = _fp8_scale(_line_amax(x, 1), FMAX)
        _fp8_encode_store(x, scale, q_ptr, stride_qm, 1, rows, c, mask, 1, FMAX, MANT, EMIN)
        _store_scale(s_ptr, i_ptr, rows, scale, rows < M, STORE_INV)
        return
    # --- pass 1: absmax
    amax = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(0, N, BLOCK_N):
        x, _ = _fp8_tile(x_ptr, stride_xm, rows, n0 + c, M, N, d_ptr, DIV)
        blk = _line_amax(x, 1)
        # NaN-propagating running max (tl.maximum may drop NaN on the GPU)
        amax = tl.where((blk != blk) | (amax != amax), float("nan"), tl.maximum(amax, blk))
    scale = _fp8_scale(amax, FMAX)
    # --- pass 2: encode (COL_AMAX: and the column pass's absmax over these rows, an atomic max a column)
    for n0 in range(0, N, BLOCK_N):
        raw, mask = _fp8_tile(x_ptr, stride_xm, rows, n0 + c, M, N, d_ptr, 0)
        x = _fp8_div(raw, rows, n0 + c, M, N, d_ptr, DIV)
        _fp8_encode_store(x, scale, q_ptr, stride_qm, 1, rows, n0 + c, mask, 1, FMAX, MANT, EMIN)
        if COL_AMAX:
            _col_amax_store(_col_amax_bits(raw, rows, n0 + c, M, N, e_ptr), c_ptr, n0 + c, N)
    _store_scale(s_ptr, i_ptr, rows, scale, rows < M, STORE_INV)


@triton.jit
def _col_amax_bits(raw, rows, cols, M, N, e_ptr):
    """Column maxima of ``|raw * e[row]|`` as fp32 bit patterns with the sign cleared: non-negative floats
    order like their bits, inf and NaN above every finite value (one integer max, NaN-propagating)."""
    return tl.max(_fp8_div(raw, rows, cols, M, N, e_ptr, 2).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=0)


@triton.jit
def _col_amax_store(bits, c_ptr, cols, N):
    """Atomic max of column absmax bits; a non-finite column's made the NaN ``_col_amax_kernel`` gives."""
    tl.atomic_max(c_ptr + cols, tl.where(bits >= 0x7F800000, 0x7FC00000, bits), mask=cols < N, sem="relaxed")


@triton.jit
def _fp8_rows_col_amax(x_ptr, d_ptr, q_ptr, s_ptr, i_ptr, e_ptr, c_ptr, M, N, ROWS, stride_xm, stride_qm,
                       FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, DIV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_INV: tl.constexpr):
    """The one-pass row quantizer over ROWS rows (BLOCK_M at a time) that also takes the column absmax of
    ``x * e[row]`` (what ``_col_amax_kernel`` takes with DIV=2 and ``r = e``): the same products, a running
    max per column in registers (``_col_amax_bits``), then one atomic max per column."""
    c = tl.arange(0, BLOCK_N)
    cmax = tl.zeros([BLOCK_N], tl.int32)
    r0 = tl.program_id(0) * ROWS
    for i in range(0, ROWS, BLOCK_M):
        rows = r0 + i + tl.arange(0, BLOCK_M)
        raw, mask = _fp8_tile(x_ptr, stride_xm, rows, c, M, N, d_ptr, 0)
        x = _fp8_div(raw, rows, c, M, N, d_ptr, DIV)
        scale = _fp8_scale(_line_amax(x, 1), FMAX)
        _fp8_encode_store(x, scale, q_ptr, stride_qm, 1, rows, c, mask, 1, FMAX, MANT, EMIN)
        _store_scale(s_ptr, i_ptr, rows, scale, rows < M, STORE_INV)
        cmax = tl.maximum(cmax, _col_amax_bits(raw, rows, c, M, N, e_ptr))
    _col_amax_store(cmax, c_ptr, c, N)


@triton.jit
def _col_amax_kernel(x_ptr, d_ptr, amax_ptr, M, N, stride_xm, DIV: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    # Column absmax over a 2-D grid of tiles, combined with an integer atomic max on the
    # fp32 bit patterns: non-negative floats order like their bits, and NaN's bits
    # (0x7FC00000) exceed every finite value's and inf's, so NaN wins as in torch.amax.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x, _ = _fp8_tile(x_ptr, stride_xm, rows, cols, M, N, d_ptr, DIV)
    amax = _line_amax(x, 0)
    bits = tl.where(amax != amax, 0x7FC00000, amax.to(tl.int32, bitcast=True))
    tl.atomic_max(amax_ptr + cols, bits, mask=cols < N)


@triton.jit
def _quantize_fp8_cols_kernel(
    # pointers (amax_ptr: the column absmax bits; with BIAS b_ptr takes the column sums of x, p_ptr the
    # tiles' partial sums (num_programs(0), N); cnt_ptr: a zeroed counter per column strip, with BIAS or RESET)
    x_ptr, d_ptr, q_ptr, s_ptr, amax_ptr, i_ptr, b_ptr, p_ptr, cnt_ptr,
    M, N,
    stride_xm, stride_qm, stride_qn,
    FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, DIV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_INV: tl.constexpr = False,
    BIAS: tl.constexpr = False, RESET: tl.constexpr = False, SUM_BLOCK: tl.constexpr = 64,
):
    # One scale per column, from the column absmax of _col_amax_kernel; fully parallel tiles. The
    # last tile of each column strip to finish (a counter) adds the partial sums (BIAS) and puts the
    # absmax and the counter back to zero (RESET): the buffer is ready for the next launch, no memset.
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    amax = tl.load(amax_ptr + cols, mask=cols < N, other=0).to(tl.float32, bitcast=True)
    scale = _fp8_scale(amax, FMAX)
    raw, mask = _fp8_tile(x_ptr, stride_xm, rows, cols, M, N, d_ptr, 0)
    x = _fp8_div(raw, rows, cols, M, N, d_ptr, DIV)
    _fp8_encode_store(x, scale, q_ptr, stride_qm, stride_qn, rows, cols, mask, 0, FMAX, MANT, EMIN)
    _store_scale(s_ptr, i_ptr, cols, scale, (cols < N) & (pid_m == 0), STORE_INV)
    if BIAS:
        tl.store(p_ptr + pid_m * N + cols, tl.sum(raw, axis=0), mask=cols < N)
    if BIAS or RESET:
        _cols_last_tile(amax_ptr, b_ptr, p_ptr, cnt_ptr, cols, N, BLOCK_N, BIAS, RESET, SUM_BLOCK)


@triton.jit
def _cols_last_tile(amax_ptr, b_ptr, p_ptr, cnt_ptr, cols, N, BLOCK_N: tl.constexpr, BIAS: tl.constexpr,
                    RESET: tl.constexpr, SUM_BLOCK: tl.constexpr):
    """Count this tile done in its strip; the strip's last one (every other has read the absmax and
    written its partial sum: release / acquire through the counter) writes the column sums, the tiles'
    partial sums added in order, SUM_BLOCK at a time, and zeroes the absmax and the counter."""
    tl.debug_barrier()  # the whole program's loads and stores come before its count
    n_m = tl.num_programs(0)
    done = tl.atomic_add(cnt_ptr + tl.program_id(1), 1, sem="acq_rel")
    if done == n_m - 1:
        ok = cols < N
        if BIAS:
            acc = tl.zeros([BLOCK_N], tl.float32)
            for g0 in range(0, n_m, SUM_BLOCK):
                g = g0 + tl.arange(0, SUM_BLOCK)
                part = tl.load(p_ptr + g.to(tl.int64)[:, None] * N + cols[None, :], mask=(g < n_m)[:, None] & ok[None, :],
                               other=0.0, cache_modifier=".cg")
                acc += tl.sum(part, axis=0)
            tl.store(b_ptr + cols, acc, mask=ok)
        if RESET:
            tl.store(amax_ptr + cols, tl.zeros([BLOCK_N], tl.int32), mask=ok)
        tl.atomic_xchg(cnt_ptr + tl.program_id(1), 0, sem="relaxed")


def triton_quantize_fp8(x2d: torch.Tensor, dim: int, fmt: str = "e5m2", *, column_major: bool = False,
                 divide_by: torch.Tensor | None = None, inverse: bool = False,
                 multiply_by: torch.Tensor | None = None, column_amax_of: torch.Tensor | None = None,
                 column_amax: "ColumnAmax | None" = None, bias_grad: bool = False) -> tuple:
    """Absmax FP8 quantization with one fp32 scale per row (``dim=1``) or column (``dim=0``).

    Returns ``(x_fp8, scale)`` with ``x ~ x_fp8 / scale``, bit-identical to
    ``fp4lightning.ops.gemm.quantize_fp8_reference`` for ``fmt`` in ``'e4m3'``/``'e5m2'``
    (``'bf16'`` needs no kernel; the dispatch layer handles it). ``x2d``: fp32/bf16/fp16,
    2-D, any strides. ``column_major=True`` (with ``dim=0``) returns the same values laid
    out column by column (``q.t()`` contiguous): the layout ``fp4_wgrad`` feeds to the FP8
    tensor cores without a transpose in registers. ``divide_by`` (fp32, one value per
    column for ``dim=1``, per row for ``dim=0``) quantizes ``x2d * (1 / divide_by)`` without
    materialising it (the FP4 scale of the GeMM's reduction dimension folded into dY): one IEEE
    reciprocal per divisor, then one fp32 multiply per element, as ``fp4lightning.numerics.cpu_fused.fp8_scaled``
    computes it, so bit-identical to it. ``inverse=True`` returns ``(x_fp8, scale, 1 / scale)``, the
    reciprocals written by the same kernel (IEEE, so ``torch.reciprocal(scale)`` bit for bit).
    ``multiply_by``: instead of ``divide_by``, its reciprocals ``1 / divide_by`` where they are at hand
    (written by the FP4 quantizer that made the divisor, ``triton_quantize_rows(inverse=True)``): the
    same bits, without the reciprocal launch.

    Fused passes over dY (FP4Linear's backward reads dY once per quantizer): ``column_amax_of`` (``dim=1``,
    fp32, one multiplier per row) also takes the column absmax of ``x2d * column_amax_of[:, None]`` in the
    row pass and appends a ``ColumnAmax``; hand it to the ``dim=0`` call as ``column_amax`` (with
    ``multiply_by`` the same tensor) instead of a column absmax pass. ``bias_grad`` (``dim=0``) appends the fp32 column sums of ``x2d`` (a bias
    gradient), summed per tile of the column pass and then over the tiles in a fixed order: the same
    sum as ``x2d.sum(0, dtype=torch.float32)`` up to the order of the fp32 additions, deterministic.
    """
    x2d = check_rows("x2d", x2d, FLOAT_DTYPES, "the gradient to quantize")
    check_same_device(x2d=x2d)
    if fmt not in _FP8:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose 'e4m3' or 'e5m2'")
    if dim not in (0, 1):
        raise ValueError(f"dim must be 1 (one scale per row) or 0 (one scale per column), got {dim!r}")
    if column_major and dim != 0:
        raise ValueError("column_major=True is the layout of the per-column (dim=0) quantization only")
    if divide_by is not None and multiply_by is not None:
        raise ValueError("give divide_by or its reciprocals multiply_by, not both")
    if (column_amax_of is not None and dim != 1) or ((column_amax is not None or bias_grad) and dim != 0):
        raise ValueError("column_amax_of goes with the row pass (dim=1); column_amax and bias_grad with the "
                         "column pass (dim=0)")
    div = 0
    if divide_by is not None or multiply_by is not None:
        n_div = x2d.shape[1] if dim == 1 else x2d.shape[0]
        name, vec = ("divide_by", divide_by) if divide_by is not None else ("multiply_by", multiply_by)
        what = "one fp32 divisor per column (dim=1) / per row (dim=0)"
        vec = check_vector(name, vec, n_div, (torch.float32,), what)
        check_same_device(x2d=x2d, **{name: vec})
        # IEEE 1/d on CPU and CUDA; the kernels multiply
        divide_by = torch.reciprocal(vec) if multiply_by is None else vec
        div = 1 if dim == 1 else 2
    fmax, mant, emin, dtype = _FP8[fmt]
    m, n = x2d.shape
    q = torch.empty(n, m, dtype=dtype, device=x2d.device).t() if column_major else \
        torch.empty(m, n, dtype=dtype, device=x2d.device)
    meta = dict(FMAX=fmax, MANT=mant, EMIN=emin, DIV=div)
    d = divide_by if divide_by is not None else x2d  # placeholder pointer when unused
    scale = torch.empty(m if dim == 1 else n, dtype=torch.float32, device=x2d.device)
    inv = torch.empty_like(scale) if inverse else scale  # placeholder pointer when unused
    if dim == 1:
        extra = _fp8_rows(x2d, d, q, scale, inv, meta, inverse, column_amax_of)
    else:
        extra = _fp8_cols(x2d, d, q, scale, inv, meta, inverse, column_major, column_amax, bias_grad)
    return (q, scale) + ((inv,) if inverse else ()) + extra


class ColumnAmax:
    """The column absmax a row pass took for the column pass (``triton_quantize_fp8(column_amax_of=)``):
    its bits in a scratch buffer that the column pass reads and zeroes, and the row multipliers it was
    taken with."""

    __slots__ = ("buf", "multipliers", "token")

    def __init__(self, buf: torch.Tensor, multipliers: torch.Tensor, token):
        self.buf, self.multipliers, self.token = buf, multipliers, token


#: rows the fused row pass (with the column absmax) aims to give each program: enough programs for an
#: H200's 132 SMs (4 a SM), few enough that the column absmax costs N atomics per program (M / 16 at
#: 8192 tokens, against M / 32 of the separate column absmax kernel)
FUSED_ROWS_PROGRAMS = 512 if not INTERPRET else 2
#: partial sums the column pass's last tile of a strip adds at once (SUM_BLOCK tiles of BLOCK_N columns)
BIAS_SUM_ELEMENTS = 2048
#: per (device, is_meta, stream): [int32 scratch, taken (a column pass is still to run), generation]
_SCRATCH: dict[tuple, list] = {}


def _scratch(n: int, like: torch.Tensor):
    """``(int32 (n,) of zeros, token)``: the column pass's absmax bits (first half) and per-strip counters
    (second half). Kept per device and stream: the column pass's last tiles put it back to zero, so no
    memset launch precedes a use; a fresh zeroed buffer while a CUDA graph is captured."""
    if like.is_cuda and not like.is_meta and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=like.device), None
    stream = torch.cuda.current_stream(like.device).cuda_stream if like.is_cuda and not like.is_meta else 0
    key = (str(like.device), like.is_meta, stream)
    ent = _SCRATCH.get(key)
    if ent is None or ent[0].numel() < n:
        ent = _SCRATCH[key] = [torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=like.device), False, 0]
    elif ent[1]:  # taken by a row pass whose column pass never ran (an error between them)
        ent[0].zero_()
    ent[1], ent[2] = True, ent[2] + 1
    return ent[0][:n], (key, ent[2])


def _scratch_current(token) -> bool:
    ent = _SCRATCH.get(token[0]) if token is not None else None
    return token is None or (ent is not None and ent[2] == token[1])


def _fp8_rows(x2d, d, q, scale, inv, meta, inverse, column_amax_of):
    """The row pass of ``triton_quantize_fp8``; ``(ColumnAmax or None,)`` with ``column_amax_of``."""
    m, n = x2d.shape
    block_m, block_n, single, warps = fp8_rows_launch_params(n)
    fused = column_amax_of is not None
    e, buf, rows, token = x2d, x2d, block_m, None  # placeholders when not fused
    if fused:
        e = check_vector("column_amax_of", column_amax_of, m, (torch.float32,), "one fp32 multiplier per row")
        check_same_device(x2d=x2d, column_amax_of=e)
        buf, token = _scratch(2 * n, x2d)
        if single:  # many rows a program: fewer atomics (two-pass rows: one atomic per column per row block)
            rows = block_m * triton.cdiv(m, block_m * FUSED_ROWS_PROGRAMS)
    _quantize_fp8_rows_kernel[(triton.cdiv(m, rows),)](
        x2d, d, q.view(torch.uint8), scale, inv, e, buf, m, n, rows, x2d.stride(0), q.stride(0), **meta,
        BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, STORE_INV=inverse, COL_AMAX=fused, num_warps=warps)
    return (ColumnAmax(buf, e, token),) if fused else ()


def _fp8_cols(x2d, d, q, scale, inv, meta, inverse, column_major, column_amax, bias_grad):
    """The column pass of ``triton_quantize_fp8``; ``(bias gradient,)`` with ``bias_grad``."""
    m, n = x2d.shape
    (am, an, aw), (block_m, block_n, warps) = fp8_cols_launch_params(m, n, column_major)
    if column_amax is not None:
        if column_amax.multipliers.data_ptr() != d.data_ptr() or column_amax.buf.numel() != 2 * n:
            raise ValueError("column_amax was taken for another tensor or other row multipliers: pass the row "
                             "pass's column_amax_of as this call's multiply_by")
        if not _scratch_current(column_amax.token):
            raise RuntimeError("column_amax was overwritten by another row pass before this column pass")
        buf, token = column_amax.buf, column_amax.token
    else:
        buf, token = _scratch(2 * n, x2d)
        _col_amax_kernel[(triton.cdiv(m, am), triton.cdiv(n, an))](
            x2d, d, buf, m, n, x2d.stride(0), DIV=meta["DIV"], BLOCK_M=am, BLOCK_N=an, num_warps=aw)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    bias = torch.empty(n, dtype=torch.float32, device=x2d.device) if bias_grad else scale
    part = torch.empty(grid[0], n, dtype=torch.float32, device=x2d.device) if bias_grad else scale
    qb = q.view(torch.uint8)  # the kernels write FP8 bit patterns
    _quantize_fp8_cols_kernel[grid](
        x2d, d, qb, scale, buf, inv, bias, part, buf[n:], m, n, x2d.stride(0), qb.stride(0), qb.stride(1), **meta,
        BLOCK_M=block_m, BLOCK_N=block_n, STORE_INV=inverse, BIAS=bias_grad, RESET=True,
        SUM_BLOCK=max(1, BIAS_SUM_ELEMENTS // block_n), num_warps=warps)
    if token is not None:
        _SCRATCH[token[0]][1] = False  # zero again once this launch has run (stream order)
    return (bias,) if bias_grad else ()


def fp8_rows_launch_params(n: int) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps) of the per-row FP8 quantizer for rows of ``n``
    elements (also what kernels/compile_check.py compiles). Bandwidth-bound: tiles of ~4K elements
    keep enough loads in flight without spills."""
    if n <= (MAX_SINGLE_PASS_FP8 if not INTERPRET else 128):  # small under the interpreter: both paths tested
        # one read (and one division) per element: the row block stays in registers
        block_n = triton.next_power_of_2(n)
        block_m = max(1, 2048 // block_n)
        # 32 elements per thread from 8192 per program down (4 warps at 4096, as the FP4 quantizer):
        # the per-row work (absmax reduction, scale) then costs less per element (31 against 37
        # SASS instructions per element at N = 4096 with 8 warps, compile_check; not yet timed)
        return block_m, block_n, True, (8 if block_m * block_n >= 8192 else 4)
    block_n = min(triton.next_power_of_2(n), 1024 if not INTERPRET else 64)
    return max(1, 4096 // block_n), block_n, block_n >= n, 4


def fp8_cols_launch_params(m: int, n: int, column_major: bool) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``((BLOCK_M, BLOCK_N, num_warps) of the column absmax, (...) of the per-column quantizer)``
    for an ``m x n`` tensor (also what kernels/compile_check.py compiles)."""
    block_n = min(triton.next_power_of_2(n), 128)
    amax = (max(1, 4096 // block_n), block_n, 4)
    if column_major:  # tiles long along M: the stores run along contiguous bytes
        return amax, (min(triton.next_power_of_2(m), 256), 16, 4)
    return amax, amax
