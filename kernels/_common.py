"""Shared pieces of the FP4 Triton kernels: mode flags, E2M1/FP8 bit arithmetic, input checks.

The E2M1 format (arXiv 2501.17116, section 3.1; docs/method.md section 1) is a minifloat
with 1 mantissa bit and exponent bias 1, so every E2M1 value is exact in FP8 E4M3,
FP8 E5M2, fp16 and bf16. The kernels therefore never convert *values* between float
types: decoding builds the target type's bit pattern with integer arithmetic, and
encoding rounds with exact fp32 arithmetic and emits integer codes. That keeps the
kernels bit-identical to the PyTorch reference and sidesteps the Triton interpreter's
inexact in-kernel fp8 downcasts (docs/kernels.md, "Known interpreter bugs").
"""
from __future__ import annotations

if __name__ != "fp4lightning.kernels._common":  # see kernels/__init__.py
    raise ImportError(f"the kernels/ folder is the package 'fp4lightning.kernels'; import it as "
                      f"'fp4lightning.kernels' (e.g. `from fp4lightning.kernels import gemm`), not as {__name__!r}")

import os

import torch
import triton
import triton.language as tl

from fp4lightning.numerics.constants import (AMAX_EPS, E2M1_MAX, E8M0_BIAS, F8E4M3_MAX, F8E4M3_MIN_NORMAL, F32_MAX,
                                    F32_MIN_NORMAL, FP8_AMAX_EPS)

#: Kernels run under the Triton interpreter (CPU tensors) when this is set before import.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Which operand type a GeMM feeds to ``tl.dot`` (a constexpr of every GeMM kernel).
DOT_FP8E4 = 0  # FP8 E4M3 tensor cores (Hopper+): forward GeMM, and backward with an E4M3 dY
DOT_FP8E5 = 1  # FP8 E5M2 tensor cores: backward with an E5M2 dY (codes decoded to E5M2)
DOT_FP16 = 2  # fp16 tensor cores: GPUs without FP8 MMA, fp16 dY
DOT_BF16 = 3  # bf16 tensor cores: bf16 dY on a GPU
DOT_FP32 = 4  # interpreter only: its bf16 tl.dot returns garbage (docs/kernels.md), so upcast

#: Hopper's FP8 MMA accumulates in reduced precision. By default each tl.dot's partial
#: sum is promoted into the fp32 accumulator (``max_num_imprecise_acc`` = the dot's K),
#: as DeepSeek-V3 and TransformerEngine do; FP4LIGHTNING_FP8_FAST_ACCUM=1 trades that
#: for speed.
FP8_FAST_ACCUM = os.environ.get("FP4LIGHTNING_FP8_FAST_ACCUM", "0") == "1"


def gemm_path() -> str:
    """FP4LIGHTNING_GEMM_PATH (read at each launch): how the FP4 GeMMs reach the FP8 tensor
    cores, ``decode`` (default: codes decoded in the GeMM loop, kernels/gemm.py) or ``expand``
    (a bandwidth-bound kernel writes FP8 copies first, then a plain FP8 GeMM, kernels/fp8_gemm.py)."""
    return os.environ.get("FP4LIGHTNING_GEMM_PATH", "decode")

#: FP4LIGHTNING_AUTOTUNE=0 keeps only the default GeMM config of the GPU's family.
AUTOTUNE = os.environ.get("FP4LIGHTNING_AUTOTUNE", "1") != "0"


INTERPRET_C = tl.constexpr(INTERPRET)

