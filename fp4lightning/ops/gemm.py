"""The three GeMMs of the FP4 linear layer and their operand quantizers: the PyTorch references
and the dispatch to the Triton kernels (arXiv 2501.17116, section 3; docs/method.md section 3).

Per linear layer ``Y = A W^T`` (A: M x K tokens, W: N x K) the three GeMMs are

    forward  Y  = diag(1/s_a) (A_q  W_q^T) diag(1/s_w)             A_q, W_q FP4
    dgrad    dA = diag(1/s_g1) (G1_q W_q),    G1 = dY diag(1/s_w)   G1_q FP8 E5M2, per row
    wgrad    dW = diag(1/s_g2) (G2_q^T A_q),  G2 = diag(1/s_a) dY   G2_q FP8 E5M2, per column

where ``s`` are quantization multipliers (``q = x * s``). Folding the FP4 scales of
the *reduction* dimension into dY before its FP8 cast is what lets every scale that
is left be applied in the epilogue, so each GeMM consumes raw 4-bit codes.
The DGE factor ``f'(W s_w)`` multiplies the wgrad output element-wise.

Every function here has a PyTorch reference (``*_reference``), which runs on any
device and is what CPU training uses, and a Triton twin (``fp4lightning.kernels``,
``triton_*``); the plain name (``fp4_gemm``, ``quantize_fp8``, ...) picks between them. ``FP4LIGHTNING_BACKEND`` selects:

* ``auto`` (default) - on CUDA the vendor FP8 GeMM (``scaled_mm``) where the GPU has FP8 tensor
  cores (sm_89+) and its ``torch._scaled_mm`` runs row-wise scaled GeMMs (a tiny call of each kind on
  first use, ``ops.capability``; a kind it refuses goes through another output dtype or to the Triton
  GeMM, with one line saying so), else the Triton kernels when they are importable; on CPU the reference;
* ``reference``      - always PyTorch;
* ``triton``         - always Triton (on CPU this needs ``TRITON_INTERPRET=1`` set
  before import, and is only meant for testing the kernels);
* ``scaled_mm``      - the three GeMMs on ``torch._scaled_mm`` (cuBLASLt / CUTLASS FP8 GeMM with
  row-wise scales, ``kernels/scaled_mm.py``): the FP4 codes as E4M3 operands, dY in FP8, every
  scale that is left a per-row or per-column epilogue scale. On CUDA the quantizers are the
  Triton kernels; on CPU (tests only: torch's CPU ``_scaled_mm`` is slow) the references.
  Feature sizes that are not multiples of 16 fall back to the Triton GeMM on CUDA, the
  reference on CPU; a bf16/fp16 dY (``grad_format='bf16'``) runs the backward GeMMs the same way.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from fp4lightning.numerics.constants import AMAX_EPS, DY_FORMATS, F8E4M3_MAX, F8E5M2_MAX, FP8_AMAX_EPS
from fp4lightning.numerics import cpu_bf16, cpu_fused
from fp4lightning.numerics.absmax import quantize_rows_reference
from fp4lightning.numerics.block_formats import block_gemm_reference
from fp4lightning.numerics.formats import decode_packed_fp4
from fp4lightning.numerics import occ
from fp4lightning.numerics.occ import fold_e4m3, occ_clamp
from fp4lightning.ops import capability

__all__ = [
    "backend_for",
    "DY_FORMATS",
    "output_dtype",
    "operand_dtype",
    "quantize_fp4",
    "quantize_fp4_clamped",
    "quantize_fp4_folded",
    "occ_bounds",
    "quantize_fp8",
    "quantize_fp8_divided",
    "fp4_gemm",
    "fp4_gemm_folded",
    "fp4_dgrad",
    "fp4_wgrad",
    "block_gemm",
    "triton_quantizers",
    "scaled_mm_unavailable",
    "scaled_mm_routes",
    "forget_scaled_mm_probe",
    "quantize_fp4_refold",
    "refold_operand",
    "fp4_gemm_reference",
    "fp4_dgrad_reference",
    "fp4_wgrad_reference",
    "quantize_fp8_reference",
]

BACKENDS = ("auto", "reference", "triton", "scaled_mm")


@functools.lru_cache(maxsize=None)
def _triton_kernels():
    """Import the Triton kernels lazily; None where they cannot be used."""
    try:
        from fp4lightning import kernels  # noqa: F401  (fp4lightning.kernels == the top-level kernels/ folder)
        from fp4lightning.kernels import fp4_triton

        return fp4_triton
    except Exception as e:  # triton missing or no driver: the reference path still works
        if torch.cuda.is_available():
            # on a GPU this silently costs all the speed: say why once
            warnings.warn(f"fp4lightning: Triton kernels unavailable ({type(e).__name__}: {e}); "
                          "using the PyTorch reference path", RuntimeWarning, stacklevel=3)
        return None


@functools.lru_cache(maxsize=None)
def _quantile_kernels():
    """``kernels/quantile.py`` (OCC's quantiles in one launch), or None where it cannot be imported."""
    try:
        from fp4lightning.kernels import quantile

        return quantile
    except Exception:  # triton missing
        return None


@functools.lru_cache(maxsize=None)
def _scaled_mm_kernels():
    """``kernels/scaled_mm.py`` (the torch._scaled_mm GeMMs), or None where it cannot be imported."""
    try:
        from fp4lightning.kernels import scaled_mm

        return scaled_mm
    except Exception:  # triton missing: its operand kernels and the module's imports need it
        return None


@functools.lru_cache(maxsize=None)
def scaled_mm_unavailable(device: torch.device) -> str | None:
    """Why the ``scaled_mm`` backend cannot run on ``device``, or None when it can."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return (f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]}) has no FP8 tensor cores "
                    "(sm_89 or newer)")
    elif device.type != "cpu":
        return f"torch._scaled_mm is not used on {device.type} devices here"
    if _scaled_mm_kernels() is None:
        return "fp4lightning.kernels cannot be imported (is triton installed?)"
    if scaled_mm_routes(device).backend != "scaled_mm":
        first = next(iter(scaled_mm_routes(device).refused.values()))
        return f"torch._scaled_mm on {_device_name(device)} runs no row-wise scaled FP8 GeMM ({first})"
    return None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    cap = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{cap[0]}{cap[1]})"


@functools.lru_cache(maxsize=None)
def _routes(device: torch.device) -> capability.GemmRoutes:
    sm = _scaled_mm_kernels()
    results = capability.probe(device, sm.FP8_FAST_ACCUM if sm is not None else False) \
        if hasattr(torch, "_scaled_mm") else None
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    routes = capability.choose_gemm_route(cap, results, device.type == "cuda" and _triton_kernels() is not None)
    line = capability.describe(_device_name(device), routes)
    if line:  # once per device (cached): a GPU whose torch refuses some kinds still trains, a little slower
        warnings.warn(f"fp4lightning: {line}", RuntimeWarning, stacklevel=4)
    return routes


def forget_scaled_mm_probe() -> None:
    """Probe every device again on its next use (the probe's results are cached per device)."""
    _routes.cache_clear()
    scaled_mm_unavailable.cache_clear()


def scaled_mm_routes(device: torch.device) -> capability.GemmRoutes:
    """Where each ``torch._scaled_mm`` call of the scaled_mm backend goes on ``device``
    (``ops.capability``): probed on first use per device, then cached."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _routes(device)


def backend_for(device: torch.device) -> str:
    """'scaled_mm', 'triton' or 'reference' for tensors on ``device``, honouring FP4LIGHTNING_BACKEND."""
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
    if choice == "scaled_mm":
        why = scaled_mm_unavailable(torch.device(device))
        if why:
            raise RuntimeError(f"FP4LIGHTNING_BACKEND=scaled_mm: {why}; set FP4LIGHTNING_BACKEND to triton or "
                               "reference")
        return "scaled_mm"
    if device.type != "cuda":
        return "reference"
    if scaled_mm_unavailable(torch.device(device)) is None:
        return "scaled_mm"
    return "triton" if _triton_kernels() is not None else "reference"


def triton_quantizers(device: torch.device) -> bool:
    """Whether the quantizers (and the block recipes' GeMM) run as Triton kernels on ``device``: on
    the Triton backend, and on the scaled_mm backend on CUDA (its CPU form, for tests, uses the
    references)."""
    backend = backend_for(device)
    return backend == "triton" or (backend == "scaled_mm" and device.type == "cuda"
                                   and _triton_kernels() is not None)


def _gemm_backend(device: torch.device, fits_scaled_mm: bool,
                  kind: tuple | None = None) -> tuple[str, torch.dtype | None]:
    """``(backend, dtype _scaled_mm writes)`` of one GeMM: the scaled_mm backend's GeMMs whose operands
    do not suit ``_scaled_mm`` (feature sizes not multiples of 16, a bf16 dY), or whose ``kind``
    ((first operand's dtype, output dtype, bias fused)) the device refuses and no other output dtype
    stands in for (``ops.capability``), run the Triton GeMM on CUDA and the reference on CPU."""
    backend = backend_for(device)
    if backend != "scaled_mm":
        return backend, None
    fallback = "triton" if device.type == "cuda" and _triton_kernels() is not None else "reference"
    if not fits_scaled_mm:
        return fallback, None
    return scaled_mm_routes(device).routes.get(kind, (fallback, None))


def _bias_fused(bias: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    # kernels/scaled_mm.py fuses a bias into bf16 / fp16 outputs only
    return bias is not None and out_dtype in (torch.bfloat16, torch.float16)


def _fits(*dims: int) -> bool:
    return all(d % 16 == 0 for d in dims)


def _is_fp8(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _is_e4m3(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.float8_e4m3fn


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Dtype the reference GeMMs run in: E2M1/E5M2 values are exact in all three.

    fp16 matmul on CPU is very slow (no vectorised kernel), so CPU fp16 computes in fp32.
    """
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


def output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer's output takes for input ``x``, as ``nn.Linear``'s: the autocast dtype
    of ``x``'s device while autocast is on there, else ``x``'s dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def operand_dtype(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """``(held in, rounded to)`` for the operands of a reference GeMM computing in ``dtype``'s compute
    dtype: ``(compute dtype, None)``, or ``(float32, bfloat16)`` where bf16 GeMMs are emulated
    (``cpu_bf16.gemm_plan``): values that are not already exact in bf16 are rounded to it."""
    cd = _compute_dtype(dtype, device)
    od, _ = cpu_bf16.gemm_plan(cd, device)
    return od, (cd if od != cd else None)


# --------------------------------------------------------------------------- FP4 quantize
def quantize_fp4(x2d: torch.Tensor, scale_mode: str = "float", per_tensor: bool = False,
                 values_dtype: torch.dtype = torch.float32, inverse: bool = False,
                 bias_bf16: torch.Tensor | None = None):
    """Row-wise FP4 quantization -> ``(packed codes (M, ceil(K/2)) uint8, scale (M,) fp32, values)``.

    ``values`` is the E2M1-grid tensor in ``values_dtype`` (exact in fp32, bf16 and fp16)
    when the reference path computed it anyway (it saves the forward GeMM a decode), else None.
    On the scaled_mm backend ``values`` is the forward GeMM's E4M3 operand (M, K), whatever
    ``values_dtype``. ``inverse``: a fourth element, ``1 / scale`` as the Triton quantizer writes it
    in the same pass (``torch.reciprocal``'s bits), or None where it is not written (the reference).
    ``bias_bf16`` (fp32, one value per row of a weight ``x2d``: the layer's bias): a last element,
    ``bias_bf16.to(torch.bfloat16)`` written by the Triton quantizer's pass (the same bits), or None.
    """
    scaled = backend_for(x2d.device) == "scaled_mm"
    extra = ((None,) if inverse else ()) + ((None,) if bias_bf16 is not None else ())
    if triton_quantizers(x2d.device):
        # with scaled_mm one pass writes the packed codes (kept for backward) and the forward's E4M3 operand
        out = _triton_kernels().triton_quantize_rows(x2d, scale_mode=scale_mode, per_tensor=per_tensor, e4m3=scaled,
                                                     inverse=inverse, bias_bf16=bias_bf16)
        return out if scaled else out[:2] + (None,) + out[2:]
    codes, scale, values = quantize_rows_reference(x2d, scale_mode, per_tensor=per_tensor, packed=True,
                                                   return_values=True,
                                                   values_dtype=torch.float32 if scaled else values_dtype)
    return (codes, scale, (values.to(torch.float8_e4m3fn) if scaled else values)) + extra


def quantize_fp4_clamped(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                         per_tensor: bool = False, fold: bool = False, values_dtype: torch.dtype = torch.float32,
                         values_round: torch.dtype | None = None):
    """OCC clamp + row-wise FP4 quantization -> ``(packed, scale, values, residual)``.

    Same results as ``occ_clamp(x2d, bounds)`` then ``quantize_fp4`` on the clamped
    tensor (section 3.3): ``residual = x - clamp(x)`` is dense in x's dtype, ``values``
    as in ``quantize_fp4``. With ``fold`` the reference path returns the values with the
    residual folded in, ``q + s * residual`` (fp32, then ``values_dtype``, rounded to
    ``values_round`` on the way when given): the forward GeMM on them adds the compensation
    ``R W^T`` (values is None on the Triton path).
    The Triton backend and the compiled reference do it in one fused pass over x. On the
    scaled_mm backend ``fold`` must be False and ``values`` is the E4M3 operand of the clamped
    tensor's E2M1 values (M, K).
    """
    scaled = backend_for(x2d.device) == "scaled_mm"
    if fold and scaled:
        raise ValueError("quantize_fp4_clamped(fold=True): the scaled_mm backend folds OCC's compensation with "
                         "quantize_fp4_folded (an E4M3 operand), not into decoded values")
    if triton_quantizers(x2d.device):
        if scaled:
            codes, scale, resid, e4 = _triton_kernels().triton_quantize_rows_clamped(
                x2d, bounds, scale_mode=scale_mode, per_tensor=per_tensor, e4m3=True)
            return codes, scale, e4, resid
        codes, scale, resid = _triton_kernels().triton_quantize_rows_clamped(x2d, bounds, scale_mode=scale_mode,
                                                                      per_tensor=per_tensor)
        return codes, scale, None, resid
    if scaled:
        values_dtype, values_round = torch.float32, None
    if x2d.dtype != torch.float64 and x2d.shape[1] % 2 == 0 and scale_mode in ("float", "pow2"):
        codes, scale, values, resid = cpu_fused.fp4_rows(x2d, AMAX_EPS, scale_mode == "pow2", per_tensor,
                                                         values_dtype, bounds, fold, values_round)
        return codes, scale, (values.to(torch.float8_e4m3fn) if scaled else values), resid
    xc, resid = occ_clamp(x2d, bounds)
    codes, scale, values = quantize_rows_reference(xc, scale_mode, per_tensor=per_tensor, packed=True, return_values=True)
    if fold:
        values = values + resid.float() * scale[:, None]
    if values_round is not None:
        values = values.to(values_round)
    return codes, scale, values.to(torch.float8_e4m3fn if scaled else values_dtype), resid


def quantize_fp4_folded(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                        per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """OCC's compensation folded into the activation operand in E4M3 (``FP4Config.occ_fold_e4m3``).

    Returns ``(e4, scale)``: ``e4`` (M, K) ``torch.float8_e4m3fn`` holds ``(A_q + s_a R) 2^-shift``
    rounded to E4M3 (``fp4lightning.numerics.occ.fold_e4m3``; the E2M1 entries exact, the ~2% outliers
    at 3 mantissa bits) and ``scale = s_a 2^-shift`` (fp32, one per row), so ``x ~ e4 / scale``.
    Rows whose folded values are not finite get a NaN scale and zero codes (an inf activation
    would otherwise saturate to a finite value and hide a diverged step). The Triton backend
    does it in one kernel (``kernels/quantize.py``, bit-identical to this).
    """
    if triton_quantizers(x2d.device):
        return _triton_kernels().triton_quantize_rows_folded(x2d, bounds, scale_mode=scale_mode, per_tensor=per_tensor)
    if x2d.dtype != torch.float64 and scale_mode in ("float", "pow2"):
        return cpu_fused.fp4_rows_folded(x2d, AMAX_EPS, scale_mode == "pow2", per_tensor, bounds)
    return quantize_fp4_folded_steps(x2d, bounds, scale_mode, per_tensor)


def quantize_fp4_folded_steps(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                              per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp4_folded`` as its three steps, unfused (float64 inputs; the tests' oracle)."""
    _, scale, folded, _ = quantize_fp4_clamped(x2d, bounds, scale_mode, per_tensor, fold=True,
                                               values_dtype=torch.float32)
    e4, shift = fold_e4m3(folded)
    bad = ~torch.isfinite(folded.abs().amax(1))  # NaN or +/-inf anywhere in the row
    scale = torch.where(bad, torch.full_like(scale, float("nan")), torch.ldexp(scale, -shift))
    e4 = e4.masked_fill_(bad[:, None], 0.0)
    return e4.to(torch.float8_e4m3fn), scale


def occ_bounds(x2d: torch.Tensor, alpha: float = 0.99, method: str = "sample",
               sample_size: int = occ.DEFAULT_SAMPLE_SIZE) -> torch.Tensor:
    """OCC's ``tensor([lo, hi])`` (``fp4lightning.numerics.occ.occ_bounds``); where the quantizers are Triton
    kernels and the kernel gives the same bits as the sort it replaces (a bf16 activation whose sample
    CUDA sorts with cub), one launch (``kernels/quantile.py``) instead of about eighteen."""
    kq = _quantile_kernels() if triton_quantizers(x2d.device) else None
    if kq is not None and kq.occ_quantiles_supported(x2d, alpha, method, sample_size):
        return kq.triton_occ_quantiles(x2d, alpha, method, sample_size)
    return occ.occ_bounds(x2d, alpha, method, sample_size)


def quantize_fp4_refold(x2d: torch.Tensor, bounds: torch.Tensor, scale_mode: str = "float",
                        per_tensor: bool = False, capacity: int | None = None):
    """What the scaled_mm backend's ``paper`` quantizes the activation to: ``(e4, fold_scale, packed,
    scale, residual)``, the forward's folded E4M3 operand and its scale (``quantize_fp4_folded``) and
    what backward rebuilds it from (``refold_operand``): the packed codes, scale and dense residual
    (x's dtype) of ``quantize_fp4_clamped``. One Triton pass over x on CUDA; two references on CPU.
    ``capacity``: on the Triton path the residual comes from that pass as the compact residual of that
    many slots, ``(indices, values, overflow, count)`` (``triton_quantize_rows_folded(capacity=)``);
    the references still return it dense."""
    if triton_quantizers(x2d.device):
        return _triton_kernels().triton_quantize_rows_folded(x2d, bounds, scale_mode=scale_mode,
                                                             per_tensor=per_tensor, save=True, capacity=capacity)
    e4, fold_scale = quantize_fp4_folded(x2d, bounds, scale_mode, per_tensor)
    codes, scale, _, resid = quantize_fp4_clamped(x2d, bounds, scale_mode, per_tensor)
    return e4, fold_scale, codes, scale, resid


def refold_operand(codes: torch.Tensor, scale: torch.Tensor, fold_scale: torch.Tensor, resid: tuple,
                   shape: tuple[int, int]) -> torch.Tensor:
    """``quantize_fp4_folded``'s E4M3 operand, bit for bit, rebuilt from what the scaled_mm backend's
    FP4Linear saves instead of it: the packed E2M1 codes and scale ``s_a`` of the clamped activation,
    the folded scale ``s_a 2^-shift`` and the compact residual ``(flat indices, values in x's dtype,
    overflow)`` (``linear._compact_residual``). Returns (M, K) ``float8_e4m3fn``: row-major from the
    PyTorch form, column-major from the Triton kernels (written as wgrad reads it, its only user).

    The same arithmetic as ``cpu_fused.fp4_rows_folded``: ``v = A_q + R s_a`` in fp32, times ``2^-shift``,
    saturated to E4M3's 448 and rounded; rows with a NaN folded scale are zeros. (Past the compact
    residual's capacity the outliers it dropped are missing: FP4Linear then returns a NaN weight
    gradient, as the Triton path does.)"""
    m, k = shape
    idx, vals, _, *count = resid
    if triton_quantizers(codes.device):  # two bandwidth-bound kernels (kernels/scaled_mm.py), the shift found in them
        return _scaled_mm_kernels().triton_refold(codes, scale, None, idx, vals, k, transposed=True,
                                                  fold_scale=fold_scale, count=count[0] if count else None)
    # the shift, from the two scales: 2^-shift exactly (0 <= shift <= 8), NaN for rows folded to NaN
    p = torch.exp2(torch.round(torch.log2(fold_scale / scale)))
    r = torch.zeros(m * k + 1, dtype=vals.dtype, device=vals.device)
    r.scatter_(0, idx.long(), vals)  # unique indices; the padding slots land in the spare element
    v = decode_packed_fp4(codes, k, torch.float32) + r[:m * k].view(m, k).float() * scale[:, None]
    e4 = (v * p[:, None]).clamp(-F8E4M3_MAX, F8E4M3_MAX)
    return torch.where(torch.isnan(p)[:, None], 0.0, e4).to(torch.float8_e4m3fn)


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
    n = x2d.shape[1] if dim == 1 else x2d.shape[0]
    return quantize_fp8_divided(x2d, torch.ones(n, device=x2d.device, dtype=torch.float32), dim, fmt)


def quantize_fp8_divided(x2d: torch.Tensor, div: torch.Tensor, dim: int, fmt: str = "e5m2",
                         carrier: torch.dtype | None = None, inverse: bool = False,
                         div_inv: torch.Tensor | None = None, column_amax_of: torch.Tensor | None = None,
                         column_amax=None, bias_grad: bool = False):
    """``quantize_fp8(x2d.float() * (1 / div), dim, fmt)`` with the fold fused in (both paths).

    ``div`` (fp32) divides every row for ``dim=1`` (one value per column) and every column
    for ``dim=0`` (one value per row): the FP4 scale of the next GeMM's reduction dimension.
    ``carrier`` (reference path only): return the FP8 values held exactly in this dtype (the
    reference GeMM's), saving it a conversion pass; the Triton path returns FP8 tensors.
    ``inverse``: return ``(values, scale, 1 / scale or None)``, the reciprocals the Triton
    quantizers write in the same pass (``fp4_dgrad`` / ``fp4_wgrad``'s ``g_scale_inv``); None
    where they are not written (the GeMM then takes ``torch.reciprocal(scale)``, the same bits).
    ``div_inv``: ``1 / div`` where it is at hand (the FP4 quantizer wrote it, ``quantize_fp4(inverse=True)``);
    the Triton quantizers multiply by it instead of taking the reciprocal themselves (the same bits).

    Work on dY that rides in these passes on the Triton quantizers (``triton_quantize_fp8``), each
    appended to the result, None where it did not (the caller then does it apart): ``column_amax_of``
    (``dim=1``): the column pass's absmax, taken in the row pass with these row multipliers (the column
    pass's ``div_inv``), handed to the ``dim=0`` call as ``column_amax``; ``bias_grad`` (``dim=0``): the
    fp32 column sums of ``x2d`` (the bias gradient; fp32 additions in the kernel's order).
    """
    if triton_quantizers(x2d.device) and fmt != "bf16":
        # the fold (one multiply by 1/div per element) happens in the kernel's registers, as the
        # reference computes it: no fp32 copy of dY is written and read back
        fold = dict(divide_by=div.float()) if div_inv is None else dict(multiply_by=div_inv)
        if column_amax is not None and div_inv is None:
            column_amax = None  # taken with other multipliers: the column pass takes its own
        return _triton_kernels().triton_quantize_fp8(
            x2d, dim=dim, fmt=fmt, column_major=dim == 0, inverse=inverse, column_amax_of=column_amax_of,
            column_amax=column_amax, bias_grad=bias_grad, **fold)
    out = _quantize_fp8_divided_torch(x2d, div, dim, fmt, carrier)
    out = (*out, None) if inverse else out
    return out + ((None,) if column_amax_of is not None else ()) + ((None,) if bias_grad else ())


def _quantize_fp8_divided_torch(x2d, div, dim, fmt, carrier):
    """``quantize_fp8_divided`` without the Triton quantizers."""
    if backend_for(x2d.device) == "scaled_mm":
        carrier = None  # _scaled_mm reads the FP8 tensor itself
    if fmt == "bf16":
        n = x2d.shape[0] if dim == 1 else x2d.shape[1]
        inv = torch.reciprocal(div.float())
        g = x2d.float() * (inv[None, :] if dim == 1 else inv[:, None])
        return g.to(torch.bfloat16), torch.ones(n, device=x2d.device, dtype=torch.float32)
    fp8 = {"e5m2": (F8E5M2_MAX, torch.float8_e5m2), "e4m3": (F8E4M3_MAX, torch.float8_e4m3fn)}.get(fmt)
    if fp8 is None:
        raise ValueError(f"unknown gradient format {fmt!r}; choose one of {DY_FORMATS}")
    return cpu_fused.fp8_scaled(x2d, div, dim, fp8[0], FP8_AMAX_EPS, fp8[1], carrier)


def quantize_fp8(x2d: torch.Tensor, dim: int, fmt: str = "e5m2"):
    if triton_quantizers(x2d.device) and fmt != "bf16":
        # per-column scales feed fp4_wgrad, which reads a column-major dY without a transpose
        return _triton_kernels().triton_quantize_fp8(x2d, dim=dim, fmt=fmt, column_major=dim == 0)
    return quantize_fp8_reference(x2d, dim, fmt)


# --------------------------------------------------------------------------- GeMMs (reference)
def _mm(a: torch.Tensor, b: torch.Tensor, acc_round: torch.dtype | None) -> torch.Tensor:
    """``a @ b`` of a reference GeMM planned by ``cpu_bf16.gemm_plan``: with ``acc_round`` the
    operands are fp32 holding bf16 values and the fp32 product is rounded by the epilogue."""
    return cpu_bf16.emulated_mm_f32(a, b) if acc_round is not None else a @ b


def _fp4_values(packed: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    # a 256-entry byte table gather: measured faster on CPU than a compiled arithmetic
    # decode, whose interleaving store does not vectorize
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
    skip a decode of the packed codes. Where bf16 GeMMs are emulated (``cpu_bf16.gemm_plan``) the
    operands are fp32 and the product is rounded to bf16 in the epilogue: the same bits as a bf16
    GeMM with fp32 accumulation; callers can hand fp32 ``a_values``/``w_values`` to skip a cast.
    """
    od, acc_round = cpu_bf16.gemm_plan(_compute_dtype(out_dtype, a_packed.device), a_packed.device)
    a = a_values.to(od) if a_values is not None else _fp4_values(a_packed, k, od)
    w = w_values.to(od) if w_values is not None else _fp4_values(w_packed, k, od)
    return cpu_fused.gemm_epilogue(_mm(a, w.t(), acc_round), a_scale, w_scale, bias, out_dtype, acc_round)


def fp4_dgrad_reference(
    g: torch.Tensor, g_scale: torch.Tensor, w_packed: torch.Tensor, k: int, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dA = (G1_q W_q) / s_g1[:, None]``; ``g`` (M x N) FP8 or bf16, W packed along K."""
    od, acc_round = cpu_bf16.gemm_plan(_compute_dtype(out_dtype, g.device), g.device)
    acc = _mm(g.to(od), _fp4_values(w_packed, k, od), acc_round)
    return cpu_fused.gemm_epilogue(acc, g_scale, None, None, out_dtype, acc_round)


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
    gemm_dtype: torch.dtype | None = None,
    a_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dW = (G2_q^T A_q) / s_g2[:, None] + addend``, times ``f'(W s_w)`` when ``dge_weight`` is given.

    ``a_values`` (M x K, values exact in the GeMM's dtype) replaces the decoded ``a_packed``: the
    E4M3 operand of ``FP4Config.occ_fold_e4m3``.

    ``g`` is (M x N) with one scale per column (N), A packed along K; output N x K.
    ``addend`` (N x K, e.g. OCC's compensation term ``(dY^T R)``) is added before the
    DGE factor, which multiplies the whole weight gradient. ``gemm_dtype`` (default: the
    compute dtype of ``out_dtype``) is the GeMM's operand dtype: both operands are exact in
    bf16 (E5M2/E4M3 and E2M1 values), so bf16 changes only the rounding of the GeMM's
    output to bf16 (fp32 accumulation), as in bf16 ``nn.Linear``.
    """
    od, acc_round = cpu_bf16.gemm_plan(gemm_dtype or _compute_dtype(out_dtype, g.device), g.device)
    a = a_values.to(od) if a_values is not None else _fp4_values(a_packed, k, od)
    acc = _mm(g.to(od).t(), a, acc_round)
    return cpu_fused.wgrad_epilogue(acc, g_scale, addend, dge_weight,
                                    dge_weight_scale if dge_weight is not None else None, dge_k, dge_clamp, out_dtype,
                                    acc_round)


# --------------------------------------------------------------------------- GeMMs (dispatch)
# On the scaled_mm backend ``a_values`` / ``w_values`` in E4M3 are the operands the quantizers
# wrote (kernels/scaled_mm.py expands the packed codes when they are not given).
def fp4_gemm(a_packed, a_scale, w_packed, w_scale, k, out_dtype=torch.float32, bias=None, a_values=None,
             w_values=None, a_scale_inv=None, w_scale_inv=None, bias_cast=None):
    """``a_scale_inv`` / ``w_scale_inv``: ``1 / scale`` where the quantizers wrote it (the scaled_mm
    backend's epilogue multiplies by them; the same bits as its own reciprocals). ``bias_cast``:
    ``bias.to(bfloat16)`` where the weight's quantizer wrote it (``quantize_fp4(bias_bf16=)``)."""
    backend, mm_dtype = _gemm_backend(a_packed.device, _fits(k, w_packed.shape[0]),
                                      (torch.float8_e4m3fn, out_dtype, _bias_fused(bias, out_dtype)))
    if backend == "scaled_mm":
        sm = _scaled_mm_kernels()
        a8 = a_values if _is_e4m3(a_values) else sm.e4m3_rows(a_packed, k)
        w8 = w_values if _is_e4m3(w_values) else sm.e4m3_rows(w_packed, k)
        return sm.scaled_fp4_gemm(a8, a_scale, w8, w_scale, out_dtype, bias, mm_dtype=mm_dtype,
                                  a_scale_inv=a_scale_inv, w_scale_inv=w_scale_inv, bias_cast=bias_cast)
    if backend == "triton":
        return _triton_kernels().triton_fp4_gemm(a_packed, a_scale, w_packed, w_scale, k, out_dtype=out_dtype, bias=bias)
    return fp4_gemm_reference(a_packed, a_scale, w_packed, w_scale, k, out_dtype, bias, a_values, w_values)


def fp4_dgrad(g, g_scale, w_packed, k, out_dtype=torch.float32, g_scale_inv=None):
    """``g_scale_inv``: ``1 / g_scale`` where the quantizer wrote it (``quantize_fp8_divided(inverse=True)``)."""
    backend, mm_dtype = _gemm_backend(g.device, _is_fp8(g) and _fits(k, w_packed.shape[0]),
                                      (g.dtype, out_dtype, False))
    if backend == "scaled_mm":
        sm = _scaled_mm_kernels()
        return sm.scaled_fp4_dgrad(g, g_scale, sm.e4m3_cols(w_packed, k), out_dtype, mm_dtype=mm_dtype,
                                   g_scale_inv=g_scale_inv)
    if backend == "triton":
        return _triton_kernels().triton_fp4_dgrad(g, g_scale, w_packed, k, out_dtype=out_dtype)
    return fp4_dgrad_reference(g, g_scale, w_packed, k, out_dtype)


def fp4_gemm_folded(a_fold, a_scale, w_packed, w_scale, k, out_dtype=torch.float32, bias=None, w_values=None,
                    values_dtype=None, a_scale_inv=None, w_scale_inv=None, bias_cast=None):
    """Forward GeMM on the E4M3 operand of ``quantize_fp4_folded``: ``(E W_q^T) / (s s_w^T) + bias``.

    ``values_dtype`` (reference path): the dtype the reference GeMM reads E in (E4M3 values are
    exact in bf16 and fp32); default the compute dtype of ``out_dtype``. ``a_scale_inv`` /
    ``w_scale_inv``, ``bias_cast``: as in ``fp4_gemm``."""
    backend, mm_dtype = _gemm_backend(a_fold.device, _fits(k, w_packed.shape[0]),
                                      (torch.float8_e4m3fn, out_dtype, _bias_fused(bias, out_dtype)))
    if backend == "scaled_mm":
        sm = _scaled_mm_kernels()
        w8 = w_values if _is_e4m3(w_values) else sm.e4m3_rows(w_packed, k)
        return sm.scaled_fp4_gemm(a_fold, a_scale, w8, w_scale, out_dtype, bias, mm_dtype=mm_dtype,
                                  a_scale_inv=a_scale_inv, w_scale_inv=w_scale_inv, bias_cast=bias_cast)
    if backend == "triton":
        return _triton_kernels().triton_folded_gemm(a_fold, a_scale, w_packed, w_scale, k, out_dtype=out_dtype,
                                                    bias=bias)
    a_vals = a_fold.to(values_dtype or _compute_dtype(out_dtype, a_fold.device))
    w_vals = None if w_values is None or _is_fp8(w_values) else w_values
    return fp4_gemm_reference(a_fold, a_scale, w_packed, w_scale, k, out_dtype, bias, a_vals, w_vals)


def fp4_wgrad(g, g_scale, a_packed, k, out_dtype=torch.float32, dge_weight=None, dge_weight_scale=None,
              dge_k=5.0, dge_clamp=3.0, addend=None, gemm_dtype=None, a_values=None, nan_if=None, g_scale_inv=None):
    """``nan_if`` (a 0-dim bool on the device): where set, the gradient is all NaN (no host sync; on
    the scaled_mm backend on CUDA inside the wgrad's epilogue pass). ``g_scale_inv``: as in ``fp4_dgrad``."""
    backend, mm_dtype = _gemm_backend(g.device, _is_fp8(g) and _fits(k, g.shape[1]),
                                      (g.dtype, torch.float32, False))
    if backend == "scaled_mm":
        sm = _scaled_mm_kernels()
        # A's values transposed (tokens contiguous): from its packed codes, or the folded E4M3 operand
        a8t = sm.fp8_cols(a_values) if a_values is not None else sm.e4m3_cols(a_packed, k)
        return sm.scaled_fp4_wgrad(g, g_scale, a8t, out_dtype, dge_weight, dge_weight_scale, dge_k, dge_clamp, addend,
                                   mm_dtype=mm_dtype, nan_if=nan_if, g_scale_inv=g_scale_inv)
    dw = _fp4_wgrad_other(backend, g, g_scale, a_packed, k, out_dtype, dge_weight, dge_weight_scale, dge_k, dge_clamp,
                          addend, gemm_dtype, a_values)
    return dw if nan_if is None else torch.where(nan_if, torch.full((), float("nan"), device=dw.device), dw)


def _fp4_wgrad_other(backend, g, g_scale, a_packed, k, out_dtype, dge_weight, dge_weight_scale, dge_k, dge_clamp,
                     addend, gemm_dtype, a_values):
    """``fp4_wgrad`` on the Triton and reference backends."""
    if a_values is not None:  # the E4M3-folded activation operand (FP4Config.occ_fold_e4m3)
        # the Triton GeMM needs an FP8 dY (it says so in one line on the Triton backend); the
        # scaled_mm backend's bf16 dY takes the reference
        if backend == "triton" and (_is_fp8(g) or backend_for(g.device) == "triton"):
            return _triton_kernels().triton_folded_wgrad(
                g, g_scale, a_values, out_dtype=out_dtype, dge_weight=dge_weight,
                dge_weight_scale=dge_weight_scale, dge_k=dge_k, dge_clamp=dge_clamp, addend=addend)
        return fp4_wgrad_reference(g, g_scale, a_packed, k, out_dtype, dge_weight, dge_weight_scale, dge_k,
                                   dge_clamp, addend, gemm_dtype, a_values)
    if backend == "triton":
        return _triton_kernels().triton_fp4_wgrad(
            g, g_scale, a_packed, k, out_dtype=out_dtype, dge_weight=dge_weight,
            dge_weight_scale=dge_weight_scale, dge_k=dge_k, dge_clamp=dge_clamp, addend=addend,
        )
    return fp4_wgrad_reference(g, g_scale, a_packed, k, out_dtype, dge_weight, dge_weight_scale, dge_k, dge_clamp,
                               addend, gemm_dtype)


# --------------------------------------------------------------------------- block-scaled GeMM
def block_gemm(a, b) -> torch.Tensor:
    """fp32 ``A B^T`` of two ``BlockFP4`` operands (fp4lightning.numerics.block_formats) sharing their
    reduction dimension: the Triton block-scaled kernel (kernels/block.py) on the Triton backend,
    else ``block_gemm_reference``. 2-D (16 x 16) tiles are handed to the kernel as per-row
    scales; the tensor-wide factors (NVFP4 global scale, MXFP4 SR post-scale) go to its epilogue."""
    if a.shape[1] != b.shape[1] or a.fmt != b.fmt:
        raise ValueError(f"block_gemm: operands differ ({a.fmt} {a.shape} vs {b.fmt} {b.shape}); "
                         "they must share the format and the reduction (last) dimension")
    if not triton_quantizers(a.codes.device):
        return block_gemm_reference(a, b, torch.float32)
    from fp4lightning.kernels import block as kb

    def rows(q):  # one scale row per tensor row
        return q.scales.repeat_interleave(q.block, dim=0)[: q.shape[0]].contiguous() if q.block_2d else q.scales

    def factor(q):
        return q.post_scale if q.global_scale is None else q.global_scale * q.post_scale

    f = factor(a) * factor(b)
    if isinstance(f, torch.Tensor):
        f = f.to(torch.float32).reshape(())
    return kb.triton_block_gemm(a.codes, rows(a), b.codes, rows(b), a.fmt, f)
