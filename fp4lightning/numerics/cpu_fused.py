"""Fused elementwise passes of the PyTorch (CPU) path, compiled with ``torch.compile``.

The reference path of ``fp4lightning.ops.gemm`` spends most of its time not in the three GeMMs
but in elementwise passes around them: the FP4 quantizers (absmax, scale, rounding,
packing, decoding), the two FP8 casts of dY with their pre-scaling, the GeMM epilogues and
the DGE factor (arXiv 2501.17116, sections 3.1-3.3). Each function here is one such group
of passes written once in plain PyTorch; ``torch.compile`` (Inductor, C++ on CPU) fuses it
into one or two loops over memory. The compiled and the eager evaluation of the same
function give the same bits (every operation is exact or an IEEE fp32 operation done in the
same order; ``tests/test_linear.py`` checks it bitwise), so compiling changes speed only.

``FP4LIGHTNING_COMPILE`` selects: ``auto`` (default: compile on CPU), ``1`` (compile on any
device), ``0`` (eager). Where compiling fails - no C++ compiler on the machine, a full disk under
Inductor's cache, ... - a one-line warning says why once and everything runs eagerly with the same
numerics.
Set ``TORCHINDUCTOR_CACHE_DIR`` to keep compiled kernels between processes. Compiling takes a minute
or more at the first steps of a process; :mod:`fp4lightning.numerics.compile_progress` says so.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fp4lightning.numerics.compile_progress import watching
from fp4lightning.numerics.constants import E2M1_MAX, E4M3_FOLD_MAX_SHIFT, F8E4M3_MAX
from fp4lightning.numerics.dge import dge_derivative
from fp4lightning.numerics.formats import e2m1_index, e2m1_magnitude, pow2_floor, round_to_e5m2

__all__ = ["compile_enabled", "fused_pass", "fp4_rows", "fp4_rows_folded", "fp8_scaled", "gemm_epilogue",
           "wgrad_epilogue"]

COMPILE_CHOICES = ("auto", "0", "1")
_FAILED: list[str] = []  # the reason compiling failed, once it has


def compile_enabled(device: torch.device) -> bool:
    """Whether the fused functions run compiled on ``device`` (see the module docstring)."""
    choice = os.environ.get("FP4LIGHTNING_COMPILE", "auto").lower()
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"FP4LIGHTNING_COMPILE={choice!r} is not one of {COMPILE_CHOICES}")
    if choice == "0" or _FAILED:
        return False
    return choice == "1" or device.type == "cpu"


#: input variants (shapes stay dynamic; dtypes, flags and formats each add a graph) one fused
#: function may compile before it runs eagerly; torch's default (8) is too few for the block
#: quantizer (format x 2-D x rounding x dtype x requires_grad)
RECOMPILE_LIMIT = 64


def fused_pass(fn=None, *, eager_below: int = 0):
    """Decorator: run ``fn`` compiled where ``compile_enabled``, else (or if compiling fails) eagerly.

    ``fn`` is a group of elementwise passes in plain PyTorch whose first argument is a tensor (its
    device decides); its compiled form must give the eager bits (see the module docstring). The
    eager function stays reachable as ``.eager``. The other numerics modules (the block quantizer)
    and the FP8 gradient all-reduce fuse their passes with it too. ``@fused_pass(eager_below=N)``:
    a first argument of fewer than N elements runs eagerly (same bits), for passes of a few ops,
    whose eager form costs less than a compiled call's fixed cost on small tensors.
    """
    if fn is None:
        return functools.partial(fused_pass, eager_below=eager_below)
    compiled = None
    too_many_variants = False

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        nonlocal compiled, too_many_variants
        if (not compile_enabled(x.device) or too_many_variants or x.numel() < eager_below
                or _dispatch_mode_active()):
            return fn(x, *args, **kwargs)
        try:
            if compiled is None:
                # emulate_precision_casts: keep every cast eager makes (a .to(bf16).float() round
                # trip is a rounding here, e.g. cpu_bf16.gemm_plan's; Inductor would drop it)
                compiled = torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})
            # watching: the first compile says so, and a line every 20 s while compiling goes on
            with _recompile_limit(), watching():
                return compiled(x, *args, **kwargs)
        except Exception as e:
            too_many_variants = _compile_failed(fn, e)
        return fn(x, *args, **kwargs)

    wrapper.eager = fn
    return wrapper


@contextlib.contextmanager
def _recompile_limit() -> Iterator[None]:
    """Dynamo's recompile limit set to :data:`RECOMPILE_LIMIT` for one fused call, the previous value back
    after it. Two attribute writes: ``torch._dynamo.config.patch`` around a compiled call on a small tensor
    cost about as much as the call. (torch keeps these settings per thread, as ``patch`` does.)"""
    cfg = torch._dynamo.config
    saved = cfg.recompile_limit
    cfg.recompile_limit = RECOMPILE_LIMIT
    try:
        yield
    finally:
        cfg.recompile_limit = saved


def _dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is on (a FLOP counter such as Lightning's ``measure_flops``, a
    tracer): Dynamo compiles no frame under one, so the call runs eagerly (the same bits) and the
    function compiles again outside it."""
    return _get_current_dispatch_mode() is not None