# fp4lightning.numerics.constants as compile-time constants of the kernels (a jit function may only read
# globals that are tl.constexpr)
E2M1_MAX_C = tl.constexpr(E2M1_MAX)  # 6.0
AMAX_EPS_C = tl.constexpr(AMAX_EPS)  # 2^-124
FP8_AMAX_EPS_C = tl.constexpr(FP8_AMAX_EPS)  # 2^-110
F8E4M3_MAX_C = tl.constexpr(F8E4M3_MAX)  # 448.0
F8E4M3_MIN_NORMAL_C = tl.constexpr(F8E4M3_MIN_NORMAL)  # 2^-6
F32_MIN_NORMAL_C = tl.constexpr(F32_MIN_NORMAL)  # 2^-126
F32_MAX_C = tl.constexpr(F32_MAX)  # 3.4028234663852886e38: |x| <= it  <=>  x finite
E8M0_BIAS_C = tl.constexpr(E8M0_BIAS)  # 127


def has_fp8_mma(device: torch.device) -> bool:
    """FP8 tensor cores reachable from ``tl.dot``: Hopper (sm_90) and newer."""
    if INTERPRET or device.type != "cuda":
        return INTERPRET  # the interpreter's fp8 tl.dot is exact (docs/kernels.md): test that path
    return torch.cuda.get_device_capability(device) >= (9, 0)


