"""The FP4 E2M1 number format and its FP8 companions (arXiv 2501.17116, section 3.1).

E2M1 has 1 sign bit, 2 exponent bits and 1 mantissa bit. Its eight magnitudes are
0, 0.5, 1, 1.5, 2, 3, 4, 6; there is no inf and no NaN. A 4-bit *code* is
``sign << 3 | index`` where ``index`` points into ``E2M1_VALUES``; two codes are
packed per byte (element ``2j`` in the low nibble, ``2j + 1`` in the high nibble).

Rounding is round-to-nearest with ties to the *even mantissa* (the OCP-MX / IEEE
rule, also TransformerEngine's reference): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The authors' released CUDA table rounds
ties up instead (2.5 -> 3, 5 -> 6); we follow the OCP rule on purpose. Magnitudes
beyond 6 saturate to 6; NaN stays NaN in ``round_to_e2m1``.

Every E2M1 value is exact in FP8 E4M3, bf16 and fp16, which is how the GeMMs run
on hardware without FP4 tensor cores.
"""
from __future__ import annotations

import torch

from fp4lightning.numerics.constants import E2M1_MAX, E2M1_VALUES, F32_EXPONENT_MASK, F8E4M3_MAX, F8E5M2_MAX

__all__ = [
    "round_to_e2m1",
    "encode_e2m1",
    "decode_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "decode_packed_fp4",
    "cast_to_fp8",
    "saturating_cast_",
    "pow2_floor",
    "e2m1_index",
    "e2m1_magnitude",
    "round_to_e5m2",
]

