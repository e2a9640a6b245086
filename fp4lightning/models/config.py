"""The shape of a LLaMA-2 model (:class:`LlamaConfig`) and the named configs, without torch.

Kept apart from :mod:`fp4lightning.models.llama` so that the recipe schema
(:mod:`fp4lightning.train.recipe`) can check ``model.*`` keys before torch is imported: a recipe
mistake is reported in well under a second. The table of named configs is in
:mod:`fp4lightning.models.llama`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["LlamaConfig", "LLAMA_CONFIGS", "llama_config"]


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-2 model. ``n_kv_heads=None`` means multi-head attention."""

    vocab_size: int = 4096
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 3
    n_kv_heads: int | None = None
    # SwiGLU hidden width; LLaMA uses ~8/3 * dim rounded up to a multiple of 256 (7B: 11008)
    ffn_dim: int = 512
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head dim dim/n_heads={self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.kv_heads}"
            )

    def normalized(self) -> "LlamaConfig":
        """This config with defaults spelled out (``n_kv_heads=None`` -> ``n_heads``), for comparing
        two configs: ``None`` and ``n_heads`` build the same model. (``ffn_dim`` has no derived default.)"""
        return dataclasses.replace(self, n_kv_heads=self.kv_heads)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def num_params(self) -> int:
        """Parameter count computed from the shapes (no allocation)."""
        attn = self.dim * self.dim * 2 + self.dim * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.dim * self.ffn_dim
        per_layer = attn + mlp + 2 * self.dim
        emb = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return emb + self.n_layers * per_layer + self.dim + head


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=4096, dim=192, n_layers=4, n_heads=3, ffn_dim=512, max_seq_len=256),
    "llama2-1.3b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=24, n_heads=16, ffn_dim=5504, max_seq_len=2048),
    "llama2-7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=4096),
    "llama2-13b": LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, ffn_dim=13824, max_seq_len=4096),
}


def llama_config(name: str, **overrides) -> LlamaConfig:
    """Named config with field overrides, e.g. ``llama_config("tiny", vocab_size=8192)``."""
    if name not in LLAMA_CONFIGS:
        raise ValueError(f"unknown model name {name!r}; valid choices: {sorted(LLAMA_CONFIGS)}")
    return dataclasses.replace(LLAMA_CONFIGS[name], **overrides)
