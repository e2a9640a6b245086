"""The FP4 GeMMs as plain FP8 GeMMs on expanded operands (issue 12's option (a); docs/kernels.md).

Every E2M1 value is exact in FP8 E4M3 and in E5M2 (arXiv 2501.17116, section 3.1;
docs/method.md section 1). So instead of decoding 4-bit codes inside a GeMM's main loop
(``kernels/gemm.py``, the ``decode`` path), a bandwidth-bound kernel expands the packed
codes once per GeMM into FP8 bytes, in the layout the FP8 tensor cores want (K-major:
the reduction dimension contiguous), and the GeMM's loop is then nothing but loads and
``wgmma``:

    forward  Y  = (A8 W8^T) / (s_a s_w^T) + bias     A8 = expand(A_q)       W8 = expand(W_q)
    dgrad    dA = (G1 W8t^T) / s_g1[:, None]          W8t = expand(W_q)^T    (K x N, N contiguous)
    wgrad    dW = (G2t A8t^T) / s_g2 [+ C] * f'(W s_w) A8t = expand(A_q)^T   (K x M, M contiguous)

(G2t is dY^T with tokens contiguous, what ``quantize_fp8(dim=0, column_major=True)`` writes.)
The packed 4-bit form stays what the layer saves for backward; the expanded copies are
temporaries (1 byte per element against 0.5). The backward operands are expanded to
dY's FP8 type (E5M2 or E4M3), so both dot operands have one type.

Numerics are those of the decode path: the same products (exact), fp32 accumulation and
the same epilogue operations in the same order, so the forward is bit-identical to it
(and to the reference) wherever the accumulation is exact.

Why both paths exist: the decode path's loop spends issue slots on the SWAR decode
(``kernels/compile_check.py`` reads 0.90 issue cycles per tensor cycle for the sm_90a
forward, 1.27 for the backward), this path's loop has none but moves twice the operand
bytes plus the expansion pass. Which is faster is a measurement (``benchmarks/bench_kernels.py``
times both side by side); ``FP4LIGHTNING_GEMM_PATH`` picks one (docs/perf.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import (
    AUTOTUNE,
    DOT_FP8E4,
    DOT_FP8E5,
    FLOAT_DTYPES,
    INTERPRET,
    check_out_dtype,
    check_packed,
    check_rows,
    check_same_device,
    check_vector,
    dge_factor,
    e2m1_bits,
    finish_rows_in_chunks,
    has_fp8_mma,
    m_bucket,
    mma,
    precise_accumulation,
    round_up,
    tile_ids,
)

__all__ = ["triton_expand_fp4", "triton_fp8_gemm", "triton_transpose_fp8", "triton_folded_gemm", "triton_folded_wgrad",
           "EXPAND_DTYPES"]

#: FP8 types an FP4 operand can be expanded to (both hold every E2M1 value exactly).
EXPAND_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: Row strides of expanded copies are padded to this many bytes (16-byte vector loads);
#: the pad holds zeros.
_PAD = 16


# --------------------------------------------------------------------------- expansion
@triton.jit
def _expand_kernel(p_ptr, y_ptr, R, KH, KY, RY, stride_p, stride_y,
                   TRANSPOSE: tl.constexpr, MANT: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_KH: tl.constexpr):
    """Packed codes (R x KH bytes) -> FP8 bytes: y[r, k] (KY columns written, zeros past the
    codes) or, TRANSPOSE, y[k, r] (RY columns written, zeros past R)."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_kh = pid_k * BLOCK_KH + tl.arange(0, BLOCK_KH)
    b = tl.load(p_ptr + offs_r.to(tl.int64)[:, None] * stride_p + offs_kh[None, :],
                mask=(offs_r < R)[:, None] & (offs_kh < KH)[None, :], other=0)  # zero bytes -> +0.0
    b = b.to(tl.int32)
    lo = e2m1_bits(b & 0xF, MANT, HALF, 7)
    hi = e2m1_bits(b >> 4, MANT, HALF, 7)
    v = tl.join(lo, hi).reshape(BLOCK_R, 2 * BLOCK_KH).to(tl.uint8)  # element 2j: low nibble of byte j
    offs_k = pid_k * 2 * BLOCK_KH + tl.arange(0, 2 * BLOCK_KH)
    if TRANSPOSE:
        ptrs = y_ptr + offs_k.to(tl.int64)[None, :] * stride_y + offs_r[:, None]
        tl.store(ptrs, v, mask=(offs_r < RY)[:, None] & (offs_k < KY)[None, :])
    else:
        ptrs = y_ptr + offs_r.to(tl.int64)[:, None] * stride_y + offs_k[None, :]
        tl.store(ptrs, v, mask=(offs_r < R)[:, None] & (offs_k < KY)[None, :])


