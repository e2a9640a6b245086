"""Absmax scaling into FP4 with a chosen granularity (arXiv 2501.17116, section 3.1).

``scale = 6 / amax`` over each scaling group, ``q = round_e2m1(x * scale)``, and the
dequantized value is ``q / scale``. Granularity follows the GeMM ``Y = A W^T`` so the
scales factor out of the product and can be applied in the epilogue:

* ``per_token``   - one scale per row of a (tokens x features) activation;
* ``per_channel`` - one scale per output channel, i.e. per row of W (out x in);
* ``per_tensor``  - one scale for everything (an ablation; worse for activations).

Both per-token and per-channel are "one scale per row of a row-major 2-D tensor", so
a single row-wise quantizer serves both. Scales are always returned one per row
(per-tensor repeats the same value) which keeps every GeMM's epilogue identical.

``scale_mode="pow2"`` rounds the scale down to a power of two (the released code's
choice); ``"float"`` (the default, the paper's research code) keeps it exact.
The scale arithmetic is pinned to fp32 so that the PyTorch reference and the Triton
kernel produce bit-identical codes and scales.

Non-finite input: a row containing NaN or +/-inf gets a NaN scale, so every element
of that row dequantizes to NaN (NaN in, NaN out). The 4-bit codes of such a row are
meaningless. Dynamic loss scaling relies on this to see overflow.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fp4lightning.numerics.constants import AMAX_EPS, E2M1_MAX
from fp4lightning.numerics.formats import decode_e2m1, decode_packed_fp4, unpack_fp4
from fp4lightning.numerics.cpu_fused import fp4_rows, scale_from_amax

__all__ = [
    "Granularity",
    "ScaleMode",
    "QuantizedFP4",
    "compute_scale",
    "quantize",
    "quantize_rows_reference",
    "dequantize",
    "fake_quantize",
]

Granularity = Literal["per_token", "per_channel", "per_tensor"]
ScaleMode = Literal["float", "pow2"]
GRANULARITIES = ("per_token", "per_channel", "per_tensor")
SCALE_MODES = ("float", "pow2")



@dataclass
class QuantizedFP4:
    """FP4 codes plus their fp32 per-row scales.

    ``codes`` is uint8, either one code per element (shape ``(M, K)``) or packed two
    per byte (shape ``(M, ceil(K/2))``); ``scale`` is fp32 of shape ``(M,)``;
    ``shape`` is the original shape (leading dims are flattened into M).
    """

    codes: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    packed: bool

    @property
    def k(self) -> int:
        return self.shape[-1]

    def unpacked_codes(self) -> torch.Tensor:
        return unpack_fp4(self.codes, self.k) if self.packed else self.codes

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale.numel() * 4


def compute_scale(amax: torch.Tensor, scale_mode: ScaleMode = "float") -> torch.Tensor:
    """fp32 scale ``6 / amax`` (or its power-of-two floor) with NaN for non-finite amax."""
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; choose one of {SCALE_MODES}")
    return scale_from_amax(amax.float(), E2M1_MAX, AMAX_EPS, scale_mode == "pow2")


def quantize_rows_reference(
    x2d: torch.Tensor,
    scale_mode: ScaleMode = "float",
    per_tensor: bool = False,
    packed: bool = True,
    return_values: bool = False,
    values_dtype: torch.dtype = torch.float32,
):
    """Row-wise FP4 quantization of a 2-D tensor: the reference for the Triton kernel.

    Returns ``(codes, scale)`` or, with ``return_values=True``, ``(codes, scale, q)``
    where ``q`` (on the E2M1 grid, in ``values_dtype``) saves callers from decoding the
    codes again. The passes run fused (``fp4lightning.numerics.cpu_fused``).
    """
    if x2d.dim() != 2:
        raise ValueError(f"quantize_rows_reference expects a 2-D tensor, got shape {tuple(x2d.shape)}")
    if x2d.dtype == torch.float64:
        x2d = x2d.float()  # the spec is fp32 arithmetic (bit-exact twin of the Triton kernel)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; choose one of {SCALE_MODES}")
    k = x2d.shape[1]
    if k % 2:  # a zero column changes no amax and packs as the zero padding code
        x2d = torch.nn.functional.pad(x2d, (0, 1))
    codes, scale, q, _ = fp4_rows(x2d, AMAX_EPS, scale_mode == "pow2", per_tensor, values_dtype)
    if k % 2:
        q = q[:, :k]
    if not packed:
        codes = unpack_fp4(codes, k)
    return (codes, scale, q) if return_values else (codes, scale)


def _as_rows(x: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, bool]:
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {GRANULARITIES}")
    if x.dim() == 0:
        raise ValueError("cannot quantize a 0-d tensor; give it at least one dimension")
    return x.reshape(-1, x.shape[-1]), granularity == "per_tensor"


def quantize(
    x: torch.Tensor,
    granularity: Granularity = "per_token",
    scale_mode: ScaleMode = "float",
    packed: bool = True,
) -> QuantizedFP4:
    """Quantize ``x`` to FP4 with absmax scaling along its last dimension.

    ``per_token`` and ``per_channel`` both give one scale per row of ``x`` viewed as
    ``(-1, x.shape[-1])``: pass activations as (tokens, features) and weights as
    (out, in). ``per_tensor`` uses one scale for all elements.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    rows, per_tensor = _as_rows(x, granularity)
    codes, scale = quantize_rows_reference(rows, scale_mode, per_tensor=per_tensor, packed=packed)
    return QuantizedFP4(codes, scale, x.shape, packed)


def dequantize(q: QuantizedFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(codes) / scale`` in fp32, cast to ``dtype``, with the original shape."""
    vals = decode_packed_fp4(q.codes, q.k) if q.packed else decode_e2m1(q.codes, torch.float32)
    return (vals / q.scale[:, None]).to(dtype).reshape(q.shape)


def fake_quantize(
    x: torch.Tensor, granularity: Granularity = "per_token", scale_mode: ScaleMode = "float"
) -> torch.Tensor:
    """Quantize and dequantize in one go (no gradient logic), keeping ``x``'s dtype."""
    rows, per_tensor = _as_rows(x, granularity)
    _, scale, q = quantize_rows_reference(rows, scale_mode, per_tensor=per_tensor, packed=False, return_values=True)
    return (q / scale[:, None]).to(x.dtype).reshape(x.shape)
