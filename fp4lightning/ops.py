"""The FP4 linear layer's kernels, with dispatch between PyTorch and Triton (section 3).

Per linear layer ``Y = A W^T`` (A: M x K tokens, W: N x K) the three GeMMs are

    forward  Y  = diag(1/s_a) (A_q  W_q^T) diag(1/s_w)             A_q, W_q FP4
    dgrad    dA = diag(1/s_g1) (G1_q W_q),    G1 = dY diag(1/s_w)   G1_q FP8 E5M2, per row
    wgrad    dW = diag(1/s_g2) (G2_q^T A_q),  G2 = diag(1/s_a) dY   G2_q FP8 E5M2, per column

where ``s`` are quantization multipliers (``q = x * s``). Folding the FP4 scales of
the *reduction* dimension into dY before its FP8 cast is what lets every scale that
is left be applied in the epilogue, so each GeMM consumes raw 4-bit codes.
The DGE factor ``f'(W s_w)`` multiplies the wgrad output element-wise.

Every function here has a PyTorch reference (``*_reference``), which runs on any
device and is what CPU training uses. ``FP4LIGHTNING_BACKEND`` selects:

* ``auto`` (default) - Triton kernels on CUDA when they are importable, else the reference;
* ``reference``      - always PyTorch;
* ``triton``         - always Triton (on CPU this needs ``TRITON_INTERPRET=1`` set
  before import, and is only meant for testing the kernels).
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from .formats import F8E4M3_MAX, F8E5M2_MAX, cast_to_fp8, decode_e2m1, decode_packed_fp4, unpack_fp4
from .occ import occ_clamp
from .quantize import AMAX_EPS, quantize_rows

__all__ = [
    "backend_for",
    "quantize_fp4",
    "quantize_fp4_clamped",
    "quantize_fp8",
    "fp4_gemm",
    "fp4_dgrad",
    "fp4_wgrad",
    "fp4_gemm_reference",
    "fp4_dgrad_reference",
    "fp4_wgrad_reference",
    "quantize_fp8_reference",
]

BACKENDS = ("auto", "reference", "triton")
GRAD_FORMATS = ("e5m2", "e4m3", "bf16")


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """Import the Triton kernels lazily; None where they cannot be used."""
    try:
        from . import kernels  # noqa: F401  (fp4lightning.kernels == the top-level kernels/ folder)
        from .kernels import fp4_triton

        return fp4_triton
    except Exception as e:  # triton missing or no driver: the reference path still works
        if torch.cuda.is_available():
            # on a GPU this silently costs all the speed: say why once
            warnings.warn(f"fp4lightning: Triton kernels unavailable ({type(e).__name__}: {e}); "
                          "using the PyTorch reference path", RuntimeWarning, stacklevel=3)
        return None


def backend_for(device: torch.device) -> str:
    """'triton' or 'reference' for tensors on ``device``, honouring FP4LIGHTNING_BACKEND."""
    choice = os.environ.get("FP4LIGHTNING_BACKEND", "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"FP4LIGHTNING_BACKEND={choice!r} is not one of {BACKENDS}")
    if choice == "reference":
        return "reference"
    if choice == "triton":
        if _triton_kernels() is None:
            raise RuntimeError(
                "FP4LIGHTNING_BACKEND=triton but the Triton kernels cannot be imported "
                "(is triton installed? on a CPU-only machine set TRITON_INTERPRET=1 before importing)"
            )
        return "triton"
    return "triton" if device.type == "cuda" and _triton_kernels() is not None else "reference"


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Dtype the reference GeMMs run in: E2M1/E5M2 values are exact in all three.

    fp16 matmul on CPU is very slow (ENV.md), so CPU fp16 computes in fp32.
    """
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


