"""Start training from existing weights: ``init.from_hf`` / ``init.from_checkpoint`` and ``fp4lightning import-hf``.

Continued pretraining or fine-tuning of an existing LLaMA in FP4 (arXiv 2501.17116 trains
from scratch; starting from weights is the same recipe on a different starting point):

* ``fp4lightning import-hf HF_DIR OUT.ckpt`` turns a Hugging Face ``LlamaForCausalLM`` folder
  into a checkpoint that ``init.from_checkpoint``, ``fp4lightning eval`` and ``export-hf`` read,
  and prints the ``model.*`` recipe keys that match it.
* Recipe ``init.from_hf: HF_DIR`` or ``init.from_checkpoint: PATH`` loads those weights into the
  freshly built model before the first step (the optimizer and schedule start fresh). On
  ``--resume`` the run's own checkpoint wins and ``init.*`` is ignored.

Tokenizer: the token ids in ``data.dir`` must mean what they meant when the weights were
trained. Training refuses to start when the imported model carries a tokenizer whose
vocabulary differs from ``data.dir/tokenizer.json``. ``fp4lightning data prepare`` trains its
own byte-level BPE; it cannot yet tokenize a corpus with a foreign tokenizer, so a model from
elsewhere trains here only on data tokenized with its own tokenizer (docs/training.md).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from fp4lightning.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer
from fp4lightning.models.hf import from_hf_model, require_transformers
from fp4lightning.models.llama import LlamaConfig
from fp4lightning.train.checkpoint import load_checkpoint
from fp4lightning.train.recipe import RecipeError

__all__ = ["load_init_weights", "InitWeights", "import_hf", "check_init_tokenizer", "same_tokenizer",
           "config_differences", "InitError"]


class InitError(RecipeError):
    """The initial weights cannot be used with this recipe (names the key and the fix)."""


def _hf_tokenizer(hf_dir: Path) -> Tokenizer | None:
    """The folder's ``tokenizer.json`` as our Tokenizer, if it has our BOS/EOS tokens; else None."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if BOS_TOKEN not in text or EOS_TOKEN not in text:
        return None
    return Tokenizer.from_str(text)


def _vocab(tok: Tokenizer) -> dict[str, int]:
    return tok.backend.get_vocab(with_added_tokens=True)


# what transformers' from_pretrained looks for in a local folder (single file or sharded index)
_HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")


def _from_hf(hf_dir: Path) -> tuple[torch.nn.Module, Tokenizer | None, bool]:
    """(model, tokenizer or None, the folder had a tokenizer at all)."""
    transformers = require_transformers()
    if not (hf_dir / "config.json").is_file():
        raise InitError(f"{hf_dir} is not a Hugging Face model folder (no config.json)")
    if not any((hf_dir / n).is_file() for n in _HF_WEIGHT_FILES):
        raise InitError(
            f"{hf_dir} has config.json but no weights ({', '.join(_HF_WEIGHT_FILES)}); copy the model's "
            "weight files into it (e.g. `fp4lightning export-hf CKPT DIR` writes model.safetensors)")
    # no dtype keyword (transformers 4.56 renamed torch_dtype to dtype and warns on the old name; older
    # versions refuse the new one): loaded as stored or in fp32, then made fp32, which is exact
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float()
    if type(hf).__name__ != "LlamaForCausalLM":
        raise InitError(f"{hf_dir} holds a {type(hf).__name__}; only LlamaForCausalLM imports")
    has_tok = any((hf_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))
    return from_hf_model(hf), _hf_tokenizer(hf_dir), has_tok


def config_differences(want: LlamaConfig, have: LlamaConfig) -> tuple[list[str], LlamaConfig]:
    """``(names of the fields that shape weights and differ, have normalized)``.

    Compares normalized configs (``n_kv_heads=None`` means ``n_heads``: an exported multi-head
    model says 3 where the recipe left it unset). ``init_std`` and ``max_seq_len`` do not shape
    any weight (RoPE tables are computed).
    """
    want, have = want.normalized(), have.normalized()
    diff = [f.name for f in dataclasses.fields(LlamaConfig)
            if f.name not in ("init_std", "max_seq_len") and getattr(want, f.name) != getattr(have, f.name)]
    return diff, have


def load_init_weights(cfg) -> tuple[dict[str, torch.Tensor], LlamaConfig, Tokenizer | None, str]:
    """``(state_dict, model config, tokenizer or None, source)`` named by ``cfg.init``; checked against ``cfg``.

    Raises :class:`InitError` naming the recipe keys that disagree with the weights.
    """
    if cfg.init.from_checkpoint:
        key, src = "init.from_checkpoint", Path(cfg.init.from_checkpoint)
        model, tok, _ = load_checkpoint(src)
    else:
        key, src = "init.from_hf", Path(cfg.init.from_hf)
        model, tok, _ = _from_hf(src)
    have = model.config
    diff, shape = config_differences(cfg.llama_config(), have)
    if diff:
        keys = " ".join(f"model.{k}={getattr(shape, k)}" for k in diff)
        raise InitError(f"recipe key `{key}` = {src}: its model differs from the recipe's in {', '.join(diff)}; "
                        f"set {keys}")
    return model.state_dict(), have, tok, str(src)


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether token ids mean the same tokens under ``a`` and ``b`` (equal vocabularies)."""
    return _vocab(a) == _vocab(b)


def check_init_tokenizer(init_tok: Tokenizer | None, data_tok: Tokenizer, source: str, data_dir: str) -> None:
    """Refuse data whose token ids mean something else than the imported model's."""
    if init_tok is not None and not same_tokenizer(init_tok, data_tok):
        raise InitError(
            f"the initial weights ({source}) were trained with a different tokenizer than {data_dir}/tokenizer.json; "
            "their token ids would not match. Train on data prepared with that model's tokenizer "
            "(for a checkpoint trained here: the same data.dir)"
        )


class InitWeights(L.Callback):
    """Copy ``state_dict`` into the model once it is built (and converted to FP4), before the first step."""

    def __init__(self, state_dict: dict[str, torch.Tensor], source: str):
        self.weights, self.source = state_dict, source

    def on_fit_start(self, trainer, pl_module) -> None:
        model = pl_module.model
        with torch.no_grad():
            # FP4Linear keeps nn.Linear's parameter names, so the keys match before and after conversion
            missing, unexpected = model.load_state_dict(self.weights, strict=False)
        missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_embeddings)]
        if missing or unexpected:
            raise InitError(f"initial weights {self.source}: missing {missing}, unexpected {unexpected}")
        if trainer.is_global_zero:
            print(f"initialised the model from {self.source}", flush=True)
        self.weights = {}  # free the copy


# ----------------------------------------------------------------------------- import-hf
def import_hf(hf_dir: str | Path, out: str | Path) -> tuple[Path, LlamaConfig, bool]:
    """Write ``out`` (a checkpoint ``load_checkpoint`` reads) from a HF LLaMA folder.

    Returns ``(path, model config, tokenizer included)``.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    model, tok, has_tok = _from_hf(hf_dir)
    ckpt: dict[str, Any] = {
        "hyper_parameters": {"model": dataclasses.asdict(model.config), "fp4": None, "recipe": None},
        "state_dict": {f"model.{k}": v.contiguous() for k, v in model.state_dict().items()},
        "tokenizer": tok.to_str() if tok is not None else None,
        "fp4lightning_import": {"from_hf": str(hf_dir.resolve()), "had_tokenizer": has_tok},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(ckpt, tmp)
    tmp.replace(out)
    return out, model.config, tok is not None
