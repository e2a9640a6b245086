"""The three FP4 GeMMs of a linear layer in Triton (arXiv 2501.17116, section 3; docs/method.md section 3).

With ``Y = A W^T`` (A: M x K tokens, W: N x K), A and W quantized per row along K to
packed E2M1 codes with fp32 multipliers ``s`` (``q = x * s``):

    forward  Y  = (A_q W_q^T) / (s_a s_w^T) + bias         fp4_gemm   (M x N)
    dgrad    dA = (G1 W_q) / s_g1[:, None]                  fp4_dgrad  (M x K), reduces over N
    wgrad    dW = (G2^T A_q) / s_g2[:, None] * f'(W s_w)    fp4_wgrad  (N x K), reduces over M

G1 / G2 are dY with the FP4 scale of the reduction dimension folded in, in FP8 E5M2 /
E4M3 (or bf16), scaled per row (G1) or per column (G2). ``f'`` is the DGE derivative
(section 3.2), fused into the wgrad epilogue.

How the 4-bit operand reaches the tensor cores here (the ``decode`` path): codes are loaded
as packed bytes and decoded in registers to the dot type by integer arithmetic
(``_common.decode_e2m1_dot``). The ``expand`` path (``kernels/fp8_gemm.py``; ``path=`` or
FP4LIGHTNING_GEMM_PATH, see ``_path``) expands them to FP8 bytes first and runs a plain
FP8 GeMM; the three public functions below serve both.
Every E2M1 value is exact in FP8, fp16 and bf16, so the products are exact and only
fp32 accumulation rounds. Element ``2j`` of a row sits in the low nibble of byte ``j``:

* forward: both operands are packed along K, so ``sum_k a_k w_k`` splits into the
  even-k and odd-k halves, two dots on the low and the high nibbles - no shuffle;
* dgrad / wgrad: the packed operand's K is the *output* column, so the low and high
  nibbles give the even and odd output columns, interleaved once in the epilogue.

Dot types: on Hopper (sm_90+) the forward decodes to FP8 E4M3 and the backward to the
FP8 type of dY (E4M3 or E5M2; both hold E2M1 exactly), so all three GeMMs run on FP8
tensor cores. Elsewhere everything goes through fp16 (exact for E2M1 and FP8 values);
a bf16 dY uses bf16. Scales, bias and DGE are applied in fp32 in the epilogue.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    AUTOTUNE,
    DOT_BF16,
    DOT_FP8E4,
    DOT_FP8E5,
    DOT_FP16,
    DOT_FP32,
    FLOAT_DTYPES,
    FP8_DECODE_SHIFT,
    INTERPRET,
    as_dot_operand,
    check_out_dtype,
    check_packed,
    check_rows,
    check_same_device,
    check_vector,
    decode_e2m1_dot,
    decode_e2m1_pair_fp8,
    dge_factor,
    finish_rows_in_chunks,
    gemm_path,
    has_fp8_mma,
    m_bucket,
    mma,
    precise_accumulation,
    tile_ids,
)
from .fp8_gemm import triton_expand_fp4, triton_fp8_gemm

__all__ = ["triton_fp4_gemm", "triton_fp4_dgrad", "triton_fp4_wgrad", "triton_dge_factor", "GRAD_DTYPES"]

#: Accepted dtypes of the high-precision backward operand (dY).
GRAD_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------- autotune configs
# How the sweeps were chosen (by static analysis of the compiled code, not by timing; see
# docs/kernels.md, and docs/perf.md for the GPU timings of the defaults): start from the
# tile shapes cuBLAS and the Triton matmul tutorials use (128x128 / 128x256 output tiles,
# 4 or 8 warps, 3-4 stages; 64-row tiles for skinny problems).
# Then every candidate was compiled ahead of time (kernels/compile_check.py
# --all-configs; triton.compile with a GPUTarget needs no GPU), the ones ptxas spilled
# dropped, and the static roofline of the main loop read from the SASS (issue cycles
# per tensor-core cycles, see compile_check). On Hopper the FP8 forward with 128 codes
# of K per dot (BLOCK_KH=128 bytes: 256 codes per iteration) halves the share of the
# fp32 promotions per tensor op against 64 and lands at 0.90 (docs/kernels.md, "How the
# GeMMs use the tensor cores"); the 128x256 tiles spill. Hopper (wgmma, operands from
# shared memory) and older GPUs (mma.sync, operands in registers) spill on different
# tiles, hence two families; the first row of each is the default (FP4LIGHTNING_AUTOTUNE=0).
# Rows: (output rows, second tile dim, BLOCK_KH, stages, warps).

# Forward: (BLOCK_M, BLOCK_N, ...)
_FWD_SWEEP = [(128, 128, 128, 3, 8), (128, 128, 64, 4, 8), (64, 128, 128, 4, 4), (128, 64, 64, 4, 4)]
_FWD_SWEEP_MMA = [(128, 128, 32, 4, 8), (128, 128, 32, 4, 4)]
# Backward: (output rows, reduction block, ...). The output tile is rows x 2*BLOCK_KH
# columns held as two accumulators (even/odd columns), so BLOCK_KH=64 is a 128-column
# tile; the reduction block is the dot's K (>= 32 for FP8).
_DGRAD_SWEEP = [(128, 128, 128, 3, 8), (128, 128, 64, 3, 8), (128, 64, 64, 4, 8), (64, 64, 64, 4, 4)]
_DGRAD_SWEEP_MMA = [(128, 64, 64, 4, 8), (128, 64, 32, 4, 4), (64, 64, 64, 4, 4), (128, 64, 64, 3, 8)]
# wgrad: (output rows, reduction block, BLOCK_KH, ...). With an fp32 output the DGE /
# addend epilogue runs in 16-row chunks after a plain store (TWO_PHASE), which is what
# lets the 256x64 and 128x128 output tiles (K 128 / 64 per iteration) stay spill-free.
_WGRAD_SWEEP = [(256, 128, 32, 3, 8), (128, 256, 64, 2, 8), (128, 128, 64, 3, 8)]
_WGRAD_SWEEP_MMA = [(128, 64, 32, 4, 8), (64, 64, 32, 4, 4), (64, 64, 64, 4, 4), (64, 128, 32, 3, 4)]

_FAMILY: dict[int, str] = {}  # id(config) -> "wgmma" | "mma"


def _family_configs(sweep, sweep_mma, names: tuple[str, str, str]) -> list[triton.Config]:
    """``triton.Config`` lists of both families; ``_prune_to_family`` keeps the device's family."""
    if INTERPRET:
        # The interpreter runs one program at a time in numpy: tuning is pointless and slow,
        # and 64x64 tiles with 32 bytes (64 codes) of K keep the mask paths exercised.
        return [triton.Config({names[0]: 64, names[1]: 64, names[2]: 32, "GROUP": 4}, num_warps=4, num_stages=1)]
    out = []
    for family, rows in (("wgmma", sweep), ("mma", sweep_mma)):
        for a, b, kh, s, w in rows:
            cfg = triton.Config({names[0]: a, names[1]: b, names[2]: kh, "GROUP": 8}, num_stages=s, num_warps=w)
            _FAMILY[id(cfg)] = family
            out.append(cfg)
    return out


