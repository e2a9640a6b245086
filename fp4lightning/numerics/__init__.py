"""Numerics: the FP4/FP8 formats and everything computed on single tensors (arXiv 2501.17116, section 3).

* :mod:`~fp4lightning.numerics.constants` - every literal of the formats;
* :mod:`~fp4lightning.numerics.formats` - E2M1 rounding, codes, packing; FP8 casts;
* :mod:`~fp4lightning.numerics.absmax` - the absmax quantizer (per-token / per-channel / per-tensor);
* :mod:`~fp4lightning.numerics.dge` - the Differentiable Gradient Estimator (section 3.2);
* :mod:`~fp4lightning.numerics.occ` - Outlier Clamping and Compensation (section 3.3);
* :mod:`~fp4lightning.numerics.block_formats`, :mod:`~fp4lightning.numerics.hadamard` - NVFP4 / MXFP4
  and the random Hadamard transform (beyond the paper);
* :mod:`~fp4lightning.numerics.cpu_fused`, :mod:`~fp4lightning.numerics.cpu_bf16` - the CPU path's
  compiled elementwise passes and bf16 GeMM emulation.

Nothing here imports a layer above it (ops, nn, Lightning, the application).
"""
