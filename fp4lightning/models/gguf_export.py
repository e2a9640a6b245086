"""A trained LLaMA as one GGUF file for llama.cpp (``fp4lightning export-gguf``), its FP4 layers stored as the
FP4 codes and scales the training forward multiplied by.

Which GGUF tensor type holds a run's FP4 linear layers (``gguf`` >= 0.19, llama.cpp's own writer):

* ``mxfp4``, ``mxfp4-rht-sr`` -> ``MXFP4``: 32-element blocks along K with one E8M0 scale, the OCP format
  the forward quantizes the weight to (RHT and stochastic rounding act on the backward GeMMs only).
* ``nvfp4`` -> ``NVFP4``: 16-element blocks with E4M3 scales, four to a 64-element GGUF block, and the
  per-tensor fp32 scale as the F32 tensor ``<name>.scale`` that llama.cpp multiplies the layer's output by
  (its convention for NVIDIA ModelOpt checkpoints; our forward applies it in the same place, the GeMM's
  epilogue). Each row's 16-blocks carry the scale of the 16 x 16 weight tile they lie in.
* ``paper`` and its ablations with ``scale_mode=pow2`` -> ``MXFP4``: the per-row scale ``s`` is a power of two,
  so every 32-block of the row takes the E8M0 scale ``1/s`` and the codes unchanged.
* the same presets with float scales (the default): no GGUF type holds ``code / s`` exactly. Refused unless
  ``requantize``; then the forward's FP4 weights are re-quantized to MXFP4 with ``gguf.quants.quantize``
  and the weight SQNR (MXFP4 against the forward's weights) is reported per layer.

Layers the run kept in high precision, the embeddings and the head are written in F32 or F16 (``dtype``);
the norms always in F32 (llama.cpp's convention for 1-D tensors). The master weights are what those
layers computed with.

Layout. llama.cpp's ``llama`` architecture rotates interleaved pairs ``(x[2i], x[2i+1])``; our RoPE is
Hugging Face's rotate-half (``fp4lightning.models.llama``), so the rows of ``q_proj`` and ``k_proj`` are
permuted as llama.cpp's ``convert_hf_to_gguf.py`` permutes them (:func:`rope_row_order`). Blocks run
along K, so a row permutation moves whole rows of codes and scales and changes no value.

Packing. Our codes (``fp4lightning.numerics.formats``) are E2M1 bit patterns ``sign << 3 | magnitude
index``, two to a byte, element ``2j`` in the low nibble. GGUF uses the same 4-bit codes (its tables hold
the values doubled and the scales halved) in another order: an MXFP4 block is the E8M0 byte, then 16
bytes holding elements ``j`` (low nibble) and ``j + 16`` (high); an NVFP4 block is four E4M3 scale bytes,
then per 16-block 8 bytes holding elements ``j`` and ``j + 8``. ``gguf`` has a quantizer for MXFP4 but
none that keeps given codes and scales, and none for NVFP4, so both are packed here
(:func:`pack_mxfp4`, :func:`pack_nvfp4`); ``tests/test_export_gguf.py`` reads them back with
``gguf.GGUFReader`` and ``gguf.quants.dequantize``.

The file is written beside the target (``.<name>.export-<pid>``) and renamed into place when complete:
a full disk or an error leaves the target as it was. ``gguf`` is imported inside the functions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fp4lightning.config import FP4Config
from fp4lightning.errors import UsageError
from fp4lightning.models.export_file import check_export_file, export_file
from fp4lightning.models.llama import Llama
from fp4lightning.nn.linear import FP4Linear, quantize_weight
from fp4lightning.numerics.block_formats import quantize_block
from fp4lightning.numerics.constants import E8M0_BIAS
from fp4lightning.numerics.formats import unpack_fp4

__all__ = ["GGUF_DTYPES", "GGUFReport", "exact_gguf_type", "export_gguf", "fp4_gguf_tensor",
           "pack_mxfp4", "pack_nvfp4", "rope_row_order", "require_gguf", "forward_weight", "sqnr_db"]

#: --dtype choices: the GGUF type of the embeddings, the head and the layers kept in high precision
GGUF_DTYPES = ("f32", "f16")
MXFP4_BLOCK = 32  # elements per GGUF MXFP4 block (one E8M0 byte + 16 bytes of codes)
NVFP4_SUPERBLOCK = 64  # elements per GGUF NVFP4 block: four 16-element sub-blocks (4 scale bytes + 32 bytes)
NVFP4_SUB = 16
#: GGUF tokenizer: byte-level BPE (llama.cpp's "gpt2" model) with GPT-2's pre-tokenizer regex, which is
#: ours (``fp4lightning.data.tokenizer``: ``ByteLevel(add_prefix_space=False)``)
TOKENIZER_MODEL, TOKENIZER_PRE = "gpt2", "gpt-2"


def require_gguf():
    """The ``gguf`` module; ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a dependency of fp4lightning
        raise ImportError("export-gguf needs the gguf package: pip install 'gguf==0.19.0'") from e
    return gguf


