"""Hugging Face ``transformers`` interop for :class:`fp4lightning.models.llama.Llama`.

Our module names are HF ``LlamaForCausalLM`` names without the ``model.`` prefix on the
decoder (the head is ``lm_head`` in both) and RoPE uses HF's rotate-half layout, so the
conversion is a rename. FP4 training keeps high-precision master weights in
``FP4Linear.weight`` (the state dict is unchanged by ``convert_to_fp4``), so exported
weights are the trained master weights; they run in any precision transformers supports.

``transformers`` is an optional dependency (``pip install 'fp4lightning[hf]'``); it is
imported only inside the functions that build HF objects.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from fp4lightning.errors import UsageError
from fp4lightning.models.export_folder import export_folder
from fp4lightning.models.llama import Llama, LlamaConfig

__all__ = [
    "to_hf_config",
    "from_hf_config",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "to_hf_model",
    "from_hf_model",
    "save_hf",
    "require_transformers",
]

_DECODER_PREFIX = "model."
#: tests only: seconds :func:`save_hf` sleeps after writing the weights, so a test can kill an export there
PAUSE_ENV = "FP4LIGHTNING_TEST_EXPORT_PAUSE"


def require_transformers():
    """The ``transformers`` module; ImportError saying how to install it (an optional dependency)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Hugging Face export/import needs transformers: pip install 'fp4lightning[hf]'"
        ) from e
    return transformers


