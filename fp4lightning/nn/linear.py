"""``FP4Linear``: a drop-in ``nn.Linear`` whose three GeMMs run on FP4 operands (section 3).

Forward (per layer, ``Y = A W^T``, A flattened to tokens x K):

1. OCC (section 3.3): clamp A to its signed ``1-alpha`` / ``alpha`` quantiles; keep the
   sparse residual ``R = A - A_c``.
2. Quantize ``A_c`` per token and ``W`` per output channel to E2M1 (absmax scales).
3. ``Y = diag(1/s_a) (A_q W_q^T) diag(1/s_w) + R Wdq^T + b`` - the FP4 GeMM plus the
   compensation product in high precision (``Wdq = W_q / s_w``).

Backward (dY in FP8 E5M2 by default, see ``fp4lightning.ops.gemm``):

* ``dA = dY Wdq``   (straight-through for the activation quantizer and the clamp:
  clamp + compensation is the identity on A);
* ``dW = (dY^T (A_qdq + R)) * f'(W s_w)`` with ``f'`` the DGE derivative (section 3.2),
  or plain STE when DGE is off.

What is saved for backward is the *quantized* activation - packed FP4 codes (half a
byte per element), its per-token scales and the sparse residual in CSR form (on the
Triton path: a fixed-capacity list of (index, value) pairs built without a host sync, see
``_compact_residual``) - never the high-precision input. The packed weight codes are saved too (half a byte per
weight element, against the bf16 copy of W autocast saves for ``nn.Linear``). The
high-precision weight stays the ``nn.Parameter``, so optimizers and checkpoints see
an ordinary Linear.

Dtypes follow ``nn.Linear`` under autocast: with autocast on, the output has the
autocast dtype; otherwise the input's dtype. Non-finite input rows produce NaN
output rows (NaN in, NaN out) so that loss scaling can see them. Unlike ``nn.Linear``,
one non-finite value in A makes the *whole* weight gradient NaN, not one column: its
row's NaN scale enters every column of the per-column FP8 scaling of ``dY / s_a``. Loss
scaling and the non-finite step check skip such a step either way.
"""
from __future__ import annotations

import math
import threading
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fp4lightning.config import FP4Config
from fp4lightning.nn.block_linear import block_fp4_linear
from fp4lightning.numerics.dge import frozen_dge_factor
from fp4lightning.numerics.formats import decode_packed_fp4
from fp4lightning.ops import gemm

__all__ = ["FP4Linear", "fp4_linear", "check_fp4_shape", "quantize_weight", "reuse_weight_quantization",
           "weights_updated"]

#: Triton path: capacity of the compact OCC residual saved for backward, as a multiple of the
#: expected non-zero count 2 (1 - alpha) M K (section 3.3), plus a fixed slack. The quantiles
#: come from a sample, so the real count moves a little around 2 (1 - alpha) (docs/design.md, "OCC quantiles by sampling").
OCC_CAPACITY_MARGIN = 1.5
OCC_CAPACITY_SLACK = 256

#: Feature sizes must be multiples of this: two FP4 codes share a byte, and the GPU
#: GeMMs (TMA / FP8 tensor cores) want 16-element aligned rows.
FEATURE_ALIGN = 16


def check_fp4_shape(in_features: int, out_features: int) -> str | None:
    """Why an (in, out) Linear cannot be FP4, or None if it can."""
    bad = [f"{n}={v}" for n, v in (("in_features", in_features), ("out_features", out_features)) if v % FEATURE_ALIGN]
    if bad:
        return f"{', '.join(bad)} not a multiple of {FEATURE_ALIGN}"
    return None


@dataclass
class _Activation:
    """The quantized activation of one forward: what its GeMM reads and what backward keeps."""

    codes: torch.Tensor  # packed E2M1 codes (M, K/2); with occ_fold_e4m3 the folded E4M3 operand itself
    scale: torch.Tensor  # fp32 (M,), the scale of ``codes``
    values: torch.Tensor | None = None  # the reference GeMM's decoded operand (OCC's residual folded in)
    fold: torch.Tensor | None = None  # the folded E4M3 operand (M, K) the forward GeMM reads
    fold_scale: torch.Tensor | None = None  # refold: that operand's scale s_a 2^-shift (``scale`` is s_a)
    refold: bool = False  # backward rebuilds ``fold`` from ``codes`` and the compact residual
    comp_r: torch.Tensor | None = None  # dense R for the forward's compensation GeMM (Triton / scaled_mm)
    resid: torch.Tensor | tuple | None = None  # what backward keeps of R: CSR of R^T, or the compact form
    resid_t: bool = False  # ``resid`` holds R^T (reference path) rather than R
    # 1 / the scale the forward GeMM reads (``fold_scale`` or ``scale``) where at hand: the scaled_mm
    # epilogue multiplies by it and backward folds it into dY, without reciprocal launches
    scale_inv: torch.Tensor | None = None


