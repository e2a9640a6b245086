"""fp4lightning: FP4 (E2M1) training of LLaMA-style models in PyTorch Lightning.

Implements "Optimizing Large Language Model Training Using FP4 Quantization"
(Wang et al., arXiv 2501.17116). The numerics core lives in ``formats``, ``quantize``,
``dge``, ``occ``, ``ops``, ``linear`` and ``convert``; the Lightning side in
``precision`` (``FP4Precision``), ``trainer`` (``Trainer``), ``strategy``
(``FP4DDPStrategy``) and ``optim`` (``LowPrecisionAdamW``), imported lazily so that
``import fp4lightning`` does not pull in Lightning.
"""
from .config import PRESETS, FP4Config
from .convert import convert_to_fp4, fp4_modules
from .dge import dge_derivative
from .formats import E2M1_MAX, decode_e2m1, encode_e2m1, pack_fp4, round_to_e2m1, unpack_fp4
from .linear import FP4Linear, fp4_linear
from .quantize import QuantizedFP4, dequantize, fake_quantize, quantize

__version__ = "0.1.0"

__all__ = [
    "FP4Config",
    "PRESETS",
    "FP4Linear",
    "fp4_linear",
    "convert_to_fp4",
    "fp4_modules",
    "dge_derivative",
    "E2M1_MAX",
    "round_to_e2m1",
    "encode_e2m1",
    "decode_e2m1",
    "pack_fp4",
    "unpack_fp4",
    "QuantizedFP4",
    "quantize",
    "dequantize",
    "fake_quantize",
    "FP4Precision",
    "DynamicLossScaler",
    "Trainer",
    "FP4DDPStrategy",
    "LowPrecisionAdamW",
    "state_bytes_per_param",
]

_LAZY = {
    "FP4Precision": ".precision",
    "DynamicLossScaler": ".precision",
    "Trainer": ".trainer",
    "FP4DDPStrategy": ".strategy",
    "LowPrecisionAdamW": ".optim",
    "state_bytes_per_param": ".optim",
}


def __getattr__(name):
    # Lightning is imported only when its side of the package is used
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'fp4lightning' has no attribute {name!r}")
