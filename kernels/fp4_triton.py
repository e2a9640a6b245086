"""Triton backend of ``fp4lightning.ops``: the FP4 quantizer, the FP8 dY quantizer, three GeMMs.

This module is what ``fp4lightning.ops`` imports when the backend is ``triton``
(FP4LIGHTNING_BACKEND; default on CUDA). Each function is the kernel twin of a
PyTorch reference (arXiv 2501.17116, sections 3.1-3.3; docs/method.md sections 1-3):

* ``quantize_rows`` - ``fp4lightning.quantize.quantize_rows``: bit-identical codes and scales;
* ``quantize_rows_clamped`` - ``occ_clamp`` then ``quantize_rows`` (OCC fused, section 3.3):
  bit-identical codes, scales and residual;
* ``quantize_fp8`` - ``fp4lightning.ops.quantize_fp8_reference``: bit-identical;
* ``fp4_gemm`` / ``fp4_dgrad`` / ``fp4_wgrad`` (DGE fused) - ``fp4lightning.ops.fp4_*_reference``:
  the same math with fp32 accumulation (bit-identical fp32 output where the reference
  also accumulates exactly).

On CPU the kernels run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set
before this module is imported (that is how the tests exercise them); see docs/kernels.md.
"""
from ._common import INTERPRET, has_fp8_mma
from .gemm import GRAD_DTYPES, dge_factor, fp4_dgrad, fp4_gemm, fp4_wgrad
from .quantize import quantize_fp8, quantize_rows, quantize_rows_clamped

__all__ = [
    "quantize_rows",
    "quantize_rows_clamped",
    "quantize_fp8",
    "fp4_gemm",
    "fp4_dgrad",
    "fp4_wgrad",
    "dge_factor",
    "GRAD_DTYPES",
    "INTERPRET",
    "has_fp8_mma",
]