def _compile_failed(fn, e: Exception) -> bool:
    """Say once why compiling ``fn`` failed; True when only ``fn`` is to run eagerly from now on."""
    if "RecompileLimit" in type(e).__name__:
        # this function only, not the whole CPU path: it keeps running, eagerly
        warnings.warn(f"fp4lightning: {fn.__name__} met more than {RECOMPILE_LIMIT} input variants; "
                      "running it eagerly from now on (same numerics, slower)", RuntimeWarning, stacklevel=3)
        return True
    if not _FAILED:  # no C++ compiler, or Inductor cannot build: same math eagerly
        _FAILED.append(_failure_cause(e))
        if _no_compiler(e):
            fix = "Install a C++ compiler (g++, or name one in CXX) to fuse it"
        else:
            fix = f"Fix that to fuse it (Inductor builds its kernels in {_inductor_cache_dir()})"
        warnings.warn(f"fp4lightning: torch.compile unavailable ({_FAILED[0][:300]}); running the FP4 CPU path "
                      f"eagerly (same numerics, slower). {fix}, or set FP4LIGHTNING_COMPILE=0 to silence this.",
                      RuntimeWarning, stacklevel=3)
    return False


def _failure_cause(e: BaseException) -> str:
    """The line of a failed compile that says why: an OS error (``[Errno 28] No space left on device``)
    or the compiler's ``error:`` line where the exception's text has one, else its first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    why = (next((line for line in lines if "[Errno" in line), None)
           or next((line for line in lines if "error:" in line.lower()), None)
           or (lines[0] if lines else ""))
    return f"{type(e).__name__}: {why}"


def _no_compiler(e: BaseException) -> bool:
    """Whether Inductor failed for want of a C++ compiler (not a compiler that ran and failed, a full
    disk, a cache folder it cannot write, ...)."""
    text = f"{type(e).__name__} {e}"
    return "InvalidCxxCompiler" in text or "No working C++ compiler" in text


def _inductor_cache_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 - only for the message
        return os.environ.get("TORCHINDUCTOR_CACHE_DIR", "Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR)")


def scale_from_amax(amax: torch.Tensor, fmax: float, eps: float, pow2: bool) -> torch.Tensor:
    """fp32 ``fmax / max(amax, eps)`` (or its power-of-two floor), NaN where amax is not finite: the one
    absmax scale formula (FP4 rows, FP8 dY; ``quantize.compute_scale`` calls it too)."""
    scale = fmax / amax.clamp(min=eps)
    if pow2:
        scale = pow2_floor(scale)
    return torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))


def fp4_rows(x: torch.Tensor, eps: float, pow2: bool, per_tensor: bool, values_dtype: torch.dtype,
             bounds: torch.Tensor | None = None, fold: bool = False, values_round: torch.dtype | None = None):
    """Row-wise FP4 quantization of a 2-D ``x`` with an even number of columns.

    Returns ``(packed codes uint8 (M, K/2), scale fp32 (M,), values, residual)``: ``values``
    are the dequantization's E2M1 grid values in ``values_dtype``. With ``bounds = [lo, hi]``
    ``x`` is first clamped (OCC, section 3.3) and ``residual = x - clamp(x)`` in x's dtype is
    returned; with ``fold`` it is also folded into the values as ``q + s * residual`` (fp32,
    then cast), which is how the reference GeMM adds the compensation ``R W^T``. Without
    bounds residual is None. ``values_round`` (e.g. bf16 with fp32 ``values_dtype``): the values
    are rounded to it first, then held in ``values_dtype`` (only the folded values are not already
    exact in every float dtype).

    The fused pass writes one code per byte; the pairs are then packed through an int16 view
    (code 2i in the low byte: every torch device is little-endian). Packing inside the fused
    pass read x at stride 2, which compiles to scalar gathers (1.5x the time of the whole pass).
    """
    codes, scale, q, resid = fp4_rows_unpacked(x, eps, pow2, per_tensor, values_dtype, bounds, fold, values_round)
    pairs = codes.contiguous().view(torch.int16)  # (a transposed x gives transposed codes)
    return ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).to(torch.uint8), scale, q, resid


@fused_pass
def fp4_rows_unpacked(x: torch.Tensor, eps: float, pow2: bool, per_tensor: bool, values_dtype: torch.dtype,
                      bounds: torch.Tensor | None = None, fold: bool = False, values_round: torch.dtype | None = None):
    """``fp4_rows`` with the codes unpacked: uint8 (M, K), one code ``sign << 3 | index`` per byte."""
    resid = None
    if bounds is not None:
        xc = torch.clamp(x, bounds[0].to(x.dtype), bounds[1].to(x.dtype))
        resid = x - xc
        x = xc
    amax = x.abs().amax(1).float()
    if per_tensor:
        amax = amax.amax().expand(x.shape[0])
    scale = scale_from_amax(amax, E2M1_MAX, eps, pow2)
    y = torch.mul(x, scale[:, None])  # fp32: the rounding decision is made in fp32
    y = torch.where(torch.isfinite(scale)[:, None], y, 0.0)  # non-finite rows: codes 0, NaN scale
    a = y.abs()
    # code = index + 8 * sign bit, held in fp32 until the final cast: integer uint8 passes
    # do not vectorize on CPU. copysign sees the sign of -0.0, as signbit does.
    code = e2m1_index(a) + (torch.copysign(torch.ones_like(y), y) < 0).float() * 8.0
    q = torch.copysign(e2m1_magnitude(a), y)
    if fold:
        q = q + resid.float() * scale[:, None]
    if values_round is not None:
        q = q.to(values_round)
    return code.to(torch.uint8), scale, q.to(values_dtype), resid


def _pow2_neg(shift: torch.Tensor) -> torch.Tensor:
    """2^-shift (fp32, exact) for int32 shifts in 0..126, from the exponent bits."""
    return ((127 - shift) << 23).view(torch.float32)


@fused_pass
def fp4_rows_folded(x: torch.Tensor, eps: float, pow2: bool, per_tensor: bool, bounds: torch.Tensor):
    """OCC's compensation folded into the activation operand in E4M3 (``FP4Config.occ_fold_e4m3``),
    in one fused pass: ``(e4 float8_e4m3fn (M, K), scale fp32 (M,))``.

    The same bits as the three steps it fuses (``fp4_rows_unpacked(fold=True)``, then
    ``fp4lightning.numerics.occ.fold_e4m3``, then NaN scales and zero codes for rows whose folded values are
    not finite; ``fp4lightning.ops.gemm.quantize_fp4_folded`` keeps them spelled out for float64 inputs and
    the tests compare the two): the frexp exponent is read from the bits and ``ldexp`` is a
    multiply by an exact power of two, both exact, so Inductor can fuse it.
    """
    xc = torch.clamp(x, bounds[0].to(x.dtype), bounds[1].to(x.dtype))
    resid = x - xc
    amax = xc.abs().amax(1).float()
    if per_tensor:
        amax = amax.amax().expand(x.shape[0])
    scale = scale_from_amax(amax, E2M1_MAX, eps, pow2)
    y = torch.mul(xc, scale[:, None])
    y = torch.where(torch.isfinite(scale)[:, None], y, 0.0)
    v = torch.copysign(e2m1_magnitude(y.abs()), y) + resid.float() * scale[:, None]
    famax = v.abs().amax(1)
    bad = ~torch.isfinite(famax)  # NaN or +/-inf anywhere in the folded row
    famax = torch.where(bad, 0.0, famax)
    e = ((famax.view(torch.int32) >> 23) & 0xFF) - 126  # frexp's exponent (normal numbers; 0 and
    shift = (e - 9).clamp(0, E4M3_FOLD_MAX_SHIFT)  # subnormals land on shift 0 either way)
    shift = torch.where(famax * _pow2_neg(shift) > F8E4M3_MAX, shift + 1, shift).clamp(max=E4M3_FOLD_MAX_SHIFT)
    p = _pow2_neg(shift)
    e4 = torch.where(bad[:, None], 0.0, (v * p[:, None]).clamp(-F8E4M3_MAX, F8E4M3_MAX))
    return e4.to(torch.float8_e4m3fn), torch.where(bad, float("nan"), scale * p)


@fused_pass
def fp8_scaled(x: torch.Tensor, div: torch.Tensor, dim: int, fmax: float, eps: float, fp8_dtype: torch.dtype,
               carrier: torch.dtype | None = None):
    """``g = x.float() * (1 / div)`` (``div`` broadcast over rows for dim=1, over columns for dim=0),
    then absmax FP8 quantization of g with one scale per row (dim=1) or column (dim=0).

    The fold is one IEEE reciprocal per divisor and one fp32 multiply per element (within about
    1.5 fp32 ulp of the exact quotient; what the Triton quantizers compute, bit for bit, without a
    division per element on the GPU).

    Returns ``(g_fp8, scale)``, ``g ~ g_fp8 / scale``; a non-finite row/column gets a NaN
    scale and zero codes. With ``carrier`` (bf16/fp32) the FP8 values come back held in that
    dtype (exactly: FP8 values are bf16 values), ready for a GeMM that runs in it.
    """
    # With a bf16/fp16 carrier, per-column scales (dim=0) are computed on the transposed view and
    # the values written column-major: the wgrad GeMM then reads G^T row-major (oneDNN's bf16
    # GeMM with a transposed operand costs about twice the plain one) and the column reduction
    # becomes a row reduction. An fp32 carrier (fp32 training, or bf16 GeMMs emulated on fp32
    # kernels, fp4lightning.numerics.cpu_bf16) stays row-major: MKL's fp32 GeMM takes the transposed view
    # at no cost, while the strided pass over the transposed view costs more than twice the
    # row-major one (docs/perf.md, "Measured design choices"). Same values and scales either way,
    # bit for bit.
    transposed = carrier is not None and dim == 0 and carrier != torch.float32
    if transposed:
        x, dim = x.t(), 1
    inv = torch.reciprocal(div)
    g = x.float() * (inv[None, :] if dim == 1 else inv[:, None])
    amax = g.abs().amax(dim)
    scale = scale_from_amax(amax, fmax, eps, False)
    s = scale[:, None] if dim == 1 else scale[None, :]
    scaled = torch.where(torch.isfinite(s), g * s, 0.0)
    scaled = scaled.clamp(-fmax, fmax)
    if carrier is not None and fp8_dtype == torch.float8_e5m2 and torch.compiler.is_compiling():
        # same values as the FP8 cast; compiled, the arithmetic vectorizes and the cast does not
        out = round_to_e5m2(scaled).to(carrier)
    else:
        g8 = scaled.to(fp8_dtype)
        out = g8 if carrier is None else g8.to(carrier)
    return (out.contiguous().t() if transposed else out), scale


@fused_pass
def gemm_epilogue(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor | None,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, acc_round: torch.dtype | None = None):
    """``(acc / row_scale[:, None] / col_scale[None, :] + bias)`` in fp32, cast to ``out_dtype``;
    ``acc`` rounded to ``acc_round`` first when given (the output rounding of an emulated bf16
    GeMM, fp4lightning.numerics.cpu_bf16.gemm_plan)."""
    if acc_round is not None:
        acc = acc.to(acc_round)
    y = acc.float() / row_scale[:, None]
    if col_scale is not None:
        y = y / col_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


@fused_pass
def wgrad_epilogue(acc: torch.Tensor, row_scale: torch.Tensor, addend: torch.Tensor | None,
                   weight: torch.Tensor | None, weight_scale: torch.Tensor | None, dge_k: float,
                   dge_clamp: float, out_dtype: torch.dtype, acc_round: torch.dtype | None = None):
    """``(acc / row_scale[:, None] + addend) * f'(W s_w)`` in fp32 (DGE factor when ``weight``
    is given, section 3.2; ``fp4lightning.numerics.dge.dge_derivative``), cast to ``out_dtype``; ``acc``
    rounded to ``acc_round`` first when given (as in :func:`gemm_epilogue`)."""
    if acc_round is not None:
        acc = acc.to(acc_round)
    dw = acc.float() / row_scale[:, None]
    if addend is not None:
        dw = dw + addend.float()
    if weight is not None:
        dw = dw * dge_derivative(weight.float() * weight_scale[:, None], dge_k, dge_clamp)
    return dw.to(out_dtype)


@fused_pass
def bits_sum(ints: torch.Tensor) -> torch.Tensor:
    """Exact int64 sum of an integer tensor (the bits of an operand that seed its stochastic
    rounding, fp4lightning.nn.block_linear): compiled it is ~2.5x faster than eager's widening sum."""
    return ints.to(torch.int64).sum()
