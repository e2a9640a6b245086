"""fp4lightning: FP4 (E2M1) training of LLaMA-style models in PyTorch Lightning.

Implements "Optimizing Large Language Model Training Using FP4 Quantization"
(Wang et al., arXiv 2501.17116). The public surface is the names below; everything else is
reached through its submodule (``fp4lightning.formats``, ``fp4lightning.quantize``,
``fp4lightning.gemm_dispatch``, ...; docs/design.md maps every concept to its file).

Only the numerics (``FP4Config``, ``FP4Linear``, ``convert_to_fp4``) are imported eagerly:
the Lightning side (``Trainer``, ``FP4Precision``, the strategies, ``LowPrecisionAdamW``) and
the model loader (``load_checkpoint``) load on first use, so ``import fp4lightning`` pulls in
neither Lightning nor omegaconf nor lm-eval.
"""
from .config import FP4Config
from .convert import convert_to_fp4
from .linear import FP4Linear

__version__ = "0.1.0"

__all__ = [
    "Trainer",
    "FP4Precision",
    "FP4DDPStrategy",
    "FP4FSDPStrategy",
    "FP4Config",
    "FP4Linear",
    "convert_to_fp4",
    "LowPrecisionAdamW",
    "load_checkpoint",
]

_LAZY = {
    "Trainer": ".trainer",
    "FP4Precision": ".precision",
    "FP4DDPStrategy": ".strategy",
    "FP4FSDPStrategy": ".strategy",
    "LowPrecisionAdamW": ".optim",
    "load_checkpoint": ".checkpoint",
}


def __getattr__(name):
    # the Lightning side and the model loader are imported only when used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'fp4lightning' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
