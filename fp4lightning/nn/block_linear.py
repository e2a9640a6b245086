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
stochastic rounding (``FP4Config.stochastic_rounding``). Its random draws are a hash of a seed
derived from ``(sr_seed, operand, checksum of the operand's bits)``: a function of the training
state only, so a run resumed from a checkpoint draws exactly what the uninterrupted run drew. On
CPU the checksum seeds a ``torch.Generator`` whose first draw is the seed (``block_formats.sr_seed``);
on a GPU the checksum stays on the device and the seed is integer arithmetic on it
(``block_formats.sr_seed_from_checksum``, inside the Triton quantizer on the Triton path), so no
backward waits for the host. The two devices draw different (equally distributed) streams, as the
CPU and CUDA generators did before.

The paper's techniques compose (arXiv 2501.17116, sections 3.2 and 3.3): OCC clamps A
before it is quantized and adds the residual's products in high precision (fprop and
wgrad); DGE multiplies the weight gradient by ``f'(W * s)`` with ``s`` each weight
element's block encode scale.

Two GeMM paths, picked per device like the paper recipe's quantizers
(``fp4lightning.ops.gemm.triton_quantizers``: CUDA tensors, or ``FP4LIGHTNING_BACKEND=triton``):

* reference (PyTorch): each operand is quantized and decoded in one pass to
  ``e2m1 * block_scale`` (exact in bf16 and fp32; nothing is packed), each GeMM is one dense
  matmul in the compute dtype, and the per-tensor factors (NVFP4's global scale) are applied
  in the epilogue;
* Triton: each operand is quantized to packed codes and block scales by
  ``kernels/block_quantize.py`` (the codes, scales and stochastic draws of ``quantize_block``, bit
  for bit; a stats pass first where NVFP4's global scale or a device-side seed needs the whole
  tensor; transposed operands read in place), and each GeMM is ``kernels/block.py``'s
  block-scaled kernel, which decodes a tile, applies its block scales exactly, accumulates in
  fp32 and applies the tensor-wide factor in its epilogue. OCC's residual product and DGE run in
  PyTorch around it.
  The two paths compute the same products; they differ only in accumulation order and in the
  reference's bf16 output rounding under bf16 autocast.
"""
from __future__ import annotations

import torch

from fp4lightning.config import SR_OPERANDS  # the six GeMM operands SR can apply to (GeMM.operand)
from fp4lightning.numerics import cpu_bf16
from fp4lightning.numerics.block_formats import BLOCK_SIZES, fake_quantize_block, sr_seed, sr_seed_from_checksum
from fp4lightning.numerics.cpu_fused import bits_sum
from fp4lightning.numerics.dge import dge_derivative
from fp4lightning.numerics.hadamard import apply_rht, rht_matrix
from fp4lightning.numerics.occ import occ_bounds, occ_clamp
from fp4lightning.ops import gemm

__all__ = ["BLOCK_FORMAT_NAMES", "SR_OPERANDS", "block_fp4_linear", "element_decode", "host_seeded"]

#: FP4Config.block_format -> block_formats name (block size and scale type)
BLOCK_FORMAT_NAMES = {"block16_e4m3": "nvfp4", "block32_e8m0": "mxfp4"}
_MASK63 = (1 << 63) - 1


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 sum of the tensor's raw bits, on its device: identical tensors (e.g. after a
    resume) give identical seeds."""
    t = t.detach()  # any layout: the sum does not depend on the order (no copy of a transposed operand)
    if t.dtype == torch.float64:
        t = t.float()
    return bits_sum(t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]))


def _seed_base(cfg, operand: str) -> int:
    """The config's and the operand's part of a stochastic-rounding seed (the checksum is added)."""
    return (cfg.sr_seed * 1_000_003 + SR_OPERANDS.index(operand) * 7_919) & _MASK63


def host_seeded(device: torch.device) -> bool:
    """Whether stochastic-rounding seeds come from a host generator (CPU, where reading the checksum
    costs nothing) rather than ``sr_seed_from_checksum`` on the device."""
    return device.type == "cpu"


def _sr_seed(cfg, operand: str, t: torch.Tensor) -> torch.Tensor | None:
    """The 0-dim int64 seed of ``operand``'s stochastic rounding (None: round to nearest). On CPU the
    first draw of a generator seeded with ``base + checksum`` (reading the checksum costs nothing
    there); elsewhere ``sr_seed_from_checksum`` on the device, which never waits for it."""
    if operand not in cfg.stochastic_rounding:
        return None
    if host_seeded(t.device):
        gen = torch.Generator().manual_seed((_seed_base(cfg, operand) + int(_checksum(t))) & _MASK63)
        return sr_seed(gen, t.device)
    return sr_seed_from_checksum(_seed_base(cfg, operand), _checksum(t))