def _prune_to_family(configs, named_args, **kwargs):
    """The configs of this GPU's family (all of them, or the default with AUTOTUNE off)."""
    dev = next(v.device for v in named_args.values() if isinstance(v, torch.Tensor))
    family = "wgmma" if torch.cuda.get_device_capability(dev) >= (9, 0) else "mma"
    keep = [c for c in configs if _FAMILY.get(id(c)) == family]
    return keep if AUTOTUNE else keep[:1]


_PRUNE = {"early_config_prune": _prune_to_family}


# --------------------------------------------------------------------------- forward
@triton.autotune(configs=_family_configs(_FWD_SWEEP, _FWD_SWEEP_MMA, ("BLOCK_M", "BLOCK_N", "BLOCK_KH")),
                 key=["M_BUCKET", "N", "KH", "DOT", "HAS_BIAS", "PRECISE_ACC"], prune_configs_by=_PRUNE)
@triton.jit
def _fp4_gemm_kernel(
    # pointers
    a_ptr, w_ptr, sa_ptr, sw_ptr, bias_ptr, y_ptr,
    # sizes (KH: packed bytes per row; M_BUCKET: M rounded up to a power of two, the
    # autotune key, so a new batch size does not re-tune)
    M, M_BUCKET, N, KH,
    # strides (inner strides are 1)
    stride_am, stride_wn, stride_ym,
    # meta-parameters
    DOT: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISE_ACC: tl.constexpr, UNSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_n = tile_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kh = tl.arange(0, BLOCK_KH)
    # Out-of-range rows wrap around instead of being masked (their results are never
    # stored), which keeps the main loop free of row masks.
    a_ptrs = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_am + offs_kh[None, :]
    w_ptrs = w_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_wn + offs_kh[None, :]

    # --- main loop: packed bytes -> two dots (even k on low nibbles, odd k on high).
    # Written as a plain loop on purpose: Triton's software pipeliner then streams the
    # packed bytes through shared memory with cp.async (num_stages deep). Hand-written
    # register double buffering defeats that and spills (checked in the sm_90 PTX).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kh0 in range(0, KH, BLOCK_KH):
        k_ok = (offs_kh < KH - kh0)[None, :]
        a = tl.load(a_ptrs, mask=k_ok, other=0)  # zero bytes decode to +0.0
        w = tl.load(w_ptrs, mask=k_ok, other=0)
        if DOT <= 1:  # FP8: four codes per instruction, scaled by 2^-6 each (see _common)
            a_lo, a_hi = decode_e2m1_pair_fp8(a, DOT)
            w_lo, w_hi = decode_e2m1_pair_fp8(w, DOT)
            acc = mma(a_lo, tl.trans(w_lo), acc, DOT, PRECISE_ACC)
            acc = mma(a_hi, tl.trans(w_hi), acc, DOT, PRECISE_ACC)
        else:
            acc = mma(decode_e2m1_dot(a & 0xF, DOT), tl.trans(decode_e2m1_dot(w & 0xF, DOT)), acc, DOT,
                      PRECISE_ACC)
            acc = mma(decode_e2m1_dot(a >> 4, DOT), tl.trans(decode_e2m1_dot(w >> 4, DOT)), acc, DOT,
                      PRECISE_ACC)
        a_ptrs += BLOCK_KH
        w_ptrs += BLOCK_KH
    if DOT <= 1:
        acc = acc * UNSCALE  # both operands carry 2^-6: an exact power of two

    # --- epilogue: Y = acc / s_a / s_w + bias in fp32, the reference's operation order
    # (IEEE divisions, so an exact accumulator gives a bit-identical fp32 result)
    m_ok = offs_m < M
    n_ok = offs_n < N
    sa = tl.load(sa_ptr + offs_m, mask=m_ok, other=1.0)
    sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=1.0)
    y = tl.math.div_rn(tl.math.div_rn(acc, sa[:, None]), sw[None, :])
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _unscale(*dots: int) -> float:
    """UNSCALE of a launch: 2^(sum of FP8_DECODE_SHIFT) over the decoded operands' dot types,
    undoing ``decode_e2m1_pair_fp8``'s power of two in the epilogue (1.0 off the FP8 path)."""
    return float(2 ** sum(FP8_DECODE_SHIFT.get(d, 0) for d in dots))


