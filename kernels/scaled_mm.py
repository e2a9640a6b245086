"""FP4Linear's three GeMMs on the vendor FP8 GeMM, ``torch._scaled_mm`` (cuBLASLt or CUTLASS).

Every E2M1 value is exactly an E4M3 value (arXiv 2501.17116, section 3.1; docs/method.md section
1), and folding each GeMM's reduction-dimension scale into dY before its FP8 cast (docs/method.md
section 3) leaves every GeMM with one scale per output row and one per output column: the
row-wise scaling ``_scaled_mm`` applies in its epilogue. The layouts are those of torchao's
row-wise float8 training (first operand row-major, second column-major, the only pair Hopper's
cuBLASLt takes; the second is passed as the transposed view of a row-major copy):

    forward  Y  = _scaled_mm(A8,  W8t.T,  1/s_a  (M, 1), 1/s_w (1, N)) [+ bias]
    dgrad    dA = _scaled_mm(G1,  W8tt.T, 1/s_g1 (M, 1), 1     (1, K))
    wgrad    dW = _scaled_mm(G2t, A8t.T,  1/s_g2 (N, 1), 1     (1, K)) [+ addend] [* f'(W s_w)]

with A8 (M, K) and W8 (N, K) the E4M3 copies of the FP4 codes, ``W8tt`` (K, N) = W8 transposed,
G1 (M, N) the FP8 ``dY / s_w`` quantized per row, G2t (N, M) the FP8 ``dY / s_a`` quantized per
column and laid out tokens-contiguous, and A8t (K, M) = A8 transposed (or the folded-OCC E4M3
operand transposed, ``FP4Config.occ_fold_e4m3``). The first operand may be E5M2 (dY), the second
is always E4M3: CUTLASS's row-wise kernel takes no other second operand.

Shapes: ``_scaled_mm`` reads rows whose length is a multiple of 16 (cuBLASLt: K and N multiples of
16, 16-byte aligned row strides). The feature sizes K and N are (FP4Linear requires it,
``linear.FEATURE_ALIGN``); ``fits`` tells the dispatch, which falls back to the Triton GeMM on CUDA
or the PyTorch reference on CPU for other sizes. The token count M is free in the forward and
dgrad (the first operand's row count) and is the reduction dimension of wgrad, where both
operands are padded with zero columns to a multiple of 16 (a copy of each only when M is not one;
zeros add nothing to the sums).

Numerics: the operands are bit-identical to the reference path's (E2M1 codes exact in E4M3, the
same FP8 dY bits); the products are exact and summed in fp32 (``use_fast_accum=False``: cuBLAS
promotes Hopper's FP8 partial sums, like the Triton kernels' precise accumulation;
FP4LIGHTNING_FP8_FAST_ACCUM=1 turns it off); the epilogue multiplies by the scales' IEEE
reciprocals and rounds once to the output dtype. Against the reference (IEEE divisions, and
under bf16 the GeMM's output rounded before the scales) that is within one rounding of the output
dtype plus fp32 summation error (tests/test_scaled_mm.py states the bound). A fused bias is
rounded to the output dtype first, as ``nn.Linear`` under autocast rounds it.

On CPU torch runs ``_scaled_mm`` as well (slowly: it dequantizes and runs an fp32 GeMM), which is
what ``FP4LIGHTNING_BACKEND=scaled_mm`` tests on a machine without a GPU. torch's CPU kernel takes
any layout, so ``_scaled`` enforces cuBLASLt's rules on every device: a layout bug fails the CPU
tests, not the first GPU run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4lightning.numerics import cpu_fused
from fp4lightning.numerics.constants import E4M3_FOLD_MAX_SHIFT
from fp4lightning.numerics.formats import decode_packed_fp4

from ._common import (F8E4M3_MAX_C, FP8_FAST_ACCUM, INTERPRET, check_same_device, e2m1_bits, finish_tile,
                      minifloat_bits, round_up, sign_bit)
from .fp8_gemm import triton_expand_fp4, triton_transpose_fp8

__all__ = ["ALIGN", "fits", "e4m3_rows", "e4m3_cols", "fp8_cols", "scaled_fp4_gemm", "scaled_fp4_dgrad",
           "scaled_fp4_wgrad", "triton_wgrad_finish", "triton_refold", "nan_where"]

#: cuBLASLt's FP8 GeMM reads rows whose length and stride are multiples of 16 elements (bytes)
ALIGN = 16
E4M3 = torch.float8_e4m3fn
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_FOLD_MAX_SHIFT_C = tl.constexpr(E4M3_FOLD_MAX_SHIFT)


def fits(*dims: int) -> bool:
    """Whether feature sizes ``dims`` suit ``_scaled_mm`` (the dispatch falls back otherwise)."""
    return all(d % ALIGN == 0 for d in dims)


def _pad_cols(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows, c) with unit column stride, as a tensor whose column count and row stride are
    multiples of 16 (zeros in the added columns); ``t`` itself when it already is one."""
    r, c = t.shape
    if c % ALIGN == 0 and t.stride(1) == 1 and (r <= 1 or t.stride(0) % ALIGN == 0):
        return t
    out = torch.zeros(r, round_up(c, ALIGN), dtype=torch.uint8, device=t.device)
    out[:, :c] = t.view(torch.uint8) if t.stride(1) == 1 else t.contiguous().view(torch.uint8)
    return out.view(t.dtype)


