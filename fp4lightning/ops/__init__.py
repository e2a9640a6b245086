"""The three GeMMs of an FP4 linear layer: PyTorch references, the vendor's FP8 GeMM (``torch._scaled_mm``)
and the Triton kernels (:mod:`fp4lightning.kernels`), and the choice between them
(:mod:`~fp4lightning.ops.gemm`)."""