def _quantize_activation(x2d: torch.Tensor, cfg: FP4Config, backend: str, vals_dtype: torch.dtype,
                         vals_round: torch.dtype | None) -> _Activation:
    """OCC's clamp (section 3.3) fused with the per-token activation quantizer, in the form this
    backend's forward GeMM reads, and the residual in the form backward keeps it."""
    per_tensor = cfg.act_granularity == "per_tensor"
    if not cfg.occ:
        codes, scale, values, inv = gemm.quantize_fp4(x2d, cfg.scale_mode, per_tensor, values_dtype=vals_dtype,
                                                      inverse=True)
        return _Activation(codes, scale, values, scale_inv=inv)
    bounds = gemm.occ_bounds(x2d, cfg.occ_alpha, cfg.occ_quantile, cfg.occ_sample_size)
    if backend == "scaled_mm" and (cfg.occ_fold_e4m3 or cfg.occ_compensation):
        # The scaled_mm backend runs `paper`'s OCC folded into the E4M3 activation operand (no
        # compensation GeMMs; docs/perf.md "OCC on the GPU", docs/results.md section 10: within
        # noise of the exact compensation in training loss). Backward keeps the packed codes and
        # the compact residual, not the 1-byte operand, and rebuilds the operand's bits from them
        # (gemm.refold_operand): the saved bytes stay those of the Triton path.
        fold, fold_scale, codes, scale, r = gemm.quantize_fp4_refold(
            x2d, bounds, cfg.scale_mode, per_tensor, capacity=_compact_capacity(x2d.numel(), cfg.occ_alpha))
        # R in x's dtype: the refold needs its bits. 1 / fold_scale: taken once, for the forward's
        # epilogue and backward's dY / s
        return _Activation(codes, scale, fold=fold, fold_scale=fold_scale, refold=True,
                           resid=_compact_residual(r, cfg.occ_alpha), scale_inv=torch.reciprocal(fold_scale))
    if cfg.occ_fold_e4m3:
        # Y = (E W_q^T) / (s_a 2^-shift s_w) with E = E4M3((A_q + s_a R) 2^-shift): the
        # compensation rides in the FP4 GeMM's operand (docs/perf.md, "OCC on the GPU"); backward
        # keeps the folded operand, which the wgrad GeMM reads
        fold, scale = gemm.quantize_fp4_folded(x2d, bounds, cfg.scale_mode, per_tensor)
        return _Activation(fold, scale, fold=fold)
    # Triton and scaled_mm: the residual stays dense and the compensation runs as GeMMs.
    # Reference path: fold the residual into the decoded operand,
    # Y = ((A_q + s_a R) W_q^T) / (s_a s_w), one dense product instead of a sparse
    # one (CPU sparse kernels cost as much as the dense GeMM). Only the ~2% outlier
    # entries of the operand change; they are held in the compute dtype, bf16
    # under autocast, like nn.Linear's operands.
    dense_comp = backend != "reference"
    codes, scale, values, r = gemm.quantize_fp4_clamped(
        x2d, bounds, cfg.scale_mode, per_tensor, fold=cfg.occ_compensation and not dense_comp,
        values_dtype=vals_dtype, values_round=vals_round)
    if not cfg.occ_compensation:
        return _Activation(codes, scale, values)
    if dense_comp:
        # Triton / scaled_mm path: R in the compute dtype (bf16 under autocast, as the
        # reference path's folded operand and nn.Linear's operands), kept for backward
        # in a fixed-capacity compact form built without a host sync
        r = r.to(vals_round or vals_dtype)  # the compute dtype, never its fp32 carrier
        return _Activation(codes, scale, values, comp_r=r, resid=_compact_residual(r, cfg.occ_alpha))
    # what backward keeps: ~2% non-zeros; R^T in CSR form for the CPU sparse kernels
    return _Activation(codes, scale, values, resid=_sparse_residual(r, transpose=True), resid_t=True)