def _decode_mode(decode: str | None, device: torch.device) -> int:
    if decode is None:
        decode = "fp8" if has_fp8_mma(device) else "fp16"
    if decode not in ("fp8", "fp16"):
        raise ValueError(f"decode={decode!r}: choose 'fp8' (FP8 tensor cores, sm_90+) or 'fp16'")
    if decode == "fp8" and not has_fp8_mma(device):
        raise ValueError(f"decode='fp8' needs FP8 tensor cores (sm_90+); {device} has none, use decode='fp16'")
    return DOT_FP8E4 if decode == "fp8" else DOT_FP16


def _path(path: str | None, device: torch.device, fp8_operand: bool = True) -> str:
    """The GeMM path of a launch: ``'decode'`` (codes decoded in the main loop) or ``'expand'``
    (codes expanded to FP8 bytes by ``fp8_gemm.triton_expand_fp4``, then a plain FP8 GeMM).

    ``path=None`` follows FP4LIGHTNING_GEMM_PATH and falls back to ``'decode'`` where
    ``'expand'`` cannot run (no FP8 tensor cores, a bf16/fp16 dY); an explicit
    ``path='expand'`` there is an error.
    """
    asked = path
    if path is None:
        path = gemm_path()
    if path not in ("decode", "expand"):
        raise ValueError(f"path={path!r} (or FP4LIGHTNING_GEMM_PATH): choose 'decode' (FP4 codes decoded in the "
                         "GeMM loop) or 'expand' (codes expanded to FP8 first, then a plain FP8 GeMM)")
    if path == "expand" and not (has_fp8_mma(device) and fp8_operand):
        if asked is not None:
            why = ("the high-precision operand is not FP8" if has_fp8_mma(device)
                   else f"{device} has no FP8 tensor cores (sm_90+)")
            raise ValueError(f"path='expand' runs the GeMM on FP8 tensor cores, but {why}; use path='decode'")
        path = "decode"
    return path