def _quant(t: torch.Tensor, fmt: str, cfg, operand: str, cd: torch.dtype, block_2d: bool = False):
    """(values * block scales in ``cd``, tensor-wide factor, block decode scales) of one operand."""
    seed = _sr_seed(cfg, operand, t)
    rounding = "nearest" if seed is None else "stochastic"
    return fake_quantize_block(t, fmt, rounding, None, block_2d=block_2d, dtype=cd, seed=seed)


def _gemm(a, b, a_extra: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``A B^T`` of two fake-quantized operands ``(values, factor, _)``; per-tensor factors
    in the epilogue. ``a_extra`` (high precision, OCC's outliers) joins A's values."""
    av, ga, _ = a
    bv, gb, _ = b
    if a_extra is not None:
        av = av.float().add_(a_extra.float() / ga).to(av.dtype)
    y = cpu_bf16.mm(av, bv.t()).float()
    g = ga * gb
    return y if isinstance(g, float) and g == 1.0 else y.mul_(g)


# --------------------------------------------------------------------------- Triton path
def _use_triton(t: torch.Tensor) -> bool:
    return gemm.triton_quantizers(t.device)  # the Triton and the scaled_mm backends on CUDA


def _quant_packed(t: torch.Tensor, fmt: str, cfg, operand: str, block_2d: bool = False, stats=None):
    """One operand (any strides) as packed block FP4 (``BlockFP4``) through the Triton quantizer,
    drawing what ``_quant`` draws. ``stats``: ``weight_stats`` of the same elements, when known."""
    from fp4lightning.kernels.block_quantize import triton_quantize_block

    kw = {}
    if operand in cfg.stochastic_rounding:
        if host_seeded(t.device):
            kw["seed"] = _sr_seed(cfg, operand, t)
        else:  # the kernel derives sr_seed_from_checksum(base, checksum) itself
            kw["seed_base"] = _seed_base(cfg, operand)
    rounding = "stochastic" if kw else "nearest"
    return triton_quantize_block(t.detach(), fmt, rounding, block_2d, stats=stats, **kw)


def _weight_stats(weight: torch.Tensor, fmt: str, cfg):
    """The Triton stats pass over the weight (amax and checksum), when a weight operand needs it:
    taken once in forward and reused by dgrad's ``W^T``; None when no weight operand needs it."""
    from fp4lightning.kernels.block_quantize import triton_block_stats

    sr_on_device = not host_seeded(weight.device) and {"fprop.w", "dgrad.w"} & set(cfg.stochastic_rounding)
    return triton_block_stats(weight.detach()) if fmt == "nvfp4" or sr_on_device else None


def _gemm_triton(a, b) -> torch.Tensor:
    """fp32 ``A B^T`` of two ``BlockFP4`` operands through the Triton block GeMM (one launch)."""
    from fp4lightning.kernels.block import triton_block_gemm_fp4

    return triton_block_gemm_fp4(a, b)


def _values_of(q) -> tuple[torch.Tensor, float | torch.Tensor, torch.Tensor]:
    """``(values, factor, block decode scales)`` of a ``BlockFP4``: ``_quant``'s triple (fp32)."""
    vals, g = q.gemm_operand(torch.float32)
    return vals, g, q.block_scales_fp32()


def element_decode(q, shape, block_2d: bool, b: int) -> torch.Tensor:
    """(N, K) fp32 decode scale of every element of a fake-quantized weight ``q`` (``_quant``'s triple),
    blocks of ``b`` (``b`` x ``b`` tiles with ``block_2d``): what DGE divides the weight by."""
    _, factor, dec = q
    el = dec.repeat_interleave(b, dim=1)
    if block_2d:
        el = el.repeat_interleave(b, dim=0)
    return el[: shape[0], : shape[1]] * factor


def _gemm_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype the reference path's GeMMs read their operands in: bf16 for a bf16 output (bf16
    GeMMs under bf16 autocast, as ``nn.Linear``'s), else fp32."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


def _occ(x2d: torch.Tensor, cfg, bounds=None):
    """(clamped A, residual or None, bounds) - OCC of section 3.3, or the identity."""
    if not cfg.occ:
        return x2d, None, None
    if bounds is None:
        bounds = occ_bounds(x2d, cfg.occ_alpha, cfg.occ_quantile, cfg.occ_sample_size)
    xc, r = occ_clamp(x2d, bounds)
    return xc, (r if cfg.occ_compensation else None), bounds


class _BlockFP4LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cfg):
        out_dtype = gemm.output_dtype(x)
        cd = _gemm_dtype(out_dtype)
        fmt = BLOCK_FORMAT_NAMES[cfg.block_format]
        n, k = weight.shape
        x2d = x.reshape(-1, k)
        triton = _use_triton(x)
        with torch.autocast(x.device.type, enabled=False):
            xc, r, bounds = _occ(x2d, cfg)
            w_stats = None
            if triton:
                w_stats = _weight_stats(weight, fmt, cfg)
                pw = _quant_packed(weight, fmt, cfg, "fprop.w", block_2d=cfg.weight_block_2d, stats=w_stats)
                y = _gemm_triton(_quant_packed(xc, fmt, cfg, "fprop.a"), pw)
                # decoded only for what reads it: OCC's compensation, DGE (2-D tiles: W's scales)
                qw = _values_of(pw) if cfg.weight_block_2d and (r is not None or cfg.dge) else None
                if r is not None:  # OCC compensation R W_q^T, in fp32
                    wv, gw, _ = _values_of(pw) if qw is None else qw
                    y.add_((r.float() @ wv.t()).mul_(gw))
            else:
                qa = _quant(xc, fmt, cfg, "fprop.a", cd)
                qw = _quant(weight.detach(), fmt, cfg, "fprop.w", cd, block_2d=cfg.weight_block_2d)
                y = _gemm(qa, qw, r)
            if bias is not None:
                y.add_(bias.float())
        ctx.save_for_backward(x2d, weight)
        # 2-D tiles: W^T's quantization is W's, transposed - keep it for dgrad (reference) and DGE
        ctx.cfg, ctx.fmt, ctx.bounds, ctx.qw = cfg, fmt, bounds, (qw if cfg.weight_block_2d else None)
        ctx.triton, ctx.w_stats = triton, w_stats
        ctx.has_bias, ctx.cd, ctx.x_dtype, ctx.x_shape = bias is not None, cd, x.dtype, x.shape
        return y.to(out_dtype).reshape(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dyf = dy.reshape(-1, weight.shape[0]).float()
        grad_x = grad_w = grad_b = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = _block_dgrad(ctx, weight, dyf).to(ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                grad_w = _block_wgrad(ctx, x2d, weight, dyf).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = dyf.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def _block_dgrad(ctx, weight: torch.Tensor, dyf: torch.Tensor) -> torch.Tensor:
    """fp32 ``dA = dY W``: the reduction runs over N (2-D tiles quantize W^T to W's codes, transposed)."""
    cfg, fmt = ctx.cfg, ctx.fmt
    if ctx.triton:
        pwt = _quant_packed(weight.t(), fmt, cfg, "dgrad.w", block_2d=cfg.weight_block_2d, stats=ctx.w_stats)
        return _gemm_triton(_quant_packed(dyf, fmt, cfg, "dgrad.g"), pwt)
    qg = _quant(dyf, fmt, cfg, "dgrad.g", ctx.cd)
    if ctx.qw is not None and "dgrad.w" not in cfg.stochastic_rounding:
        wv, gw, _ = ctx.qw
        qwt = (wv.t(), gw, None)
    else:
        qwt = _quant(weight.detach().t(), fmt, cfg, "dgrad.w", ctx.cd, block_2d=cfg.weight_block_2d)
    return _gemm(qg, qwt)


def _block_wgrad(ctx, x2d: torch.Tensor, weight: torch.Tensor, dyf: torch.Tensor) -> torch.Tensor:
    """fp32 ``dW = dY^T A``: the reduction runs over tokens M, with an optional RHT of both operands
    along M; OCC's compensation ``dY^T R`` and the DGE factor follow."""
    cfg, fmt, cd = ctx.cfg, ctx.fmt, ctx.cd
    xc, r, _ = _occ(x2d, cfg, ctx.bounds)
    g_op, a_op = dyf, xc
    if cfg.rht_wgrad:
        q = rht_matrix(cfg.rht_seed, device=dyf.device)
        g_op, a_op = apply_rht(g_op, q, 0), apply_rht(a_op, q, 0)
    if ctx.triton:
        # the transposes are views: the quantizer reads them in place
        grad_w = _gemm_triton(_quant_packed(g_op.t(), fmt, cfg, "wgrad.g"),
                              _quant_packed(a_op.t(), fmt, cfg, "wgrad.a"))
    else:
        grad_w = _gemm(_quant(g_op.t(), fmt, cfg, "wgrad.g", cd), _quant(a_op.t(), fmt, cfg, "wgrad.a", cd))
    if r is not None:  # OCC compensation's share dY^T R, in high precision
        grad_w.add_(dyf.t() @ r.float())
    if cfg.dge:
        qw = ctx.qw
        if qw is None:  # re-derive fprop's (round-to-nearest) weight scales
            qw = _quant(weight.detach(), fmt, cfg.replace(stochastic_rounding=()), "fprop.w", cd)
            # (the decode scales are the same on both paths: only they are used here)
        dec = element_decode(qw, tuple(weight.shape), cfg.weight_block_2d, BLOCK_SIZES[fmt])
        grad_w.mul_(dge_derivative(weight.detach().float() / dec, cfg.dge_k, cfg.dge_clamp))
    return grad_w


def block_fp4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg) -> torch.Tensor:
    """``F.linear`` with block-FP4 GeMMs (``cfg.block_format`` != "none"); inputs already validated."""
    return _BlockFP4LinearFn.apply(x, weight, bias, cfg)