def _forward_gemm(act: _Activation, w_codes: torch.Tensor, w_scale: torch.Tensor, w_vals: torch.Tensor | None,
                  k: int, out_dtype: torch.dtype, bias: torch.Tensor | None,
                  vals_dtype: torch.dtype, w_inv: torch.Tensor | None = None,
                  bias_cast: torch.Tensor | None = None) -> torch.Tensor:
    """The FP4 GeMM plus OCC's compensation product ``R Wdq^T`` (in the folded operand, or a second GeMM).
    ``w_inv``: ``1 / w_scale`` where the weight's quantizer wrote it; ``bias_cast``: the bias in bf16, likewise."""
    if act.fold is not None:
        scale = act.scale if act.fold_scale is None else act.fold_scale
        return gemm.fp4_gemm_folded(act.fold, scale, w_codes, w_scale, k, out_dtype, bias=bias, w_values=w_vals,
                                    values_dtype=vals_dtype, a_scale_inv=act.scale_inv, w_scale_inv=w_inv,
                                    bias_cast=bias_cast)
    if act.comp_r is None:  # no compensation, or (reference path) already folded into act.values
        return gemm.fp4_gemm(act.codes, act.scale, w_codes, w_scale, k, out_dtype, bias=bias, a_values=act.values,
                             w_values=w_vals, a_scale_inv=act.scale_inv, w_scale_inv=w_inv, bias_cast=bias_cast)
    # Triton / scaled_mm path: R Wdq^T = (R W_q^T) diag(1/s_w) as a dense tensor-core GeMM
    # on the dense R the quantizer just wrote (at ~2% density a bf16 GeMM beats a sparse
    # one, which gathers ~N bytes per non-zero at a fraction of the tensor-core rate);
    # R and the E2M1 values are exact in R's dtype, the accumulation is fp32.
    r = act.comp_r
    y = gemm.fp4_gemm(act.codes, act.scale, w_codes, w_scale, k, torch.float32, bias=bias, a_values=act.values,
                      w_values=w_vals)
    w_q = decode_packed_fp4(w_codes, k, r.dtype)
    return y.add_(_mm_f32(r, w_q.t()).div_(w_scale[None, :])).to(out_dtype)


class _FP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: FP4Config,
                w_quant: tuple | None = None):
        out_dtype = gemm.output_dtype(x)
        k = weight.shape[1]
        x2d = x.reshape(-1, k)
        with torch.autocast(x.device.type, enabled=False):
            # the reference GeMMs run on decoded values in this dtype (bf16 under autocast; fp32
            # holding bf16 values where CPU bf16 GeMMs are emulated, fp4lightning.numerics.cpu_bf16)
            vals_dtype, vals_round = gemm.operand_dtype(out_dtype, x.device)
            act = _quantize_activation(x2d, cfg, gemm.backend_for(x.device), vals_dtype, vals_round)
            if w_quant is None:  # the weight's quantizer also casts an fp32 bias for a bf16 epilogue
                cast = bias is not None and bias.dtype == torch.float32 and out_dtype == torch.bfloat16
                w_quant = quantize_weight(weight, cfg, vals_dtype, inverse=True, bias_bf16=bias if cast else None)
            # a cached or gathered quantization may come without 1 / w_scale (FSDP's triple) or the cast bias
            w_codes, w_scale, w_vals, w_inv, b16 = (*w_quant, None, None)[:5]
            y = _forward_gemm(act, w_codes, w_scale, w_vals, k, out_dtype, bias, vals_dtype, w_inv, b16)
        compact = isinstance(act.resid, tuple)
        ctx.save_for_backward(act.codes, act.scale, w_codes, w_scale, weight, act.fold_scale, act.scale_inv, w_inv,
                              *(act.resid if compact else (act.resid,)))
        ctx.folded = act.fold is not None and not act.refold
        ctx.refold = act.refold
        ctx.cfg, ctx.k, ctx.out_dtype, ctx.has_bias = cfg, k, out_dtype, bias is not None
        ctx.compact_shape = tuple(x2d.shape) if compact else None
        ctx.resid_t = act.resid_t
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a_codes, a_scale, w_codes, w_scale, weight, fold_scale, a_inv, w_inv, *resid = ctx.saved_tensors
        resid = tuple(resid) if ctx.compact_shape is not None else resid[0]
        cfg, k, cd = ctx.cfg, ctx.k, ctx.out_dtype
        dy2d = dy.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = col_amax = None
        # On the Triton dY quantizers the column pass's absmax rides in the row pass (with the row multipliers
        # 1 / s_a it folds in), and on a GPU the bias gradient in the column pass (fp32 sums in the kernel's
        # order; on CPU, where that path is the tests' form of the GPU's, torch's sum keeps the reference's bits)
        wgrad = ctx.needs_input_grad[1]
        fused_bias = ctx.has_bias and ctx.needs_input_grad[2] and wgrad and _bias_in_column_pass(dy)
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                # dA = dY diag(1/s_w) W_q : fold the reduction-dim scale into dY first
                g1, s_g1, inv_g1, *col = gemm.quantize_fp8_divided(
                    dy2d, w_scale, dim=1, fmt=cfg.grad_format, carrier=gemm.operand_dtype(cd, dy.device)[0],
                    inverse=True, div_inv=w_inv, column_amax_of=a_inv if wgrad and a_inv is not None else None)
                col_amax = col[0] if col else None
                grad_x = gemm.fp4_dgrad(g1, s_g1, w_codes, k, cd, g_scale_inv=inv_g1).reshape(*dy.shape[:-1], k)
                del g1, s_g1, inv_g1  # one FP8 copy of dY at a time: freed before the wgrad operand is made
            if wgrad:
                grad_w, grad_b = _weight_grad(ctx, dy2d, a_codes, a_scale, fold_scale, resid, weight, w_scale,
                                              a_inv, col_amax, fused_bias)
                grad_w = grad_w.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                if grad_b is None:
                    grad_b = dy2d.sum(0, dtype=torch.float32)  # no fp32 copy of dY
                grad_b = grad_b.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


