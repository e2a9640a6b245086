"""Triton kernels for the block-scaled FP4 formats: MXFP4 / NVFP4 quantizers and a block-scaled GeMM.

Twins of the PyTorch reference in ``fp4lightning/numerics/block_formats.py`` (see its docstring for
the formats). They target CUDA GPUs *without* FP4 tensor cores: the GeMM decodes a tile of
E2M1 codes, multiplies each value by its block's scale (exact in bf16), and runs one
bf16 ``tl.dot`` with fp32 accumulation per ``block_k`` columns (several scale blocks).

All rounding is exact integer/fp32 arithmetic (``_common.minifloat_bits``), never an
in-kernel float downcast, so the codes and scales are bit-identical to the reference
(and hence to torchao) under the interpreter and on a GPU. Scope: round-to-nearest,
1-D blocks, K a multiple of the block; a block holding a NaN gets the format's NaN scale and
decodes to NaN, as in the reference.
Tested under ``TRITON_INTERPRET=1`` (``tests/test_block_kernels.py``); the same tests pass
compiled on an H200 (docs/perf.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4lightning.numerics.block_formats import nvfp4_global_scale

from ._common import (E2M1_MAX_C, E8M0_BIAS_C, F8E4M3_MAX_C, F8E4M3_MIN_NORMAL_C, F32_MIN_NORMAL_C, INTERPRET,
                      decode_e2m1_dot, minifloat_bits, sign_bit)

__all__ = ["triton_quantize_mxfp4", "triton_quantize_nvfp4", "triton_block_gemm", "triton_block_gemm_fp4",
           "e4m3_value"]

_DOT_FP32 = 4  # decode_e2m1_dot target: fp32 values (exact)


# --------------------------------------------------------------------------- quantizers
@triton.jit
def _e2m1_pack_store(y, q_ptr, rows, col0, M, stride_qm, BLOCK_M: tl.constexpr, B: tl.constexpr):
    """Round fp32 ``y`` (BLOCK_M, B), already in [-6, 6], to E2M1 codes; store packed bytes."""
    idx = minifloat_bits(tl.abs(y), 1, 0)  # 0..7, ties to even
    code = idx | (sign_bit(y) << 3)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_M, B // 2, 2)))
    byte = (lo | (hi << 4)).to(tl.uint8)
    bcols = col0 // 2 + tl.arange(0, B // 2)
    tl.store(q_ptr + rows[:, None] * stride_qm + bcols[None, :], byte, mask=(rows < M)[:, None])


@triton.jit
def _mx_quant_kernel(x_ptr, q_ptr, s_ptr, M, stride_xm, stride_qm, stride_sm, BLOCK_M: tl.constexpr):
    # --- one program: BLOCK_M rows x one 32-element block
    pid_m, pid_b = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_b * 32 + tl.arange(0, 32)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
    x = x.to(tl.float32)
    # --- E8M0 scale: 2^(floor(log2 amax) - 2), read off the exponent bits
    amax = tl.max(tl.abs(x), axis=1)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - E8M0_BIAS_C - 2  # 2 = log2 of E2M1's largest power of two
    biased = tl.minimum(tl.maximum(e, -E8M0_BIAS_C), E8M0_BIAS_C + 1) + E8M0_BIAS_C
    # a NaN in the block (tl.max skips it): the E8M0 NaN byte, so the block decodes to NaN as the
    # reference's does; its codes are the reference's x / 2^128 (inf): zeros carrying x's sign
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    biased = tl.where(has_nan, 255, biased)
    scale = tl.maximum((biased << 23).to(tl.float32, bitcast=True), F32_MIN_NORMAL_C)
    # --- scale, saturate, round, pack
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -E2M1_MAX_C), E2M1_MAX_C)
    y = tl.where(x == x, y, 0.0)  # (x / inf is a signed zero already; the NaN itself gets code 0)
    _e2m1_pack_store(y, q_ptr, rows, pid_b * 32, M, stride_qm, BLOCK_M, 32)
    tl.store(s_ptr + rows * stride_sm + pid_b, biased.to(tl.uint8), mask=rows < M)


@triton.jit
def e4m3_value(bits):
    """fp32 value of non-negative E4M3 bit patterns (int32); the NaN patterns 0x7F / 0xFF give NaN."""
    e = bits >> 3
    m = (bits & 7).to(tl.float32)
    normal = (1.0 + m * 0.125) * ((e + 120) << 23).to(tl.float32, bitcast=True)  # 2^(e - 7)
    value = tl.where(e > 0, normal, m * 0.001953125)  # subnormal: m / 8 * 2^-6
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), value)  # a NaN block stays NaN


@triton.jit
def _nv_quant_kernel(x_ptr, q_ptr, s_ptr, g_ptr, M, stride_xm, stride_qm, stride_sm, BLOCK_M: tl.constexpr):
    # --- one program: BLOCK_M rows x one 16-element block
    pid_m, pid_b = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_b * 16 + tl.arange(0, 16)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None], other=0.0)
    x = x.to(tl.float32)
    g = tl.load(g_ptr)  # per-tensor decode scale amax / (448 * 6)
    # --- E4M3 block scale of (amax / 6) / g, saturating, at least the smallest normal 2^-6
    amax = tl.max(tl.abs(x), axis=1)
    # IEEE divisions (div_rn): a plain '/' compiles to an approximate division on GPUs, which
    # changed codes against the reference on an H200 (the interpreter divides exactly)
    s = tl.minimum(tl.maximum(tl.math.div_rn(tl.math.div_rn(amax, E2M1_MAX_C), g), F8E4M3_MIN_NORMAL_C),
                   F8E4M3_MAX_C)
    bits = minifloat_bits(s, 3, -6)  # E4M3: F8E4M3_MANT_BITS, F8E4M3_EMIN
    # a NaN in the block (tl.max skips it): the E4M3 NaN scale 0x7F and zero codes, the reference's
    # (its x * NaN is NaN, code 0), so the block decodes to NaN
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    bits = tl.where(has_nan, 0x7F, bits)
    s8 = e4m3_value(bits)
    recip = tl.math.div_rn(tl.math.div_rn(tl.full(s8.shape, 1.0, tl.float32), g), s8)
    y = tl.minimum(tl.maximum(x * recip[:, None], -E2M1_MAX_C), E2M1_MAX_C)
    y = tl.where(has_nan[:, None], 0.0, y)
    _e2m1_pack_store(y, q_ptr, rows, pid_b * 16, M, stride_qm, BLOCK_M, 16)
    tl.store(s_ptr + rows * stride_sm + pid_b, bits.to(tl.uint8), mask=rows < M)


def _check(x: torch.Tensor, b: int, name: str) -> torch.Tensor:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name}: expected a 2-D floating-point tensor, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] % b:
        raise ValueError(f"{name}: K={x.shape[1]} must be a multiple of {b}; use the reference "
                         "(fp4lightning.numerics.block_formats), which pads")
    if not INTERPRET and x.device.type != "cuda":
        raise RuntimeError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1 set before import)")
    return x.contiguous()


def triton_quantize_mxfp4(x: torch.Tensor, block_m: int = 16):
    """(packed codes (M, K/2) uint8, biased E8M0 exponents (M, K/32) uint8), as the reference."""
    x = _check(x, 32, "quantize_mxfp4")
    m, k = x.shape
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // 32, dtype=torch.uint8, device=x.device)
    _mx_quant_kernel[(triton.cdiv(m, block_m), k // 32)](x, q, s, m, x.stride(0), q.stride(0), s.stride(0),
                                                         BLOCK_M=block_m)
    return q, s


def triton_quantize_nvfp4(x: torch.Tensor, block_m: int = 16):
    """(packed codes, E4M3 block scales (M, K/16) float8_e4m3fn, fp32 global scale), as the reference."""
    x = _check(x, 16, "quantize_nvfp4")
    m, k = x.shape
    if x.numel() == 0:
        raise ValueError(f"quantize_nvfp4: empty input {tuple(x.shape)} has no amax for its global scale")
    g = nvfp4_global_scale(torch.linalg.vector_norm(x.float(), float("inf"))).reshape(1)
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // 16, dtype=torch.uint8, device=x.device)
    _nv_quant_kernel[(triton.cdiv(m, block_m), k // 16)](x, q, s, g, m, x.stride(0), q.stride(0), s.stride(0),
                                                         BLOCK_M=block_m)
    return q, s.view(torch.float8_e4m3fn), g.reshape(())


# --------------------------------------------------------------------------- GeMM
@triton.jit
def _block_scales(s_ptr, rows, kb, M, stride_sm, FMT: tl.constexpr):
    raw = tl.load(s_ptr + rows * stride_sm + kb, mask=rows < M, other=127 if FMT == 0 else 56).to(tl.int32)
    if FMT == 0:  # E8M0: 2^(raw - 127); raw 0 reads as 2^-126 like the reference
        s = tl.maximum((raw << 23).to(tl.float32, bitcast=True), 1.1754943508222875e-38)
    else:  # E4M3
        s = e4m3_value(raw)
    return s


@triton.jit
def _scaled_tile(q_ptr, s_ptr, rows, k0, M, K, stride_qm, stride_sm,
                 BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr, FMT: tl.constexpr,
                 DOT_BF16: tl.constexpr, S_SHIFT: tl.constexpr):
    """Rows ``rows`` x K columns ``k0 .. k0+BLOCK_K`` of a block-FP4 operand: E2M1 value times its
    block's scale (scale row ``row >> S_SHIFT``: 4 for NVFP4's 16 x 16 tiles). The product has at
    most 2 + 4 significant bits, so it is exact in bf16 (same exponent range as fp32): the
    tensor-core dot then multiplies exact values and adds in fp32."""
    bcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(q_ptr + rows[:, None] * stride_qm + bcols[None, :],
                   mask=(rows < M)[:, None] & (bcols < K // 2)[None, :], other=0)
    v = tl.reshape(tl.join(decode_e2m1_dot(byte & 0xF, 4), decode_e2m1_dot(byte >> 4, 4)), (BLOCK, BLOCK_K))
    NB: tl.constexpr = BLOCK_K // B
    kb = k0 // B + tl.arange(0, NB)
    raw = tl.load(s_ptr + (rows >> S_SHIFT)[:, None] * stride_sm + kb[None, :],
                  mask=(rows < M)[:, None] & (kb < K // B)[None, :],
                  other=127 if FMT == 0 else 56).to(tl.int32)
    if FMT == 0:  # E8M0: 2^(raw - 127); raw 0 reads as 2^-126 like the reference
        sc = tl.maximum((raw << 23).to(tl.float32, bitcast=True), 1.1754943508222875e-38)
    else:  # E4M3
        sc = e4m3_value(raw)
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK, NB, B)), (BLOCK, BLOCK_K))
    v = v * sc
    if DOT_BF16:
        v = v.to(tl.bfloat16)
    return v


@triton.jit
def _block_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, y_ptr, ga_ptr, gb_ptr,  # pointers (ga, gb: NVFP4 global scales)
    M, N, K, factor, post_a, post_b,  # sizes; epilogue factors
    stride_am, stride_sam, stride_bn, stride_sbn, stride_ym,  # strides
    B: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_BF16: tl.constexpr, SA_SHIFT: tl.constexpr = 0, SB_SHIFT: tl.constexpr = 0, EPI: tl.constexpr = 0,
):
    # EPI: 0 no epilogue factor; 1 times ``factor``; 2 times (ga * post_a) * (gb * post_b), the fp32
    # product the reference forms (block_gemm's factor)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # --- BLOCK_K columns (several scale blocks) per step: decode, scale (exact), one fp32-accumulating dot
    for k0 in range(0, K, BLOCK_K):
        a = _scaled_tile(a_ptr, sa_ptr, rm, k0, M, K, stride_am, stride_sam, BLOCK_M, BLOCK_K, B, FMT, DOT_BF16,
                         SA_SHIFT)
        b = _scaled_tile(b_ptr, sb_ptr, rn, k0, N, K, stride_bn, stride_sbn, BLOCK_N, BLOCK_K, B, FMT, DOT_BF16,
                         SB_SHIFT)
        acc = tl.dot(a, tl.trans(b), acc)
    if EPI == 1:
        acc = acc * factor
    elif EPI == 2:
        acc = acc * ((tl.load(ga_ptr) * post_a) * (tl.load(gb_ptr) * post_b))
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)


def triton_block_gemm(a_codes, a_scales, b_codes, b_scales, fmt: str, factor: float | torch.Tensor = 1.0,
                      block_m: int = 128, block_n: int = 256, block_k: int = 64) -> torch.Tensor:
    """fp32 ``A B^T`` of two block-FP4 operands (packed codes + block scales along K) times ``factor``.

    ``fmt``: ``"mxfp4"`` (uint8 E8M0 scales) or ``"nvfp4"`` (float8_e4m3fn scales; pass the
    product of the two global scales as ``factor``).
    """
    if fmt not in ("mxfp4", "nvfp4"):
        raise ValueError(f"block_gemm: unknown format {fmt!r}; choose 'mxfp4' or 'nvfp4'")
    b = 32 if fmt == "mxfp4" else 16
    bad = [f"{n}={v}" for n, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k))
           if v < 16 or v & (v - 1)]
    if bad:
        raise ValueError(f"block_gemm: tile sizes must be powers of two >= 16, got {', '.join(bad)}")
    if block_k % b:
        raise ValueError(f"block_gemm: block_k={block_k} must be a multiple of the {fmt} block size {b}")
    for name, t in (("a_codes", a_codes), ("b_codes", b_codes)):
        if t.dim() != 2 or t.dtype != torch.uint8:
            raise TypeError(f"block_gemm: {name} must be 2-D packed uint8 codes, got {tuple(t.shape)} {t.dtype}")
    scale_dtype = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    for name, t in (("a_scales", a_scales), ("b_scales", b_scales)):
        if t.dtype != scale_dtype:
            raise TypeError(f"block_gemm: {fmt} {name} must be {scale_dtype} (the quantizer's scales), got {t.dtype}")
    devices = {t.device for t in (a_codes, a_scales, b_codes, b_scales)}
    if len(devices) > 1:
        raise ValueError(f"block_gemm: operands on different devices {sorted(map(str, devices))}")
    a_codes, b_codes = a_codes.contiguous(), b_codes.contiguous()  # the kernel reads rows of unit stride
    m, kh = a_codes.shape
    n = b_codes.shape[0]
    k = 2 * kh
    if b_codes.shape[1] != kh or a_scales.shape != (m, k // b) or b_scales.shape != (n, k // b):
        raise ValueError(f"block_gemm: shapes do not match: codes {tuple(a_codes.shape)} / {tuple(b_codes.shape)}, "
                         f"scales {tuple(a_scales.shape)} / {tuple(b_scales.shape)} for {fmt} blocks of {b}")
    sa, sb = a_scales.view(torch.uint8).contiguous(), b_scales.view(torch.uint8).contiguous()
    y = torch.empty(m, n, dtype=torch.float32, device=a_codes.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_gemm_kernel[grid](a_codes, sa, b_codes, sb, y, y, y, m, n, k, 1.0, 1.0, 1.0,
                             a_codes.stride(0), sa.stride(0), b_codes.stride(0), sb.stride(0), y.stride(0),
                             B=b, FMT=0 if fmt == "mxfp4" else 1, BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_K=block_k, DOT_BF16=not INTERPRET,  # bf16 tl.dot is wrong in the interpreter
                             num_warps=8 if block_m * block_n >= 128 * 128 else 4)
    return y if isinstance(factor, float) and factor == 1.0 else y * factor


def triton_block_gemm_fp4(a, b, block_m: int = 128, block_n: int = 256, block_k: int = 64) -> torch.Tensor:
    """fp32 ``A B^T`` of two ``BlockFP4`` operands (fp4lightning.numerics.block_formats) sharing their
    reduction dimension, in one launch: NVFP4's 16 x 16 tile scales read in place (no per-row copy),
    and the tensor-wide factor (global scales, MXFP4's SR post-scale) applied in the epilogue with
    the fp32 arithmetic of ``ops.gemm.block_gemm`` (which expands the tiles and multiplies after)."""
    if a.shape[1] != b.shape[1] or a.fmt != b.fmt:
        raise ValueError(f"block_gemm: operands differ ({a.fmt} {a.shape} vs {b.fmt} {b.shape}); "
                         "they must share the format and the reduction (last) dimension")
    fmt, blk = a.fmt, a.block
    if block_k % blk:
        raise ValueError(f"block_gemm: block_k={block_k} must be a multiple of the {fmt} block size {blk}")
    m, n, k = a.shape[0], b.shape[0], a.codes.shape[1] * 2  # K padded to the block, as the codes are
    y = torch.empty(m, n, dtype=torch.float32, device=a.codes.device)
    if a.global_scale is not None:  # NVFP4: (ga * post_a) * (gb * post_b) on the device
        epi, factor, ga, gb = 2, 1.0, a.global_scale.reshape(1), b.global_scale.reshape(1)
    else:  # the host's float product, applied as fp32 (as ``y * factor`` does)
        factor, ga, gb = a.post_scale * b.post_scale, y, y
        epi = 0 if factor == 1.0 else 1
    sa, sb = a.scales.view(torch.uint8).contiguous(), b.scales.view(torch.uint8).contiguous()
    qa, qb = a.codes.contiguous(), b.codes.contiguous()  # the kernel reads rows of unit stride
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_gemm_kernel[grid](qa, sa, qb, sb, y, ga, gb, m, n, k, factor, a.post_scale, b.post_scale,
                             qa.stride(0), sa.stride(0), qb.stride(0), sb.stride(0), y.stride(0),
                             B=blk, FMT=0 if fmt == "mxfp4" else 1, BLOCK_M=block_m, BLOCK_N=block_n,
                             BLOCK_K=block_k, DOT_BF16=not INTERPRET, SA_SHIFT=4 if a.block_2d else 0,
                             SB_SHIFT=4 if b.block_2d else 0, EPI=epi,
                             num_warps=8 if block_m * block_n >= 128 * 128 else 4)
    return y
