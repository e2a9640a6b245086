"""A trained LLaMA as a Hugging Face folder in compressed-tensors' NVFP4 format (``fp4lightning export-hf
--format nvfp4``), its FP4 layers stored as the codes and scales the training forward multiplied by.

compressed-tensors (the format vLLM and ``transformers`` load; scheme ``NVFP4A16``, format
``nvfp4-pack-quantized``) stores a layer as ``weight_packed`` (uint8 (N, K/2): E2M1 codes, two to a byte,
element ``2j`` in the low nibble, ``sign << 3 | magnitude index``: our packing, byte for byte),
``weight_scale`` (``float8_e4m3fn`` (N, K/16): one scale per 16 elements of a row) and
``weight_global_scale`` (fp32 (1,)). Its decode is ``e2m1 * (weight_scale / weight_global_scale)``: the
global scale is stored in the *encode* direction (``448 * 6 / amax``), where ours (``BlockFP4.global_scale``,
``amax / (448 * 6)``) is a decode factor.

Which preset maps exactly:

* ``nvfp4``: the forward's own codes and E4M3 block scales; each row's 16-blocks carry the scale of the
  16 x 16 weight tile they lie in. The global scale is stored as ``G = 1 / g`` rounded to fp32, or the
  fp32 neighbour within two ulps for which ``s / G == s * g`` for every E4M3 scale ``s`` of the layer
  (:func:`ct_global_scale`). Then compressed-tensors' fp32 dequantization equals ours bit for bit;
  where no ``G`` does that (a division cannot always reproduce a product), it is chosen so that the
  bf16 weights compressed-tensors decompresses to (its decompression always yields bf16) equal ours
  rounded to bf16, and the fp32 values differ by at most two ulps. The report says which (and names any
  layer whose bf16 decode no candidate matches; docs/evaluation.md, "Serve it", has the measured rates).
* ``mxfp4`` and ``paper`` with ``scale_mode=pow2``: the forward's block (or row) scales are powers of two,
  so each 16-block keeps the forward's codes with the E4M3 scale ``2**(e - k)`` and the global scale is
  ``2**-k`` (``k`` = the layer's largest block exponent less 8): exact in fp32, as long as the layer's block
  exponents span at most 17 octaves (E4M3 holds powers of two from 2**-9 to 2**8); a block below that
  range is re-quantized like the next case.
* every other preset (``paper`` with float scales, ...) and high-precision runs: no exact representation.
  Refused unless ``requantize``; then the weights the forward multiplied by are re-quantized to NVFP4
  (16-element blocks, round to nearest) and the weight SQNR is reported per layer.

Only the layers the run trained in FP4 are quantized; the rest (the head, the blocks ``keep_first_n`` /
``keep_last_n`` kept) are listed in the config's ``ignore`` and stored in bf16 with the embeddings and
norms. vLLM fuses ``q/k/v_proj`` and ``gate/up_proj`` and keeps one global scale per fused layer (the
largest), so it serves such layers exactly only where their global scales agree. Power-of-two scales can
share one (:func:`_share_fused_global_scales`); the nvfp4 preset trains one per weight, which no shared scale
reproduces: :attr:`NVFP4Export.fused_mismatch` lists those groups and the command says so.

The folder is written by ``compressed-tensors`` itself (``apply_quantization_config``, ``ModelCompressor``
``compress_model`` / ``update_config``) through :func:`fp4lightning.models.hf.save_hf`, so it is renamed
into place only when complete. ``compressed_tensors`` is imported inside the functions.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fp4lightning.config import FP4Config
from fp4lightning.errors import UsageError
from fp4lightning.models.hf import save_hf, to_hf_model
from fp4lightning.models.llama import Llama
from fp4lightning.nn.linear import FP4Linear, quantize_weight
from fp4lightning.numerics.block_formats import BlockFP4, quantize_block, quantize_nvfp4
from fp4lightning.numerics.constants import E8M0_BIAS
from fp4lightning.numerics.formats import unpack_fp4

__all__ = ["CT_SCHEME", "CT_FORMAT", "NVFP4Weight", "NVFP4Export", "exact_nvfp4", "forward_weight", "nvfp4_weight",
           "ct_global_scale", "save_hf_nvfp4", "require_compressed_tensors"]

CT_SCHEME = "NVFP4A16"  # compressed-tensors preset: NVFP4 weights, activations left in 16 bits
CT_FORMAT = "nvfp4-pack-quantized"
GROUP = 16  # elements per NVFP4 block along K
E4M3_POW2_MIN, E4M3_POW2_MAX = -9, 8  # powers of two E4M3 holds: 2**-9 (subnormal) to 2**8 = 256
_ZERO_BLOCK = -(2**30)  # the exponent recorded for a block whose codes are all zero (any scale decodes it)
#: fp32 neighbours of 1/g tried each way for the stored global scale
_G_NEIGHBOURS = 2
#: the pairs vLLM fuses into one layer with one global scale
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def require_compressed_tensors():
    """The ``compressed_tensors`` module; ImportError saying how to install it."""
    try:
        import compressed_tensors
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("export-hf --format nvfp4 needs compressed-tensors: pip install 'fp4lightning[hf]' "
                          "(or compressed-tensors==0.20.1)") from e
    return compressed_tensors


# ----------------------------------------------------------------------------- which preset is exact
def exact_nvfp4(cfg: FP4Config | None) -> tuple[bool, str]:
    """``(exact, why)``: whether a layer trained with ``cfg`` (None: high precision) is stored exactly."""
    if cfg is None:
        return False, "the layer trained in high precision (its weights were never FP4)"
    if "fprop.w" in cfg.stochastic_rounding:
        return False, "its forward rounds the weight stochastically (stochastic_rounding holds fprop.w)"
    if cfg.block_format == "block16_e4m3":
        return True, "the forward's own NVFP4 codes, E4M3 block scales and fp32 tensor scale"
    if cfg.block_format == "block32_e8m0":
        return True, "the forward's MXFP4 codes; its power-of-two block scales as E4M3 under a power-of-two global"
    if cfg.scale_mode == "pow2":
        return True, "the forward's codes; its power-of-two row scales as E4M3 under a power-of-two global"
    return False, ("its per-row scales are floats (scale_mode=float), which no E4M3 block scale under one global "
                   "scale holds exactly")


def forward_weight(layer: nn.Linear) -> torch.Tensor:
    """(N, K) fp32: the weights ``layer``'s forward multiplies by, scales included (the master weights of a
    high-precision layer)."""
    w = layer.weight.detach().float()
    if not isinstance(layer, FP4Linear):
        return w.clone()
    cfg = layer.config
    if cfg.block_format != "none":
        fmt = "nvfp4" if cfg.block_format == "block16_e4m3" else "mxfp4"
        return quantize_block(w, fmt, "nearest", None, block_2d=cfg.weight_block_2d).dequantize()
    _, scale, vals = quantize_weight(w, cfg, torch.float32)
    return vals / scale[:, None]


# ----------------------------------------------------------------------------- one layer
@dataclass
class NVFP4Weight:
    """One layer in compressed-tensors' layout: ``packed`` uint8 (N, K/2), ``scale`` ``float8_e4m3fn``
    (N, K/16), ``global_scale`` fp32 (1,) (a divisor); ``reference`` the (N, K) fp32 weights it stands for
    (our dequantization); ``fp32_exact``: compressed-tensors' fp32 decode equals ``reference`` bit for bit
    (else in bf16); ``sqnr_db`` of a re-quantization (None: exact)."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor
    reference: torch.Tensor
    fp32_exact: bool = True
    sqnr_db: float | None = None
    bf16_exact: bool = True
    pow2_exps: torch.Tensor | None = None  # (N, K/16) block exponents of power-of-two scales (_ZERO_BLOCK: no code)