_LUT_CACHE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Signed value of each of the 16 codes (code 8 is -0.0)."""
    key = (device, dtype)
    if key not in _LUT_CACHE:
        mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
        _LUT_CACHE[key] = torch.cat([mags, -mags]).to(device=device, dtype=dtype)
    return _LUT_CACHE[key]


def e2m1_index(a: torch.Tensor) -> torch.Tensor:
    """Index 0..7 (as a float of ``a``'s dtype) of the nearest E2M1 magnitude to ``a = |x|``:
    the magnitude bits of the E2M1 code (``.to(torch.uint8)`` them; the fused CPU passes keep
    them in float until the last cast because integer passes do not vectorize there).

    Rounding by arithmetic: the grid has step 0.5 below 2, step 1 on [2, 4) and step 2
    from 4, so ``round`` (half to even) of ``2a``, ``a`` or ``a/2`` lands on the grid, and
    the even integer it picks on a tie is the even mantissa (0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Every operation is exact in any
    binary float format (scaling by powers of two, rounding to an integer, adding a small
    integer), so the result equals the exact table bit for bit. +inf saturates to 7;
    NaN must be removed by the caller.
    """
    return torch.where(a < 2.0, torch.round(a * 2.0),
                       torch.where(a < 4.0, torch.round(a) + 2.0, torch.round(a * 0.5) + 4.0)).clamp_(max=7.0)


def e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude to ``a = |x|`` in ``a``'s dtype, ties to even (see ``e2m1_index``);
    NaN stays NaN, +inf saturates to 6."""
    return torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                       torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0)).clamp_(max=E2M1_MAX)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` to the nearest E2M1 value (ties to even mantissa), saturating at +/-6.

    Returns a tensor of ``x``'s dtype whose values all lie on the E2M1 grid. The
    decision is made in ``x``'s own precision (float64 stays float64: no double rounding
    through fp32; bf16/fp16 widen to fp32 exactly). NaN propagates; +/-inf saturate to
    +/-6 (callers that must reject inf check first).
    """
    if not x.is_floating_point():
        raise TypeError(f"round_to_e2m1 expects a floating-point tensor, got {x.dtype}")
    xf = x if x.dtype == torch.float64 else x.float()
    return torch.copysign(e2m1_magnitude(xf.abs()), xf).to(x.dtype)


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Encode ``x`` (already scaled into E2M1 range) as 4-bit codes in a uint8 tensor.

    Negative zero and negative values that round to zero keep the sign bit (code 8),
    mirroring IEEE behaviour. NaN has no E2M1 encoding: it raises ``ValueError``.
    """
    if not x.is_floating_point():
        raise TypeError(f"encode_e2m1 expects a floating-point tensor, got {x.dtype}")
    xf = x if x.dtype == torch.float64 else x.float()
    if torch.isnan(xf).any():
        raise ValueError("encode_e2m1: input contains NaN, which E2M1 cannot represent; check the input for NaN first")
    idx = e2m1_index(xf.abs()).to(torch.uint8)
    sign = torch.signbit(xf).view(torch.uint8) << 3
    return idx | sign


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode uint8 4-bit codes (one per element, values 0..15) to ``dtype``."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"decode_e2m1 expects uint8 codes, got {codes.dtype}")
    # index_select with int32 indices is ~10x faster on CPU than advanced indexing
    flat = torch.index_select(_lut(codes.device, dtype), 0, codes.reshape(-1).int())
    return flat.reshape(codes.shape)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes two per byte along the last dimension.

    Element ``2j`` goes to the low nibble of byte ``j``, element ``2j+1`` to the high
    nibble. An odd last dimension is padded with a zero code, so ``unpack_fp4``
    needs the original length back. Codes must be < 16.
    """
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    k = codes.shape[-1]
    if k % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    # one fused-ish pass: lo + 16 * hi (no & needed: codes are 4-bit)
    return torch.add(pairs[..., 0], pairs[..., 1], alpha=16)


def unpack_fp4(packed: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Inverse of ``pack_fp4``: uint8 bytes -> one code per element, last dim ``k``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 expects uint8 bytes, got {packed.dtype}")
    full = 2 * packed.shape[-1]
    if k is None:
        k = full
    if not (full - 1 <= k <= full):
        raise ValueError(f"unpack_fp4: {packed.shape[-1]} bytes hold {full - 1} or {full} codes, not k={k}")
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], full)
    return out[..., :k] if k != full else out


def decode_packed_fp4(packed: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode_e2m1(unpack_fp4(packed, k), dtype)`` in one table look-up per byte.

    A 256 x 2 table maps each byte to its two values, so decoding is one gather
    instead of an unpack (several integer passes) and a gather.
    """
    if packed.dtype != torch.uint8:
        raise TypeError(f"decode_packed_fp4 expects uint8 bytes, got {packed.dtype}")
    key = (packed.device, dtype, "pairs")
    if key not in _LUT_CACHE:
        lut = _lut(packed.device, torch.float32)
        b = torch.arange(256, device=packed.device)
        _LUT_CACHE[key] = torch.stack((lut[b & 0xF], lut[b >> 4]), dim=1).to(dtype)  # (256, 2)
    table = _LUT_CACHE[key]
    word = {2: torch.int32, 4: torch.int64}.get(table.element_size())
    if word is not None:
        # each byte's two values as one 4- or 8-byte word: a gather of scalars, ~3.5x faster
        # on CPU than gathering rows of two (same bits; little-endian puts code 0 first, and
        # every torch device is little-endian)
        pairs = torch.index_select(table.view(word).reshape(256), 0, packed.reshape(-1).int()).view(dtype)
    else:
        pairs = torch.index_select(table, 0, packed.reshape(-1).int())
    out = pairs.reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    full = out.shape[-1]
    if not (full - 1 <= k <= full):
        raise ValueError(f"decode_packed_fp4: {packed.shape[-1]} bytes hold {full - 1} or {full} codes, not k={k}")
    return out if k == full else out[..., :k]


def round_to_e5m2(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` (finite, |y| <= 57344) rounded to the nearest FP8 E5M2 value, ties to even,
    returned in fp32: the values of ``y.to(torch.float8_e5m2)``, bit for bit (-0.0 included;
    ``tests/test_formats.py``). What the fused CPU pass of the FP8 dY cast computes
    (``cpu_fused.fp8_scaled``).

    ``p``, the largest power of two <= |y| but at least 2^-14 (the E5M2 subnormal step is then
    p / 4 = 2^-16, so one formula covers both ranges), comes from five compare-and-double steps;
    ``round(y * 4 / p) * (p / 4)`` then rounds to 2 mantissa bits, ties to even, exactly
    (every factor is a power of two). Float operations only: compiled, Inductor turns them into
    vector code, where a reinterpretation of the fp32 bits becomes a scalar loop, and the FP8
    cast itself does not vectorize.
    """
    a = y.abs()
    p = torch.full_like(a, 2.0**-14)
    for step in (16, 8, 4, 2, 1):  # finds p in [2^-14, 2^17): |y| <= 57344 < 2^16
        up = p * float(2**step)
        p = torch.where(a >= up, up, p)
    return torch.round(y * (4.0 / p)) * (p * 0.25)


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 x)`` of a positive normal fp32 / fp64 ``x``, exactly: keep the exponent
    bits, zero the mantissa (``log2`` can round up just below a power of two; masking cannot).

    The one power-of-two scale of the package (``scale_mode="pow2"`` of the FP4 quantizer,
    the per-tensor FP8 scales of the gradient all-reduce). 0 maps to 0, +inf and NaN to +inf.
    """
    if x.dtype == torch.float32:
        return (x.view(torch.int32) & F32_EXPONENT_MASK).view(torch.float32)
    if x.dtype == torch.float64:
        return (x.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)  # fp64 exponent bits
    raise TypeError(f"pow2_floor expects an fp32 or fp64 tensor, got {x.dtype}")


def cast_to_fp8(x: torch.Tensor, fmt: str = "e5m2") -> torch.Tensor:
    """Saturating round-to-nearest-even cast to FP8 (``e4m3`` or ``e5m2``).

    torch's plain ``.to(float8)`` overflows to inf/NaN past the max; we clamp first
    so an amax-scaled tensor never produces inf. NaN stays NaN.
    """
    if fmt == "e4m3":
        dtype, fmax = torch.float8_e4m3fn, F8E4M3_MAX
    elif fmt == "e5m2":
        dtype, fmax = torch.float8_e5m2, F8E5M2_MAX
    else:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose 'e4m3' or 'e5m2'")
    return x.clamp(-fmax, fmax).to(dtype)


def saturating_cast_(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``cast_to_fp8`` into a preallocated ``out`` of any float dtype (FP8, fp16, ...), without
    allocating: clamps ``x`` *in place* to ``out``'s finite range, then copies (round to nearest
    even). NaN stays NaN. Returns ``out``. The one saturating cast of the package: the FP8
    gradient all-reduce (``comm``, ``fsdp``) and the FP8/fp16 optimizer moments (``optim``) use it.
    """
    fmax = torch.finfo(out.dtype).max
    return out.copy_(x.clamp_(-fmax, fmax))
