"""Triton quantizers of the block-scaled recipes (NVFP4, MXFP4): every layout and rounding the
block layer (``fp4lightning/nn/block_linear.py``) needs, with no host synchronisation.

Twins of ``fp4lightning/numerics/block_formats.py`` (its docstring describes the formats): the
same codes, block scales, global scale and stochastic draws, bit for bit, for any input. Two
kernels per operand at most:

* ``_block_stats_kernel`` - one pass over the tensor that leaves, per program, the amax (NaN if
  the program saw a NaN) and the exact int64 sum of the raw bits (the checksum that seeds
  stochastic rounding). Needed for NVFP4's per-tensor scale ``amax / (448 * 6)`` and for a seed
  derived on the device; each partial is a few bytes, and the quantizer reduces them itself, so
  neither a finishing kernel nor a copy to the host follows.
* ``_block_quant_kernel`` - scales, rounds (to nearest, or stochastically with the reference's
  counter-based uniforms: ``hash_uniform`` of the element's index in the zero-padded row-major
  tensor and a seed) and packs, writing the codes and the block scales in the reference's
  layout. It reads its input through two strides, so a transposed operand (``W^T``, ``dY^T``,
  ``A^T`` for the weight-gradient GeMM) is quantized in place of a copy. NVFP4's 16 x 16 weight
  tiles reduce their amax over 16 rows of the program's tile.

The seed of a stochastic operand is either a 0-dim int64 tensor (``sr_seed`` of a generator, as
on CPU) or derived inside the kernel from the stats' checksum and a base integer, the bits of
``block_formats.sr_seed_from_checksum``.

Rounding is exact integer/fp32 arithmetic (``_common.minifloat_bits``), never an in-kernel float
downcast; every division that the reference performs is an IEEE division (``div_rn``), and NaN
is carried by explicit ``where`` (``tl.minimum`` / ``tl.maximum`` may drop it when compiled).
Tested bitwise against the reference under ``TRITON_INTERPRET=1`` (``tests/test_block_kernels.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4lightning.numerics.block_formats import BLOCK_SIZES, MXFP4_SR_PRESCALE, BlockFP4

from ._common import E2M1_MAX_C, E8M0_BIAS_C, F8E4M3_MAX_C, F8E4M3_MIN_NORMAL_C, F32_MIN_NORMAL_C, INTERPRET, \
    minifloat_bits, sign_bit
from .block import e4m3_value

__all__ = ["triton_block_stats", "triton_quantize_block"]

#: programs of the stats pass: enough to fill an H200 (132 SMs) twice; each quantizer program
#: reads all partials (12 bytes each), so they stay few
STATS_PROGRAMS = 256
#: programs of the quantizer (each loops over tiles): a few waves of an H200
QUANT_PROGRAMS = 1056
#: warps per program of both kernels (32 x 128 tiles): at 4 the stochastic NVFP4 quantizer needs 254
#: registers a thread on sm_90a (ahead-of-time compile, triton 3.7.1), at 8 at most 128, no spills
_WARPS = 8
_M63 = (1 << 63) - 1
_NVFP4_DENOM = 448.0 * 6.0  # block_formats.NVFP4_GLOBAL_DENOM
_SR_PRESCALE_C = tl.constexpr(MXFP4_SR_PRESCALE)  # 0.75


# --------------------------------------------------------------------------- stats pass
@triton.jit
def _block_stats_kernel(x_ptr, amax_ptr, sum_ptr,  # pointers
                        M, K,  # sizes
                        stride_xm, stride_xk,  # strides
                        INT16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid, progs = tl.program_id(0), tl.num_programs(0)
    n_tk = tl.cdiv(K, BLOCK_K)
    amax = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    nan = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    bits = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int64)
    # --- tiles pid, pid + progs, ...: running amax, NaN flag and bit sum
    for t in range(pid, tl.cdiv(M, BLOCK_M) * n_tk, progs):
        rows = (t // n_tk) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % n_tk) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :].to(tl.int64) * stride_xk,
                    mask=mask, other=0.0)
        xf = x.to(tl.float32)
        amax = tl.maximum(amax, tl.where(xf == xf, tl.abs(xf), 0.0))
        nan = nan | (xf != xf).to(tl.int32)
        if INT16:  # bf16 / fp16: the sum of the int16 bit patterns, sign-extended
            bits += x.to(tl.int16, bitcast=True).to(tl.int64)
        else:
            bits += x.to(tl.int32, bitcast=True).to(tl.int64)
    # --- one partial per program
    any_nan = tl.max(tl.max(nan, axis=1), axis=0) > 0
    tl.store(amax_ptr + pid, tl.where(any_nan, float("nan"), tl.max(tl.max(amax, axis=1), axis=0)))
    tl.store(sum_ptr + pid, tl.sum(tl.sum(bits, axis=1), axis=0))


@triton.jit
def _tensor_stats(amax_ptr, sum_ptr, P, PMAX: tl.constexpr):
    """(amax, any NaN, bit sum) of the whole tensor from the stats pass' ``P`` partials."""
    offs = tl.arange(0, PMAX)
    am = tl.load(amax_ptr + offs, mask=offs < P, other=0.0)
    any_nan = tl.max((am != am).to(tl.int32), axis=0) > 0
    amax = tl.max(tl.where(am == am, am, 0.0), axis=0)
    total = tl.sum(tl.load(sum_ptr + offs, mask=offs < P, other=0), axis=0)
    return amax, any_nan, total