def ct_global_scale(q: BlockFP4) -> tuple[torch.Tensor, bool, bool]:
    """``(G, fp32_exact, bf16_exact)``: compressed-tensors' global scale (fp32 (1,)) for our decode factor ``g``,
    and whether its decode equals ours in fp32 and after rounding to bf16.

    Our decode is ``e2m1 * (s * g)`` (``BlockFP4.dequantize``: scale first, then values), theirs
    ``e2m1 * (s / G)``; the two agree bitwise where ``s / G == s * g`` in fp32 for every block scale ``s``.
    Tried: ``fl(1/g)`` and its neighbours; the one whose bf16 decode agrees and whose fp32 decode is fewest
    ulps off (nearest ``fl(1/g)`` on a tie)."""
    g = q.global_scale.float().reshape(())
    s = torch.unique(q.scales.float().flatten())
    s = s[s > 0]
    mags = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ours = (s * g)[:, None] * mags  # every (block scale, magnitude) pair the layer can decode
    g0 = (1.0 / g).reshape(1)
    bits = g0.view(torch.int32)
    best, best_key = g0, None
    for d in sorted(range(-_G_NEIGHBOURS, _G_NEIGHBOURS + 1), key=abs):
        cand = (bits + d).view(torch.float32)
        theirs = (s / cand)[:, None] * mags
        ulps = int((theirs.view(torch.int32) - ours.view(torch.int32)).abs().max()) if s.numel() else 0
        key = (not torch.equal(theirs.bfloat16(), ours.bfloat16()), ulps)
        if best_key is None or key < best_key:
            best, best_key = cand, key
    return best.clone(), best_key[1] == 0, not best_key[0]