def triton_fp4_gemm(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    *,
    decode: str | None = None,
    fast_accum: bool | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Forward FP4 GeMM ``Y = (A_q W_q^T) / (s_a s_w^T) + bias`` -> (M, N) ``out_dtype``.

    ``a_packed`` (M, ceil(k/2)) and ``w_packed`` (N, ceil(k/2)) are uint8 with two E2M1
    codes per byte along K (pad nibble zero, as every quantizer here writes it: the forward
    multiplies it rather than masking it, so codes of another K, or a set pad nibble, are misread);
    ``a_scale`` (M,) and ``w_scale`` (N,) fp32 multipliers; ``bias`` (N,) any float
    dtype. ``decode`` forces the tensor-core type: ``'fp8'`` (E4M3, sm_90+) or
    ``'fp16'``; default: FP8 where available. ``fast_accum=True`` skips the promotion
    of FP8 partial sums into the fp32 accumulator (``None``: FP4LIGHTNING_FP8_FAST_ACCUM).
    ``path``: ``'decode'`` or ``'expand'`` (see ``_path``; ``None``: FP4LIGHTNING_GEMM_PATH).
    """
    a_packed = check_packed("a_packed", a_packed, k)
    w_packed = check_packed("w_packed", w_packed, k)
    m, n, kh = a_packed.shape[0], w_packed.shape[0], a_packed.shape[1]
    a_scale = check_vector("a_scale", a_scale, m, (torch.float32,), "one fp32 scale per row of A")
    w_scale = check_vector("w_scale", w_scale, n, (torch.float32,), "one fp32 scale per row of W")
    if bias is not None:
        bias = check_vector("bias", bias, n, FLOAT_DTYPES, "one value per output feature")
    check_out_dtype(out_dtype)
    check_same_device(a_packed=a_packed, a_scale=a_scale, w_packed=w_packed, w_scale=w_scale, bias=bias)
    dot = _decode_mode(decode, a_packed.device)
    if _path(path, a_packed.device, dot == DOT_FP8E4) == "expand":
        return triton_fp8_gemm(triton_expand_fp4(a_packed, k), triton_expand_fp4(w_packed, k), out_dtype,
                               row_scale=a_scale, col_scale=w_scale, bias=bias,
                               precise_acc=precise_accumulation(fast_accum))
    y = torch.empty(m, n, dtype=out_dtype, device=a_packed.device)
    grid = lambda META: (triton.cdiv(m, META["BLOCK_M"]) * triton.cdiv(n, META["BLOCK_N"]),)  # noqa: E731
    _fp4_gemm_kernel[grid](
        a_packed, w_packed, a_scale, w_scale, bias if bias is not None else a_scale, y,
        m, m_bucket(m), n, kh, a_packed.stride(0), w_packed.stride(0), y.stride(0),
        DOT=dot, HAS_BIAS=bias is not None, PRECISE_ACC=precise_accumulation(fast_accum), UNSCALE=_unscale(dot, dot),
    )
    return y


# --------------------------------------------------------------------------- backward
def _grad_dot_mode(g: torch.Tensor) -> int:
    """Tensor-core type for a backward GeMM with high-precision operand ``g``."""
    if g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        if has_fp8_mma(g.device):
            return DOT_FP8E4 if g.dtype == torch.float8_e4m3fn else DOT_FP8E5
        return DOT_FP16
    if g.dtype == torch.bfloat16:
        return DOT_FP32 if INTERPRET else DOT_BF16
    return DOT_FP16


def _check_grad(g: torch.Tensor, g_scale: torch.Tensor, n_scale: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = check_rows("g", g, GRAD_DTYPES, "dY, M x N, in FP8 E5M2/E4M3 or bf16/fp16")
    return g, check_vector("g_scale", g_scale, n_scale, (torch.float32,), what)


def _loadable_grad(g: torch.Tensor) -> torch.Tensor:
    """Triton cannot even load FP8 E4M3 before sm_89; there it is widened to fp16 (exact)."""
    if (g.dtype == torch.float8_e4m3fn and not INTERPRET and g.device.type == "cuda"
            and torch.cuda.get_device_capability(g.device) < (8, 9)):
        return g.to(torch.float16)
    return g


@triton.autotune(configs=_family_configs(_DGRAD_SWEEP, _DGRAD_SWEEP_MMA, ("BLOCK_M", "BLOCK_N", "BLOCK_KH")),
                 key=["M_BUCKET", "N", "KH", "DOT", "PRECISE_ACC"], prune_configs_by=_PRUNE)
@triton.jit
def _fp4_dgrad_kernel(
    # pointers
    g_ptr, w_ptr, sg_ptr, y_ptr,
    # sizes (M_BUCKET: autotune key, see _fp4_gemm_kernel)
    M, M_BUCKET, N, K, KH,
    # strides
    stride_gm, stride_wn, stride_ym,
    # meta-parameters (BLOCK_N is the reduction block)
    DOT: tl.constexpr, PRECISE_ACC: tl.constexpr, UNSCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KH: tl.constexpr, GROUP: tl.constexpr,
):
    pid_m, pid_k = tile_ids(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(KH, BLOCK_KH), GROUP)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_kh = pid_k * BLOCK_KH + tl.arange(0, BLOCK_KH)
    offs_n = tl.arange(0, BLOCK_N)
    g_ptrs = g_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_gm + offs_n[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (offs_kh % KH)[None, :]

    # --- main loop over N: even / odd output columns from the low / high nibbles
    acc_even = tl.zeros((BLOCK_M, BLOCK_KH), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_M, BLOCK_KH), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n_ok = offs_n < N - n0
        g = as_dot_operand(tl.load(g_ptrs, mask=n_ok[None, :], other=0.0), DOT)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
        if DOT <= 1:
            w_lo, w_hi = decode_e2m1_pair_fp8(w, DOT)
            acc_even = mma(g, w_lo, acc_even, DOT, PRECISE_ACC)
            acc_odd = mma(g, w_hi, acc_odd, DOT, PRECISE_ACC)
        else:
            acc_even = mma(g, decode_e2m1_dot(w & 0xF, DOT), acc_even, DOT, PRECISE_ACC)
            acc_odd = mma(g, decode_e2m1_dot(w >> 4, DOT), acc_odd, DOT, PRECISE_ACC)
        g_ptrs += BLOCK_N
        w_ptrs += BLOCK_N * stride_wn
    if DOT <= 1:
        acc_even = acc_even * UNSCALE  # the decoded operand carries 2^-shift
        acc_odd = acc_odd * UNSCALE

    # --- epilogue: interleave columns, divide by the per-row dY scale
    out = tl.join(acc_even, acc_odd).reshape(BLOCK_M, 2 * BLOCK_KH)
    m_ok = offs_m < M
    sg = tl.load(sg_ptr + offs_m, mask=m_ok, other=1.0)
    out = tl.math.div_rn(out, sg[:, None])
    offs_k = pid_k * 2 * BLOCK_KH + tl.arange(0, 2 * BLOCK_KH)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_k[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_k < K)[None, :])


def triton_fp4_dgrad(g: torch.Tensor, g_scale: torch.Tensor, w_packed: torch.Tensor, k: int,
              out_dtype: torch.dtype = torch.float32, *, fast_accum: bool | None = None,
              path: str | None = None) -> torch.Tensor:
    """Activation gradient ``dA = (G1 W_q) / s_g1[:, None]`` -> (M, k) ``out_dtype``.

    ``g`` (M, N): dY with W's scales folded in, FP8 E5M2/E4M3 (or bf16/fp16), one fp32
    scale per row in ``g_scale`` (M,); ``w_packed`` (N, ceil(k/2)) the forward's packed
    weight codes (packed along K, the output dimension here). ``fast_accum`` and ``path`` as in ``fp4_gemm``.
    """
    w_packed = check_packed("w_packed", w_packed, k)
    n, kh = w_packed.shape
    g, g_scale = _check_grad(g, g_scale, g.shape[0], "one fp32 scale per row of dY")
    if g.shape[1] != n:
        raise ValueError(f"g has {g.shape[1]} columns but w_packed has {n} rows (out_features); "
                         "dgrad reduces over that shared dimension")
    check_out_dtype(out_dtype)
    check_same_device(g=g, g_scale=g_scale, w_packed=w_packed)
    m = g.shape[0]
    if _path(path, g.device, g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)) == "expand":
        w8t = triton_expand_fp4(w_packed, k, g.dtype, transpose=True)  # (k, N): N, the reduction, contiguous
        return triton_fp8_gemm(g, w8t, out_dtype, row_scale=g_scale, precise_acc=precise_accumulation(fast_accum))
    g = _loadable_grad(g)
    y = torch.empty(m, k, dtype=out_dtype, device=g.device)
    dot = _grad_dot_mode(g)
    grid = lambda META: (triton.cdiv(m, META["BLOCK_M"]) * triton.cdiv(kh, META["BLOCK_KH"]),)  # noqa: E731
    _fp4_dgrad_kernel[grid](
        g, w_packed, g_scale, y, m, m_bucket(m), n, k, kh, g.stride(0), w_packed.stride(0), y.stride(0),
        DOT=dot, PRECISE_ACC=precise_accumulation(fast_accum), UNSCALE=_unscale(dot),
    )
    return y


@triton.jit
def _dge_factor_kernel(w_ptr, sw_ptr, y_ptr, N, K, stride_wn, stride_yn,
                       DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    sw = tl.load(sw_ptr + offs_n, mask=offs_n < N, other=1.0)
    f = dge_factor(w * sw[:, None], DGE_INV_K, DGE_POW, DGE_CLAMP)
    tl.store(y_ptr + rows * stride_yn + offs_k[None, :], f, mask=mask)


def triton_dge_factor(w: torch.Tensor, w_scale: torch.Tensor, dge_k: float = 5.0, dge_clamp: float = 3.0) -> torch.Tensor:
    """The DGE factor ``f'(W s_w)`` (N, K) fp32 that ``fp4_wgrad`` fuses into its epilogue.

    The same device function as the wgrad epilogue, so ``fp4_wgrad(..., dge_weight=w)``
    equals ``fp4_wgrad(...) * dge_factor(w, ...)`` bit for bit; exposed to test the
    epilogue's math on its own and to precompute the factor once per weight update.
    """
    w = check_rows("w", w, FLOAT_DTYPES, "the high-precision weight W, N x K")
    n, k = w.shape
    w_scale = check_vector("w_scale", w_scale, n, (torch.float32,), "W's per-row fp32 FP4 scale")
    check_same_device(w=w, w_scale=w_scale)
    y = torch.empty(n, k, dtype=torch.float32, device=w.device)
    grid = (triton.cdiv(n, 32), triton.cdiv(k, 128))
    _dge_factor_kernel[grid](w, w_scale, y, n, k, w.stride(0), y.stride(0), DGE_INV_K=1.0 / float(dge_k),
                             DGE_POW=1.0 / float(dge_k) - 1.0, DGE_CLAMP=float(dge_clamp), BLOCK_N=32, BLOCK_K=128)
    return y


# one function: a kernel is one launch, its accumulators live in registers from the main loop to the
# epilogue (the epilogue's halves are device functions below)
@triton.autotune(configs=_family_configs(_WGRAD_SWEEP, _WGRAD_SWEEP_MMA, ("BLOCK_N", "BLOCK_M", "BLOCK_KH")),
                 key=["M_BUCKET", "N", "KH", "DOT", "PRECISE_ACC", "G_T", "HAS_DGE", "HAS_ADDEND"], prune_configs_by=_PRUNE)
@triton.jit
def _fp4_wgrad_kernel(
    # pointers (c_ptr: optional addend, any strides)
    g_ptr, a_ptr, sg_ptr, w_ptr, sw_ptr, c_ptr, y_ptr,
    # sizes (M_BUCKET: autotune key, see _fp4_gemm_kernel)
    M, M_BUCKET, N, K, KH,
    # strides (dY: one of stride_gm / stride_gn is 1, which one is G_T)
    stride_gm, stride_gn, stride_am, stride_wn, stride_cn, stride_ck, stride_yn,
    # meta-parameters (BLOCK_M is the reduction block)
    DOT: tl.constexpr, PRECISE_ACC: tl.constexpr, UNSCALE: tl.constexpr, G_T: tl.constexpr, HAS_ADDEND: tl.constexpr,
    TWO_PHASE: tl.constexpr, EPI_N: tl.constexpr,
    HAS_DGE: tl.constexpr, DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KH: tl.constexpr, GROUP: tl.constexpr,
):
    pid_n, pid_k = tile_ids(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(KH, BLOCK_KH), GROUP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kh = pid_k * BLOCK_KH + tl.arange(0, BLOCK_KH)
    offs_m = tl.arange(0, BLOCK_M)
    # dY row-major: read as [BLOCK_M, BLOCK_N] tiles (coalesced) and transposed in registers;
    # dY column-major (G_T, what quantize_fp8(dim=0, column_major=True) writes): read as
    # [BLOCK_N, BLOCK_M] tiles that are already K-major, the layout FP8 wgmma takes
    if G_T:
        g_ptrs = g_ptr + (offs_n % N).to(tl.int64)[:, None] * stride_gn + offs_m[None, :]
    else:
        g_ptrs = g_ptr + offs_m.to(tl.int64)[:, None] * stride_gm + (offs_n % N)[None, :]
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (offs_kh % KH)[None, :]

    # --- main loop over M (tokens)
    acc_even = tl.zeros((BLOCK_N, BLOCK_KH), dtype=tl.float32)
    acc_odd = tl.zeros((BLOCK_N, BLOCK_KH), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        m_ok = (offs_m < M - m0)[:, None]
        if G_T:
            g = as_dot_operand(tl.load(g_ptrs, mask=tl.trans(m_ok), other=0.0), DOT)
        else:
            g = tl.trans(as_dot_operand(tl.load(g_ptrs, mask=m_ok, other=0.0), DOT))
        a = tl.load(a_ptrs, mask=m_ok, other=0)
        if DOT <= 1:
            a_lo, a_hi = decode_e2m1_pair_fp8(a, DOT)
            acc_even = mma(g, a_lo, acc_even, DOT, PRECISE_ACC)
            acc_odd = mma(g, a_hi, acc_odd, DOT, PRECISE_ACC)
        else:
            acc_even = mma(g, decode_e2m1_dot(a & 0xF, DOT), acc_even, DOT, PRECISE_ACC)
            acc_odd = mma(g, decode_e2m1_dot(a >> 4, DOT), acc_odd, DOT, PRECISE_ACC)
        g_ptrs += BLOCK_M if G_T else BLOCK_M * stride_gm
        a_ptrs += BLOCK_M * stride_am
    if DOT <= 1:
        acc_even = acc_even * UNSCALE  # the decoded operand carries 2^-shift
        acc_odd = acc_odd * UNSCALE

    # --- epilogue: divide by the per-column dY scale, add, DGE factor. With the DGE math
    # (or an addend) the even and odd columns are finished one half at a time: the
    # joined tile's temporaries spill registers on sm_90 (checked in the PTX).
    # A multiply by the (IEEE) reciprocal of the scale, within an ulp of the reference's
    # division: a full IEEE division per element spills registers here.
    n_ok = offs_n < N
    sg = tl.load(sg_ptr + offs_n, mask=n_ok, other=1.0)
    inv_sg = tl.math.div_rn(tl.full(sg.shape, 1.0, tl.float32), sg)
    if (HAS_DGE or HAS_ADDEND) and TWO_PHASE:
        # fp32 output: store acc / s_g, then finish it in row chunks of EPI_N (addend, DGE)
        # re-read by the same block - the DGE math on the whole tile would hold several
        # tile-sized temporaries and spill the large tiles (compile_check)
        out = tl.join(acc_even, acc_odd).reshape(BLOCK_N, 2 * BLOCK_KH) * inv_sg[:, None]
        offs_k = pid_k * 2 * BLOCK_KH + tl.arange(0, 2 * BLOCK_KH)
        k_ok = offs_k < K
        tl.store(y_ptr + offs_n.to(tl.int64)[:, None] * stride_yn + offs_k[None, :], out,
                 mask=n_ok[:, None] & k_ok[None, :])
        finish_rows_in_chunks(y_ptr, stride_yn, c_ptr, stride_cn, stride_ck, w_ptr, stride_wn, sw_ptr,
                              pid_n * BLOCK_N, N, offs_k, k_ok, BLOCK_N, EPI_N, HAS_ADDEND, HAS_DGE,
                              DGE_INV_K, DGE_POW, DGE_CLAMP)
    elif HAS_DGE or HAS_ADDEND:
        sw = tl.load(sw_ptr + offs_n, mask=n_ok, other=1.0)
        col = pid_k * 2 * BLOCK_KH + 2 * tl.arange(0, BLOCK_KH)
        _wgrad_epilogue_half(acc_even, inv_sg, sw, offs_n, n_ok, col, K, c_ptr, stride_cn, stride_ck,
                             w_ptr, stride_wn, y_ptr, stride_yn, HAS_ADDEND, HAS_DGE, DGE_INV_K, DGE_POW, DGE_CLAMP)
        _wgrad_epilogue_half(acc_odd, inv_sg, sw, offs_n, n_ok, col + 1, K, c_ptr, stride_cn, stride_ck,
                             w_ptr, stride_wn, y_ptr, stride_yn, HAS_ADDEND, HAS_DGE, DGE_INV_K, DGE_POW, DGE_CLAMP)
    else:
        out = tl.join(acc_even, acc_odd).reshape(BLOCK_N, 2 * BLOCK_KH) * inv_sg[:, None]
        offs_k = pid_k * 2 * BLOCK_KH + tl.arange(0, 2 * BLOCK_KH)
        y_ptrs = y_ptr + offs_n.to(tl.int64)[:, None] * stride_yn + offs_k[None, :]
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & (offs_k < K)[None, :])


@triton.jit
def _wgrad_epilogue_half(acc, inv_sg, sw, offs_n, n_ok, col, K, c_ptr, stride_cn, stride_ck, w_ptr, stride_wn,
                         y_ptr, stride_yn, HAS_ADDEND: tl.constexpr, HAS_DGE: tl.constexpr,
                         DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr, DGE_CLAMP: tl.constexpr):
    """``(acc / s_g + addend) * f'(W s_w)`` for the output columns ``col`` (every other one)."""
    mask = n_ok[:, None] & (col < K)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    out = acc * inv_sg[:, None]
    if HAS_ADDEND:
        out += tl.load(c_ptr + rows * stride_cn + col.to(tl.int64)[None, :] * stride_ck, mask=mask,
                       other=0.0).to(tl.float32)
    if HAS_DGE:
        w = tl.load(w_ptr + rows * stride_wn + col[None, :], mask=mask, other=0.0)
        out = out * dge_factor(w.to(tl.float32) * sw[:, None], DGE_INV_K, DGE_POW, DGE_CLAMP)
    tl.store(y_ptr + rows * stride_yn + col[None, :], out.to(y_ptr.dtype.element_ty), mask=mask)


def triton_fp4_wgrad(
    g: torch.Tensor,
    g_scale: torch.Tensor,
    a_packed: torch.Tensor,
    k: int,
    out_dtype: torch.dtype = torch.float32,
    dge_weight: torch.Tensor | None = None,
    dge_weight_scale: torch.Tensor | None = None,
    dge_k: float = 5.0,
    dge_clamp: float = 3.0,
    addend: torch.Tensor | None = None,
    *,
    fast_accum: bool | None = None,
    path: str | None = None,
) -> torch.Tensor:
    """Weight gradient ``dW = (G2^T A_q) / s_g2[:, None] + addend``, times ``f'(W s_w)`` with DGE -> (N, k).

    ``g`` (M, N): dY with A's scales folded in, FP8 E5M2/E4M3 (or bf16/fp16), one fp32
    scale per *column* in ``g_scale`` (N,); ``a_packed`` (M, ceil(k/2)) the forward's
    packed activation codes. With ``dge_weight`` (N, k) and ``dge_weight_scale`` (N,)
    the DGE derivative (``dge_k``, ``dge_clamp``) multiplies the result element-wise.
    ``addend`` (N, k, any float dtype and strides; e.g. OCC's compensation term
    ``(R^T dY)^T``) is added in the epilogue before the DGE factor. ``fast_accum`` and
    ``path`` as in ``fp4_gemm``.
    """
    a_packed = check_packed("a_packed", a_packed, k)
    g, g_t, g_scale = _check_wgrad_grad(g, g_scale, a_packed.shape[0])
    n = g.shape[1]
    check_out_dtype(out_dtype)
    if dge_weight is not None:
        dge_weight, dge_weight_scale = _check_dge(dge_weight, dge_weight_scale, n, k, dge_k, dge_clamp)
    _check_addend(addend, n, k)
    check_same_device(g=g, g_scale=g_scale, a_packed=a_packed, dge_weight=dge_weight,
                      dge_weight_scale=dge_weight_scale, addend=addend)
    if _path(path, g.device, g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)) == "expand":
        a8t = triton_expand_fp4(a_packed, k, g.dtype, transpose=True)  # (k, M): tokens, the reduction, contiguous
        g2t = g.t() if g_t else g.t().contiguous()  # (N, M), tokens contiguous
        return triton_fp8_gemm(g2t, a8t, out_dtype, row_scale=g_scale, row_reciprocal=True, addend=addend,
                               dge_weight=dge_weight, dge_weight_scale=dge_weight_scale, dge_k=dge_k,
                               dge_clamp=dge_clamp, precise_acc=precise_accumulation(fast_accum))
    return _launch_wgrad(g, g_t, g_scale, a_packed, k, out_dtype, dge_weight, dge_weight_scale, dge_k, dge_clamp,
                         addend, precise_accumulation(fast_accum))