# --------------------------------------------------------------------------- bit arithmetic
@triton.jit
def minifloat_bits(a, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Magnitude bits (int32) of the minifloat nearest to ``a >= 0`` (fp32), ties to even.

    ``MANT`` mantissa bits, ``EMIN`` the smallest normal exponent (= 1 - bias). The
    caller clamps ``a`` to the format's maximum first (saturation) and keeps NaN out.
    Both branches are exact IEEE arithmetic, so the result is bit-identical to
    round-to-nearest-even (and to ``fp4lightning.numerics.formats.e2m1_index`` for E2M1,
    MANT=1, EMIN=0, which gives the code index 0..7):

    * ``a >= 2^EMIN`` (normal): round the fp32 bit pattern to MANT mantissa bits in
      integer arithmetic (add half an ulp of the target minus one, plus the kept lowest
      bit, then drop the low bits; a carry moves into the exponent field as it should),
      then re-bias the exponent: ``(e_fp32 << MANT | m) - ((126 + EMIN) << MANT)``;
    * ``a < 2^EMIN`` (the target's subnormals, multiples of 2^(EMIN - MANT)): scale by
      2^(MANT - EMIN) (exact) and add 2^23, which rounds to an integer with ties to even
      in one fp32 addition; the integer is the low bits of the sum's pattern.

    About half the instructions of the earlier exponent / floor formulation per element
    (kernels/compile_check.py counts the quantizers' SASS), which is what bounds the
    quantizers' throughput on a GPU.
    """
    b = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MANT
    HALF_ULP: tl.constexpr = (1 << (SHIFT - 1)) - 1
    REBIAS: tl.constexpr = (126 + EMIN) << MANT
    normal = ((b + HALF_ULP + ((b >> SHIFT) & 1)) >> SHIFT) - REBIAS
    SUB_SCALE: tl.constexpr = 2.0 ** (MANT - EMIN)
    sub = (a * SUB_SCALE + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    MIN_NORMAL: tl.constexpr = 2.0 ** EMIN
    return tl.where(a < MIN_NORMAL, sub, normal)


@triton.jit
def sign_bit(y):
    """1 where the fp32 sign bit is set (negative numbers and -0.0), else 0 (int32)."""
    return (y.to(tl.int32, bitcast=True) >> 31) & 1


@triton.jit
def e2m1_bits(c, MANT: tl.constexpr, HALF: tl.constexpr, SIGN: tl.constexpr):
    """4-bit E2M1 codes -> the bit patterns (int32) of their exact values in a float type with
    ``MANT`` mantissa bits, ``HALF`` the bits of 0.5 there and the sign at bit ``SIGN``
    (E4M3: 3, 0x30, 7; E5M2: 2, 0x38, 7; fp16: 10, 0x3800, 15; bf16: 7, 0x3F00, 15;
    fp32: 23, 0x3F000000, 31). Integer arithmetic only: no float conversion can round."""
    # Index i >= 2 is the normal 1.m x 2^(e-1) with e = i >> 1, m = i & 1, so in a
    # target type with MANT mantissa bits its bits are (i << (MANT - 1)) + bits(0.5);
    # i == 1 is E2M1's only subnormal, 0.5.
    c = c.to(tl.int32)
    i = c & 7
    mag = tl.where(i >= 2, (i << (MANT - 1)) + HALF, tl.where(i == 1, HALF, 0))
    return mag | ((c & 8) << (SIGN - 3))


@triton.jit
def decode_e2m1_dot(c, DOT: tl.constexpr):
    """4-bit E2M1 codes (uint8 nibbles, 0..15) -> values in the dot operand type ``DOT`` (the
    in-register twin of ``fp4lightning.numerics.formats.decode_e2m1``)."""
    if DOT == 0:  # DOT_FP8E4
        out = e2m1_bits(c, 3, 0x30, 7).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    elif DOT == 1:  # DOT_FP8E5
        out = e2m1_bits(c, 2, 0x38, 7).to(tl.uint8).to(tl.float8e5, bitcast=True)
    elif DOT == 2:  # DOT_FP16
        out = e2m1_bits(c, 10, 0x3800, 15).to(tl.uint16).to(tl.float16, bitcast=True)
    elif DOT == 3:  # DOT_BF16
        out = e2m1_bits(c, 7, 0x3F00, 15).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:  # DOT_FP32: fp16 -> fp32 upcasts are exact
        out = e2m1_bits(c, 10, 0x3800, 15).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return out


# --- FP8 decode without per-code work (issue: instruction-bound GeMM loops).
# With i = e1 e0 m the 3 magnitude bits of an E2M1 code, the FP8 byte
#   E4M3: s | i << 2        (exponent field e1 e0, top mantissa bit m)
#   E5M2: s | i << 1
# is the E2M1 value times 2^-6 (E4M3) or 2^-14 (E5M2): one uniform power of two for
# normals and for E2M1's subnormal 0.5 alike (both formats hold it as a subnormal). So a
# 32-bit register of four packed bytes becomes four FP8 low-nibble values and four
# high-nibble values with a handful of shift / and / or instructions (SWAR), and the
# power of two is folded into the epilogue (exact). Measured from the SASS with
# kernels/compile_check.py against the per-code decode (decode_e2m1_dot above), which
# costs about ten instructions per code. The alternative, FP8 copies of the operands
# (twice the bytes, transposed copies for the backward GeMMs since FP8 wgmma wants K-major
# operands), is the ``expand`` path of kernels/fp8_gemm.py; which is faster is measured by
# benchmarks/bench_kernels.py on a GPU.
#: log2 of the factor that undoes the decode's scaling, per FP8 dot type
FP8_DECODE_SHIFT = {DOT_FP8E4: 6, DOT_FP8E5: 14}

_PAIR_ASM = {
    DOT_FP8E4: """{
    .reg .b32 t0, t1, t2, t3;
    shl.b32 t0, $2, 4;
    and.b32 t0, t0, 0x80808080;
    shl.b32 t1, $2, 2;
    and.b32 t1, t1, 0x1C1C1C1C;
    and.b32 t2, $2, 0x80808080;
    shr.b32 t3, $2, 2;
    and.b32 t3, t3, 0x1C1C1C1C;
    or.b32 $0, t0, t1;
    or.b32 $1, t2, t3;
    }""",
    DOT_FP8E5: """{
    .reg .b32 t0, t1, t2, t3;
    shl.b32 t0, $2, 4;
    and.b32 t0, t0, 0x80808080;
    shl.b32 t1, $2, 1;
    and.b32 t1, t1, 0x0E0E0E0E;
    and.b32 t2, $2, 0x80808080;
    shr.b32 t3, $2, 3;
    and.b32 t3, t3, 0x0E0E0E0E;
    or.b32 $0, t0, t1;
    or.b32 $1, t2, t3;
    }""",
}


_PAIR_ASM_E4M3 = tl.constexpr(_PAIR_ASM[DOT_FP8E4])
_PAIR_ASM_E5M2 = tl.constexpr(_PAIR_ASM[DOT_FP8E5])


@triton.jit
def _pair_bits_e4m3_asm(b):
    return tl.inline_asm_elementwise(_PAIR_ASM_E4M3, "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8), is_pure=True,
                                     pack=4)


@triton.jit
def _pair_bits_e5m2_asm(b):
    return tl.inline_asm_elementwise(_PAIR_ASM_E5M2, "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8), is_pure=True,
                                     pack=4)


@triton.jit
def _pair_bits_bytes(b, DOT: tl.constexpr):
    # the same bit formula one byte at a time (the interpreter cannot run PTX)
    c = b.to(tl.int32)
    if DOT == 0:
        lo = ((c << 4) & 0x80) | ((c << 2) & 0x1C)
        hi = (c & 0x80) | ((c >> 2) & 0x1C)
    else:
        lo = ((c << 4) & 0x80) | ((c << 1) & 0x0E)
        hi = (c & 0x80) | ((c >> 3) & 0x0E)
    return lo.to(tl.uint8), hi.to(tl.uint8)


@triton.jit
def decode_e2m1_pair_fp8(b, DOT: tl.constexpr):
    """Packed E2M1 bytes (uint8) -> (low-nibble, high-nibble) FP8 values of dot type
    ``DOT`` (E4M3 or E5M2), each times 2^-FP8_DECODE_SHIFT[DOT] (exact)."""
    if INTERPRET_C:
        lo, hi = _pair_bits_bytes(b, DOT)
    elif DOT == 0:
        lo, hi = _pair_bits_e4m3_asm(b)
    else:
        lo, hi = _pair_bits_e5m2_asm(b)
    if DOT == 0:
        out = lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)
    else:
        out = lo.to(tl.float8e5, bitcast=True), hi.to(tl.float8e5, bitcast=True)
    return out


@triton.jit
def as_dot_operand(g, DOT: tl.constexpr):
    """Bring a loaded high-precision operand (FP8 / bf16 / fp16) to the dot type ``DOT``."""
    if DOT == 2:
        g = g.to(tl.float16)  # FP8 on a GPU without FP8 MMA: every FP8 value is exact in fp16
    elif DOT == 4:
        g = g.to(tl.float32)
    return g


@triton.jit
def mma(x, y, acc, DOT: tl.constexpr, PRECISE_ACC: tl.constexpr):
    """``acc += x @ y`` with fp32 accumulation; FP8 partial sums promoted when PRECISE_ACC."""
    if INTERPRET_C and DOT <= 1:
        # The interpreter widens FP8 dot operands to fp16 with a conversion that garbles
        # E5M2 subnormals (triton 3.7 interpreter.py _convert_float), which the decoded
        # E2M1 0.5 is (2^-15); its fp8 -> fp32 casts are exact, and so is an fp32 dot here.
        acc = tl.dot(x.to(tl.float32), y.to(tl.float32), acc)
    elif DOT <= 1 and PRECISE_ACC:
        acc = tl.dot(x, y, acc, max_num_imprecise_acc=x.shape[1])
    else:
        acc = tl.dot(x, y, acc)
    return acc


@triton.jit
def tile_ids(pid, num_r, num_c, GROUP: tl.constexpr):
    """(row, column) tile of program ``pid``, visiting GROUP row-tiles per column sweep.

    Consecutive programs then share operand tiles in L2 (Triton matmul tutorial).
    """
    width = GROUP * num_c
    first = (pid // width) * GROUP
    size = tl.minimum(num_r - first, GROUP)
    return first + ((pid % width) % size), (pid % width) // size


# --------------------------------------------------------------------------- shared by the GeMMs
# (the decode path, kernels/gemm.py, and the expand path, kernels/fp8_gemm.py)
def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (the 16-byte row strides of the FP8 operands)."""
    return (x + m - 1) // m * m


def m_bucket(m: int) -> int:
    """The autotune key of a token count (``M_BUCKET``): the next power of two (at least 16), so a
    new batch size does not re-tune."""
    return max(16, triton.next_power_of_2(m))


def precise_accumulation(fast_accum: bool | None) -> bool:
    """PRECISE_ACC of a launch: promote FP8 partial sums unless fast accumulation is asked for.

    ``fast_accum=None`` follows FP4LIGHTNING_FP8_FAST_ACCUM (default off). Only FP8 dots
    are affected (Hopper's FP8 MMA accumulates in reduced precision, see ``mma``).
    """
    return not (FP8_FAST_ACCUM if fast_accum is None else fast_accum)


@triton.jit
def dge_factor(x, INV_K: tl.constexpr, POW: tl.constexpr, CLAMP: tl.constexpr):
    """DGE derivative f'(x) of fp32 scaled weights (arXiv 2501.17116, section 3.2): the device
    function of every wgrad epilogue and of ``gemm.triton_dge_factor``.

    The interval is taken from the magnitude after the quantizer's saturation,
    ``a = min(|x|, 6)``: ``W * s_w`` rounded in fp32 lands just above 6 for each row's
    largest weight (0.37 * (6 / 0.37) = 6.0000005), and that weight quantizes to 6, a
    grid point, so its derivative is exactly 1/k - never 0. Same formula as
    ``fp4lightning.numerics.dge.dge_derivative``; NaN and +/-inf get 0.
    """
    a = tl.minimum(tl.abs(x), E2M1_MAX_C)
    # interval width delta on the E2M1 grid: 0.5 / 1 / 2; powers of two, so * 1/delta is exact
    inv_delta = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    delta = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    left = tl.floor(a * inv_delta) * delta
    t = tl.abs(2.0 * (a - left) * inv_delta - 1.0)
    # t^POW with POW < 0; t == 0 (an interval mid-point) is +inf, which the clamp caps;
    # t == 1 (a grid point) is exactly 1 (log2(1) = 0), so f' = 1/k exactly there
    safe = tl.where(t > 0.0, t, 1.0)
    d = INV_K * tl.where(t > 0.0, tl.exp2(POW * tl.log2(safe)), float("inf"))
    d = tl.minimum(d, CLAMP)
    return tl.where(tl.abs(x) <= 3.4028234663852886e38, d, 0.0)  # NaN and +/-inf: 0, as the reference


@triton.jit
def finish_tile(y_ptr, stride_y, c_ptr, stride_cr, stride_cc, w_ptr, stride_w, sw_ptr, rows, cols, r_ok, col_ok,
                HAS_ADDEND: tl.constexpr, HAS_DGE: tl.constexpr, DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr,
                DGE_CLAMP: tl.constexpr):
    """A wgrad epilogue on the fp32 output at ``rows`` x ``cols``, in place: add the addend C,
    multiply by the DGE factor f'(W s_w). The one copy of that math for the GeMM kernels' chunked
    second phase (``finish_rows_in_chunks``) and the stand-alone epilogue kernel behind
    ``_scaled_mm`` (``scaled_mm._wgrad_finish_kernel``)."""
    mask = r_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)[:, None]
    ptrs = y_ptr + r64 * stride_y + cols[None, :]
    v = tl.load(ptrs, mask=mask, other=0.0)
    if HAS_ADDEND:
        v += tl.load(c_ptr + r64 * stride_cr + cols.to(tl.int64)[None, :] * stride_cc, mask=mask,
                     other=0.0).to(tl.float32)
    if HAS_DGE:
        sw = tl.load(sw_ptr + rows, mask=r_ok, other=1.0)
        w = tl.load(w_ptr + r64 * stride_w + cols[None, :], mask=mask, other=0.0)
        v = v * dge_factor(w.to(tl.float32) * sw[:, None], DGE_INV_K, DGE_POW, DGE_CLAMP)
    tl.store(ptrs, v, mask=mask)


@triton.jit
def finish_rows_in_chunks(y_ptr, stride_y, c_ptr, stride_cr, stride_cc, w_ptr, stride_w, sw_ptr, row0, R, cols,
                          col_ok, BLOCK_R: tl.constexpr, EPI: tl.constexpr, HAS_ADDEND: tl.constexpr,
                          HAS_DGE: tl.constexpr, DGE_INV_K: tl.constexpr, DGE_POW: tl.constexpr,
                          DGE_CLAMP: tl.constexpr):
    """Second phase of a wgrad epilogue on an fp32 output tile already stored at rows
    ``row0 ..`` (R rows in all) and columns ``cols``: re-read it in chunks of EPI rows and finish
    each (``finish_tile``). Chunked because the DGE math on a whole tile holds several tile-sized
    temporaries and spills (compile_check)."""
    tl.debug_barrier()  # the block's own stores are visible to all its threads
    for r0 in tl.static_range(0, BLOCK_R, EPI):
        rows = row0 + r0 + tl.arange(0, EPI)
        finish_tile(y_ptr, stride_y, c_ptr, stride_cr, stride_cc, w_ptr, stride_w, sw_ptr, rows, cols, rows < R,
                    col_ok, HAS_ADDEND, HAS_DGE, DGE_INV_K, DGE_POW, DGE_CLAMP)


# --------------------------------------------------------------------------- input checks
def check_device(name: str, t: torch.Tensor) -> None:
    if INTERPRET:
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, but TRITON_INTERPRET=1 runs the kernels on CPU tensors; "
                             "move it to the CPU or unset TRITON_INTERPRET on a GPU machine")
    elif t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: the compiled Triton kernels need CUDA tensors "
                         "(on CPU use FP4LIGHTNING_BACKEND=reference, or TRITON_INTERPRET=1 to test the kernels)")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    for n, t in items:
        check_device(n, t)
    dev0 = items[0][1].device
    for n, t in items[1:]:
        if t.device != dev0:
            raise ValueError(f"{n} is on {t.device} but {items[0][0]} is on {dev0}; put all operands on one device")