def _from_blocks(q: BlockFP4, reference: torch.Tensor, sqnr_db: float | None) -> NVFP4Weight:
    n = q.shape[0]
    scale = q.scales.repeat_interleave(GROUP, dim=0)[:n] if q.block_2d else q.scales
    G, fp32_exact, bf16_exact = ct_global_scale(q)
    return NVFP4Weight(q.codes.contiguous(), scale.contiguous(), G, reference, fp32_exact, sqnr_db, bf16_exact)


def nvfp4_weight(layer: nn.Linear, name: str, requantize: bool = False) -> NVFP4Weight:
    """``layer``'s weight for compressed-tensors: exact where :func:`exact_nvfp4` says so, else (with
    ``requantize``) re-quantized; :class:`UsageError` naming ``name`` otherwise."""
    w = layer.weight.detach().float()
    n, k = w.shape
    if not torch.isfinite(w).all():
        raise UsageError(f"layer {name} holds non-finite weights; this checkpoint cannot be exported")
    if k % GROUP:
        raise UsageError(f"layer {name}: its input size {k} is not a multiple of {GROUP}, which compressed-tensors' "
                         "NVFP4 needs; export with --format fp32")
    cfg = layer.config if isinstance(layer, FP4Linear) else None
    exact, why = exact_nvfp4(cfg)
    if exact and cfg.block_format == "block16_e4m3":
        q = quantize_nvfp4(w, "nearest", None, block_2d=cfg.weight_block_2d)
        return _from_blocks(q, q.dequantize(), None)
    if exact:
        got = _pow2_exact(layer)
        if got is not None:
            return got
        why = "its block scales span more than the 17 octaves E4M3 holds under one global scale"
    if not requantize:
        raise UsageError(f"layer {name} cannot be stored in NVFP4 exactly: {why}; pass --requantize to re-quantize "
                         "the weights its forward used to NVFP4 (the weight SQNR is printed), train with the nvfp4 "
                         "preset for an exact export, or export with --format fp32")
    ref = forward_weight(layer)
    q = quantize_nvfp4(ref, "nearest", None)
    back = q.dequantize()
    return _from_blocks(q, back, _sqnr_db(back, ref))