# --------------------------------------------------------------------------- random bits
@triton.jit
def _lowbias32(x):
    """Wellons' lowbias32 hash of uint32 ``x`` (wrapping uint32 arithmetic)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _seed_from_checksum(total, base):
    """``block_formats.sr_seed_from_checksum``: uint32 seed of ``(base + total) mod 2^63``."""
    s = total + base  # int64, wrapping; the mod 2^63 only clears bit 63, i.e. bit 31 of the high word
    lo = s.to(tl.uint32)
    hi = (s >> 32).to(tl.uint32) & 0x7FFFFFFF
    return _lowbias32(lo ^ _lowbias32(hi ^ tl.full(hi.shape, 0x9E3779B1, tl.uint32)))


@triton.jit
def _uniform(index, seed):
    """``block_formats.hash_uniform``: fp32 in [0, 1) from the int64 element index and uint32 seed."""
    x = _lowbias32(index.to(tl.uint32) ^ seed)
    return (x >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24


# --------------------------------------------------------------------------- quantizer
@triton.jit
def _block_amax(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr, TILE2D: tl.constexpr):
    """Per block: amax of ``x`` (BLOCK_M, BLOCK_K), NaN where the block holds a NaN. Shape (BLOCK_M, NB),
    or (BLOCK_M // 16, NB) with 16 x 16 tiles."""
    NB: tl.constexpr = BLOCK_K // B
    ax = tl.reshape(tl.where(x == x, tl.abs(x), 0.0), (BLOCK_M, NB, B))
    isnan = tl.reshape((x != x).to(tl.int32), (BLOCK_M, NB, B))
    bmax, bnan = tl.max(ax, axis=2), tl.max(isnan, axis=2)
    if TILE2D:
        bmax = tl.max(tl.reshape(bmax, (BLOCK_M // 16, 16, NB)), axis=1)
        bnan = tl.max(tl.reshape(bnan, (BLOCK_M // 16, 16, NB)), axis=1)
    return tl.where(bnan > 0, float("nan"), bmax)


@triton.jit
def _to_elements(s, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, B: tl.constexpr, TILE2D: tl.constexpr):
    """A per-block value (``_block_amax``'s shape) broadcast to every element (BLOCK_M, BLOCK_K)."""
    NB: tl.constexpr = BLOCK_K // B
    if TILE2D:
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_M // 16, 16, NB)), (BLOCK_M, NB))
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_M, NB, B)), (BLOCK_M, BLOCK_K))


@triton.jit
def _nv_scales(bmax, g):
    """NVFP4: E4M3 bits of ``(bmax / 6) / g`` clamped to [2^-6, 448], and the encode factor
    ``(1 / g) / scale``. Where the scale is NaN (a NaN in the block, or inf / inf when the tensor
    holds an inf) its E4M3 NaN keeps the fp32 NaN's sign bit (0x7F / 0xFF), as torch's cast does."""
    s = tl.math.div_rn(tl.math.div_rn(bmax, E2M1_MAX_C), g)
    s_nan = s != s
    sc = tl.where(s < F8E4M3_MIN_NORMAL_C, F8E4M3_MIN_NORMAL_C, tl.where(s > F8E4M3_MAX_C, F8E4M3_MAX_C, s))
    bits = tl.where(s_nan, 0x7F | (sign_bit(s) << 7), minifloat_bits(tl.where(s_nan, 1.0, sc), 3, -6))
    one = tl.full(bmax.shape, 1.0, tl.float32)
    return bits, tl.math.div_rn(tl.math.div_rn(one, g), tl.where(s_nan, s, e4m3_value(bits)))


@triton.jit
def _mx_scales(bmax):
    """MXFP4: biased E8M0 exponent ``floor(log2 bmax) - 2`` (255 where bmax is NaN) and its fp32 value."""
    e = ((bmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - E8M0_BIAS_C - 2  # 2 = log2 of E2M1's top power of 2
    biased = tl.minimum(tl.maximum(e, -E8M0_BIAS_C), E8M0_BIAS_C + 1) + E8M0_BIAS_C
    biased = tl.where(bmax != bmax, 255, biased)
    return biased, tl.maximum((biased << 23).to(tl.float32, bitcast=True), F32_MIN_NORMAL_C)  # 255: inf


@triton.jit
def _e2m1_codes(y, index, seed, SR: tl.constexpr):
    """4-bit codes of fp32 ``y`` (already in [-6, 6] or NaN): the E2M1 neighbour nearest (ties to even)
    or, stochastically, the upper one with probability the distance from the lower one over the step."""
    a = tl.abs(y)
    if SR:
        step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
        t = tl.math.div_rn(a, step)
        lo = tl.floor(t)
        a = (lo + tl.where(_uniform(index, seed) < t - lo, 1.0, 0.0)) * step  # on the grid: exact
    mag = minifloat_bits(tl.where(a == a, a, 0.0), 1, 0)  # NaN -> code 0, its sign kept
    return mag | (sign_bit(y) << 3)


@triton.jit
def _block_quant_kernel(
    x_ptr, q_ptr, s_ptr, g_ptr, amax_ptr, sum_ptr, seed_ptr,  # pointers
    M, K, KP, P, seed_base,  # sizes (KP: K padded to the block), stats partials, seed base
    stride_xm, stride_xk, stride_qm, stride_sm,  # strides
    B: tl.constexpr, NV: tl.constexpr, TILE2D: tl.constexpr, SR: tl.constexpr, G_MODE: tl.constexpr,
    SEED_MODE: tl.constexpr, PMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # G_MODE: 0 no global scale (MXFP4), 1 from the stats partials (written to g_ptr), 2 read from g_ptr
    # SEED_MODE: 0 none, 1 read the int64 seed at seed_ptr, 2 derived from the stats' checksum and seed_base
    pid, progs = tl.program_id(0), tl.num_programs(0)
    # --- tensor-wide values: NVFP4's global scale, the stochastic-rounding seed
    g = 1.0
    seed = tl.full((), 0, tl.uint32)
    if G_MODE == 1 or SEED_MODE == 2:
        amax, any_nan, total = _tensor_stats(amax_ptr, sum_ptr, P, PMAX)
        if G_MODE == 1:
            g = tl.math.div_rn(amax, 2688.0)  # 448 * 6
            g = tl.where((g > 0) & (not any_nan), g, 1.0)  # a NaN or all-zero tensor: 1
            if pid == 0:
                tl.store(g_ptr, g)
        if SEED_MODE == 2:
            seed = _seed_from_checksum(total, seed_base)
    if G_MODE == 2:
        g = tl.load(g_ptr)
    if SEED_MODE == 1:
        seed = tl.load(seed_ptr).to(tl.uint32)
    NB: tl.constexpr = BLOCK_K // B
    n_tk = tl.cdiv(KP, BLOCK_K)
    for t in range(pid, tl.cdiv(M, BLOCK_M) * n_tk, progs):
        # --- load a (BLOCK_M, BLOCK_K) tile, zeros beyond K (the reference's padding)
        tm, tk = t // n_tk, t % n_tk
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tk * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :].to(tl.int64) * stride_xk,
                    mask=(rows < M)[:, None] & (cols < K)[None, :], other=0.0).to(tl.float32)
        # --- block scales and the scaled values
        bmax = _block_amax(x, BLOCK_M, BLOCK_K, B, TILE2D)
        if NV:
            sbits, recip = _nv_scales(bmax, g)
            # factor first: of two NaN operands the reference's product keeps the second's (the
            # factor's), the interpreter's the first's (on a GPU every NaN result is the same)
            y = _to_elements(recip, BLOCK_M, BLOCK_K, B, TILE2D) * x
        else:
            sbits, scale = _mx_scales(bmax)
            y = tl.math.div_rn(x, _to_elements(scale, BLOCK_M, BLOCK_K, B, TILE2D))
            if SR:
                y = y * _SR_PRESCALE_C
        y = tl.where(y > E2M1_MAX_C, E2M1_MAX_C, tl.where(y < -E2M1_MAX_C, -E2M1_MAX_C, y))  # NaN stays
        # --- codes (index: the element's place in the zero-padded row-major tensor), packed in pairs
        index = rows[:, None].to(tl.int64) * KP + cols[None, :]
        code = _e2m1_codes(y, index, seed, SR)
        lo, hi = tl.split(tl.reshape(code, (BLOCK_M, BLOCK_K // 2, 2)))
        bcols = tk * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_qm + bcols[None, :], (lo | (hi << 4)).to(tl.uint8),
                 mask=(rows < M)[:, None] & (bcols < KP // 2)[None, :])
        # --- block scales: one row per row, or per 16 rows with tiles
        kb = tk * NB + tl.arange(0, NB)
        if TILE2D:
            srows = tm * (BLOCK_M // 16) + tl.arange(0, BLOCK_M // 16)
            smask = (srows < tl.cdiv(M, 16))[:, None] & (kb < KP // B)[None, :]
        else:
            srows = rows
            smask = (rows < M)[:, None] & (kb < KP // B)[None, :]
        tl.store(s_ptr + srows[:, None].to(tl.int64) * stride_sm + kb[None, :], sbits.to(tl.uint8), mask=smask)


# --------------------------------------------------------------------------- wrappers
def _check(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name}: expected a 2-D floating-point tensor, got {tuple(x.shape)} {x.dtype}")
    if x.numel() == 0:
        raise ValueError(f"{name}: empty input {tuple(x.shape)}: nothing to quantize")
    if not INTERPRET and x.device.type != "cuda":
        raise RuntimeError(f"{name}: Triton needs a CUDA tensor (or TRITON_INTERPRET=1 set before import)")
    return x.float() if x.dtype == torch.float64 else x  # the reference's checksum of fp64: its fp32 bits


def triton_block_stats(x: torch.Tensor, programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-program partials of 2-D ``x`` (any strides): fp32 amax (NaN where a NaN was seen) and the
    int64 sum of the raw bits (the element-size integers; fp64 is read as fp32). One launch."""
    x = _check(x, "block_stats")
    m, k = x.shape
    block_m, block_k = (16, 64) if INTERPRET else (32, 128)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(k, block_k)
    p = max(1, min(tiles, programs or STATS_PROGRAMS))
    amax = torch.empty(p, dtype=torch.float32, device=x.device)
    bits = torch.empty(p, dtype=torch.int64, device=x.device)
    _block_stats_kernel[(p,)](x, amax, bits, m, k, x.stride(0), x.stride(1), INT16=x.element_size() == 2,
                              BLOCK_M=block_m, BLOCK_K=block_k, num_warps=_WARPS)
    return amax, bits


def triton_quantize_block(x: torch.Tensor, fmt: str, rounding: str = "nearest", block_2d: bool = False, *,
                          seed: torch.Tensor | None = None, seed_base: int | None = None,
                          stats: tuple[torch.Tensor, torch.Tensor] | None = None,
                          global_scale: torch.Tensor | None = None, programs: int | None = None) -> BlockFP4:
    """``block_formats.quantize_block(x, fmt, rounding, block_2d=block_2d, seed=...)`` of 2-D ``x`` (any
    strides, e.g. a transposed view), bit for bit, with the tensor-wide values found on the device.

    Stochastic rounding takes ``seed`` (0-dim int64, as ``quantize_block``) or ``seed_base`` (the seed
    is then ``sr_seed_from_checksum(seed_base, checksum of x)``, computed in the kernel). ``stats``:
    ``triton_block_stats(x)`` when the caller has it (the same tensor, or its transpose); else it is
    computed when needed (NVFP4's global scale, a derived seed). ``global_scale``: NVFP4's 0-dim fp32
    scale of this tensor, when known. Launches: the quantizer, plus the stats pass if it is needed
    and not given.
    """
    if fmt not in BLOCK_SIZES:
        raise ValueError(f"quantize_block: unknown block format {fmt!r}; choose one of {tuple(BLOCK_SIZES)}")
    if block_2d and fmt != "nvfp4":
        raise ValueError("quantize_block: 2-D weight blocks are defined for NVFP4 (16x16) only")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"quantize_block: rounding={rounding!r} is not 'nearest' or 'stochastic'")
    sr = rounding == "stochastic"
    if sr and (seed is None) == (seed_base is None):
        raise ValueError("quantize_block: stochastic rounding takes exactly one of seed= and seed_base=")
    x = _check(x, "quantize_block")
    b, nv = BLOCK_SIZES[fmt], fmt == "nvfp4"
    m, k = x.shape
    kp = triton.cdiv(k, b) * b
    g_mode = 0 if not nv else (2 if global_scale is not None else 1)
    seed_mode = 0 if not sr else (1 if seed is not None else 2)
    if stats is None and (g_mode == 1 or seed_mode == 2):
        stats = triton_block_stats(x)
    dev = x.device
    q = torch.empty(m, kp // 2, dtype=torch.uint8, device=dev)
    s = torch.empty(triton.cdiv(m, 16) if block_2d else m, kp // b, dtype=torch.uint8, device=dev)
    g = global_scale.reshape(1).to(torch.float32) if g_mode == 2 else torch.empty(1, dtype=torch.float32, device=dev)
    amax, bits = stats if stats is not None else (g, g)  # unread without stats
    block_m, block_k = (16, 64) if INTERPRET else (32, 128)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(kp, block_k)
    _block_quant_kernel[(max(1, min(tiles, programs or QUANT_PROGRAMS)),)](
        x, q, s, g, amax, bits, seed if seed is not None else g,
        m, k, kp, amax.numel(), (seed_base or 0) & _M63,
        x.stride(0), x.stride(1), q.stride(0), s.stride(0),
        B=b, NV=nv, TILE2D=block_2d, SR=sr, G_MODE=g_mode, SEED_MODE=seed_mode,
        PMAX=triton.next_power_of_2(amax.numel()), BLOCK_M=block_m, BLOCK_K=block_k, num_warps=_WARPS)
    if nv:
        return BlockFP4(q, s.view(torch.float8_e4m3fn), g.reshape(()), "nvfp4", block_2d, (m, k))
    return BlockFP4(q, s, None, "mxfp4", False, (m, k), 1.0 / MXFP4_SR_PRESCALE if sr else 1.0)
