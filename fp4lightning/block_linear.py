"""The block-scaled FP4 linear layer: NVFP4 / MXFP4 recipes through ``FP4Linear``.

``FP4Linear`` dispatches here when ``FP4Config.block_format`` is not ``"none"``. Per
layer ``Y = A W^T`` (A: M x K tokens, W: N x K), every GeMM takes block-FP4 operands
whose blocks run along that GeMM's reduction dimension:

    fprop  Y  = A  W^T     A blocks along K,  W blocks along K (or 16 x 16 tiles)
    dgrad  dA = dY W       dY blocks along N, W blocks along N (the same tiles when 2-D)
    wgrad  dW = dY^T A     dY and A blocks along M (tokens), optionally after a 16-point
                           random Hadamard transform of both along M

Because the wgrad operands are blocked along tokens, the high-precision input is kept
for backward (as TransformerEngine's NVFP4 recipe does) and re-quantized there, unlike
the paper's per-token path, which saves packed codes. Each of the six operands can use
stochastic rounding (``FP4Config.stochastic_rounding``). Its random draws come from a
generator seeded by ``(sr_seed, operand, checksum of the operand's bits)``: a function of
the training state only, so a run resumed from a checkpoint draws exactly what the
uninterrupted run drew.

The paper's techniques compose (arXiv 2501.17116, sections 3.2 and 3.3): OCC clamps A
before it is quantized and adds the residual's products in high precision (fprop and
wgrad); DGE multiplies the weight gradient by ``f'(W * s)`` with ``s`` each weight
element's block encode scale.

This is the reference (PyTorch) path: each GeMM dequantizes its operands block by block
(exact in bf16/fp32) and runs one dense matmul, with per-tensor factors in the epilogue.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import SR_OPERANDS  # the six GeMM operands SR can apply to (GeMM.operand)
from .block_formats import BlockFP4, _operand, _pack, _unpack, quantize_block
from .hadamard import apply_rht, rht_matrix

__all__ = ["BLOCK_FORMAT_NAMES", "SR_OPERANDS", "block_fp4_linear", "positional_keep"]

#: FP4Config.block_format -> block_formats name (block size and scale type)
BLOCK_FORMAT_NAMES = {"block16_e4m3": "nvfp4", "block32_e8m0": "mxfp4"}
_MASK63 = (1 << 63) - 1


def _checksum(t: torch.Tensor) -> int:
    """Sum of the tensor's raw bits: identical tensors (e.g. after a resume) give identical seeds."""
    t = t.detach().contiguous().reshape(-1)
    if t.dtype == torch.float64:
        t = t.float()
    ints = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    return int(ints.sum(dtype=torch.int64))


def _rounding(cfg, operand: str, t: torch.Tensor):
    """("nearest", None) or ("stochastic", a generator seeded from the config and the data)."""
    if operand not in cfg.stochastic_rounding:
        return "nearest", None
    seed = (cfg.sr_seed * 1_000_003 + SR_OPERANDS.index(operand) * 7_919 + _checksum(t)) & _MASK63
    return "stochastic", torch.Generator(device=t.device).manual_seed(seed)


def _quant(t: torch.Tensor, fmt: str, cfg, operand: str, block_2d: bool = False) -> BlockFP4:
    rounding, gen = _rounding(cfg, operand, t)
    return quantize_block(t, fmt, rounding, gen, block_2d=block_2d)


def _transpose_2d(q: BlockFP4) -> BlockFP4:
    """The same 2-D-tiled block tensor, transposed (codes and tile scales), no re-quantization."""
    m, k = q.shape
    b = q.block
    codes = _unpack(q.codes)[:, :k]  # (M, K)
    ct = torch.nn.functional.pad(codes.t(), (0, (-m) % b)).contiguous()  # (K, Mp)
    return BlockFP4(_pack(ct), q.scales.t().contiguous(), q.global_scale, q.fmt, True, (k, m), q.post_scale)