# ----------------------------------------------------------------------------- which type is exact
def exact_gguf_type(cfg: FP4Config) -> tuple[str | None, str]:
    """``("MXFP4" | "NVFP4" | None, why)``: the GGUF type that holds a layer of ``cfg`` exactly, else None and
    the reason in words."""
    if "fprop.w" in cfg.stochastic_rounding:
        return None, "its forward rounds the weight stochastically (stochastic_rounding holds fprop.w)"
    if cfg.block_format == "block32_e8m0":
        return "MXFP4", "the forward's own MXFP4 codes and E8M0 scales"
    if cfg.block_format == "block16_e4m3":
        return "NVFP4", "the forward's own NVFP4 codes, E4M3 block scales and fp32 tensor scale"
    if cfg.scale_mode == "pow2":
        return "MXFP4", "per-row power-of-two scales: each 32-block takes its row's scale as E8M0"
    return None, ("its per-row scales are floats (scale_mode=float), which no E8M0 or E4M3 block scale holds "
                  "exactly")


def forward_weight(layer: FP4Linear) -> torch.Tensor:
    """(N, K) fp32: the weight values the layer's FP4 forward multiplies by on the reference path,
    the E2M1 values times their scales (NVFP4's tensor scale not included: see :func:`fp4_gguf_tensor`)."""
    cfg, w = layer.config, layer.weight.detach().float()
    if cfg.block_format != "none":
        q = quantize_block(w, _block_name(cfg), "nearest", None, block_2d=cfg.weight_block_2d)
        vals, _ = q.gemm_operand(torch.float32)
        return vals
    _, scale, vals = quantize_weight(w, cfg, torch.float32)
    return vals / scale[:, None]


def _block_name(cfg: FP4Config) -> str:
    return {"block16_e4m3": "nvfp4", "block32_e8m0": "mxfp4"}[cfg.block_format]


# ----------------------------------------------------------------------------- packing
def pack_mxfp4(codes: torch.Tensor, e8m0: torch.Tensor) -> np.ndarray:
    """GGUF MXFP4 bytes (N, K/32 * 17) of 4-bit codes (N, K) and biased E8M0 exponents (N, K/32)."""
    n, k = codes.shape
    c = codes.reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    qs = c[..., :16] | (c[..., 16:] << 4)
    return torch.cat([e8m0.reshape(n, -1, 1), qs], dim=-1).reshape(n, -1).numpy()


