"""Triton backend of ``fp4lightning.ops``: the FP4 quantizer, the FP8 dY quantizer, three GeMMs.

This module is what ``fp4lightning.ops`` imports when the backend is ``triton``
(FP4LIGHTNING_BACKEND; default on CUDA). Each function is the kernel twin of a
PyTorch reference (arXiv 2501.17116, sections 3.1-3.3; METHOD.md sections 1-3):

=================  ==============================================  =====================
kernel             reference                                        agreement
=================  ==============================================  =====================
quantize_rows      fp4lightning.quantize.quantize_rows               bit-identical
quantize_fp8       fp4lightning.ops.quantize_fp8_reference           bit-identical
fp4_gemm           fp4lightning.ops.fp4_gemm_reference               same math, fp32 acc
fp4_dgrad          fp4lightning.ops.fp4_dgrad_reference              same math, fp32 acc
fp4_wgrad          fp4lightning.ops.fp4_wgrad_reference (+ DGE)      same math, fp32 acc
=================  ==============================================  =====================

On CPU the kernels run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set
before this module is imported (that is how the tests exercise them); see docs/kernels.md.
"""
from ._common import INTERPRET, has_fp8_mma
from .gemm import GRAD_DTYPES, fp4_dgrad, fp4_gemm, fp4_wgrad
from .quantize import quantize_fp8, quantize_rows

__all__ = [
    "quantize_rows",
    "quantize_fp8",
    "fp4_gemm",
    "fp4_dgrad",
    "fp4_wgrad",
    "GRAD_DTYPES",
    "INTERPRET",
    "has_fp8_mma",
]
