"""`fp4lightning export-gguf` (issue 50, items 1 and 3): the GGUF file, read back with the ``gguf`` package's
own reader and dequantizer, holds bit for bit the FP4 weights the training forward multiplies by (MXFP4 for
the mxfp4 preset and for paper with power-of-two scales, NVFP4 plus its tensor scale for nvfp4), LLaMA's
hyper-parameters, a vocabulary that rebuilds our tokenizer's ids, llama.cpp's RoPE layout; bad input is one
line and exit 2, and nothing half-written is left behind."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fp4lightning.cli import main
from fp4lightning.data.tokenizer import Tokenizer
from fp4lightning.models.gguf_export import rope_row_order, sqnr_db
from fp4lightning.models.llama import Llama, LlamaConfig, apply_rope, rope_cos_sin
from fp4lightning.nn import block_linear, linear
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.train.checkpoint import load_checkpoint
from tests.test_data import mount_tmpfs

gguf = pytest.importorskip("gguf")

_ROOT = Path(__file__).resolve().parents[1]
#: vocabulary 416 > the tokenizer's 400: the GGUF pads it with unused entries
_SHAPE = dict(vocab_size=416, dim=64, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=64,
              rope_theta=5000.0, norm_eps=1e-6)
_LEAF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}
#: preset id -> (preset, overrides, GGUF type of its FP4 layers)
_EXACT = {"mxfp4": ("mxfp4", {}, "MXFP4"), "mxfp4-rht-sr": ("mxfp4-rht-sr", {}, "MXFP4"),
          "nvfp4": ("nvfp4", {}, "NVFP4"), "paper-pow2": ("paper", {"scale_mode": "pow2"}, "MXFP4")}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    texts = [(_ROOT / "docs" / name).read_text() for name in ("design.md", "method.md", "training.md")]
    return Tokenizer.train(texts, vocab_size=400)


@pytest.fixture(scope="module")
def weights() -> dict:
    """A LLaMA's state dict with rows of very different sizes (a range of scales per tensor)."""
    g = torch.Generator().manual_seed(50)
    model = Llama(LlamaConfig(**_SHAPE))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(torch.exp2(torch.randint(-3, 4, (p.shape[0], 1), generator=g).float()))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _checkpoint(path: Path, weights: dict, tokenizer: Tokenizer | None, preset: str | None, overrides=None) -> Path:
    """A checkpoint as `fp4lightning train` writes it (what load_checkpoint reads)."""
    torch.save({"hyper_parameters": {"model": dataclasses.asdict(LlamaConfig(**_SHAPE)),
                                     "fp4": None if preset is None else {"preset": preset, "overrides": overrides or {}},
                                     "recipe": None},
                "state_dict": {f"model.{k}": v for k, v in weights.items()},
                "tokenizer": tokenizer.to_str() if tokenizer is not None else None}, path)
    return path