def _bias_in_column_pass(dy: torch.Tensor) -> bool:
    """Whether the bias gradient is asked of dY's column pass (on a GPU; see ``_FP4LinearFn.backward``)."""
    return dy.is_cuda


def _weight_grad(ctx, dy2d: torch.Tensor, a_codes: torch.Tensor, a_scale: torch.Tensor, fold_scale: torch.Tensor | None,
           resid, weight: torch.Tensor, w_scale: torch.Tensor, a_inv: torch.Tensor | None = None, col_amax=None,
           bias_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(dW = (dY^T (A_qdq + R)) * f'(W s_w), the bias gradient or None)`` from what the forward saved
    (section 3); ``a_inv``: 1 / the activation scale the forward GeMM read (``fold_scale`` when refolding),
    where at hand; ``col_amax``: dY's column absmax from the row pass; ``bias_grad``: dY's column sums
    from the column pass where the Triton quantizer takes them (else None)."""
    cfg, k, cd = ctx.cfg, ctx.k, ctx.out_dtype
    # Under bf16 autocast the wgrad GeMM runs in bf16 like nn.Linear's: its
    # operands (E5M2 and E2M1 values) are exact in bf16, only its output is rounded.
    gemm_dtype = torch.bfloat16 if cd == torch.bfloat16 else torch.float32
    a_vals = a_codes if ctx.folded else None
    if ctx.refold:  # the forward's folded E4M3 operand, bit for bit, and its row scales
        a_vals = gemm.refold_operand(a_codes, a_scale, fold_scale, resid, ctx.compact_shape)
        a_scale = fold_scale
    g2, s_g2, inv_g2, *bias = gemm.quantize_fp8_divided(
        dy2d, a_scale, dim=0, fmt=cfg.grad_format, carrier=gemm.operand_dtype(gemm_dtype, dy2d.device)[0],
        inverse=True, div_inv=a_inv, column_amax=col_amax, bias_grad=bias_grad)
    # OCC compensation's share dY^T R (fp32 sparse product), added before the DGE
    # factor: DGE multiplies the whole dL/dW_q
    comp = None
    if ctx.refold:
        pass  # the compensation rides in the folded operand
    elif ctx.compact_shape is not None:  # Triton path: dense GeMM on R scattered back
        comp = _compact_wgrad(dy2d, resid, ctx.compact_shape)
    elif resid is not None:
        rt = resid if ctx.resid_t else _csr_transpose(resid)
        comp = _sparse_wgrad(rt, dy2d)
    grad_w = gemm.fp4_wgrad(
        g2, s_g2, None if a_vals is not None else a_codes, k, torch.float32,
        dge_weight=weight if cfg.dge else None, dge_weight_scale=w_scale,
        dge_k=cfg.dge_k, dge_clamp=cfg.dge_clamp, addend=comp, gemm_dtype=gemm_dtype,
        a_values=a_vals,
        # more outliers than the compact residual holds: a NaN step, never a wrong one
        nan_if=resid[2] if ctx.refold else None, g_scale_inv=inv_g2,
    )
    if cfg.dge_frozen_factor:  # experiment: STE times f'(W_0 s_w0), see fp4lightning.experiments.dge_probe
        grad_w = grad_w * frozen_dge_factor(weight, w_scale, cfg)
    return grad_w, (bias[0] if bias else None)


def quantize_weight(weight: torch.Tensor, cfg: FP4Config, values_dtype: torch.dtype = torch.float32,
                    inverse: bool = False, bias_bf16: torch.Tensor | None = None):
    """(packed codes, per-channel scales, decoded values or None) of the weight, as the layer's forward
    quantizes it; FSDP's FP4 all-gather quantizes each rank's rows with it (``distributed.fsdp``).
    ``inverse``: a fourth element, ``1 / scale`` where the Triton quantizer wrote it (else None);
    ``bias_bf16`` (the layer's fp32 bias): a last element, it in bf16 where that pass wrote it (else None)."""
    return gemm.quantize_fp4(weight.detach(), cfg.scale_mode, cfg.weight_granularity == "per_tensor",
                             values_dtype=values_dtype, inverse=inverse,
                             bias_bf16=None if bias_bf16 is None else bias_bf16.detach())


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32: bf16/fp16 operands stay half precision on CUDA (tensor cores, fp32
    accumulation and output); otherwise both are promoted to fp32."""
    if (a.device.type == "cuda" and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten.mm, "dtype")):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _compact_capacity(n: int, alpha: float) -> int:
    """Slots of the compact residual of an activation of ``n`` elements (``_compact_residual``)."""
    return min(n, math.ceil(n * 2.0 * (1.0 - alpha) * OCC_CAPACITY_MARGIN) + OCC_CAPACITY_SLACK)


def _compact_residual(r: torch.Tensor | tuple, alpha: float):
    """Dense residual R (M x K) -> ``(flat indices, values, overflow)`` with no host sync; a tuple ``r`` is
    the compact residual already (the fold kernel's, ``(indices, values, overflow, count)``), returned as is.

    Fixed capacity ``OCC_CAPACITY_MARGIN * 2 (1 - alpha) M K + OCC_CAPACITY_SLACK`` (at most
    M K), filled by ``torch.nonzero_static`` in row-major order; unused slots hold index M K
    (one past the end) and value 0. Indices are int32 when they fit, values keep R's
    dtype: 6 bytes per slot for bf16 activations, ~0.18 bytes per activation element at
    alpha = 0.99. ``overflow`` (a 0-dim bool on the device) is set when R has more non-zeros
    than slots; backward then returns a NaN weight gradient (never a silently wrong one),
    which the non-finite step check of loss scaling skips.
    """
    if isinstance(r, tuple):
        return r
    flat = r.reshape(-1)
    n = flat.numel()
    cap = _compact_capacity(n, alpha)
    nz = flat != 0
    idx = torch.nonzero_static(nz, size=cap, fill_value=n).reshape(-1)
    vals = torch.where(idx < n, flat[idx.clamp_max(n - 1)], torch.zeros((), dtype=flat.dtype, device=flat.device))
    overflow = nz.sum() > cap
    return idx.to(torch.int32) if n < 2**31 - 1 else idx, vals, overflow


def _compact_wgrad(dy2d: torch.Tensor, resid: tuple, shape) -> torch.Tensor:
    """OCC's share of the weight gradient, ``dY^T R`` (N x K, fp32), from the compact residual:
    R is scattered back into a transient dense buffer and multiplied on the tensor cores
    (the same FLOPs as one bf16 GeMM of the layer; no host sync)."""
    idx, vals, overflow = resid
    m, k = shape
    # one spare element takes the padding slots: every index is unique, so a plain scatter
    # (no atomics, deterministic) puts R back; index_add_'s bf16 atomics cost about half of a
    # whole bf16 layer's forward + backward on an H200 (docs/perf.md, "Measured design choices")
    dense = torch.zeros(m * k + 1, dtype=vals.dtype, device=vals.device)
    dense.scatter_(0, idx.long(), vals)
    comp = _mm_f32(dy2d.t(), dense[:m * k].view(m, k))
    return torch.where(overflow, torch.full((), float("nan"), device=comp.device), comp)


#: OCC's CPU sparse product ``R^T dY`` takes dY in column chunks of about this many fp32 bytes, so
#: that a chunk stays in cache while every non-zero of R^T reads a row of it: about twice as fast
#: as one product over the whole of dY (docs/perf.md, "Measured design choices"), with the same
#: bits, since each output element is the same sum in the same order
SPARSE_CHUNK_BYTES = 1 << 21


def _sparse_wgrad(rt: torch.Tensor, dy2d: torch.Tensor) -> torch.Tensor:
    """OCC's share of the weight gradient, ``dY^T R = (R^T dY)^T`` (N x K, row-major, fp32), from
    ``rt`` (CSR of R^T, K x M) and dY (M x N, any float dtype), in cache-sized column chunks of dY.
    Written row-major so the wgrad epilogue reads it like the GeMM's output (a transposed view
    cost that pass 8 ms more at 2816 x 1024).

    The chunks give the one-call product's bits: every column meets the same products in the same
    order. MKL takes another code path for a narrow right-hand side (on an AVX-512 CPU a chunk of
    8 or 16 columns rounds differently from the same columns inside a wide one), so no chunk is
    narrower than 64 columns: the short remainder joins the last full chunk."""
    m, n = dy2d.shape
    cols = max(64, SPARSE_CHUNK_BYTES // (4 * max(m, 1)) // 16 * 16)
    if 2 * cols > n:
        return torch.sparse.mm(rt, dy2d.float().contiguous()).t().contiguous()
    out = torch.empty(n, rt.shape[0], dtype=torch.float32, device=dy2d.device)
    starts = list(range(0, n - cols + 1, cols))  # full chunks; the last one runs to n
    for j, end in zip(starts, starts[1:] + [n]):
        out[j:end] = torch.sparse.mm(rt, dy2d[:, j:end].float().contiguous()).t()
    return out


def _csr(crow: torch.Tensor, col: torch.Tensor, vals: torch.Tensor, shape) -> torch.Tensor:
    return torch.sparse_csr_tensor(crow.int(), col.int(), vals, shape, check_invariants=False)


def _nonzero_values(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major flat indices (int64, ascending) and values of the non-zeros of a contiguous ``r``.

    At OCC's ~2% density most 8-byte words of ``r`` are zero: ``nonzero`` runs over the words'
    bit patterns (no separate mask pass), then by value over the elements of the few non-zero
    words, which are gathered once and also give the values (-0.0 has a non-zero bit pattern and
    drops out in the second step; NaN is a non-zero). 1-D ``index_select`` throughout (advanced
    indexing costs several times more on CPU). About two thirds of the time of a bool mask with
    ``nonzero`` over its words (docs/perf.md, "Measured design choices"). The same indices and
    values in the same order as ``r.reshape(-1).nonzero()``.
    """
    flat = r.reshape(-1)  # contiguous: reshape copies a non-contiguous r
    per = 8 // flat.element_size()
    if flat.numel() % per or flat.numel() < 4096 or flat.storage_offset() % per:
        idx = (flat != 0).nonzero().squeeze(1)
        return idx, flat.index_select(0, idx)
    words = flat.view(torch.int64)
    w = (words != 0).nonzero().squeeze(1)
    cand = words.index_select(0, w).view(flat.dtype)  # the elements of the non-zero words, in order
    p = (cand != 0).nonzero().squeeze(1)
    return w.index_select(0, p // per) * per + p % per, cand.index_select(0, p)


def _sparse_residual(r: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """Dense residual R -> fp32 CSR of R (or of R^T) with int32 indices (~8 bytes per non-zero).

    fp32 because the compensation product is meant to be high precision (and CPU
    sparse kernels take no bf16); int32 indices halve torch's default int64 cost.
    Built from the flat indices of the non-zeros (row-major order is CSR order), cheaper than
    ``to_sparse_csr``; for R^T they are re-ordered by column with one (unstable) sort of
    unique keys, much cheaper than ``nonzero`` on the transposed view or a stable sort.
    """
    m, k = r.shape
    flat_idx, vals = _nonzero_values(r)
    rows, cols = flat_idx // k, flat_idx % k
    if transpose:
        key = cols * m + rows
        order = torch.sort(key.int() if m * k < 2**31 else key).indices  # unique keys: any sort
        vals, rows, cols, m, k = vals.index_select(0, order), cols.index_select(0, order), rows.index_select(0, order), k, m
    vals = vals.float()
    crow = torch.zeros(m + 1, dtype=torch.int64, device=r.device)
    crow[1:] = torch.bincount(rows, minlength=m).cumsum(0)
    with warnings.catch_warnings():  # "sparse CSR support is in beta": known, not actionable
        warnings.simplefilter("ignore", UserWarning)
        return _csr(crow, cols, vals, (m, k))


def _csr_transpose(a: torch.Tensor) -> torch.Tensor:
    """CSR of ``a.T``: a stable sort of the non-zeros by column (torch's own ``a.t()``
    then ``mm`` goes through a much slower generic conversion)."""
    m, k = a.shape
    crow, col = a.crow_indices().long(), a.col_indices().long()
    rows = torch.repeat_interleave(torch.arange(m, device=a.device), crow.diff())
    order = torch.argsort(col, stable=True)
    new_crow = torch.zeros(k + 1, dtype=torch.int64, device=a.device)
    new_crow[1:] = torch.bincount(col, minlength=k).cumsum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return _csr(new_crow, rows[order], a.values()[order], (k, m))


@torch.compiler.disable
def fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: FP4Config | None = None, w_quant: tuple | None = None) -> torch.Tensor:
    """Functional form of ``FP4Linear`` (``F.linear`` with FP4 GeMMs).

    Under ``torch.compile`` it is one clean graph break: the layer's own kernels (Triton, the vendor's
    ``_scaled_mm``, the CPU path's compiled passes) already run fused, and the code around it (norms,
    RoPE, SwiGLU, residuals) compiles into the graphs on either side."""
    cfg = config or FP4Config()
    if not x.is_floating_point():
        raise TypeError(f"fp4_linear: input must be floating point, got {x.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp4_linear: input has {x.shape[-1]} features in its last dimension (shape {tuple(x.shape)}) "
            f"but the weight expects {weight.shape[1]}"
        )
    if x.numel() == 0:
        return torch.nn.functional.linear(x, weight, bias)
    if cfg.block_format != "none":  # NVFP4 / MXFP4 recipes
        return block_fp4_linear(x, weight, bias, cfg)
    if (cfg.occ and cfg.occ_fold_e4m3 and cfg.grad_format == "bf16" and torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad) and gemm.backend_for(x.device) == "triton"):
        # said before the step's forward work, not at its first backward
        raise TypeError("FP4Config(occ_fold_e4m3=True, grad_format='bf16'): on the Triton backend the folded-OCC "
                        "weight gradient needs an FP8 dY; set grad_format to 'e5m2' (the paper's) or 'e4m3', "
                        "or FP4LIGHTNING_BACKEND=reference")
    return _FP4LinearFn.apply(x, weight, bias, cfg, w_quant)


# ----------------------------------------------------------------------------- weight quantization reuse
class _Reuse(threading.local):
    enabled = False


_REUSE = _Reuse()
_EPOCH = [0]  # advanced by weights_updated(): a quantization from an older epoch is never served
_HOLDERS: "weakref.WeakSet[FP4Linear]" = weakref.WeakSet()  # layers holding one, dropped by weights_updated()


@contextmanager
def reuse_weight_quantization(enabled: bool = True):
    """Inside, an ``FP4Linear`` reuses its weight's FP4 quantization (packed codes, scales, the forward's
    operand) from an earlier forward of the same weight epoch instead of quantizing again: under gradient
    accumulation the weight is quantized once per optimizer step, not once per micro-batch.

    The epoch ends with :func:`weights_updated`, which whoever changes the weights must call: the Trainer's
    ``FP4Precision`` enters this context around each training forward and calls it after every optimizer
    step. The cache is keyed on the epoch, the weight's storage, its version counter, dtype and the forward's
    operand dtype, so an in-place edit that autograd sees (``copy_``, ``load_state_dict``) also refreshes it;
    the epoch covers what it cannot see (fused optimizers and ``.data`` writes do not bump the version).
    Outside this context every forward quantizes the weight afresh."""
    prev, _REUSE.enabled = _REUSE.enabled, enabled
    try:
        yield
    finally:
        _REUSE.enabled = prev


def weights_updated() -> None:
    """Every cached weight quantization is stale from now on (call after changing FP4 weights in place
    while :func:`reuse_weight_quantization` is in use); the cached tensors are freed."""
    _EPOCH[0] += 1
    for layer in list(_HOLDERS):
        layer._weight_quant = None
    _HOLDERS.clear()


def _reused_weight_quant(layer: "FP4Linear", x: torch.Tensor) -> tuple | None:
    """The layer's weight quantization for input ``x`` from the cache (made now if missing or stale), or None
    where reuse is off or does not apply (block formats quantize inside their own GeMM)."""
    w, cfg = layer.weight, layer.config
    if not _REUSE.enabled or cfg.block_format != "none" or x.numel() == 0 or not x.is_floating_point():
        return None
    vals_dtype = gemm.operand_dtype(gemm.output_dtype(x), x.device)[0]
    key = (_EPOCH[0], w.data_ptr(), w._version, w.dtype, w.device, vals_dtype, id(cfg))
    cached = layer._weight_quant
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.autocast(x.device.type, enabled=False):
        quant = quantize_weight(w, cfg, vals_dtype, inverse=True)
    layer._weight_quant = (key, quant)
    _HOLDERS.add(layer)
    return quant


@torch.compiler.disable
def _fp4_linear_layer(layer: "FP4Linear", x: torch.Tensor) -> torch.Tensor:
    """The layer's forward: its weight quantization (FSDP's gathered one, the reused one, or none: made
    in the forward), then :func:`fp4_linear`; under ``torch.compile`` one graph break, lookup included."""
    quant = getattr(layer.weight, "fp4_weight_quant", None)
    if quant is None:
        quant = _reused_weight_quant(layer, x)
    return fp4_linear(x, layer.weight, layer.bias, layer.config, quant)


class FP4Linear(nn.Linear):
    """``nn.Linear`` with FP4 forward and backward GeMMs (arXiv 2501.17116).

    Parameters and state-dict keys are those of ``nn.Linear`` (``weight``, ``bias``),
    kept in high precision. ``config`` holds the FP4 recipe (default: the paper's).
    Both feature sizes must be multiples of 16.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 config: FP4Config | None = None):
        why = check_fp4_shape(in_features, out_features)
        if why:
            raise ValueError(f"FP4Linear({in_features}, {out_features}): {why}; keep this layer as nn.Linear "
                             "(convert_to_fp4 skips such layers with a warning)")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.config = config or FP4Config()

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: FP4Config | None = None) -> "FP4Linear":
        """Wrap an existing ``nn.Linear``, sharing (not copying) its parameters."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, config=config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new

    _weight_quant: tuple | None = None  # (key, quantization) under reuse_weight_quantization

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weight is quantized on every call unless reuse_weight_quantization is on, whose cache
        # is keyed on an epoch that weights_updated() ends: no tensor-side key sees every update path
        # (fused AdamW and ``.data`` edits do not bump ``weight._version``), and a stale weight would
        # silently train the wrong model.
        # Under FSDP2 with the FP4 all-gather (fp4lightning.distributed.fsdp) the gathered weight carries the
        # packed codes and scales its shards were quantized to, for this forward only.
        return _fp4_linear_layer(self, x)

    def extra_repr(self) -> str:
        c = self.config
        block = c.block_format != "none"  # the block recipes replace the granularity and dY keys
        parts = [super().extra_repr()]
        if block:
            parts.append(f"block={c.block_format}" + ("(w 16x16)" if c.weight_block_2d else ""))
        else:
            parts += [f"w={c.weight_granularity}", f"a={c.act_granularity}"]
        parts.append(f"dge(k={c.dge_k})" if c.dge else "ste")
        if c.occ:
            comp = ", comp folded in e4m3" if c.occ_fold_e4m3 else ("" if c.occ_compensation else ", no comp")
            parts.append(f"occ(alpha={c.occ_alpha}{comp})")
        if not block:
            parts.append(f"dY={c.grad_format}")
        if block and c.rht_wgrad:
            parts.append("rht(wgrad)")
        if block and c.stochastic_rounding:
            parts.append(f"sr({','.join(c.stochastic_rounding)})")
        return ", ".join(parts)