def check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], what: str) -> torch.Tensor:
    """Check a 2-D tensor of an allowed dtype; return it with contiguous rows.

    The kernels take any row stride but need unit stride along a row (16-byte vector
    loads). Other layouts (``x.t()``, ``x[:, ::2]``, a gradient of ``y.t()``) are copied
    once here, as ``nn.Linear`` accepts them too.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D ({what}), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {names} ({what})")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); the kernels need at least one element")
    if t.shape[1] > 1 and t.stride(1) != 1:
        t = t.contiguous()
    return t


def check_vector(name: str, t: torch.Tensor, n: int, dtypes: tuple[torch.dtype, ...], what: str) -> torch.Tensor:
    """Check a 1-D tensor of ``n`` elements; return it contiguous (copied if strided)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},) ({what}), got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {dtypes[0]} ({what})")
    if n > 1 and t.stride(0) != 1:
        t = t.contiguous()
    return t


def check_packed(name: str, t: torch.Tensor, k: int) -> torch.Tensor:
    """Packed FP4 codes: uint8 (rows, ceil(k/2)), two codes per byte along K (returned row-contiguous)."""
    t = check_rows(name, t, (torch.uint8,), "packed FP4 codes, two per byte along K")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int (the unpacked reduction length), got {k!r}")
    if t.shape[1] != (k + 1) // 2:
        raise ValueError(f"{name} has {t.shape[1]} bytes per row, but k={k} needs {(k + 1) // 2} "
                         "(two FP4 codes per byte; an odd k is padded with a zero code)")
    return t


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_DTYPES = FLOAT_DTYPES


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported; "
                        "choose torch.float32, torch.bfloat16 or torch.float16")