def _export(capsys, *args) -> tuple[int, list[str], str]:
    capsys.readouterr()
    rc = main(["export-gguf", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, err.strip().splitlines(), out


def _forward_weights(model: Llama, monkeypatch) -> dict:
    """{layer name: (weight values, tensor-wide factor)} the FP4 forward multiplies by, recorded from a real
    forward pass where it quantizes the weight (``quantize_weight`` / ``fake_quantize_block``)."""
    layers = {m.weight.data_ptr(): n for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    seen: dict = {}
    real_rows, real_block = linear.quantize_weight, block_linear.fake_quantize_block

    def rows(weight, cfg, *args, **kwargs):
        quant = real_rows(weight, cfg, *args, **kwargs)
        _, scale, vals = quant[:3]
        if weight.data_ptr() in layers:
            seen[layers[weight.data_ptr()]] = (vals.float() / scale[:, None], 1.0)
        return quant

    def block(x, *args, **kwargs):
        vals, factor, dec = real_block(x, *args, **kwargs)
        if x.data_ptr() in layers and x.shape == model.get_submodule(layers[x.data_ptr()]).weight.shape:
            seen[layers[x.data_ptr()]] = (vals.float(), factor)
        return vals, factor, dec

    monkeypatch.setattr(linear, "quantize_weight", rows)
    monkeypatch.setattr(block_linear, "fake_quantize_block", block)
    with torch.no_grad():
        model(torch.randint(0, _SHAPE["vocab_size"], (2, 16)))
    assert sorted(seen) == sorted(layers.values())
    return seen


def _gguf_name(layer: str) -> str:
    _, i, rest = layer.split(".", 2)
    return f"blk.{i}.{_LEAF[rest]}"


def _unpermuted(name: str, values: np.ndarray) -> np.ndarray:
    """GGUF q/k rows back in our rotate-half order."""
    heads = {"attn_q": _SHAPE["n_heads"], "attn_k": _SHAPE["n_kv_heads"]}.get(name.removesuffix(".weight").split(".")[-1])
    if heads is None:
        return values
    out = np.empty_like(values)
    out[rope_row_order(values.shape[0], heads).numpy()] = values
    return out


def _bits(x) -> np.ndarray:
    """fp32 bit patterns, with -0 as +0: GGUF's E2M1 tables have no negative zero (code 8 decodes to +0),
    which changes no product and no sum."""
    return (np.asarray(x, dtype=np.float32) + np.float32(0)).view(np.uint32)


@pytest.mark.parametrize("preset_id", list(_EXACT))
def test_fp4_tensors_read_back_bitwise_as_the_forward_multiplies(preset_id, weights, tokenizer, tmp_path, capsys,
                                                                monkeypatch):
    preset, overrides, qtype = _EXACT[preset_id]
    ckpt = _checkpoint(tmp_path / "run.ckpt", weights, tokenizer, preset, overrides)
    rc, err, out = _export(capsys, ckpt, tmp_path / "model.gguf")
    assert rc == 0 and not err, err
    model = load_checkpoint(ckpt, fp4=True).model
    fwd = _forward_weights(model, monkeypatch)
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    n_fp4 = {"nvfp4": 7}.get(preset_id, 21)  # nvfp4 keeps the first and the last block in high precision
    assert len(fwd) == n_fp4 and f"{n_fp4} {qtype}" in out
    for layer, (values, factor) in fwd.items():
        t = tensors[_gguf_name(layer) + ".weight"]
        assert t.tensor_type.name == qtype, layer
        back = _unpermuted(t.name, gguf.quants.dequantize(t.data, t.tensor_type))
        assert np.array_equal(_bits(back), _bits(values)), layer
        scale = tensors.get(_gguf_name(layer) + ".scale")
        if qtype == "NVFP4":  # the per-tensor scale llama.cpp multiplies the output by, as our epilogue does
            assert scale.tensor_type.name == "F32" and scale.data.tolist() == [float(factor)]
        else:
            assert scale is None and factor == 1.0
    # everything else: the master weights, exactly (f32)
    for key, value in weights.items():
        name = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, 3).get_name(
            key if key.startswith("lm_head") else "model." + key, try_suffixes=(".weight",))
        if name.removesuffix(".weight") not in {_gguf_name(n) for n in fwd}:
            t = tensors[name]
            assert t.tensor_type.name == "F32", name
            assert np.array_equal(_unpermuted(name.removesuffix(".weight"), t.data.reshape(value.shape)),
                                  value.numpy()), name


def test_metadata_and_f16(weights, tokenizer, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "run.ckpt", weights, tokenizer, "mxfp4")
    rc, err, _ = _export(capsys, ckpt, tmp_path / "model.gguf", "--dtype", "f16")
    assert rc == 0, err
    r = gguf.GGUFReader(tmp_path / "model.gguf")
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    cfg = LlamaConfig(**_SHAPE)
    want = {"general.architecture": "llama", "llama.context_length": cfg.max_seq_len, "llama.embedding_length": 64,
            "llama.block_count": 3, "llama.feed_forward_length": 128, "llama.attention.head_count": 2,
            "llama.attention.head_count_kv": 1, "llama.rope.dimension_count": 32, "llama.vocab_size": 416,
            "general.file_type": int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE), "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.bos_token_id": tokenizer.bos_id,
            "tokenizer.ggml.eos_token_id": tokenizer.eos_id, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False}
    assert {k: f.get(k) for k in want} == want
    assert f["llama.rope.freq_base"] == pytest.approx(5000.0) and f["llama.attention.layer_norm_rms_epsilon"] == \
        pytest.approx(1e-6, rel=1e-6)
    assert not any("chat_template" in k or "unknown_token" in k or "padding_token" in k for k in f)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["token_embd.weight"] == types["output.weight"] == "F16"
    assert types["output_norm.weight"] == types["blk.0.attn_norm.weight"] == types["blk.2.ffn_norm.weight"] == "F32"
    assert len(r.tensors) == 2 + 1 + 3 * 9


def test_vocabulary_rebuilds_our_token_ids(weights, tokenizer, tmp_path, capsys):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    ckpt = _checkpoint(tmp_path / "run.ckpt", weights, tokenizer, "mxfp4")
    assert _export(capsys, ckpt, tmp_path / "model.gguf")[0] == 0
    f = gguf.GGUFReader(tmp_path / "model.gguf").fields
    tokens, types = f["tokenizer.ggml.tokens"].contents(), f["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in f["tokenizer.ggml.merges"].contents()]
    assert len(tokens) == 416 and types.count(gguf.TokenType.UNUSED) == 16
    assert [i for i, t in enumerate(types) if t == gguf.TokenType.CONTROL] == sorted([tokenizer.bos_id, tokenizer.eos_id])
    rebuilt = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens) if types[i] == gguf.TokenType.NORMAL}, merges))
    rebuilt.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex: tokenizer.ggml.pre
    rebuilt.decoder = decoders.ByteLevel()
    text = (_ROOT / "README.md").read_text() + "\n  tabs\tand  spaces, ünïcödé 日本語 123456 ''quotes'' \n\n"
    ids = rebuilt.encode(text).ids
    assert ids == tokenizer.encode(text, bos=False) and len(ids) > 1000
    assert rebuilt.decode(ids) == text


