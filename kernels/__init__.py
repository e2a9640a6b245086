"""Triton kernels of fp4lightning (the FP4 quantizer, the FP8 dY quantizer, the GeMMs, the block formats).

Installed, this folder is ``fp4lightning.kernels`` (pyproject.toml's package-dir). Imported under
another name (``import kernels.gemm`` from the repository root) every kernel module would be a
second copy (separate Triton caches and autotuners, ``isinstance`` checks failing between the
copies): ``_common``, which every kernel module imports first, refuses that with an ImportError
naming the right import. The refusal is not here because other libraries probe for a package
called ``kernels`` by importing it (transformers looks for Hugging Face's ``kernels``): the bare
package must import without error.
"""
