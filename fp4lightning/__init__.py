"""fp4lightning: FP4 (E2M1) training of LLaMA-style models in PyTorch Lightning.

Implements "Optimizing Large Language Model Training Using FP4 Quantization"
(Wang et al., arXiv 2501.17116). The numerics core lives in ``formats``, ``quantize``,
``dge``, ``occ``, ``ops``, ``linear`` and ``convert``; the Lightning side in
``precision`` (``FP4Precision``), ``trainer`` (``Trainer``), ``strategy``
(``FP4DDPStrategy``) and ``optim`` (``LowPrecisionAdamW``). Every name is imported lazily, on
first use, so that ``import fp4lightning`` (and ``fp4lightning --help``) loads neither torch
nor Lightning.
"""
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
    "FP4Config": ".config",
    "PRESETS": ".config",
    "FP4Linear": ".linear",
    "fp4_linear": ".linear",
    "convert_to_fp4": ".convert",
    "fp4_modules": ".convert",
    "dge_derivative": ".dge",
    "E2M1_MAX": ".formats",
    "round_to_e2m1": ".formats",
    "encode_e2m1": ".formats",
    "decode_e2m1": ".formats",
    "pack_fp4": ".formats",
    "unpack_fp4": ".formats",
    "QuantizedFP4": ".quantize",
    "quantize": ".quantize",
    "dequantize": ".quantize",
    "fake_quantize": ".quantize",
    "FP4Precision": ".precision",
    "DynamicLossScaler": ".loss_scaler",
    "Trainer": ".trainer",
    "FP4DDPStrategy": ".strategy",
    "LowPrecisionAdamW": ".optim",
    "state_bytes_per_param": ".optim",
}


def __getattr__(name):
    # torch and Lightning are imported only when a name that needs them is used
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # a name equal to its submodule's (quantize) then means the function
        return value
    raise AttributeError(f"module 'fp4lightning' has no attribute {name!r}")