# --------------------------------------------------------------------------- FP4 quantize
def quantize_fp4(x2d: torch.Tensor, scale_mode: str = "float", per_tensor: bool = False):
    """Row-wise FP4 quantization -> ``(packed codes (M, ceil(K/2)) uint8, scale (M,) fp32, values)``.

    ``values`` is the fp32 E2M1-grid tensor when the reference path computed it anyway
    (it saves the forward GeMM an unpack), else None.
    """
    if backend_for(x2d.device) == "triton":
        codes, scale = _triton_kernels().quantize_rows(x2d, scale_mode=scale_mode, per_tensor=per_tensor)
        return codes, scale, None
    return quantize_rows(x2d, scale_mode, per_tensor=per_tensor, packed=True, return_values=True)


def quantize_fp4_clamped(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                         per_tensor: bool = False):
    """OCC clamp + row-wise FP4 quantization -> ``(packed, scale, values, residual)``.

    Same results as ``occ_clamp(x2d, bounds)`` then ``quantize_fp4`` on the clamped
    tensor (section 3.3): ``residual = x - clamp(x)`` is dense in x's dtype, ``values``
    as in ``quantize_fp4``. The Triton backend does it in one fused pass over x.
    """
    if backend_for(x2d.device) == "triton":
        kern = _triton_kernels()
        if hasattr(kern, "quantize_rows_clamped"):
            codes, scale, resid = kern.quantize_rows_clamped(x2d, bounds, scale_mode=scale_mode, per_tensor=per_tensor)
            return codes, scale, None, resid
    xc, resid = occ_clamp(x2d, bounds)
    codes, scale, values = quantize_rows(xc, scale_mode, per_tensor=per_tensor, packed=True, return_values=True)
    return codes, scale, values, resid


# --------------------------------------------------------------------------- FP8 quantize
def quantize_fp8_reference(x2d: torch.Tensor, dim: int, fmt: str = "e5m2"):
    """Absmax FP8 quantization with one fp32 scale per row (dim=1) or column (dim=0).

    Returns ``(x_fp8, scale)`` with ``x ~ x_fp8 / scale``. ``fmt='bf16'`` returns
    ``(x.bfloat16(), ones)`` so callers treat both alike. Non-finite rows/columns
    get a NaN scale (NaN propagates to the GeMM output, where loss scaling sees it).
    """
    if fmt == "bf16":
        n = x2d.shape[0] if dim == 1 else x2d.shape[1]
        return x2d.to(torch.bfloat16), torch.ones(n, device=x2d.device, dtype=torch.float32)
    fmax = {"e5m2": F8E5M2_MAX, "e4m3": F8E4M3_MAX}.get(fmt)
    if fmax is None:
        raise ValueError(f"unknown gradient format {fmt!r}; choose one of {GRAD_FORMATS}")
    xf = x2d.float()
    amax = torch.linalg.vector_norm(xf, float("inf"), dim=dim)  # one pass, NaN propagates
    scale = fmax / amax.clamp(min=AMAX_EPS)
    finite = torch.isfinite(amax)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    scaled = xf * (scale[:, None] if dim == 1 else scale[None, :])
    if not bool(finite.all()):  # only non-finite rows/columns produce NaN here
        scaled = torch.nan_to_num(scaled, nan=0.0)
    return cast_to_fp8(scaled, fmt), scale


def quantize_fp8(x2d: torch.Tensor, dim: int, fmt: str = "e5m2"):
    if backend_for(x2d.device) == "triton" and fmt != "bf16":
        kern = _triton_kernels()
        if hasattr(kern, "quantize_fp8"):
            # per-column scales feed fp4_wgrad, which reads a column-major dY without a transpose
            return kern.quantize_fp8(x2d, dim=dim, fmt=fmt, column_major=dim == 0)
    return quantize_fp8_reference(x2d, dim, fmt)


