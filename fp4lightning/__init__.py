"""fp4lightning: FP4 (E2M1) training of LLaMA-style models in PyTorch Lightning.

Implements "Optimizing Large Language Model Training Using FP4 Quantization"
(Wang et al., arXiv 2501.17116). The numerics core lives in ``formats``, ``quantize``,
``dge``, ``occ``, ``ops``, ``linear`` and ``convert``.
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
]