def test_rope_rows_give_llama_cpp_interleaved_rotation_our_scores():
    """q.k after our rotate-half RoPE == q.k after llama.cpp's interleaved RoPE on the permuted rows."""
    g = torch.Generator().manual_seed(0)
    n_heads, hd, t, dim = 2, 32, 12, 64
    x = torch.randn(t, dim, generator=g, dtype=torch.float64)
    wq, wk = torch.randn(n_heads * hd, dim, generator=g, dtype=torch.float64), torch.randn(hd, dim, generator=g,
                                                                                           dtype=torch.float64)
    cos, sin = rope_cos_sin(t, hd, 10000.0, torch.device("cpu"))
    ours_q = apply_rope((x @ wq.t()).view(t, n_heads, hd).transpose(0, 1), cos.double(), sin.double())
    ours_k = apply_rope((x @ wk.t()).view(t, 1, hd).transpose(0, 1), cos.double(), sin.double())
    pos = torch.arange(t, dtype=torch.float64)[:, None]
    theta = pos * 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (T, hd/2): pair i turns at freq i

    def interleaved(y):  # llama.cpp's LLAMA_ROPE_TYPE_NORM: pairs (2i, 2i+1)
        a, b = y[..., 0::2], y[..., 1::2]
        return torch.stack((a * theta.cos() - b * theta.sin(), a * theta.sin() + b * theta.cos()), -1).flatten(-2)

    cpp_q = interleaved((x @ wq[rope_row_order(n_heads * hd, n_heads)].t()).view(t, n_heads, hd).transpose(0, 1))
    cpp_k = interleaved((x @ wk[rope_row_order(hd, 1)].t()).view(t, 1, hd).transpose(0, 1))
    torch.testing.assert_close(cpp_q @ cpp_k.transpose(-1, -2), ours_q @ ours_k.transpose(-1, -2), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- bad input
def test_float_scales_refused_then_requantized_with_their_sqnr(weights, tokenizer, tmp_path, capsys, monkeypatch):
    ckpt = _checkpoint(tmp_path / "run.ckpt", weights, tokenizer, "paper")
    out = tmp_path / "model.gguf"
    rc, err, _ = _export(capsys, ckpt, out)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("fp4lightning export-gguf: error: layer layers.0.self_attn.q_proj cannot be stored")
    assert "scale_mode=float" in err[0] and "--requantize" in err[0] and "scale_mode=pow2" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]
    rc, err, printed = _export(capsys, ckpt, out, "--requantize")
    assert rc == 0, err
    fwd = _forward_weights(load_checkpoint(ckpt, fp4=True).model, monkeypatch)
    tensors = {t.name: t for t in gguf.GGUFReader(out).tensors}
    dbs = {}
    for layer, (values, _) in fwd.items():
        t = tensors[_gguf_name(layer) + ".weight"]
        assert t.tensor_type.name == "MXFP4"
        dbs[t.name] = sqnr_db(_unpermuted(_gguf_name(layer), gguf.quants.dequantize(t.data, t.tensor_type)), values)
    worst = min(dbs, key=dbs.get)
    assert 14 < dbs[worst] < 30  # a re-quantization: neither exact nor garbage
    assert f"lowest {dbs[worst]:.2f} dB ({worst})" in printed and "re-quantized 21 FP4 layers to MXFP4" in printed