def _check_wgrad_grad(g, g_scale, m: int) -> tuple[torch.Tensor, bool, torch.Tensor]:
    """``(g, g_t, g_scale)`` checked: dY (M, N) and one fp32 scale per column; ``g_t``: dY is
    column-major (what ``quantize_fp8(dim=0, column_major=True)`` writes), used as it is."""
    g_t = isinstance(g, torch.Tensor) and g.dim() == 2 and g.shape[0] > 1 and g.stride(0) == 1
    if g_t:
        g_scale = _check_grad(g.t(), g_scale, g.shape[1], "one fp32 scale per column of dY")[1]
    else:
        g, g_scale = _check_grad(g, g_scale, g.shape[1], "one fp32 scale per column of dY")
    if g.shape[0] != m:
        raise ValueError(f"g has {g.shape[0]} rows but a_packed has {m} (tokens); wgrad reduces over tokens")
    return g, g_t, g_scale


def _check_dge(dge_weight, dge_weight_scale, n: int, k: int, dge_k: float,
               dge_clamp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The DGE operands of a wgrad epilogue, checked: W (n, k) and its per-row fp32 FP4 scale."""
    dge_weight = check_rows("dge_weight", dge_weight, FLOAT_DTYPES, "the high-precision weight W, N x K")
    if tuple(dge_weight.shape) != (n, k):
        raise ValueError(f"dge_weight must have shape ({n}, {k}) = (columns of g, k), "
                         f"got {tuple(dge_weight.shape)}")
    if dge_weight_scale is None:
        raise ValueError("dge_weight_scale (W's per-row FP4 scale) is required with dge_weight")
    dge_weight_scale = check_vector("dge_weight_scale", dge_weight_scale, n, (torch.float32,),
                                    "W's per-row fp32 FP4 scale")
    if not dge_k > 1.0:
        raise ValueError(f"dge_k must be > 1 (the paper uses 5), got {dge_k}")
    if not dge_clamp > 0:
        raise ValueError(f"dge_clamp must be positive (the paper uses 3), got {dge_clamp}")
    return dge_weight, dge_weight_scale


def _check_addend(addend, n: int, k: int) -> None:
    if addend is not None:
        if not isinstance(addend, torch.Tensor) or tuple(addend.shape) != (n, k) or addend.dtype not in FLOAT_DTYPES:
            raise ValueError(f"addend must be a float32/bf16/fp16 tensor of shape ({n}, {k}), got "
                             f"{tuple(addend.shape) if isinstance(addend, torch.Tensor) else type(addend).__name__}"
                             f"{' ' + str(addend.dtype) if isinstance(addend, torch.Tensor) else ''}")


def _launch_wgrad(g, g_t: bool, g_scale, a_packed, k: int, out_dtype: torch.dtype, dge_weight, dge_weight_scale,
                  dge_k: float, dge_clamp: float, addend, precise_acc: bool) -> torch.Tensor:
    """Allocate dW (N, k) and launch ``_fp4_wgrad_kernel`` on checked operands (the decode path)."""
    m, kh = a_packed.shape
    n = g.shape[1]
    y = torch.empty(n, k, dtype=out_dtype, device=g.device)
    grid = lambda META: (triton.cdiv(n, META["BLOCK_N"]) * triton.cdiv(kh, META["BLOCK_KH"]),)  # noqa: E731
    has_dge, has_add = dge_weight is not None, addend is not None
    g = _loadable_grad(g)
    dot = _grad_dot_mode(g)
    _fp4_wgrad_kernel[grid](
        g, a_packed, g_scale, dge_weight if has_dge else g_scale, dge_weight_scale if has_dge else g_scale,
        addend if has_add else g_scale, y,
        m, m_bucket(m), n, k, kh, g.stride(0), g.stride(1), a_packed.stride(0),
        dge_weight.stride(0) if has_dge else 0,
        addend.stride(0) if has_add else 0, addend.stride(1) if has_add else 0, y.stride(0),
        DOT=dot, PRECISE_ACC=precise_acc, UNSCALE=_unscale(dot), G_T=g_t, HAS_ADDEND=has_add,
        TWO_PHASE=out_dtype == torch.float32, EPI_N=16, HAS_DGE=has_dge,
        DGE_INV_K=1.0 / float(dge_k), DGE_POW=1.0 / float(dge_k) - 1.0, DGE_CLAMP=float(dge_clamp),
    )
    return y