def _check_one_device(**tensors: torch.Tensor | None) -> None:
    """One device for all operands (any device: ``_scaled_mm`` runs on CPU without the Triton interpreter;
    the Triton kernels here check theirs with ``_common.check_same_device``)."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    for n, t in items[1:]:
        if t.device != items[0][1].device:
            raise ValueError(f"{n} is on {t.device} but {items[0][0]} is on {items[0][1].device}; "
                             "put all operands on one device")


# --------------------------------------------------------------------------- operands
def e4m3_rows(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Packed FP4 codes (R, k/2) -> their exact E4M3 values (R, k), row-major (the forward's
    operands): the Triton expansion on CUDA, a decode on CPU."""
    if packed.is_cuda:
        return triton_expand_fp4(packed, k)
    return decode_packed_fp4(packed, k, torch.float32).to(E4M3)


def e4m3_cols(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Packed FP4 codes (R, k/2) -> their E4M3 values transposed, (k, R16) row-major with R16 = R
    rounded up to 16 and zeros past R: the second operand of dgrad (from W) and wgrad (from A)."""
    if packed.is_cuda:
        t = triton_expand_fp4(packed, k, transpose=True)  # (k, r) view of a (k, R16) buffer, zeros past r
        return t.as_strided((k, t.stride(0)), (t.stride(0), 1))
    return _pad_cols(decode_packed_fp4(packed, k, torch.float32).to(E4M3).t().contiguous())


def fp8_cols(x: torch.Tensor) -> torch.Tensor:
    """An (R, C) FP8 tensor transposed, (C, R16) row-major with zeros past R (the folded-OCC E4M3
    operand as wgrad's second operand). A column-major ``x`` (``triton_refold(transposed=True)``)
    is read as it is: no copy when R is a multiple of 16, else one into a zero-padded buffer."""
    if x.shape[0] > 1 and x.stride(0) == 1:
        return _pad_cols(x.t())
    if x.is_cuda:
        t = triton_transpose_fp8(x)  # its pad is not written: padded here when R is not a multiple of 16
        return t if x.shape[0] % ALIGN == 0 else _pad_cols(t)
    return _pad_cols(x.t().contiguous())


def _tokens_contiguous(g: torch.Tensor) -> torch.Tensor:
    """An (M, N) FP8 dY, row- or column-major, as (N, M16) with tokens contiguous (wgrad's first operand)."""
    gt = g.t() if g.shape[0] > 1 and g.stride(0) == 1 else g.t().contiguous()
    return _pad_cols(gt)


# --------------------------------------------------------------------------- the GeMM call
def _scaled(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._scaled_mm(a, b, ...)`` after checking what cuBLASLt on Hopper requires (torch's CPU
    kernel would accept more): ``a`` (M, K) row-major, ``b`` (K, N) column-major, K and N multiples
    of 16, 16-byte row strides and bases, FP8 operands with an E4M3 second one."""
    if a.dtype not in FP8 or b.dtype != E4M3:
        raise TypeError(f"_scaled_mm operands: first FP8, second E4M3; got {a.dtype} and {b.dtype}")
    k, n = b.shape
    if a.shape[1] != k or k % ALIGN or n % ALIGN:
        raise ValueError(f"_scaled_mm shapes {tuple(a.shape)} x {tuple(b.shape)}: K and N must be multiples of {ALIGN}")
    if a.stride(1) != 1 or b.stride(0) != 1 or (a.shape[0] > 1 and a.stride(0) % ALIGN) or b.stride(1) % ALIGN:
        raise ValueError(f"_scaled_mm layouts: first operand row-major, second column-major, 16-byte row strides; "
                         f"got strides {a.stride()} and {b.stride()}")
    if a.data_ptr() % ALIGN or b.data_ptr() % ALIGN:
        raise ValueError("_scaled_mm operands must start at 16-byte aligned addresses")
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=FP8_FAST_ACCUM)


def _row_scale(s: torch.Tensor, inv: torch.Tensor | None = None) -> torch.Tensor:
    """(n, 1) fp32 reciprocals: ``_scaled_mm`` multiplies, the references divide by ``s``. ``inv``:
    the reciprocals already written by ``s``'s quantizer (the same IEEE bits, no launch)."""
    return (torch.reciprocal(s.float()) if inv is None else inv).reshape(-1, 1)


#: rows of ones per (device, is_meta): read-only, allocated once and grown when a wider one is asked for
_ONES: dict[tuple[str, bool], torch.Tensor] = {}


def _unit_cols(n: int, like: torch.Tensor) -> torch.Tensor:
    """A (1, n) fp32 row of ones on ``like``'s device: row-wise scaling takes no tensor-wise partner.
    Kept between calls (a fill launch per GeMM otherwise), except while a CUDA graph is captured
    (its memory would belong to the graph). Keyed with ``is_meta`` as well as the device: the
    roofline's trace shows meta tensors as CUDA ones (benchmarks/roofline.py)."""
    if like.is_cuda and not like.is_meta and torch.cuda.is_current_stream_capturing():
        return torch.ones(1, n, dtype=torch.float32, device=like.device)
    key = (str(like.device), like.is_meta)
    buf = _ONES.get(key)
    if buf is None or buf.numel() < n:
        buf = _ONES[key] = torch.ones(max(n, 1024), dtype=torch.float32, device=like.device)
    return buf[:n].reshape(1, n)


# --------------------------------------------------------------------------- the three GeMMs
def scaled_fp4_gemm(a8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
                    mm_dtype: torch.dtype | None = None, a_scale_inv: torch.Tensor | None = None,
                    w_scale_inv: torch.Tensor | None = None, bias_cast: torch.Tensor | None = None) -> torch.Tensor:
    """Forward ``Y = (A8 W8^T) / (s_a s_w^T) + bias``: ``a8`` (M, K) and ``w8`` (N, K) E4M3 row-major
    (the FP4 values, or the folded-OCC operand for ``a8``), ``a_scale`` (M,), ``w_scale`` (N,) fp32.
    ``mm_dtype``: the dtype ``_scaled_mm`` writes where the device refuses ``out_dtype``
    (``ops.capability``): its output is cast to fp32, the bias added, then cast to ``out_dtype``.
    ``a_scale_inv`` / ``w_scale_inv``: the scales' reciprocals where their quantizers wrote them;
    ``bias_cast``: ``bias.to(out_dtype)`` where the weight's quantizer wrote it (used only for a fused bias)."""
    _check_one_device(a8=a8, w8=w8, a_scale=a_scale, w_scale=w_scale, bias=bias)
    mm = out_dtype if mm_dtype is None else mm_dtype
    fused_bias = bias is not None and mm == out_dtype and out_dtype in (torch.bfloat16, torch.float16)
    bias_mm = None
    if fused_bias:
        bias_mm = bias_cast if bias_cast is not None and bias_cast.dtype == out_dtype else bias.to(out_dtype)
    y = _scaled(a8, w8.t(), _row_scale(a_scale, a_scale_inv), _row_scale(w_scale, w_scale_inv).reshape(1, -1), mm,
                bias_mm)
    if mm != out_dtype:
        y = y.float()
    if bias is not None and not fused_bias:  # fp32 output: _scaled_mm takes no bias there
        y = y.add_(bias.to(y.dtype))
    return y.to(out_dtype)


def scaled_fp4_dgrad(g: torch.Tensor, g_scale: torch.Tensor, w8t: torch.Tensor,
                     out_dtype: torch.dtype = torch.float32, mm_dtype: torch.dtype | None = None,
                     g_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """``dA = (G W_q) / s_g[:, None]``: ``g`` (M, N) FP8 (one scale per row), ``w8t`` (K, N) E4M3
    row-major, W's values transposed (``e4m3_cols`` of W's codes). ``mm_dtype``: as in
    ``scaled_fp4_gemm``. ``g_scale_inv``: ``1 / g_scale`` where the quantizer wrote it."""
    _check_one_device(g=g, g_scale=g_scale, w8t=w8t)
    if g.stride(1) != 1 or (g.shape[0] > 1 and g.stride(0) % ALIGN):
        g = g.contiguous()
    mm = out_dtype if mm_dtype is None else mm_dtype
    return _scaled(g, w8t.t(), _row_scale(g_scale, g_scale_inv), _unit_cols(w8t.shape[0], g), mm).to(out_dtype)


def scaled_fp4_wgrad(g: torch.Tensor, g_scale: torch.Tensor, a8t: torch.Tensor, out_dtype: torch.dtype = torch.float32,
                     dge_weight: torch.Tensor | None = None, dge_weight_scale: torch.Tensor | None = None,
                     dge_k: float = 5.0, dge_clamp: float = 3.0, addend: torch.Tensor | None = None,
                     mm_dtype: torch.dtype | None = None, nan_if: torch.Tensor | None = None,
                     g_scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """``dW = ((G^T A) / s_g[:, None] + addend) * f'(W s_w)``: ``g`` (M, N) FP8, one scale per column,
    row- or column-major; ``a8t`` (K, M16) E4M3 row-major, A's values transposed with zeros past M
    (``e4m3_cols`` / ``fp8_cols``). The GeMM's output is fp32 (``mm_dtype``, bf16 where the device
    refuses fp32, then cast to fp32); the addend and the DGE factor follow in one elementwise pass
    (the Triton kernel below on CUDA, ``cpu_fused.wgrad_epilogue`` on CPU). ``nan_if`` (a 0-dim bool
    on the device): where it is set, dW is all NaN (``torch.where(nan_if, nan, dW)``; on CUDA inside
    the same pass). ``g_scale_inv``: ``1 / g_scale`` where the quantizer wrote it."""
    _check_one_device(g=g, g_scale=g_scale, a8t=a8t, addend=addend, dge_weight=dge_weight)
    gt = _tokens_contiguous(g)
    if gt.shape[1] != a8t.shape[1]:
        raise ValueError(f"wgrad: dY has {g.shape[0]} tokens but the activation operand {a8t.shape[1]} columns")
    k = a8t.shape[0]
    dw = _scaled(gt, a8t.t(), _row_scale(g_scale, g_scale_inv), _unit_cols(k, g), mm_dtype or torch.float32).float()
    if dw.is_cuda and (addend is not None or dge_weight is not None or nan_if is not None):
        return triton_wgrad_finish(dw, addend, dge_weight, dge_weight_scale, dge_k, dge_clamp,
                                   nan_if=nan_if).to(out_dtype)
    if addend is not None or dge_weight is not None:
        ones = torch.ones(dw.shape[0], dtype=torch.float32, device=dw.device)  # the scales are applied already
        dw = cpu_fused.wgrad_epilogue(dw, ones, addend, dge_weight, dge_weight_scale if dge_weight is not None
                                      else None, dge_k, dge_clamp, out_dtype)
    return nan_where(nan_if, dw.to(out_dtype))


def nan_where(flag: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    """``t``, or all NaN where the 0-dim bool ``flag`` is set (no host sync); ``t`` when ``flag`` is None."""
    if flag is None:
        return t
    return torch.where(flag, torch.full((), float("nan"), device=t.device), t)


# --------------------------------------------------------------------------- `paper`'s folded operand, rebuilt
# Backward rebuilds the forward's folded E4M3 operand, E4M3((A_q + s_a R) 2^-shift), from the packed
# codes and the compact residual FP4Linear keeps (ops.gemm.refold_operand, whose PyTorch form is
# the reference): the codes times 2^-shift are exact in E4M3 (down to 0.5 x 2^-8 = 2^-9, its smallest
# subnormal), so one bandwidth-bound pass writes them (0.5 B read, 1 B written per element), and a
# second kernel over the compact residual's ~2% slots overwrites the outliers.
@triton.jit
def _e2m1_f32(c):
    """4-bit E2M1 codes (int32) -> their exact fp32 values (-0.0 for the negative zero code)."""
    return e2m1_bits(c, 23, 0x3F000000, 31).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(v):
    """E4M3 bit patterns (uint8) of fp32 ``v``: saturating at 448, nearest-even (exact arithmetic)."""
    mag = minifloat_bits(tl.minimum(tl.abs(v), F8E4M3_MAX_C), 3, -6)  # E4M3: 3 mantissa bits, emin -6
    return (mag | (sign_bit(v) << 7)).to(tl.uint8)


@triton.jit
def _refold_factor(s_ptr, f_ptr, rows, ok, GIVEN_P: tl.constexpr):
    """Each row's ``2^-shift`` (NaN for rows folded to NaN): ``f_ptr`` itself where GIVEN_P, else found
    from the two scales, ``s_a`` and ``s_a 2^-shift``, as the shift 0..8 whose product
    ``s_a 2^-shift`` (fp32, as the fold kernel rounds it) is the folded scale: the value
    ``ops.gemm.refold_operand``'s ``exp2(round(log2(f / s)))`` gives, without its four launches."""
    if GIVEN_P:
        p = tl.load(f_ptr + rows, mask=ok, other=1.0)
    else:
        s = tl.load(s_ptr + rows, mask=ok, other=1.0)
        f = tl.load(f_ptr + rows, mask=ok, other=1.0)
        p = tl.full(rows.shape, float("nan"), tl.float32)
        for sh in tl.static_range(E4M3_FOLD_MAX_SHIFT_C + 1):
            fac = ((127 - sh) << 23) + tl.zeros(rows.shape, tl.int32)
            fac = fac.to(tl.float32, bitcast=True)  # 2^-sh, exact
            p = tl.where(s * fac == f, fac, p)
    return p


@triton.jit
def _refold_codes_kernel(q_ptr, s_ptr, f_ptr, e_ptr, M, KH, stride_q, stride_e, BLOCK_M: tl.constexpr,
                         BLOCK_KH: tl.constexpr, TRANSPOSED: tl.constexpr, GIVEN_P: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1) * BLOCK_KH + tl.arange(0, BLOCK_KH)
    row_ok = rows < M
    mask = row_ok[:, None] & (kb < KH)[None, :]
    b = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q + kb[None, :], mask=mask, other=0).to(tl.int32)
    p = _refold_factor(s_ptr, f_ptr, rows, row_ok, GIVEN_P)[:, None]
    q = tl.join(_e2m1_f32(b & 0xF), _e2m1_f32(b >> 4)).reshape(BLOCK_M, 2 * BLOCK_KH)
    # rows folded to NaN: zeros; the negative zero code gives +0, as A_q + s_a R = -0.0 + 0.0 does
    e = tl.where((p == p) & (q != 0.0), _e4m3_bits(q * p), 0)
    ke = tl.program_id(1) * 2 * BLOCK_KH + tl.arange(0, 2 * BLOCK_KH)
    if TRANSPOSED:  # e is (K, M16): wgrad's second operand, written without a transpose pass
        dst = e_ptr + ke.to(tl.int64)[None, :] * stride_e + rows[:, None]
    else:
        dst = e_ptr + rows.to(tl.int64)[:, None] * stride_e + ke[None, :]
    tl.store(dst, e.to(tl.uint8), mask=row_ok[:, None] & (ke < 2 * KH)[None, :])


@triton.jit
def _refold_outliers_kernel(idx_ptr, v_ptr, q_ptr, s_ptr, f_ptr, e_ptr, N_SLOTS, MK, K, stride_q, stride_e,
                            BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr, GIVEN_P: tl.constexpr = False,
                            count_ptr=None, HAS_COUNT: tl.constexpr = False):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = N_SLOTS
    if HAS_COUNT:  # the fold kernel's form: slots past the count (or the capacity) hold nothing
        n_ok = tl.minimum(tl.load(count_ptr), N_SLOTS)
    idx = tl.load(idx_ptr + j, mask=j < n_ok, other=MK).to(tl.int64)
    ok = idx < MK  # padding slots hold M K
    m = tl.where(ok, idx // K, 0)
    k = tl.where(ok, idx % K, 0)
    b = tl.load(q_ptr + m * stride_q + k // 2, mask=ok, other=0).to(tl.int32)
    q = _e2m1_f32((b >> (4 * (k % 2).to(tl.int32))) & 0xF)
    r = tl.load(v_ptr + j, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + m, mask=ok, other=1.0)
    p = _refold_factor(s_ptr, f_ptr, m, ok, GIVEN_P)
    v = q + r * s  # A_q + s_a R, product and sum rounded apart (launched without FMA contraction)
    e = tl.where(p == p, _e4m3_bits(v * p), 0)
    dst = e_ptr + k * stride_e + m if TRANSPOSED else e_ptr + m * stride_e + k
    tl.store(dst, e.to(tl.uint8), mask=ok)


#: tiles of the two refold kernels (bandwidth-bound: 4K codes, 1K residual slots per program); the
#: transposed form takes 64 rows per tile, so each column's store is 64 contiguous bytes
REFOLD_BLOCK = (32, 64)
REFOLD_T_BLOCK = (64, 32)
REFOLD_OUTLIER_BLOCK = 1024


def triton_refold(codes: torch.Tensor, scale: torch.Tensor, p: torch.Tensor | None, idx: torch.Tensor,
                  vals: torch.Tensor, k: int, transposed: bool = False, *, fold_scale: torch.Tensor | None = None,
                  count: torch.Tensor | None = None) -> torch.Tensor:
    """The folded E4M3 operand (M, k) (row stride padded to 16 bytes) from the packed codes (M, k/2),
    the clamped activation's scale ``s_a``, the per-row ``2^-shift`` ``p`` (NaN for rows folded to NaN)
    and the compact residual's flat indices and values; ``ops.gemm.refold_operand`` bit for bit.
    With ``p`` None the kernels find each row's ``2^-shift`` from ``fold_scale`` (``s_a 2^-shift``, as the
    fold kernel wrote it) themselves. ``count`` (a one-element integer tensor): the compact residual
    as the fold kernel writes it (``triton_quantize_rows_folded(capacity=)``), its first ``count`` slots
    (at most all of them) in any order, the others unwritten; without it every slot is read and the
    padding slots hold index M k. ``transposed``: the same values written column-major, the (M, k)
    transposed view of a (k, M16) buffer (its columns past M unwritten), which ``fp8_cols`` hands to
    wgrad without a transpose."""
    m, kh = codes.shape
    if (p is None) == (fold_scale is None):
        raise ValueError("triton_refold: give either p (2^-shift per row) or fold_scale, not both")
    f = p if p is not None else fold_scale
    check_same_device(codes=codes, scale=scale, p=f, idx=idx, vals=vals, count=count)
    shape = (k, round_up(m, ALIGN)) if transposed else (m, round_up(k, ALIGN))
    e = torch.empty(shape, dtype=torch.uint8, device=codes.device)
    bm, bkh = (16, 32) if INTERPRET else REFOLD_T_BLOCK if transposed else REFOLD_BLOCK
    _refold_codes_kernel[(triton.cdiv(m, bm), triton.cdiv(kh, bkh))](
        codes, scale, f, e, m, kh, codes.stride(0), e.stride(0), BLOCK_M=bm, BLOCK_KH=bkh, TRANSPOSED=transposed,
        GIVEN_P=p is not None, num_warps=4)
    n = idx.numel()
    if n:
        block = 256 if INTERPRET else REFOLD_OUTLIER_BLOCK
        _refold_outliers_kernel[(triton.cdiv(n, block),)](
            idx, vals, codes, scale, f, e, n, m * k, k, codes.stride(0), e.stride(0), BLOCK=block,
            TRANSPOSED=transposed, GIVEN_P=p is not None, count_ptr=count, HAS_COUNT=count is not None,
            num_warps=4, enable_fp_fusion=False)
    return e.view(E4M3)[:, :m].t() if transposed else e.view(E4M3)[:, :k]


# --------------------------------------------------------------------------- wgrad's epilogue on a GPU
@triton.jit
def _wgrad_finish_kernel(y_ptr, c_ptr, w_ptr, sw_ptr, N, K, stride_y, stride_cn, stride_ck, stride_w,
                         flag_ptr, HAS_ADDEND: tl.constexpr, HAS_DGE: tl.constexpr, HAS_FLAG: tl.constexpr,
                         DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    finish_tile(y_ptr, stride_y, c_ptr, stride_cn, stride_ck, w_ptr, stride_w, sw_ptr, offs_n, offs_k, offs_n < N,
                offs_k < K, HAS_ADDEND, HAS_DGE, DGE_INV_K, DGE_POW, DGE_CLAMP)
    if HAS_FLAG:  # the compact residual overflowed: the whole gradient is NaN (rare; overwrites this tile)
        if tl.load(flag_ptr).to(tl.int32) != 0:
            ptrs = y_ptr + offs_n.to(tl.int64)[:, None] * stride_y + offs_k[None, :]
            nan = tl.full([BLOCK_N, BLOCK_K], float("nan"), tl.float32)
            tl.store(ptrs, nan, mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])


#: tile of the epilogue kernel (elementwise, bandwidth-bound: 4K elements per program)
FINISH_BLOCK = (32, 128)


def triton_wgrad_finish(dw: torch.Tensor, addend: torch.Tensor | None = None, dge_weight: torch.Tensor | None = None,
                        dge_weight_scale: torch.Tensor | None = None, dge_k: float = 5.0,
                        dge_clamp: float = 3.0, nan_if: torch.Tensor | None = None) -> torch.Tensor:
    """In place on the fp32 (N, K) ``dw``: ``(dw + addend) * f'(W s_w)``, with the DGE factor of the
    Triton wgrad epilogue (``_common.dge_factor``, so ``triton_dge_factor`` bit for bit); all NaN
    where the 0-dim bool ``nan_if`` is set (``nan_where``, bit for bit)."""
    if dw.dtype != torch.float32 or dw.dim() != 2 or dw.stride(1) != 1:
        raise ValueError(f"dw must be a row-major fp32 matrix, got {dw.dtype} with strides {dw.stride()}")
    n, k = dw.shape
    if dge_weight is not None:
        if dge_weight_scale is None:
            raise ValueError("dge_weight_scale (W's per-row FP4 scale) is required with dge_weight")
        if dge_weight.stride(1) != 1:
            dge_weight = dge_weight.contiguous()
    if nan_if is not None and (nan_if.dtype != torch.bool or nan_if.numel() != 1):
        raise ValueError(f"nan_if must be a one-element bool tensor, got {nan_if.dtype} of shape {tuple(nan_if.shape)}")
    check_same_device(dw=dw, addend=addend, dge_weight=dge_weight, dge_weight_scale=dge_weight_scale, nan_if=nan_if)
    c = addend if addend is not None else dw
    w = dge_weight if dge_weight is not None else dw
    sw = dge_weight_scale if dge_weight is not None else dw
    bn, bk = FINISH_BLOCK
    _wgrad_finish_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        dw, c, w, sw, n, k, dw.stride(0), c.stride(0), c.stride(1), w.stride(0), nan_if if nan_if is not None else dw,
        HAS_ADDEND=addend is not None, HAS_DGE=dge_weight is not None, HAS_FLAG=nan_if is not None,
        DGE_INV_K=1.0 / float(dge_k),
        DGE_POW=1.0 / float(dge_k) - 1.0, DGE_CLAMP=float(dge_clamp), BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return dw