def pack_nvfp4(codes: torch.Tensor, e4m3: torch.Tensor) -> np.ndarray:
    """GGUF NVFP4 bytes (N, K/64 * 36) of 4-bit codes (N, K) and E4M3 block scales (N, K/16)
    (``float8_e4m3fn``, positive: llama.cpp reads them as unsigned E4M3)."""
    n, k = codes.shape
    c = codes.reshape(n, k // NVFP4_SUPERBLOCK, 4, NVFP4_SUB)
    qs = (c[..., :8] | (c[..., 8:] << 4)).reshape(n, k // NVFP4_SUPERBLOCK, 32)
    d = (e4m3.view(torch.uint8) & 0x7F).reshape(n, k // NVFP4_SUPERBLOCK, 4)
    return torch.cat([d, qs], dim=-1).reshape(n, -1).numpy()


@dataclass
class FP4Tensor:
    """One FP4 layer as GGUF data: ``raw`` uint8 (N, bytes per row) of ``qtype``; ``tensor_scale`` (NVFP4's
    fp32 per-tensor scale, else None); ``sqnr_db`` of a re-quantization (else None)."""

    raw: np.ndarray
    qtype: str
    tensor_scale: float | None = None
    sqnr_db: float | None = None


def fp4_gguf_tensor(layer: FP4Linear, name: str, requantize: bool = False) -> FP4Tensor:
    """``layer``'s FP4 weight as GGUF data: exact where :func:`exact_gguf_type` says so, else (with
    ``requantize``) the forward's weights re-quantized to MXFP4; :class:`UsageError` naming ``name`` otherwise."""
    cfg, w = layer.config, layer.weight.detach().float()
    n, k = w.shape
    qtype, why = exact_gguf_type(cfg)
    if not torch.isfinite(w).all():
        raise UsageError(f"layer {name} holds non-finite weights; this checkpoint cannot be exported")
    if qtype == "NVFP4" and k % NVFP4_SUPERBLOCK:
        qtype, why = None, f"its input size {k} is not a multiple of {NVFP4_SUPERBLOCK} (a GGUF NVFP4 block)"
    elif qtype == "MXFP4" and k % MXFP4_BLOCK:
        qtype, why = None, f"its input size {k} is not a multiple of {MXFP4_BLOCK} (a GGUF MXFP4 block)"
    if qtype is None:
        if not requantize:
            raise UsageError(f"layer {name} cannot be stored in GGUF exactly: {why}; pass --requantize to "
                             "re-quantize its FP4 weights to MXFP4 (the weight SQNR is printed), or train with "
                             "fp4.overrides.scale_mode=pow2 or the mxfp4 / nvfp4 preset for an exact export")
        return _requantized(layer, name)
    if qtype == "NVFP4":
        q = quantize_block(w, "nvfp4", "nearest", None, block_2d=cfg.weight_block_2d)
        scales = q.scales.repeat_interleave(NVFP4_SUB, dim=0)[:n] if cfg.weight_block_2d else q.scales
        return FP4Tensor(pack_nvfp4(unpack_fp4(q.codes, k), scales), "NVFP4", float(q.global_scale))
    if cfg.block_format != "none":
        q = quantize_block(w, "mxfp4", "nearest", None)
        return FP4Tensor(pack_mxfp4(unpack_fp4(q.codes, k), q.scales), "MXFP4")
    return FP4Tensor(pack_mxfp4(*_pow2_rows(w, cfg, name)), "MXFP4")


def _pow2_rows(w: torch.Tensor, cfg: FP4Config, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes (N, K), E8M0 (N, K/32)) of the paper quantizer's power-of-two per-row scales."""
    n, k = w.shape
    packed, scale, _ = quantize_weight(w, cfg, torch.float32)
    codes = unpack_fp4(packed, k)
    mant, exp = torch.frexp(scale.double())  # scale = 0.5 * 2**exp exactly when mant == 0.5
    biased = E8M0_BIAS - (exp - 1)  # decode scale 1/s = 2**(1 - exp)
    nonzero = (codes & 0x7).amax(dim=1) > 0
    bad = nonzero & ((mant != 0.5) | (biased < 0) | (biased > 2 * E8M0_BIAS))
    if bad.any():
        row = int(bad.nonzero()[0])
        raise UsageError(f"layer {name}: row {row}'s scale {float(scale[row])!r} is not a power of two in E8M0's "
                         "range; pass --requantize to re-quantize it to MXFP4")
    biased = torch.where(nonzero, biased, torch.zeros_like(biased)).to(torch.uint8)  # an all-zero row: any scale
    return codes, biased[:, None].expand(n, k // MXFP4_BLOCK).contiguous()


def _requantized(layer: FP4Linear, name: str) -> FP4Tensor:
    gguf = require_gguf()
    k = layer.weight.shape[1]
    if k % MXFP4_BLOCK:
        raise UsageError(f"layer {name}: its input size {k} is not a multiple of {MXFP4_BLOCK}, so GGUF has no FP4 "
                         "type for it")
    ref = forward_weight(layer).numpy()
    raw = gguf.quants.quantize(ref, gguf.GGMLQuantizationType.MXFP4)
    back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    return FP4Tensor(raw, "MXFP4", sqnr_db=sqnr_db(back, ref))


def sqnr_db(x: np.ndarray | torch.Tensor, ref: np.ndarray | torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (x - ref)^2)`` in float64 (inf when equal)."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    err = float(((x - ref) ** 2).sum())
    return math.inf if err == 0 else 10 * math.log10(float((ref**2).sum()) / err)


def rope_row_order(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that turns a rotate-half (Hugging Face) ``q_proj`` / ``k_proj`` into llama.cpp's interleaved
    RoPE layout: within each head, rows ``(0, d/2, 1, d/2 + 1, ...)`` (``convert_hf_to_gguf.py``'s permute)."""
    hd = n_rows // n_heads
    return torch.arange(n_rows).reshape(n_heads, 2, hd // 2).transpose(1, 2).reshape(-1)


# ----------------------------------------------------------------------------- the file
@dataclass
class GGUFReport:
    """What :func:`export_gguf` wrote: the GGUF type of each tensor, the re-quantized layers' SQNR."""

    path: Path
    types: dict[str, str] = field(default_factory=dict)
    sqnr_db: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for t in self.types.values():
            counts[t] = counts.get(t, 0) + 1
        return ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))

    def sqnr_line(self) -> str:
        """One line on the re-quantized layers: their weight SQNR, median and lowest."""
        dbs = sorted(self.sqnr_db.values())
        worst = min(self.sqnr_db, key=self.sqnr_db.get)
        return (f"re-quantized {len(dbs)} FP4 layers to MXFP4 (no GGUF type holds their scales exactly): weight "
                f"SQNR against the FP4 weights of training, median {dbs[len(dbs) // 2]:.2f} dB, lowest "
                f"{dbs[0]:.2f} dB ({worst})")


def export_gguf(model: Llama, tokenizer, out: str | os.PathLike, dtype: str = "f32", requantize: bool = False,
                overwrite: bool = False, name: str | None = None) -> GGUFReport:
    """Write ``model`` (FP4 layers converted as in training: ``load_checkpoint(fp4=True)``) and ``tokenizer``
    (:class:`~fp4lightning.data.tokenizer.Tokenizer`) as a llama.cpp GGUF file ``out``. See the module docstring
    for the types; raises :class:`UsageError` for what cannot be exported, before anything is written."""
    gguf = require_gguf()
    if dtype not in GGUF_DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    if not isinstance(model, Llama):
        raise UsageError(f"export-gguf writes fp4lightning's LLaMA only, not a {type(model).__name__}")
    if tokenizer is None:
        raise UsageError("the checkpoint holds no tokenizer (nor is there a tokenizer.json beside it); a GGUF file "
                         "needs one: export a checkpoint written by fp4lightning train")
    out = Path(out)
    check_export_file(out, overwrite)
    report = GGUFReport(out)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    tensors = _tensors(model, dtype, requantize, report)  # every refusal happens here, before the file exists
    _add_metadata(writer, model, name, _file_type(report, dtype))
    _add_tokenizer(writer, tokenizer, model.config.vocab_size)
    for tname, (data, qtype) in tensors.items():
        writer.add_tensor(tname, data, raw_dtype=qtype)
    _write(writer, out, overwrite)
    return report


def _file_type(report: GGUFReport, dtype: str) -> int:
    gguf = require_gguf()
    types = set(report.types.values())
    if "NVFP4" in types:
        return gguf.LlamaFileType.MOSTLY_NVFP4
    if "MXFP4" in types:
        return gguf.LlamaFileType.MOSTLY_MXFP4_MOE  # llama.cpp's one MXFP4 file type, used for dense models too
    return gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32


def _tensors(model: Llama, dtype: str, requantize: bool, report: GGUFReport) -> dict:
    """``{gguf name: (numpy data, GGMLQuantizationType or None)}`` in the model's order."""
    gguf = require_gguf()
    cfg = model.config
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, cfg.n_layers)
    heads = {"self_attn.q_proj": cfg.n_heads, "self_attn.k_proj": cfg.kv_heads}
    modules = dict(model.named_modules())
    out: dict = {}
    for key, param in model.state_dict(keep_vars=True).items():
        if cfg.tie_embeddings and key == "lm_head.weight":
            continue  # llama.cpp uses token_embd when output is absent
        tname = names.get_name("model." + key if not key.startswith("lm_head.") else key, try_suffixes=(".weight",))
        if tname is None:
            raise UsageError(f"export-gguf: the model holds {key}, which llama.cpp's llama architecture has no "
                             "tensor for")
        module = modules[key.rsplit(".", 1)[0]]
        order = next((rope_row_order(param.shape[0], h) for s, h in heads.items() if key.endswith(s + ".weight")),
                     None)
        out.update(_tensor(tname, key, module, param, order, dtype, requantize, report))
    return out


def _tensor(tname: str, key: str, module: nn.Module, param: torch.Tensor, order, dtype: str, requantize: bool,
            report: GGUFReport) -> dict:
    gguf = require_gguf()
    if isinstance(module, FP4Linear):
        t = fp4_gguf_tensor(module, key.removesuffix(".weight"), requantize)
        raw = t.raw if order is None else t.raw[order.numpy()]
        report.types[tname] = t.qtype
        if t.sqnr_db is not None:
            report.sqnr_db[tname] = t.sqnr_db
        entries = {tname: (np.ascontiguousarray(raw), gguf.GGMLQuantizationType[t.qtype])}
        if t.tensor_scale is not None:  # llama.cpp multiplies the layer's output by it
            entries[tname.removesuffix(".weight") + ".scale"] = (np.array([t.tensor_scale], np.float32), None)
            report.types[tname.removesuffix(".weight") + ".scale"] = "F32"
        return entries
    w = param.detach().float()
    if order is not None:
        w = w[order]
    as_f16 = dtype == "f16" and w.dim() > 1
    if as_f16 and not torch.isfinite(w.half()).all():
        raise UsageError(f"{key} has values outside float16's range; export with --dtype f32")
    report.types[tname] = "F16" if as_f16 else "F32"
    return {tname: (w.half().numpy() if as_f16 else w.numpy(), None)}


def _add_metadata(writer, model: Llama, name: str | None, file_type: int) -> None:
    gguf = require_gguf()
    cfg = model.config
    writer.add_name(name or "fp4lightning-llama")
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(int(file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Byte-level BPE: tokens (padded to the model's vocabulary with unused ``[PAD<i>]`` entries), types,
    merges, BOS/EOS ids; BOS is added to every text (every training document started with it), EOS is not.
    Our tokenizer has no unknown or padding token, so neither id is written; there is no chat template."""
    gguf = require_gguf()
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    if len(vocab) > vocab_size:
        raise UsageError(f"the tokenizer has {len(vocab)} tokens but the model only {vocab_size} embeddings")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    special = {tokenizer.bos_token, tokenizer.eos_token}
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = gguf.TokenType.CONTROL if tok in special else gguf.TokenType.NORMAL
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(TOKENIZER_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def _write(writer, out: Path, overwrite: bool) -> None:
    """Header, metadata and tensors into the temporary file :func:`export_file` renames to ``out``."""
    with export_file(out, overwrite) as tmp:
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            for f in writer.fout:
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in writer.fout or ():
                with contextlib.suppress(OSError):  # after a full disk the buffered write fails again here
                    f.close()
            writer.fout = None
