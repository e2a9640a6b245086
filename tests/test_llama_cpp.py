"""llama.cpp runs the GGUF `fp4lightning export-gguf` writes (issue 50, item 4), on CPU, through
llama-cpp-python: its logits and perplexity on the same tokens stay within the stated gap of ours with the
same FP4 weights and fp32 activations. llama.cpp rounds the activations of each MXFP4 / NVFP4 dot product to
Q8_0 (int8 with one fp16 scale per 32 values) and keeps its KV cache in F16; that is the whole gap.

Opt-in: llama-cpp-python builds llama.cpp from source (minutes), so this module is skipped where
``llama_cpp`` does not import. ``python scripts/serve_llama_cpp.py --install CKPT`` installs it.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (python scripts/serve_llama_cpp.py --install CKPT)")
pytest.importorskip("gguf")

import torch  # noqa: E402

from fp4lightning.config import FP4Config
from fp4lightning.data.tokenizer import Tokenizer
from fp4lightning.models.ct_export import forward_weight
from fp4lightning.models.llama import Llama, LlamaConfig
from fp4lightning.nn.convert import convert_to_fp4
from fp4lightning.nn.linear import FP4Linear
from tests._numerics import sqnr

pytestmark = pytest.mark.llama_cpp

_TEXT = ("The king said to his servants, bring me the book of the law, and they brought it to him; "
         "and he read in it all the days of his life. ") * 30
_SHAPE = dict(vocab_size=320, dim=64, n_layers=2, n_heads=2, ffn_dim=128, max_seq_len=64)
#: llama.cpp's logits against ours, same FP4 weights (Q8_0 activations, F16 KV cache): measured 58.0 dB (mxfp4),
#: 59.9 dB (nvfp4); against our master weights instead 34.9 / 36.8 dB, so the bound tells the weights apart
LOGITS_SQNR_DB = 50.0
#: |perplexity ratio - 1| of llama.cpp against ours with the same FP4 weights: measured 0.016% (mxfp4), 0.004%
#: (nvfp4); against our master weights 1.0% / 0.47%
PPL_GAP = 0.002
FIT_STEPS = 6  # perplexity about 14 on the text (uniform would be 320)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train([_TEXT], vocab_size=_SHAPE["vocab_size"])


@pytest.fixture(scope="module")
def fitted(tok) -> dict:
    """A state dict of the tiny model fitted to the text for a few steps (in fp32), so that its perplexity is
    far from uniform and the FP4 weights' error shows in it."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**_SHAPE))
    ids = torch.tensor(tok.encode(_TEXT))
    n = _SHAPE["max_seq_len"]
    batch = torch.stack([ids[i: i + n + 1] for i in range(0, len(ids) - n - 1, n // 2)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(FIT_STEPS):
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.state_dict()


def _model(preset: str, state: dict) -> Llama:
    model = Llama(LlamaConfig(**_SHAPE)).eval()
    model.load_state_dict(state)
    return convert_to_fp4(model, FP4Config.from_preset(preset).replace(keep_first_n=0, keep_last_n=0))


def _fp4_weights(model: Llama) -> Llama:
    """Ours with the FP4 layers' weights as their forward multiplies by, fp32 activations."""
    ref = Llama(model.config).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, FP4Linear):
                ref.get_submodule(name).weight.copy_(forward_weight(mod))
    return ref


def _log_softmax_nll(logits: np.ndarray, ids: list[int]) -> float:
    lg = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    return float((lse - lg[np.arange(len(lg)), ids[1:]]).mean())


@pytest.mark.parametrize("preset", ["mxfp4", "nvfp4"])
def test_llama_cpp_perplexity_is_within_the_gap_of_ours(preset, tok, fitted, tmp_path):
    from fp4lightning.models.gguf_export import export_gguf

    model = _model(preset, fitted)
    export_gguf(model, tok, tmp_path / "m.gguf", "f32")
    ids = tok.encode(_TEXT)[: _SHAPE["max_seq_len"]]
    with torch.no_grad():
        want = _fp4_weights(model)(torch.tensor([ids])).float()[0].numpy()
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), n_ctx=len(ids), n_batch=len(ids), n_threads=1,
                          logits_all=True, verbose=False)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    assert sqnr(torch.from_numpy(got), torch.from_numpy(want)) > LOGITS_SQNR_DB
    ppl_got, ppl_want = math.exp(_log_softmax_nll(got, ids)), math.exp(_log_softmax_nll(want, ids))
    assert abs(ppl_got / ppl_want - 1) < PPL_GAP, (ppl_got, ppl_want)
    # the GGUF's vocabulary tokenizes as ours
    assert llm.tokenize(_TEXT[:200].encode(), add_bos=True, special=False) == tok.encode(_TEXT[:200])