# --------------------------------------------------------------------------- GeMMs (reference)
def _fp4_values(packed: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    return decode_packed_fp4(packed, k, dtype)


def fp4_gemm_reference(
    a_packed: torch.Tensor,
    a_scale: torch.Tensor,
    w_packed: torch.Tensor,
    w_scale: torch.Tensor,
    k: int,
    out_dtype: torch.dtype = torch.float32,
    bias: torch.Tensor | None = None,
    a_values: torch.Tensor | None = None,
    w_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Y = (A_q W_q^T) / (s_a s_w^T) + bias`` on E2M1 values in ``out_dtype``'s compute dtype.

    ``a_values`` / ``w_values`` (the decoded operands, when the caller still has them)
    skip a decode of the packed codes.
    """
    cd = _compute_dtype(out_dtype, a_packed.device)
    a = a_values.to(cd) if a_values is not None else _fp4_values(a_packed, k, cd)
    w = w_values.to(cd) if w_values is not None else _fp4_values(w_packed, k, cd)
    y = (a @ w.t()).float()
    y.div_(a_scale[:, None]).div_(w_scale[None, :])  # in place: the output is the big tensor
    if bias is not None:
        y.add_(bias.float())
    return y.to(out_dtype)


def fp4_dgrad_reference(
    g: torch.Tensor, g_scale: torch.Tensor, w_packed: torch.Tensor, k: int, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dA = (G1_q W_q) / s_g1[:, None]``; ``g`` (M x N) FP8 or bf16, W packed along K."""
    cd = _compute_dtype(out_dtype, g.device)
    acc = (g.to(cd) @ _fp4_values(w_packed, k, cd)).float()
    return acc.div_(g_scale[:, None]).to(out_dtype)


def fp4_wgrad_reference(
    g: torch.Tensor,
    g_scale: torch.Tensor,
    a_packed: torch.Tensor,
    k: int,
    out_dtype: torch.dtype = torch.float32,
    dge_weight: torch.Tensor | None = None,
    dge_weight_scale: torch.Tensor | None = None,
    dge_k: float = 5.0,
    dge_clamp: float = 3.0,
    addend: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dW = (G2_q^T A_q) / s_g2[:, None] + addend``, times ``f'(W s_w)`` when ``dge_weight`` is given.

    ``g`` is (M x N) with one scale per column (N), A packed along K; output N x K.
    ``addend`` (N x K, e.g. OCC's compensation term ``(dY^T R)``) is added before the
    DGE factor, which multiplies the whole weight gradient.
    """
    from .dge import dge_derivative

    cd = _compute_dtype(out_dtype, g.device)
    acc = (g.to(cd).t() @ _fp4_values(a_packed, k, cd)).float()
    dw = acc.div_(g_scale[:, None])
    if addend is not None:
        dw.add_(addend.float())
    if dge_weight is not None:
        dw.mul_(dge_derivative(dge_weight.float() * dge_weight_scale[:, None], dge_k, dge_clamp))
    return dw.to(out_dtype)


# --------------------------------------------------------------------------- GeMMs (dispatch)
def fp4_gemm(a_packed, a_scale, w_packed, w_scale, k, out_dtype=torch.float32, bias=None, a_values=None,
             w_values=None):
    if backend_for(a_packed.device) == "triton":
        return _triton_kernels().fp4_gemm(a_packed, a_scale, w_packed, w_scale, k, out_dtype=out_dtype, bias=bias)
    return fp4_gemm_reference(a_packed, a_scale, w_packed, w_scale, k, out_dtype, bias, a_values, w_values)


def fp4_dgrad(g, g_scale, w_packed, k, out_dtype=torch.float32):
    if backend_for(g.device) == "triton":
        return _triton_kernels().fp4_dgrad(g, g_scale, w_packed, k, out_dtype=out_dtype)
    return fp4_dgrad_reference(g, g_scale, w_packed, k, out_dtype)


def fp4_wgrad(g, g_scale, a_packed, k, out_dtype=torch.float32, dge_weight=None, dge_weight_scale=None,
              dge_k=5.0, dge_clamp=3.0, addend=None):
    if backend_for(g.device) == "triton":
        return _triton_kernels().fp4_wgrad(
            g, g_scale, a_packed, k, out_dtype=out_dtype, dge_weight=dge_weight,
            dge_weight_scale=dge_weight_scale, dge_k=dge_k, dge_clamp=dge_clamp, addend=addend,
        )
    return fp4_wgrad_reference(g, g_scale, a_packed, k, out_dtype, dge_weight, dge_weight_scale, dge_k, dge_clamp,
                               addend)
