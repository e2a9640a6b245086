"""Model definitions: LLaMA-2 (``llama``) and Hugging Face interop (``hf``)."""
from .llama import LLAMA_CONFIGS, Llama, LlamaConfig, llama_config

__all__ = ["Llama", "LlamaConfig", "LLAMA_CONFIGS", "llama_config"]
