"""Triton backend of ``fp4lightning.ops.gemm``: the FP4 quantizer, the FP8 dY quantizer, three GeMMs.

This module is what ``fp4lightning.ops.gemm`` imports when the backend is ``triton``
(FP4LIGHTNING_BACKEND; the default on CUDA GPUs without FP8 tensor cores), and for the quantizers
of the ``scaled_mm`` backend (the default on sm_89+, ``kernels/scaled_mm.py``). Each function is the kernel twin of a
PyTorch reference (arXiv 2501.17116, sections 3.1-3.3; docs/method.md sections 1-3):

* ``triton_quantize_rows`` - ``fp4lightning.numerics.absmax.quantize_rows_reference``: bit-identical codes and scales;
* ``triton_quantize_rows_clamped`` - ``occ_clamp`` then ``quantize_rows_reference`` (OCC fused, section 3.3):
  bit-identical codes, scales and residual;
* ``triton_quantize_rows_folded`` - ``fp4lightning.ops.gemm.quantize_fp4_folded`` (OCC folded into an
  E4M3 operand, ``FP4Config.occ_fold_e4m3``): bit-identical, with ``triton_folded_gemm`` /
  ``triton_folded_wgrad`` its two FP8 GeMMs;
* ``triton_quantize_fp8`` - ``fp4lightning.ops.gemm.quantize_fp8_reference``: bit-identical;
* ``triton_fp4_gemm`` / ``triton_fp4_dgrad`` / ``triton_fp4_wgrad`` (DGE fused) - ``fp4lightning.ops.gemm.fp4_*_reference``:
  the same math with fp32 accumulation (bit-identical fp32 output where the reference
  also accumulates exactly).

On CPU the kernels run under the Triton interpreter when ``TRITON_INTERPRET=1`` is set
before this module is imported (that is how the tests exercise them); see docs/kernels.md.
"""
from ._common import INTERPRET, has_fp8_mma
from .gemm import GRAD_DTYPES, triton_dge_factor, triton_fp4_dgrad, triton_fp4_gemm, triton_fp4_wgrad
from .fp8_gemm import triton_folded_gemm, triton_folded_wgrad
from .quantize import (triton_quantize_fp8, triton_quantize_rows, triton_quantize_rows_clamped,
                       triton_quantize_rows_folded)

__all__ = [
    "triton_quantize_rows",
    "triton_quantize_rows_clamped",
    "triton_quantize_rows_folded",
    "triton_quantize_fp8",
    "triton_fp4_gemm",
    "triton_fp4_dgrad",
    "triton_fp4_wgrad",
    "triton_folded_gemm",
    "triton_folded_wgrad",
    "triton_dge_factor",
    "GRAD_DTYPES",
    "INTERPRET",
    "has_fp8_mma",
]