def test_existing_output_refused_without_overwrite(weights, tokenizer, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "run.ckpt", weights, tokenizer, "mxfp4")
    out = tmp_path / "model.gguf"
    out.write_bytes(b"my file")
    rc, err, _ = _export(capsys, ckpt, out)
    assert rc == 2 and len(err) == 1 and f"OUT {out} exists" in err[0] and "--overwrite" in err[0], err
    assert out.read_bytes() == b"my file"
    assert _export(capsys, ckpt, out, "--overwrite")[0] == 0
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    rc, err, _ = _export(capsys, ckpt, tmp_path)
    assert rc == 2 and len(err) == 1 and "is a folder" in err[0], err


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_full_disk_leaves_the_old_file_and_nothing_else(weights, tokenizer, tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "run.ckpt", weights, tokenizer, "nvfp4")
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "768k")
    try:
        out = disk / "model.gguf"
        assert _export(capsys, ckpt, out)[0] == 0  # ~530 KB: no room for a second one beside it
        before = out.read_bytes()
        (disk / f".model.gguf.export-{2**22 + 7}").write_bytes(b"left by a killed export")  # no such process
        rc, err, _ = _export(capsys, ckpt, out, "--overwrite")
        assert rc == 2 and len(err) == 1, err
        assert err[0].startswith(f"fp4lightning export-gguf: error: no space left on device while writing {out}")
        assert "nothing was written" in err[0]
        assert out.read_bytes() == before and sorted(p.name for p in disk.iterdir()) == ["model.gguf"]
    finally:
        import subprocess

        subprocess.run(["umount", str(disk)], check=False)


def test_missing_corrupt_and_foreign_checkpoints(weights, tokenizer, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    cases = {"missing": (tmp_path / "nope.ckpt", "CKPT"),
             "corrupt": (tmp_path / "corrupt.ckpt", "is corrupt or not a PyTorch checkpoint"),
             "foreign": (tmp_path / "foreign.ckpt", "is not an fp4lightning training checkpoint"),
             "no-tokenizer": (tmp_path / "notok.ckpt", "holds no tokenizer")}
    (tmp_path / "corrupt.ckpt").write_bytes(b"\x80\x04 not a checkpoint")
    # a Lightning checkpoint of a module that is not fp4lightning's LLaMA
    torch.save({"state_dict": {"body.0.weight": torch.zeros(4, 4)}, "hyper_parameters": {"vocab": 48}},
               tmp_path / "foreign.ckpt")
    _checkpoint(tmp_path / "notok.ckpt", weights, None, "mxfp4")
    for case, (path, says) in cases.items():
        rc, err, _ = _export(capsys, path, out)
        assert rc == 2 and len(err) == 1 and says in err[0], (case, err)
        assert str(path) in err[0] or case == "no-tokenizer", (case, err)
        assert not out.exists() and not list(tmp_path.glob(".model.gguf*")), case
