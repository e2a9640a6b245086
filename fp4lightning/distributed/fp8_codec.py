"""FP8 on the wire of the gradient exchange (arXiv 2501.17116, section 6; docs/distributed.md).

One encoding for every path that sends gradients in FP8: the DDP communication hooks
(:mod:`fp4lightning.distributed.comm`), FSDP2's ``FP8ReduceScatter`` (:mod:`fp4lightning.distributed.fsdp`)
and the one-device round trip (:mod:`fp4lightning.distributed.grad_comm_sim`), so all three give the same
codes bit for bit. A tensor's scale is the power of two ``2^floor(log2(FP8_MAX / amax))``; the codes of
``x * scale`` travel as ``uint8`` (gloo and NCCL have no float8 collectives); the receiver decodes, sums
the ranks in rank order in fp32 and undoes the scale (a power of two: exact).

The per-element passes (encode, decode-and-sum, mean-and-requantise) are one loop over memory each,
compiled on CPU through :func:`fp4lightning.numerics.cpu_fused.fused_pass` (torch's eager CPU float8 casts
are scalar code) and the same math eagerly elsewhere; both give the same bits (``tests/test_ddp.py``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fp4lightning.numerics.constants import F8E4M3_MAX, F8E5M2_MAX
from fp4lightning.numerics.cpu_fused import fused_pass
from fp4lightning.numerics.formats import pow2_floor

__all__ = ["FP8_FORMATS", "pow2_scales", "tensor_amax", "encode_fp8_into", "decode_sum_into", "mean_requantize_into"]

#: FP8 wire format name -> (torch dtype, largest finite magnitude)
FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, F8E4M3_MAX),  # 448
    "e5m2": (torch.float8_e5m2, F8E5M2_MAX),  # 57344
}

#: a tensor of fewer elements is encoded eagerly (the same bits): on small tensors the encoder's four
#: eager ops cost less than a compiled call's fixed cost (the decoders, a dozen ops, stay compiled)
EAGER_BELOW = 4096

# 2^126 keeps the scale finite in fp32 even for an amax of a few subnormals.
_MAX_SCALE_EXP = 126


def pow2_scales(amax: Tensor, fp8_max: float) -> Tensor:
    """Per-tensor scales: the largest power of two ``s`` with ``amax * s <= fp8_max`` for each element of
    ``amax`` (1 where amax == 0, clamped to ``2^+-126``), fp32. Every rank that holds the same ``amax``
    derives the same scales."""
    a = amax.double()
    s = pow2_floor(fp8_max / a.clamp_min(torch.finfo(torch.float64).tiny))
    s = s.clamp(2.0**-_MAX_SCALE_EXP, 2.0**_MAX_SCALE_EXP)
    # the division can round up onto a power of two just above the true quotient
    s = torch.where(a * s > fp8_max, s * 0.5, s)
    return torch.where(a > 0, s, torch.ones_like(s)).float()


def tensor_amax(seg: Tensor) -> Tensor:
    """``max |seg|`` as a 0-dim fp32 tensor (0 for an empty tensor); inf or NaN when ``seg`` holds one."""
    if seg.numel() == 0:
        return seg.new_zeros((), dtype=torch.float32)
    # aminmax reads the data once without allocating |x|; NaN propagates, unlike in a MAX collective
    lo, hi = torch.aminmax(seg)
    return torch.maximum(hi, lo.neg()).float()


@fused_pass(eager_below=EAGER_BELOW)
def encode_fp8_into(x: Tensor, scale: Tensor, out: Tensor, fmax: float, dtype8: torch.dtype) -> Tensor:
    """``out`` (uint8) <- the FP8 codes of ``x * scale`` in fp32, saturated to +-``fmax``, round to nearest
    even (``saturating_cast_``'s result). ``scale`` is a power of two, so the product is exact."""
    out.copy_((x.float() * scale).clamp(-fmax, fmax).to(dtype8).view(torch.uint8))
    return out


#: FP8 dtype -> (mantissa bits, exponent bias): where :func:`_decode` moves a code's fields
_LAYOUT: dict[torch.dtype, tuple[int, int]] = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


def _decode(codes: Tensor, dtype8: torch.dtype) -> Tensor:
    """fp32 values of finite FP8 ``codes`` (uint8), ``codes.view(dtype8).float()``'s values built from the
    bits: a normal code's exponent and mantissa shifted into fp32's fields and the exponent rebiased, a
    subnormal code (exponent 0) as ``mantissa * 2^(1 - bias - mbits)``, then the sign. Integer and fp32
    operations only, which Inductor vectorizes (its float8 -> fp32 cast is a slower loop: this decodes in
    about half the time); no fp32 subnormal is formed, so flush-to-zero modes cannot change it. Codes of
    inf/NaN never arrive (the encoder saturates)."""
    mbits, bias = _LAYOUT[dtype8]
    c = codes.to(torch.int32)
    mag = c & 0x7F
    normal = ((mag << (23 - mbits)) + ((127 - bias) << 23)).view(torch.float32)
    subnormal = mag.float() * 2.0 ** (1 - bias - mbits)
    v = torch.where(mag >= (1 << mbits), normal, subnormal)
    return torch.where(c >= 0x80, -v, v)


def _decoded_sum(rows: Tensor, mult: Tensor, dtype8: torch.dtype) -> Tensor:
    acc = _decode(rows[0], dtype8) * mult[0]
    for r in range(1, rows.shape[0]):  # rank order, the same on every rank
        acc = acc + _decode(rows[r], dtype8) * mult[r]
    return acc


@fused_pass
def decode_sum_into(rows: Tensor, mult: Tensor, out: Tensor, dtype8: torch.dtype, divisor: int) -> Tensor:
    """``out`` <- ``(sum_r decode(rows[r]) * mult[r]) / divisor`` in fp32, summed in row (rank) order;
    ``rows`` is (R, n) uint8 FP8 codes, ``mult`` (R,) fp32 powers of two (so every product is exact).
    ``out`` may be any float dtype (one rounding into it)."""
    out.copy_(_decoded_sum(rows, mult, dtype8) / divisor)
    return out


@fused_pass
def mean_requantize_into(rows: Tensor, out: Tensor, fmax: float, dtype8: torch.dtype) -> Tensor:
    """``out`` (uint8) <- FP8 codes of the mean over rows of the decoded (R, n) codes ``rows``: fp32 sum
    in row order, divided by R, saturating cast (|mean| <= max |row|, so nothing saturates)."""
    ones = torch.ones(rows.shape[0], dtype=torch.float32, device=rows.device)
    mean = _decoded_sum(rows, ones, dtype8) / rows.shape[0]
    out.copy_(mean.clamp(-fmax, fmax).to(dtype8).view(torch.uint8))
    return out
