"""Model definitions: LLaMA-2 (``llama``), its shapes (``config``) and Hugging Face interop (``hf``).

Names are imported on first use, so reading the model shapes (``fp4lightning.models.config``, as the
recipe schema does) does not import torch.
"""

__all__ = ["Llama", "LlamaConfig", "LLAMA_CONFIGS", "llama_config"]

_LAZY = {"Llama": ".llama", "LlamaConfig": ".config", "LLAMA_CONFIGS": ".config", "llama_config": ".config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp4lightning.models' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