def _pow2_exact(layer: FP4Linear) -> NVFP4Weight | None:
    """The layer (MXFP4, or the paper quantizer with power-of-two scales) with its codes and its block exponents
    ``e`` as E4M3 scales ``2**(e - k)`` under the global scale ``2**-k``; None where one is out of E4M3's range."""
    cfg, w = layer.config, layer.weight.detach().float()
    n, k = w.shape
    if cfg.block_format == "block32_e8m0":
        q = quantize_block(w, "mxfp4", "nearest", None)
        exps = (q.scales.to(torch.int32) - E8M0_BIAS).repeat_interleave(2, dim=1)  # (N, K/16)
        packed, reference = q.codes, q.dequantize()
    else:
        packed, scale, vals = quantize_weight(w, cfg, torch.float32)
        mant, e = torch.frexp(scale.double())  # the encode scale is 0.5 * 2**e: the decode scale 2**(1 - e)
        if (mant != 0.5).any():
            return None
        exps = (1 - e).to(torch.int32)[:, None].expand(n, k // GROUP)
        reference = vals / scale[:, None]
    nonzero = (unpack_fp4(packed, k).reshape(n, k // GROUP, GROUP) & 0x7).amax(-1) > 0
    if not nonzero.any():
        exps, nonzero = torch.zeros_like(exps), torch.ones_like(nonzero)
    exps = torch.where(nonzero, exps, torch.full_like(exps, _ZERO_BLOCK))
    w = NVFP4Weight(packed.contiguous(), torch.empty(0), torch.empty(0), reference, pow2_exps=exps)
    return w if _pow2_rebase(w, int(exps.max()) - E4M3_POW2_MAX) else None


def _pow2_rebase(w: NVFP4Weight, top: int) -> bool:
    """Set ``w``'s E4M3 scales to ``2**(e - top)`` and its global scale to ``2**-top`` (from its block exponents
    ``e``); False, ``w`` unchanged, where a block holding a non-zero code or the global scale falls outside
    E4M3's powers of two or fp32's normal range."""
    exps = w.pow2_exps
    rel = exps[exps != _ZERO_BLOCK] - top
    if not (bool(((rel >= E4M3_POW2_MIN) & (rel <= E4M3_POW2_MAX)).all()) and -126 <= top <= 127):
        return False
    rel = (exps - top).clamp(E4M3_POW2_MIN, E4M3_POW2_MAX).float()
    w.scale = torch.ldexp(torch.ones(()), rel).to(torch.float8_e4m3fn).contiguous()
    w.global_scale = torch.ldexp(torch.ones(1), torch.tensor([-float(top)]))
    return True


def _share_fused_global_scales(weights: dict[str, NVFP4Weight]) -> None:
    """Give the layers vLLM fuses (q/k/v_proj, gate/up_proj) one global scale where all have power-of-two
    scales that stay in E4M3's range under it, so vLLM, which keeps one per fused layer, decodes them as we do."""
    for name in weights:
        prefix, _, leaf = name.rpartition(".")
        for group in _FUSED:
            members = [weights.get(f"{prefix}.{g}") for g in group]
            if leaf != group[0] or any(m is None or m.pow2_exps is None for m in members):
                continue
            top = max(-int(torch.log2(m.global_scale)) for m in members)
            saved = [(m.scale, m.global_scale) for m in members]
            if not all(_pow2_rebase(m, top) for m in members):
                for m, (sc, g) in zip(members, saved):
                    m.scale, m.global_scale = sc, g


def _sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``10 log10(sum ref^2 / sum (x - ref)^2)`` in float64 (inf when equal)."""
    err = float((x.double() - ref.double()).pow(2).sum())
    return math.inf if err == 0 else 10 * math.log10(float(ref.double().pow(2).sum()) / err)


# ----------------------------------------------------------------------------- the folder
@dataclass
class NVFP4Export:
    """What :func:`save_hf_nvfp4` wrote: the HF names of the NVFP4 layers, whether each decodes bitwise in fp32,
    the re-quantized layers' SQNR, the fused groups whose global scales differ (vLLM)."""

    path: Path
    layers: list[str] = field(default_factory=list)
    fp32_inexact: list[str] = field(default_factory=list)
    bf16_inexact: list[str] = field(default_factory=list)
    sqnr_db: dict[str, float] = field(default_factory=dict)
    fused_mismatch: list[str] = field(default_factory=list)
    high_precision: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """What the command prints about the export, one line each."""
        out = [f"NVFP4 ({CT_SCHEME}, compressed-tensors): {len(self.layers)} layers; high precision (bf16): "
               f"{len(self.high_precision)} linear layers"]
        if self.sqnr_db:
            dbs = sorted(self.sqnr_db.values())
            worst = min(self.sqnr_db, key=self.sqnr_db.get)
            out.append(f"re-quantized {len(dbs)} layers to NVFP4: weight SQNR against the weights their forward "
                       f"used, median {dbs[len(dbs) // 2]:.2f} dB, lowest {dbs[0]:.2f} dB ({worst})")
        else:
            out.append("the codes and block scales are the training forward's own (power-of-two ones as E4M3 under a "
                       "power-of-two global scale); "
                       f"{len(self.layers) - len(self.fp32_inexact)} of {len(self.layers)} layers decode to our "
                       "fp32 weights bit for bit, the rest to our bf16-rounded weights (fp32 within 2 ulps)")
        if self.bf16_inexact:
            out.append(f"note: {len(self.bf16_inexact)} layers decode to bf16 weights that differ from ours rounded to "
                       f"bf16 in the last bit somewhere (no fp32 global scale reproduces ours): "
                       f"{', '.join(self.bf16_inexact[:4])}")
        if self.fused_mismatch:
            out.append("note: vLLM fuses q/k/v_proj and gate/up_proj and keeps one global scale per fused layer; "
                       f"these groups have different ones, so vLLM would not decode them as trained: "
                       f"{', '.join(self.fused_mismatch[:4])}{' ...' if len(self.fused_mismatch) > 4 else ''} "
                       "(transformers and compressed-tensors decode every layer with its own)")
        return out


def _targets(model: Llama, requantize: bool) -> dict[str, nn.Linear]:
    """Our names of the linear layers to store in NVFP4: those trained in FP4, or (a run without any) with
    ``requantize`` every linear layer but the head."""
    fp4 = {n: m for n, m in model.named_modules() if isinstance(m, FP4Linear)}
    if fp4:
        return fp4
    if not requantize:
        raise UsageError("this checkpoint trained in high precision (no layer in FP4), so no layer has NVFP4 "
                         "weights to export exactly; pass --requantize to quantize its linear layers (not lm_head) "
                         "to NVFP4, or export with --format fp32")
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}


def _fused_mismatch(weights: dict[str, NVFP4Weight]) -> list[str]:
    bad = []
    for name in weights:
        prefix, _, leaf = name.rpartition(".")
        for group in _FUSED:
            if leaf != group[0]:
                continue
            gs = [weights.get(f"{prefix}.{g}") for g in group]
            if all(w is not None for w in gs) and len({float(w.global_scale) for w in gs}) > 1:
                bad.append(f"{prefix}.{{{','.join(group)}}}")
    return bad


def _compress(hf, weights: dict[str, NVFP4Weight], ignore: list[str]):
    """Quantize ``hf`` in place with compressed-tensors' own lifecycle and put our codes in: its compressor
    writes ``weight_packed`` from the weights and scales, which must give our codes (a zero's sign aside:
    ours keeps the sign the forward rounded, theirs writes +0); the stored bytes are ours."""
    require_compressed_tensors()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(CT_SCHEME, ["Linear"])}, ignore=ignore,
                            quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(hf, qc, show_progress=False)
    for name, w in weights.items():
        mod = hf.get_submodule(name)
        mod.weight.data = w.reference.to(mod.weight.device)
        mod.weight_scale.data = w.scale.float()
        mod.weight_global_scale.data = w.global_scale.clone()
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=CT_FORMAT)
    compressor.compress_model(hf)
    for name, w in weights.items():
        mod = hf.get_submodule(name)
        theirs, ours = mod.weight_packed.data, w.packed
        if not torch.equal(_no_negative_zero(theirs), _no_negative_zero(ours)) or not torch.equal(
                mod.weight_scale.data.view(torch.uint8), w.scale.view(torch.uint8)):
            raise RuntimeError(f"compressed-tensors packed {name} differently from the training forward")
        mod.weight_packed.data = ours.clone()
    compressor.remove_decompression_hook(hf)
    return compressor


