"""LLaMA-2 decoder, the architecture the paper trains in FP4 (arXiv 2501.17116, section 7).

RMSNorm (pre-norm), rotary position embeddings, SwiGLU MLP, optional grouped-query
attention (``n_kv_heads < n_heads``), causal scaled-dot-product attention and an
untied output head named ``lm_head``. Every GeMM is a plain ``nn.Linear`` so that
``fp4lightning.nn.convert.convert_to_fp4`` can swap them for ``FP4Linear`` in place; the
head keeps its name so the converter can leave it in high precision.

Module names follow the Hugging Face ``LlamaForCausalLM`` layout minus its ``model.``
prefix (``layers.0.self_attn.q_proj`` ...) and RoPE uses the same rotate-half
convention, so ``fp4lightning.models.hf`` converts state dicts by renaming only.

Named configs (``LLAMA_CONFIGS``):

========== ====== ======== ======= ========== ===== =======================================
name        dim   n_layers n_heads n_kv_heads  ffn   params (vocab 32000)
========== ====== ======== ======= ========== ===== =======================================
tiny        192       4       3        3        512   3.3M with its 4096-token vocabulary
llama2-1.3b 2048     24      16       16       5504   1.35B (no published LLaMA-2 1.3B: the
                                                      LLaMA-2 recipe at OPT/GPT-3 1.3B width)
llama2-7b   4096     32      32       32      11008   6.74B (published LLaMA-2 7B)
llama2-13b  5120     40      40       40      13824   13.0B (published LLaMA-2 13B)
========== ====== ======== ======= ========== ===== =======================================
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fp4lightning.models.config import LLAMA_CONFIGS, LlamaConfig, llama_config

__all__ = ["LlamaConfig", "Llama", "LLAMA_CONFIGS", "llama_config", "init_weights_", "compile_blocks"]


@torch.no_grad()
def init_weights_(module: nn.Module, std: float = 0.02, recurse: bool = True) -> None:
    """Initialise parameters by shape: matrices N(0, std), 1-D gains ones, biases zeros.

    Shape-based rather than name-based so it also serves as FSDP's ``param_init_fn``
    (called per submodule with ``recurse=False``) and survives ``convert_to_fp4`` swapping
    the linear layers' class.
    """
    for name, p in module.named_parameters(recurse=recurse):
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            nn.init.normal_(p, mean=0.0, std=std)
        else:
            nn.init.ones_(p)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 (as LLaMA and HF do) and cast back before the gain
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (T, head_dim) in fp32, rotate-half layout (HF convention).

    Recomputed per forward instead of stored as a buffer so the model can be built on the
    meta device and materialised later without a buffer to re-initialise; it costs
    T * head_dim / 2 multiplies.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hs); rotate in fp32 so bf16 activations keep positional precision
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.dim, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """LLaMA-2 causal language model: ``forward(idx (B, T) int64) -> logits (B, T, vocab)``.

    Build big models without allocating by constructing under ``torch.device("meta")``
    and calling ``init_weights()`` after ``to_empty(device=...)``.
    """

    #: the module types a sharding strategy wraps as units (read by ``fp4lightning.distributed.fsdp.fully_shard_fp4``)
    shard_units: tuple[type[nn.Module], ...] = (Block,)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if self.embed_tokens.weight.device.type != "meta":
            self.init_weights()

    def init_weights(self) -> None:
        """LLaMA / HF initialisation: N(0, init_std) for every matrix, ones for the norm gains."""
        init_weights_(self, self.config.init_std)

    def reset_parameters(self) -> None:
        self.init_weights()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.config.max_seq_len}")
        cos, sin = rope_cos_sin(T, self.config.head_dim, self.config.rope_theta, idx.device)
        x = self.embed_tokens(idx)  # (B, T, dim)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def compile_blocks(model: Llama, backend: str | Callable[..., Any] = "inductor",
                   memory_budget: float | None = None) -> Llama:
    """``torch.compile`` each decoder block of ``model`` in place, as torchtitan compiles each TransformerBlock.

    RMSNorm, RoPE, the code around ``scaled_dot_product_attention``, SwiGLU's activation and product and
    the residual adds fuse; every ``FP4Linear`` is one graph break (``fp4lightning.nn.linear.fp4_linear`` is
    ``torch.compiler.disable``-d) and runs as it does eagerly, so a block of 7 FP4 layers is 8 graphs. The
    embedding, the final norm and the output head are not compiled. Compiling is lazy (at the first
    forward), so layers swapped in afterwards (``FP4Precision.convert_module``) are what gets compiled.

    What is compiled is each block's ``forward`` (an instance attribute), not the module call
    (``Block.compile()``): ``fp4lightning.distributed.fsdp.fully_shard_fp4`` wraps ``forward`` in activation
    checkpointing, and a compiled module call would trace that checkpoint, whose body may not contain a
    graph break, and run the whole block eagerly. Compile first, then shard: the checkpoint wraps the
    compiled forward, FSDP2's hooks run eagerly around it. A block whose ``forward`` is already wrapped is
    refused for that reason.

    ``backend``: ``torch.compile``'s (tests pass ``"aot_eager"``: same graphs, no C++ or Triton build).
    ``memory_budget``: torch's ``activation_memory_budget`` (0-1) while each block compiles (recipe key
    ``trainer.compile_memory_budget``): below 1 the partitioner saves fewer activations and recomputes
    more in the backward. The graphs between the FP4 layers' breaks are planned apart and save more than
    one graph of the bf16 block would (docs/perf.md, "Memory of a compiled block"). None: torch's.
    Returns ``model``.
    """
    for i, block in enumerate(model.layers):
        wrapper = vars(block).get("forward")
        if wrapper is not None:
            by = getattr(getattr(wrapper, "func", wrapper), "__qualname__", type(wrapper).__name__)
            raise ValueError(f"compile_blocks: layers.{i} already wraps its forward (in {by}), e.g. fully_shard_fp4's "
                             "activation checkpointing or an earlier compile_blocks; compile the blocks before sharding")
        compiled = torch.compile(block.forward, backend=backend)
        block.forward = compiled if memory_budget is None else _with_memory_budget(compiled, memory_budget)
    return model


def _with_memory_budget(compiled: Callable[..., Any], budget: float) -> Callable[..., Any]:
    """``compiled`` called with torch's ``activation_memory_budget`` at ``budget`` (read when it compiles)."""
    import functools

    import torch._functorch.config as functorch_config

    @functools.wraps(compiled)
    def forward(*args, **kwargs):
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled(*args, **kwargs)
    return forward
