"""fp4lightning: FP4 (E2M1) training of LLaMA-style models in PyTorch Lightning.

Implements "Optimizing Large Language Model Training Using FP4 Quantization"
(Wang et al., arXiv 2501.17116). The public surface is the names below; everything else is
reached through its submodule (``fp4lightning.numerics.formats``, ``fp4lightning.numerics.absmax``,
``fp4lightning.ops.gemm``, ...; docs/design.md maps every concept to its file).

Every name is imported lazily, on first use, so ``import fp4lightning`` (and with it
``fp4lightning --help``) loads neither torch nor Lightning nor omegaconf nor lm-eval.

Imported before torch, it sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already sets
it: OpenMP threads that spin while they wait make a CPU step several times slower on a machine
shared with other work (torch's OpenMP runtime reads the variable once, when torch is imported, so
after ``import torch`` it is too late and nothing is changed; export it in the shell then).
"""
import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
del _os, _sys

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
    "FP4Config": ".config",
    "FP4Linear": ".nn.linear",
    "convert_to_fp4": ".nn.convert",
    "Trainer": ".lightning.trainer",
    "FP4Precision": ".lightning.precision",
    "FP4DDPStrategy": ".lightning.strategy",
    "FP4FSDPStrategy": ".lightning.strategy",
    "LowPrecisionAdamW": ".lightning.optim",
    "load_checkpoint": ".train.checkpoint",
}


def __getattr__(name):
    # torch and Lightning are imported only when a name that needs them is used
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # a name equal to its submodule's (quantize) then means the function
        return value
    raise AttributeError(f"module 'fp4lightning' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