def _no_negative_zero(packed: torch.Tensor) -> torch.Tensor:
    """Packed codes with -0 (code 8) written as +0 (code 0), in both nibbles."""
    lo, hi = packed & 0x0F, packed >> 4
    lo = torch.where(lo == 8, torch.zeros_like(lo), lo)
    hi = torch.where(hi == 8, torch.zeros_like(hi), hi)
    return lo | (hi << 4)


def save_hf_nvfp4(model: Llama, out_dir: str | os.PathLike, tokenizer=None, requantize: bool = False,
                  overwrite: bool = False) -> NVFP4Export:
    """Write ``model`` (FP4 layers converted as in training: ``load_checkpoint(fp4=True)``) as a Hugging Face
    folder in compressed-tensors' NVFP4 format. Every refusal (:class:`UsageError`) comes before anything is
    written; the folder is renamed into place when complete (:func:`~fp4lightning.models.hf.save_hf`)."""
    if not isinstance(model, Llama):
        raise UsageError(f"export-hf writes fp4lightning's LLaMA only, not a {type(model).__name__}")
    require_compressed_tensors()
    targets = _targets(model, requantize)
    weights = {f"model.{n}": nvfp4_weight(m, n, requantize) for n, m in targets.items()}
    report = NVFP4Export(Path(out_dir), layers=list(weights))
    report.fp32_inexact = [n for n, w in weights.items() if not w.fp32_exact]
    report.bf16_inexact = [n for n, w in weights.items() if not w.bf16_exact]
    report.sqnr_db = {n: w.sqnr_db for n, w in weights.items() if w.sqnr_db is not None}
    _share_fused_global_scales(weights)
    report.fused_mismatch = _fused_mismatch(weights)
    bos = tokenizer.bos_id if tokenizer is not None else None
    eos = tokenizer.eos_id if tokenizer is not None else None
    hf = to_hf_model(model, bos, eos).to(torch.bfloat16)
    hf.config.dtype = torch.bfloat16  # compressed-tensors decompresses to bf16: a default load must run in it
    report.high_precision = [n for n, m in hf.named_modules() if isinstance(m, nn.Linear) and n not in weights]
    compressor = _compress(hf, weights, report.high_precision)
    save_hf(model, out_dir, tokenizer, overwrite, hf_model=hf, finish=compressor.update_config,
            note=f"exported by fp4lightning export-hf --format nvfp4: the FP4 layers in compressed-tensors' "
                 f"{CT_SCHEME} ({CT_FORMAT}), the rest bf16")
    return report