_BITS = {torch.float8_e4m3fn: (3, 0x30), torch.float8_e5m2: (2, 0x38)}  # (mantissa bits, bits of 0.5)


def triton_expand_fp4(packed: torch.Tensor, k: int, dtype: torch.dtype = torch.float8_e4m3fn,
                      transpose: bool = False) -> torch.Tensor:
    """Packed E2M1 codes (R, ceil(k/2)) uint8 -> their exact values in FP8 ``dtype``.

    Returns an (R, k) tensor, or with ``transpose`` a (k, R) one (the packed dimension
    becomes the rows), as a view of a buffer whose row stride is padded to a multiple of
    16 bytes with zeros in the pad (16-byte aligned loads for the GeMM). The scale is
    not applied: the values are the codes' E2M1 values.
    """
    packed = check_packed("packed", packed, k)
    if dtype not in _BITS:
        raise TypeError(f"dtype={dtype}: expand to torch.float8_e4m3fn or torch.float8_e5m2 (both hold E2M1 exactly)")
    check_same_device(packed=packed)
    r, kh = packed.shape
    mant, half = _BITS[dtype]
    if transpose:
        buf = torch.empty(k, round_up(r, _PAD), dtype=torch.uint8, device=packed.device)
        grid_r, grid_kh = round_up(r, _PAD), kh
        ky, ry = k, buf.shape[1]
    else:
        buf = torch.empty(r, round_up(k, _PAD), dtype=torch.uint8, device=packed.device)
        grid_r, grid_kh = r, buf.shape[1] // 2
        ky, ry = buf.shape[1], r
    block_r, block_kh = (16, 32) if INTERPRET else (64, 64)
    grid = (triton.cdiv(grid_r, block_r), triton.cdiv(grid_kh, block_kh))
    _expand_kernel[grid](packed, buf, r, kh, ky, ry, packed.stride(0), buf.stride(0), TRANSPOSE=transpose,
                         MANT=mant, HALF=half, BLOCK_R=block_r, BLOCK_KH=block_kh, num_warps=4)
    out = buf.view(dtype)
    return out[:, :r] if transpose else out[:, :k]


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, R, C, stride_x, stride_y, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """y[c, r] = x[r, c] for bytes; Triton stages the tile through shared memory so both the
    loads (along C) and the stores (along R) are contiguous."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < R)[:, None] & (offs_c < C)[None, :]
    t = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_x + offs_c[None, :], mask=mask, other=0)
    tl.store(y_ptr + offs_c.to(tl.int64)[None, :] * stride_y + offs_r[:, None], t, mask=mask)


def triton_transpose_fp8(x: torch.Tensor) -> torch.Tensor:
    """(R, C) FP8 -> (C, R) of the same values, as a view of a buffer whose row stride is padded
    to 16 bytes: the layout the FP8 tensor cores read a weight-gradient operand in (the reduction
    dimension, tokens, contiguous). The pad is not written (the GeMMs never read it)."""
    x = _check_fp8("x", x)
    r, c = x.shape
    buf = torch.empty(c, round_up(r, _PAD), dtype=torch.uint8, device=x.device)
    block_r, block_c = (16, 32) if INTERPRET else (64, 64)
    _transpose_kernel[(triton.cdiv(r, block_r), triton.cdiv(c, block_c))](
        x.view(torch.uint8), buf, r, c, x.stride(0), buf.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return buf.view(x.dtype)[:, :r]


# --------------------------------------------------------------------------- FP8 GeMM
# Hopper rows (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, where): the tile shapes Triton's
# FP8 matmul tutorials and cuBLAS use, each compiled for sm_90a and read from the SASS
# (kernels/compile_check.py --all-configs; docs/kernels.md, "How the GeMMs use the tensor
# cores"). ``where`` keeps a row off the launches on which ptxas spills it: 128x256 with
# 8 warps spills 168 bytes with the fp32 promotion of precise accumulation (fine with fast
# accumulation, where it is the best loop: 0.19 issue cycles per tensor cycle). The first
# row is the default (FP4LIGHTNING_AUTOTUNE=0): spill-free everywhere, 0.49 issue cycles per
# tensor cycle with precise accumulation, 0.21 without. Kept short on purpose: every row is
# one more compile per kernel variant in the first autotuned call (scripts/gpu_check.sh has
# 8 minutes).
# Dropped after compiling: 64x256 (spills with precise accumulation), 128x128 with 4 warps
# (spills 48 bytes in the DGE epilogue; 0.50 otherwise), 128x64 (0.71).
_SWEEP = [(256, 128, 128, 3, 8, "all"), (128, 128, 128, 4, 8, "all"), (128, 256, 128, 3, 8, "fast-accum")]
_WHERE: dict[int, str] = {}  # id(config) -> where


def _fp8_configs():
    """The ``_SWEEP`` rows as ``triton.Config``s (``_prune_spilling`` drops those that spill on a launch)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP": 4}, num_warps=4, num_stages=1)]
    out = []
    for a, b, kb, s, w, where in _SWEEP:
        cfg = triton.Config({"BLOCK_M": a, "BLOCK_N": b, "BLOCK_K": kb, "GROUP": 8}, num_stages=s, num_warps=w)
        _WHERE[id(cfg)] = where
        out.append(cfg)
    return out