def to_hf_config(cfg: LlamaConfig, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """``transformers.LlamaConfig`` equivalent to ``cfg``."""
    transformers = require_transformers()
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def from_hf_config(hf_cfg) -> LlamaConfig:
    """:class:`LlamaConfig` from a ``transformers.LlamaConfig`` (or its ``to_dict()``)."""
    d = hf_cfg if isinstance(hf_cfg, dict) else hf_cfg.to_dict()
    if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias") or d.get("mlp_bias"):
        raise UsageError("only LLaMA configs with silu, no attention/MLP biases are supported")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", "default") not in ("default", None):
        raise UsageError(f"RoPE scaling {rope.get('rope_type')!r} is not supported (only plain RoPE)")
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    n_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
    if head_dim * n_heads != d["hidden_size"]:
        raise UsageError("head_dim * num_attention_heads != hidden_size is not supported")
    return LlamaConfig(
        vocab_size=d["vocab_size"],
        dim=d["hidden_size"],
        n_layers=d["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=d.get("num_key_value_heads") or n_heads,
        ffn_dim=d["intermediate_size"],
        max_seq_len=d.get("max_position_embeddings", 2048),
        rope_theta=float(theta),
        norm_eps=d.get("rms_norm_eps", 1e-5),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        init_std=d.get("initializer_range", 0.02),
    )


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename our state dict to ``LlamaForCausalLM`` keys (tensors are shared, not copied)."""
    out = {}
    for k, v in state_dict.items():
        if cfg.tie_embeddings and k == "lm_head.weight":
            continue  # HF re-ties it from embed_tokens
        out[k if k.startswith("lm_head.") else _DECODER_PREFIX + k] = v
    return out


def from_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Rename ``LlamaForCausalLM`` keys to ours, dropping HF's non-persistent RoPE buffers."""
    out = {}
    for k, v in state_dict.items():
        if k.endswith("rotary_emb.inv_freq"):
            continue
        if k.startswith(_DECODER_PREFIX):
            out[k[len(_DECODER_PREFIX):]] = v
        elif k.startswith("lm_head."):
            out[k] = v
        else:
            raise KeyError(f"unexpected key {k!r} in a LlamaForCausalLM state dict")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def to_hf_model(model: Llama, bos_token_id: int | None = None, eos_token_id: int | None = None):
    """A ``transformers.LlamaForCausalLM`` holding a copy of ``model``'s weights (fp32)."""
    transformers = require_transformers()
    hf_cfg = to_hf_config(model.config, bos_token_id, eos_token_id)
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(hf_cfg)
    sd = {k: v.detach().float().cpu().clone() for k, v in to_hf_state_dict(model.state_dict(), model.config).items()}
    # assign=True materialises the meta-built model straight from our tensors
    hf.load_state_dict(sd, strict=not model.config.tie_embeddings, assign=True)
    if model.config.tie_embeddings:
        hf.tie_weights()
    # built on meta, HF's RoPE tables are meta too: recompute them on CPU (plain RoPE only)
    for m in hf.modules():
        inv = getattr(m, "inv_freq", None)
        if isinstance(inv, torch.Tensor) and inv.is_meta:
            if hasattr(m, "compute_default_rope_parameters"):  # transformers >= 5
                inv_freq, _ = m.compute_default_rope_parameters(m.config)
            else:  # transformers 4.x
                inv_freq, _ = m.rope_init_fn(m.config, torch.device("cpu"))
            m.register_buffer("inv_freq", inv_freq, persistent=False)
            if isinstance(getattr(m, "original_inv_freq", None), torch.Tensor):
                m.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
    return hf.eval()


def from_hf_model(hf_model) -> Llama:
    """Our :class:`Llama` with a copy of a ``LlamaForCausalLM``'s weights."""
    cfg = from_hf_config(hf_model.config)
    with torch.device("meta"):
        model = Llama(cfg)
    sd = {k: v.detach().clone() for k, v in from_hf_state_dict(hf_model.state_dict(), cfg).items()}
    model.load_state_dict(sd, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def save_hf(model: Llama, out_dir: str | Path, tokenizer=None, overwrite: bool = False, *, hf_model=None,
            finish=None, note: str | None = None) -> Path:
    """Write a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

    ``tokenizer`` (an :class:`fp4lightning.data.tokenizer.Tokenizer`) is saved alongside as a
    ``PreTrainedTokenizerFast`` so ``AutoTokenizer.from_pretrained(out_dir)`` works too. Its
    post-processor prepends BOS (as LLaMA's tokenizer does), because every training document
    started with BOS: ``tokenizer(text)`` and lm-eval's ``hf`` model then see the same tokens
    as training and the ``fp4lightning`` lm-eval model (docs/evaluation.md).

    The folder is written beside ``out_dir`` and renamed into place when complete
    (:func:`~fp4lightning.models.export_folder.export_folder`): an error or a kill leaves ``out_dir``
    as it was. A folder that holds files is refused (``UsageError``) unless ``overwrite``, which
    replaces it whole. Files get the modes the umask gives.

    ``hf_model`` is the ``LlamaForCausalLM`` to save (default: :func:`to_hf_model` of ``model``), ``finish`` a
    function called with the folder after the weights are written (compressed-tensors' ``update_config``:
    ``fp4lightning.models.ct_export``), ``note`` the text of ``fp4lightning.json``.
    """
    transformers = require_transformers()
    out_dir = Path(out_dir)
    bos = tokenizer.bos_id if tokenizer is not None else None
    eos = tokenizer.eos_id if tokenizer is not None else None
    hf = to_hf_model(model, bos, eos) if hf_model is None else hf_model
    with export_folder(out_dir, overwrite) as tmp:
        hf.save_pretrained(tmp)
        if finish is not None:
            finish(tmp)
        if os.environ.get(PAUSE_ENV):
            time.sleep(float(os.environ[PAUSE_ENV]))
        if tokenizer is not None:
            fast = transformers.PreTrainedTokenizerFast(
                tokenizer_object=_bos_first(tokenizer),
                bos_token=tokenizer.bos_token,
                eos_token=tokenizer.eos_token,
                model_max_length=model.config.max_seq_len,
            )
            fast.save_pretrained(tmp)
        (tmp / "fp4lightning.json").write_text(
            json.dumps({"note": note or "exported by fp4lightning export-hf; weights are the high-precision "
                                        "master weights"})
        )
    return out_dir


def _bos_first(tokenizer):
    """A copy of the ``tokenizers`` backend whose ``encode`` starts with BOS (special tokens on)."""
    from tokenizers import processors

    from fp4lightning.data.tokenizer import Tokenizer

    backend = Tokenizer.from_str(tokenizer.to_str()).backend
    bos = processors.TemplateProcessing(
        single=f"{tokenizer.bos_token} $A", pair=f"{tokenizer.bos_token} $A {tokenizer.bos_token} $B",
        special_tokens=[(tokenizer.bos_token, tokenizer.bos_id)],
    )
    old = backend.post_processor
    backend.post_processor = bos if old is None else processors.Sequence([old, bos])
    return backend


#: printed after export-hf: how lm-eval's ``hf`` model scores the export like ``fp4lightning``
LM_EVAL_HINT = (
    "lm-eval: --model hf --model_args pretrained={out},dtype=float32 adds BOS to every context by default "
    "(the exported tokenizer does, as training did), so accuracy tasks score as with --model fp4lightning; "
    "for perplexity (loglikelihood_rolling) tasks add add_bos_token=False, since lm-eval's hf model "
    "also prefixes BOS itself there"
)