def _gemm(qa: BlockFP4, qb: BlockFP4, cd: torch.dtype, a_extra: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``A B^T`` of block-FP4 operands; ``a_extra`` (high precision) is added to A's values."""
    av, ga = _operand(qa, cd)
    bv, gb = _operand(qb, cd)
    if a_extra is not None:  # OCC's outliers, carried into the same product in high precision
        av = av.float().add_(a_extra.float() / ga).to(cd)
    y = (av @ bv.t()).float()
    return y.mul_(ga * gb)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _occ(x2d: torch.Tensor, cfg, bounds=None):
    """(clamped A, residual or None, bounds) - OCC of section 3.3, or the identity."""
    if not cfg.occ:
        return x2d, None, None
    from .occ import occ_bounds, occ_clamp

    if bounds is None:
        bounds = occ_bounds(x2d, cfg.occ_alpha, cfg.occ_quantile, cfg.occ_sample_size)
    xc, r = occ_clamp(x2d, bounds)
    return xc, (r if cfg.occ_compensation else None), bounds


class _BlockFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cfg):
        out_dtype = _out_dtype(x)
        fmt = BLOCK_FORMAT_NAMES[cfg.block_format]
        n, k = weight.shape
        x2d = x.reshape(-1, k)
        with torch.autocast(x.device.type, enabled=False):
            xc, r, bounds = _occ(x2d, cfg)
            qa = _quant(xc, fmt, cfg, "fprop.a")
            qw = _quant(weight.detach(), fmt, cfg, "fprop.w", block_2d=cfg.weight_block_2d)
            y = _gemm(qa, qw, _compute_dtype(out_dtype), r)
            if bias is not None:
                y.add_(bias.float())
        ctx.save_for_backward(x2d, weight)
        ctx.cfg, ctx.fmt, ctx.bounds, ctx.qw = cfg, fmt, bounds, (qw if cfg.weight_block_2d else None)
        ctx.has_bias, ctx.out_dtype, ctx.x_dtype, ctx.x_shape = bias is not None, out_dtype, x.dtype, x.shape
        return y.to(out_dtype).reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        cfg, fmt = ctx.cfg, ctx.fmt
        n, k = weight.shape
        cd = _compute_dtype(ctx.out_dtype)
        dyf = dy.reshape(-1, n).float()
        grad_x = grad_w = grad_b = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                # dgrad: reduction over N; 2-D tiles let fprop's quantized W serve as W^T
                qg = _quant(dyf, fmt, cfg, "dgrad.g")
                if ctx.qw is not None and "dgrad.w" not in cfg.stochastic_rounding:
                    qwt = _transpose_2d(ctx.qw)
                else:
                    qwt = _quant(weight.detach().t().contiguous(), fmt, cfg, "dgrad.w", block_2d=cfg.weight_block_2d)
                grad_x = _gemm(qg, qwt, cd).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                # wgrad: reduction over tokens M; optional RHT of both operands along M
                xc, r, _ = _occ(x2d, cfg, ctx.bounds)
                g_op, a_op = dyf, xc.float()
                if cfg.rht_wgrad:
                    q = rht_matrix(cfg.rht_seed, device=dyf.device)
                    g_op, a_op = apply_rht(g_op, q, 0), apply_rht(a_op, q, 0)
                qg = _quant(g_op.t().contiguous(), fmt, cfg, "wgrad.g")
                qa = _quant(a_op.t().contiguous(), fmt, cfg, "wgrad.a")
                grad_w = _gemm(qg, qa, cd)
                if r is not None:  # OCC compensation's share dY^T R, in high precision
                    grad_w.add_(dyf.t() @ r.float())
                if cfg.dge:
                    from .dge import dge_derivative

                    qw = ctx.qw if ctx.qw is not None else _quant(weight.detach(), fmt, cfg, "fprop.w")
                    dec = qw.element_scales()[:n, :k] * (qw.global_scale if qw.global_scale is not None else 1.0)
                    grad_w.mul_(dge_derivative(weight.detach().float() / (dec * qw.post_scale), cfg.dge_k,
                                               cfg.dge_clamp))
                grad_w = grad_w.to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = dyf.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def block_fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg) -> torch.Tensor:
    """``F.linear`` with block-FP4 GeMMs (``cfg.block_format`` != "none"); inputs already validated."""
    return _BlockFP4LinearFn.apply(x, weight, bias, cfg)


def positional_keep(module: nn.Module, keep_first_n: int, keep_last_n: int) -> list[str]:
    """Name prefixes (``"layers.0."``) of the first/last transformer blocks to keep in high precision.

    The blocks are the children of the longest ``nn.ModuleList`` that holds Linear layers
    (``layers`` in ``fp4lightning.models.llama``, ``model.layers`` in Hugging Face LLaMA).
    """
    if keep_first_n <= 0 and keep_last_n <= 0:
        return []
    best, best_name = None, ""
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and any(isinstance(c, nn.Linear) for c in m.modules()):
            if best is None or len(m) > len(best):
                best, best_name = m, name
    if best is None:
        raise ValueError("keep_first_n / keep_last_n: found no nn.ModuleList of transformer blocks in the model; "
                         "set both to 0 and list the layers in skip_modules instead")
    n = len(best)
    idx = sorted(set(range(min(keep_first_n, n))) | set(range(max(0, n - keep_last_n), n)))
    prefix = f"{best_name}." if best_name else ""
    return [f"{prefix}{i}." for i in idx]
