"""Triton kernels of fp4lightning (the FP4 quantizer, the FP8 dY quantizer, the GeMMs, the block formats)."""
# Installed, this folder is ``fp4lightning.kernels`` (pyproject.toml's package-dir). Imported under any other
# name (``import kernels`` from the repository root) it would be a second copy of every module:
# separate Triton caches and autotuners, and ``isinstance`` checks that fail between the copies.
if __name__ != "fp4lightning.kernels":
    raise ImportError(f"this folder is the package 'fp4lightning.kernels'; import it as 'fp4lightning.kernels' "
                      f"(e.g. `from fp4lightning.kernels import ...`), not as {__name__!r}")
