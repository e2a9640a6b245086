"""Numeric constants of the FP4 / FP8 formats, one home for every literal (as torchao's
``mx_formats/constants.py``).

E2M1 (arXiv 2501.17116, section 3.1): 1 sign, 2 exponent, 1 mantissa bit; magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf, no NaN. FP8 E4M3 (``float8_e4m3fn``) and E5M2 are the
OCP FP8 formats torch implements. Each value is written out in its comment so the
constant can be checked without running anything. Plain Python floats: the Triton
kernels use them as compile-time constants too.
"""
from __future__ import annotations

__all__ = [
    "E2M1_MAX",
    "E2M1_MAX_POW2",
    "E2M1_VALUES",
    "F8E4M3_MAX",
    "F8E4M3_MIN_NORMAL",
    "F8E4M3_MANT_BITS",
    "F8E4M3_EMIN",
    "E4M3_FOLD_MAX_SHIFT",
    "F8E5M2_MAX",
    "F8E5M2_MIN_NORMAL",
    "F8E5M2_MANT_BITS",
    "F8E5M2_EMIN",
    "F16_MAX",
    "F32_MAX",
    "F32_EXPONENT_MASK",
    "F32_MIN_NORMAL",
    "E8M0_BIAS",
    "E8M0_NAN",
    "AMAX_EPS",
    "FP8_AMAX_EPS",
]

# --- E2M1 (FP4)
E2M1_MAX = 6.0  # largest E2M1 magnitude: 6.0
E2M1_MAX_POW2 = 2  # the largest power of two in E2M1 is 4 = 2**2
#: The eight non-negative E2M1 magnitudes, indexed by the 3 low bits of a code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# --- FP8 E4M3 (torch.float8_e4m3fn)
F8E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max = 448.0
F8E4M3_MIN_NORMAL = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny = 0.015625
F8E4M3_MANT_BITS = 3  # mantissa bits
F8E4M3_EMIN = -6  # exponent of the smallest normal
#: OCC's E4M3 fold (fp4lightning.numerics.occ.fold_e4m3) shifts a row down by at most 2^-8: every E2M1 value
#: times 2^-8 is still exact in E4M3 (the smallest, 0.5 x 2^-8, is E4M3's smallest subnormal 2^-9)
E4M3_FOLD_MAX_SHIFT = 8

# --- FP8 E5M2 (torch.float8_e5m2)
F8E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max = 57344.0
F8E5M2_MIN_NORMAL = 2.0**-14  # torch.finfo(torch.float8_e5m2).tiny = 6.103515625e-05
F8E5M2_MANT_BITS = 2  # mantissa bits
F8E5M2_EMIN = -14  # exponent of the smallest normal

# --- fp16 / fp32
F16_MAX = 65504.0  # torch.finfo(torch.float16).max = 65504.0
F32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: |x| <= F32_MAX  <=>  x finite (NaN compares false)
F32_EXPONENT_MASK = 0x7F800000  # the 8 exponent bits of an fp32: x & mask = 2^floor(log2 x) for normal x > 0

F32_MIN_NORMAL = 2.0**-126  # smallest normal fp32 ~ 1.1754943508222875e-38

# --- E8M0 (the MXFP4 block scale)
E8M0_BIAS = 127  # E8M0 stores exponent + 127
E8M0_NAN = 255  # the E8M0 NaN code

# --- amax floors
#: FP4 amax floor, 2^-124 ~ 4.70197740328915e-38: the largest power of two below which 6 / amax
#: would overflow fp32. Every row with a normal fp32 amax (>= 2^-126 ~ 1.2e-38) above it is scaled
#: exactly by 6 / amax, however small; an all-zero row gets a finite scale (6 * 2^124) and codes of 0;
#: rows of fp32 subnormals get that same largest scale (their values land below 6).
AMAX_EPS = 2.0**-124
#: FP8 amax floor, 2^-110 ~ 7.7e-34: the largest power of two at which 57344 / amax stays finite in
#: fp32 for both E5M2 (57344 * 2^110 < 2^126) and E4M3; every normal amax above it is scaled exactly.
FP8_AMAX_EPS = 2.0**-110
#: formats of the output gradient dY in the backward GeMMs (FP4Config.grad_format): the paper's FP8
#: E5M2, E4M3, or unquantized bf16
DY_FORMATS = ("e5m2", "e4m3", "bf16")