def _prune_spilling(configs, named_args, **kwargs):
    """The rows that compile spill-free for this launch (all of them, or the default with AUTOTUNE off)."""
    def ok(c):
        where = _WHERE.get(id(c), "all")
        return not ((where == "fast-accum" and kwargs.get("PRECISE_ACC", True))
                    or (where == "no-dge" and kwargs.get("HAS_DGE", False)))
    keep = [c for c in configs if ok(c)]
    return keep if AUTOTUNE else keep[:1]


# ROW_SCALE / COL_SCALE: 0 none, 1 divide (IEEE), 2 multiply by the IEEE reciprocal
@triton.autotune(configs=_fp8_configs(), key=["M_BUCKET", "N", "K", "DOT", "PRECISE_ACC", "ROW_SCALE", "COL_SCALE",
                                          "HAS_BIAS", "HAS_ADDEND", "HAS_DGE"],
                 prune_configs_by={"early_config_prune": _prune_spilling})
@triton.jit
def _fp8_gemm_kernel(
    a_ptr, b_ptr, sr_ptr, sc_ptr, bias_ptr, c_ptr, w_ptr, sw_ptr, y_ptr,
    M, M_BUCKET, N, K,
    stride_am, stride_bn, stride_cm, stride_ck, stride_wm, stride_ym,
    DOT: tl.constexpr, PRECISE_ACC: tl.constexpr, ROW_SCALE: tl.constexpr, COL_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ADDEND: tl.constexpr, TWO_PHASE: tl.constexpr, EPI_M: tl.constexpr,
    HAS_DGE: tl.constexpr, DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """Y (M x N) = A (M x K) B (N x K)^T, both FP8 and K-major, fp32 accumulation, then the
    epilogue: row / column scales, bias, addend C, DGE factor f'(W[m, n] s_w[m])."""
    pid_m, pid_n = tile_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past the end wrap around (their results are never stored): no row masks in the loop
    a_ptrs = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (offs_k < K - k0)[None, :]
        a = tl.load(a_ptrs, mask=k_ok, other=0.0)
        b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        acc = mma(a, tl.trans(b), acc, DOT, PRECISE_ACC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    _epilogue(acc, pid_m, offs_m, offs_n, M, N, sr_ptr, sc_ptr, bias_ptr, c_ptr, w_ptr, sw_ptr, y_ptr,
              stride_cm, stride_ck, stride_wm, stride_ym, ROW_SCALE, COL_SCALE, HAS_BIAS, HAS_ADDEND, TWO_PHASE,
              EPI_M, HAS_DGE, DGE_INV_K, DGE_POW, DGE_CLAMP, BLOCK_M)


@triton.jit
def _epilogue(acc, pid_m, offs_m, offs_n, M, N, sr_ptr, sc_ptr, bias_ptr, c_ptr, w_ptr, sw_ptr, y_ptr,
              stride_cm, stride_ck, stride_wm, stride_ym,
              ROW_SCALE: tl.constexpr, COL_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ADDEND: tl.constexpr,
              TWO_PHASE: tl.constexpr, EPI_M: tl.constexpr, HAS_DGE: tl.constexpr, DGE_INV_K: tl.constexpr,
              DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row / column scales, bias, addend C, DGE factor f'(W[m, n] s_w[m]); stores the tile."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    out = acc
    if ROW_SCALE == 1:
        out = tl.math.div_rn(out, tl.load(sr_ptr + offs_m, mask=m_ok, other=1.0)[:, None])
    elif ROW_SCALE == 2:
        sr = tl.load(sr_ptr + offs_m, mask=m_ok, other=1.0)
        out = out * tl.math.div_rn(tl.full(sr.shape, 1.0, tl.float32), sr)[:, None]
    if COL_SCALE == 1:
        out = tl.math.div_rn(out, tl.load(sc_ptr + offs_n, mask=n_ok, other=1.0)[None, :])
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if (HAS_ADDEND or HAS_DGE) and TWO_PHASE:  # fp32 output: store, then finish in row chunks
        tl.store(y_ptrs, out, mask=mask)
        finish_rows_in_chunks(y_ptr, stride_ym, c_ptr, stride_cm, stride_ck, w_ptr, stride_wm, sw_ptr,
                              pid_m * BLOCK_M, M, offs_n, n_ok, BLOCK_M, EPI_M, HAS_ADDEND, HAS_DGE,
                              DGE_INV_K, DGE_POW, DGE_CLAMP)
    else:
        if HAS_ADDEND:
            out += tl.load(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_ck,
                           mask=mask, other=0.0).to(tl.float32)
        if HAS_DGE:
            sw = tl.load(sw_ptr + offs_m, mask=m_ok, other=1.0)
            w = tl.load(w_ptr + offs_m.to(tl.int64)[:, None] * stride_wm + offs_n[None, :], mask=mask, other=0.0)
            out = out * dge_factor(w.to(tl.float32) * sw[:, None], DGE_INV_K, DGE_POW, DGE_CLAMP)
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


# --- the same GeMM with TMA loads (Hopper's tensor memory accelerator): the copy engine
# moves each operand tile into shared memory, so the main loop issues no per-thread address
# arithmetic or cp.async; out-of-range rows and the K tail arrive as zeros. Needs 16-byte
# aligned bases and row strides (the expanded copies are padded so; a dY whose row is not a
# multiple of 16 bytes takes the pointer kernel).
def _set_tma_blocks(nargs):
    nargs["a_desc"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["b_desc"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _tma_configs():
    out = []
    for cfg in _fp8_configs():
        tma = triton.Config(dict(cfg.kwargs), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            pre_hook=_set_tma_blocks)
        _WHERE[id(tma)] = _WHERE.get(id(cfg), "all")
        out.append(tma)
    return out


@triton.autotune(configs=_tma_configs(), key=["M_BUCKET", "N", "K", "DOT", "PRECISE_ACC", "ROW_SCALE", "COL_SCALE",
                                              "HAS_BIAS", "HAS_ADDEND", "HAS_DGE"],
                 prune_configs_by={"early_config_prune": _prune_spilling})
@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, b_desc, sr_ptr, sc_ptr, bias_ptr, c_ptr, w_ptr, sw_ptr, y_ptr,
    M, M_BUCKET, N, K,
    stride_cm, stride_ck, stride_wm, stride_ym,
    DOT: tl.constexpr, PRECISE_ACC: tl.constexpr, ROW_SCALE: tl.constexpr, COL_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ADDEND: tl.constexpr, TWO_PHASE: tl.constexpr, EPI_M: tl.constexpr,
    HAS_DGE: tl.constexpr, DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
):
    """``_fp8_gemm_kernel`` with the operand tiles loaded through TMA descriptors."""
    pid_m, pid_n = tile_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([m0, k0])
        b = b_desc.load([n0, k0])
        acc = mma(a, tl.trans(b), acc, DOT, PRECISE_ACC)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    _epilogue(acc, pid_m, offs_m, offs_n, M, N, sr_ptr, sc_ptr, bias_ptr, c_ptr, w_ptr, sw_ptr, y_ptr,
              stride_cm, stride_ck, stride_wm, stride_ym, ROW_SCALE, COL_SCALE, HAS_BIAS, HAS_ADDEND, TWO_PHASE,
              EPI_M, HAS_DGE, DGE_INV_K, DGE_POW, DGE_CLAMP, BLOCK_M)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in tensors)


def _use_tma(tma: bool | None) -> bool:
    """``tma=None`` follows FP4LIGHTNING_TMA (default off until timed on a GPU, docs/perf.md)."""
    if tma is None:
        tma = os.environ.get("FP4LIGHTNING_TMA", "0") == "1"
    return bool(tma)


_DOT = {torch.float8_e4m3fn: DOT_FP8E4, torch.float8_e5m2: DOT_FP8E5}


def _check_fp8(name: str, t: torch.Tensor) -> torch.Tensor:
    return check_rows(name, t, EXPAND_DTYPES, "FP8, rows x K with K contiguous")


def triton_fp8_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    row_reciprocal: bool = False,
    bias: torch.Tensor | None = None,
    addend: torch.Tensor | None = None,
    dge_weight: torch.Tensor | None = None,
    dge_weight_scale: torch.Tensor | None = None,
    dge_k: float = 5.0,
    dge_clamp: float = 3.0,
    precise_acc: bool = True,
    tma: bool | None = None,
) -> torch.Tensor:
    """``Y = A B^T`` for FP8 ``a`` (M, K) and ``b`` (N, K), fp32 accumulation.

    The two operands may be of different FP8 types (E5M2 x E4M3: Hopper's ``wgmma`` takes the
    pair, ``QGMMA...E5M2.E4M3`` in the SASS; the folded-OCC weight gradient needs it).

    Epilogue, in this order: ``/ row_scale[:, None]`` (or ``* (1 / row_scale)`` with
    ``row_reciprocal``), ``/ col_scale[None, :]``, ``+ bias``, ``+ addend`` (M, N, any
    strides), ``* f'(dge_weight * dge_weight_scale[:, None])`` (the DGE derivative,
    arXiv 2501.17116 section 3.2). ``precise_acc`` promotes each dot's FP8 partial sum
    into the fp32 accumulator (Hopper accumulates FP8 products in reduced precision).
    ``tma``: load the operand tiles through TMA descriptors (``None``: FP4LIGHTNING_TMA,
    default off); operands that are not 16-byte aligned use pointer loads either way.
    """
    a, b = _check_fp8("a", a), _check_fp8("b", b)
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a has K={a.shape[1]} but b has K={b.shape[1]}; both are (rows, K) with K the reduction")
    m, n = a.shape[0], b.shape[0]
    check_out_dtype(out_dtype)
    row_scale, col_scale, bias, dge_weight, dge_weight_scale = _check_epilogue(
        m, n, row_scale, col_scale, bias, addend, dge_weight, dge_weight_scale)
    check_same_device(a=a, b=b, row_scale=row_scale, col_scale=col_scale, bias=bias, addend=addend,
                      dge_weight=dge_weight, dge_weight_scale=dge_weight_scale)
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    _launch_fp8_gemm(a, b, y, row_scale, col_scale, row_reciprocal, bias, addend, dge_weight, dge_weight_scale,
                     dge_k, dge_clamp, precise_acc, _use_tma(tma) and tma_ok(a, b))
    return y


def _check_epilogue(m: int, n: int, row_scale, col_scale, bias, addend, dge_weight, dge_weight_scale):
    """``(row_scale, col_scale, bias, dge_weight, dge_weight_scale)`` of an (m, n) output, checked and
    made contiguous where the kernel needs it."""
    if row_scale is not None:
        row_scale = check_vector("row_scale", row_scale, m, (torch.float32,), "one fp32 scale per row of the output")
    if col_scale is not None:
        col_scale = check_vector("col_scale", col_scale, n, (torch.float32,), "one fp32 scale per column of the output")
    if bias is not None:
        bias = check_vector("bias", bias, n, FLOAT_DTYPES, "one value per output column")
    for name, t in (("addend", addend), ("dge_weight", dge_weight)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != (m, n) or t.dtype not in FLOAT_DTYPES):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a float tensor of shape ({m}, {n}), got {got}")
    if dge_weight is not None:
        if dge_weight.stride(1) != 1:
            dge_weight = dge_weight.contiguous()
        if dge_weight_scale is None:
            raise ValueError("dge_weight_scale (W's per-row FP4 scale) is required with dge_weight")
        dge_weight_scale = check_vector("dge_weight_scale", dge_weight_scale, m, (torch.float32,),
                                        "W's per-row fp32 FP4 scale")
    return row_scale, col_scale, bias, dge_weight, dge_weight_scale


def _launch_fp8_gemm(a, b, y, row_scale, col_scale, row_reciprocal: bool, bias, addend, dge_weight,
                     dge_weight_scale, dge_k: float, dge_clamp: float, precise_acc: bool, tma: bool) -> None:
    """Launch the FP8 GeMM (pointer or TMA loads) on checked operands, writing ``y``; absent optional
    operands are passed as any vector (never read: their constexpr flag is off)."""
    m, k = a.shape
    n = b.shape[0]
    has_dge = dge_weight is not None
    any_vec = next(t for t in (row_scale, col_scale, bias) if t is not None) if (
        row_scale is not None or col_scale is not None or bias is not None) else y
    grid = lambda META: (triton.cdiv(m, META["BLOCK_M"]) * triton.cdiv(n, META["BLOCK_N"]),)  # noqa: E731
    vecs = (row_scale if row_scale is not None else any_vec, col_scale if col_scale is not None else any_vec,
            bias if bias is not None else any_vec, addend if addend is not None else any_vec,
            dge_weight if has_dge else any_vec, dge_weight_scale if has_dge else any_vec, y)
    strides = (addend.stride(0) if addend is not None else 0, addend.stride(1) if addend is not None else 0,
               dge_weight.stride(0) if has_dge else 0, y.stride(0))
    if tma:
        kernel = _fp8_gemm_tma_kernel
        # block shapes are set per autotune config by its pre-hook (_set_tma_blocks)
        head = (TensorDescriptor(a, [m, k], [a.stride(0), 1], [16, 16]),
                TensorDescriptor(b, [n, k], [b.stride(0), 1], [16, 16])) + vecs + (m, m_bucket(m), n, k) + strides
    else:
        kernel = _fp8_gemm_kernel
        head = (a, b) + vecs + (m, m_bucket(m), n, k, a.stride(0), b.stride(0)) + strides
    kernel[grid](
        *head,
        DOT=_DOT[a.dtype], PRECISE_ACC=precise_acc,
        ROW_SCALE=0 if row_scale is None else (2 if row_reciprocal else 1), COL_SCALE=0 if col_scale is None else 1,
        HAS_BIAS=bias is not None, HAS_ADDEND=addend is not None, TWO_PHASE=y.dtype == torch.float32, EPI_M=16,
        HAS_DGE=has_dge, DGE_INV_K=1.0 / float(dge_k), DGE_POW=1.0 / float(dge_k) - 1.0, DGE_CLAMP=float(dge_clamp),
    )


# --------------------------------------------------------------------------- OCC folded in E4M3
def _need_fp8_mma(device: torch.device, what: str) -> None:
    if not has_fp8_mma(device):
        raise RuntimeError(f"{what} runs on FP8 tensor cores (sm_90+), which {device} does not have; "
                           "drop FP4Config.occ_fold_e4m3 or set FP4LIGHTNING_BACKEND=reference")


def triton_folded_gemm(a_fold: torch.Tensor, a_scale: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                       k: int, out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None, *,
                       fast_accum: bool | None = None) -> torch.Tensor:
    """Forward GeMM of ``FP4Config.occ_fold_e4m3``: ``Y = (E W_q^T) / (s s_w^T) + bias``.

    ``a_fold`` (M, k) E4M3 and ``a_scale`` (M,) are what ``triton_quantize_rows_folded`` returns
    (OCC's compensation already in E); W's codes are expanded to E4M3 and one FP8 GeMM runs:
    no second, bf16 compensation GeMM (docs/perf.md, "OCC on the GPU")."""
    a_fold = _check_fp8("a_fold", a_fold)
    if a_fold.dtype != torch.float8_e4m3fn or a_fold.shape[1] != k:
        raise ValueError(f"a_fold must be (M, {k}) torch.float8_e4m3fn (triton_quantize_rows_folded's output), "
                         f"got {tuple(a_fold.shape)} {a_fold.dtype}")
    w_packed = check_packed("w_packed", w_packed, k)
    _need_fp8_mma(a_fold.device, "the folded-OCC forward GeMM")
    return triton_fp8_gemm(a_fold, triton_expand_fp4(w_packed, k), out_dtype, row_scale=a_scale, col_scale=w_scale,
                           bias=bias, precise_acc=precise_accumulation(fast_accum))


def triton_folded_wgrad(g: torch.Tensor, g_scale: torch.Tensor, a_fold: torch.Tensor,
                        out_dtype: torch.dtype = torch.float32, dge_weight: torch.Tensor | None = None,
                        dge_weight_scale: torch.Tensor | None = None, dge_k: float = 5.0, dge_clamp: float = 3.0,
                        addend: torch.Tensor | None = None, *, fast_accum: bool | None = None) -> torch.Tensor:
    """Weight gradient of ``FP4Config.occ_fold_e4m3``: ``dW = (G2^T E) / s_g2[:, None]``, DGE fused.

    ``g`` (M, N) FP8 dY with the folded operand's row scales divided in (one fp32 scale per
    column, ``g_scale``), row- or column-major; ``a_fold`` (M, k) the forward's E4M3 operand,
    transposed here to tokens-contiguous. The dot is E5M2 x E4M3 for an E5M2 dY (mixed FP8 types,
    one ``wgmma``), so OCC's share of the weight gradient rides in the same FP8 GeMM.
    Epilogue as ``triton_fp4_wgrad``."""
    a_fold = _check_fp8("a_fold", a_fold)
    if g.dtype not in EXPAND_DTYPES:
        raise TypeError(f"g is {g.dtype}: the folded-OCC weight gradient needs an FP8 dY "
                        "(FP4Config.grad_format 'e5m2' or 'e4m3')")
    if g.dim() != 2 or g.shape[0] != a_fold.shape[0]:
        raise ValueError(f"g has shape {tuple(g.shape)} but a_fold has {a_fold.shape[0]} rows (tokens); "
                         "wgrad reduces over tokens")
    _need_fp8_mma(g.device, "the folded-OCC weight-gradient GeMM")
    g_t = g.shape[0] > 1 and g.stride(0) == 1  # column-major dY (quantize_fp8(dim=0, column_major=True))
    g2t = g.t() if g_t else g.t().contiguous()  # (N, M), tokens contiguous
    return triton_fp8_gemm(g2t, triton_transpose_fp8(a_fold), out_dtype, row_scale=g_scale, row_reciprocal=True,
                           addend=addend, dge_weight=dge_weight, dge_weight_scale=dge_weight_scale, dge_k=dge_k,
                           dge_clamp=dge_clamp, precise_acc=precise_accumulation(fast_accum))
