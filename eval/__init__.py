"""Downstream evaluation of fp4lightning checkpoints (lm-eval-harness tasks)."""
# Installed, this folder is ``fp4lightning.eval`` (pyproject.toml's package-dir). Imported under any other
# name (``import eval`` from the repository root) it would be a second copy of every module:
# separate Triton caches and autotuners, and ``isinstance`` checks that fail between the copies.
if __name__ != "fp4lightning.eval":
    raise ImportError(f"this folder is the package 'fp4lightning.eval'; import it as 'fp4lightning.eval' "
                      f"(e.g. `from fp4lightning.eval import ...`), not as {__name__!r}")
