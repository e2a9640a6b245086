"""bf16 GeMMs on CPUs that have no native bf16 matrix kernel.

torch runs a CPU bf16 matmul through oneDNN only where oneDNN has a bf16 kernel for the
processor (AVX-512 or AMX on x86, BF16 extensions on Arm). Elsewhere (AVX2-only x86, e.g. many
AMD EPYC virtual machines) it falls back to a scalar loop, tens of times slower than the fp32
kernels (docs/perf.md, "CPUs without native bf16 GeMMs").
Everything of the FP4 simulation and of a bf16 baseline that is a GeMM would pay that.

On those CPUs this module computes the same bf16 GeMM with fp32 kernels: operands rounded to
bf16 exactly as autocast rounds them, products and sums in fp32 (as oneDNN's bf16 kernels do),
the output rounded to bf16 once. Only the order of the fp32 additions inside the GeMM differs
from a native kernel, so results agree to the last bf16 bit except where the two fp32 sums fall on
either side of a bf16 rounding boundary (one ulp), or where a sum nearly cancels and the reordering
error of its K additions is several ulps of the small result (tested in ``tests/test_cpu_bf16.py``).

``FP4LIGHTNING_CPU_BF16_GEMM`` chooses: ``auto`` (default: emulate where torch would not use
oneDNN for bf16, i.e. ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is false), ``native``
(always torch's own bf16 kernels) or ``emulate`` (always fp32 kernels).
"""
from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["emulate_bf16_gemm", "mm", "emulated_mm", "emulated_mm_f32", "gemm_plan", "EmulatedBF16Linear",
           "emulate_bf16_linears", "is_plain_linear", "high_precision_linear_type", "notice_once"]

_ENV = "FP4LIGHTNING_CPU_BF16_GEMM"
_MODES = ("auto", "native", "emulate")


def _mode() -> str:
    mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{_ENV}={mode!r} is not one of {', '.join(_MODES)} "
                         f"(auto: emulate bf16 GeMMs only on CPUs without native bf16 kernels)")
    return mode


@functools.lru_cache(maxsize=1)
def _cpu_has_native_bf16_gemm() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if probe is None:  # an older or newer torch without the probe: trust torch's own kernels
        return True
    try:
        return bool(probe())
    except Exception:  # noqa: BLE001 - a failing probe must not break training
        return True


def emulate_bf16_gemm(device: torch.device | str = "cpu") -> bool:
    """True when bf16 GeMMs on ``device`` should run as fp32 GeMMs of bf16-rounded operands."""
    if torch.device(device).type != "cpu":
        return False
    mode = _mode()
    if mode == "auto":
        return not _cpu_has_native_bf16_gemm()
    return mode == "emulate"


_noticed = False


def _rank() -> int:
    """This process's rank among data-parallel ranks (0 outside of them): every rank converts the same
    model, so rank 0 alone says so."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "0")  # torchrun sets it before the process group exists
    return int(rank) if rank.isdigit() else 0


def notice_once() -> None:
    """One line on stderr the first time emulation is switched on in this process (rank 0 only)."""
    global _noticed
    if not _noticed:
        _noticed = True
        if _rank() != 0:
            return
        print(f"[fp4lightning] this CPU has no native bf16 GeMM kernel (torch would run a scalar loop, "
              f"tens of times slower than fp32): bf16 GeMMs run as fp32 GeMMs of bf16-rounded operands, "
              f"output rounded to bf16 (same rounding points; {_ENV}=native to turn this off)", file=sys.stderr)


def emulated_mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """The emulated bf16 GeMM before its output rounding: ``a @ b`` on fp32 kernels, for fp32 operands
    that hold bf16 values. The caller rounds the fp32 result to bf16 (:func:`gemm_plan`)."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise TypeError(f"emulated_mm_f32 takes fp32 operands holding bf16 values, got {a.dtype} and {b.dtype}")
    return a @ b


def emulated_mm(a: Tensor, b: Tensor) -> Tensor:
    """The bf16 GeMM of two bf16 tensors on fp32 kernels: fp32 products and sums, one rounding to bf16."""
    return emulated_mm_f32(a.float(), b.float()).to(torch.bfloat16)


def gemm_plan(dtype: torch.dtype, device: torch.device | str) -> tuple[torch.dtype, torch.dtype | None]:
    """``(operand dtype, output rounding)`` of a GeMM meant to run in ``dtype`` on ``device``.

    ``(dtype, None)`` normally. For bf16 where :func:`emulate_bf16_gemm` says so, ``(float32,
    bfloat16)``: the caller writes its operands in fp32 (they hold bf16 values: FP4/FP8 codes are
    exact, anything else it rounds to bf16 first), multiplies them with :func:`emulated_mm_f32`
    and rounds the product to bf16 where it next reads it (a fused epilogue). The same bits as
    :func:`emulated_mm` on bf16 operands, without the two upcast passes and the separate rounding
    pass (fp4lightning.ops.gemm's reference GeMMs do this).
    """
    if dtype == torch.bfloat16 and emulate_bf16_gemm(device):
        return torch.float32, torch.bfloat16
    return dtype, None


def mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b``; for bf16 CPU operands where :func:`emulate_bf16_gemm` says so, :func:`emulated_mm`
    (what a native bf16 kernel with fp32 accumulation returns)."""
    if a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and emulate_bf16_gemm(a.device):
        return emulated_mm(a, b)
    return a @ b


class _EmulatedBF16LinearFn(torch.autograd.Function):
    """``bf16(x) bf16(W)^T + bf16(b)`` with fp32 kernels, each GeMM output rounded to bf16 once.

    Saves the bf16 operands for backward (the bytes native bf16 autocast saves); dX, dW and db are
    rounded to bf16 before they take the input's and the parameters' dtypes, as the native bf16
    kernels' outputs are under autocast.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        with torch.autocast("cpu", enabled=False):
            xb = x.to(torch.bfloat16)
            wb = weight.to(torch.bfloat16)
            b = None if bias is None else bias.to(torch.bfloat16).float()
            y = F.linear(xb.float(), wb.float(), b).to(torch.bfloat16)
        ctx.save_for_backward(xb, wb)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        xb, wb = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dx = dw = db = None
        with torch.autocast("cpu", enabled=False):
            dyf = dy.to(torch.bfloat16).float()  # the incoming gradient as the bf16 output's
            if ctx.needs_input_grad[0]:
                dx = (dyf @ wb.float()).to(torch.bfloat16).to(x_dtype)
            dy2 = dyf.reshape(-1, dyf.shape[-1])
            if ctx.needs_input_grad[1]:
                dw = (dy2.t() @ xb.reshape(-1, xb.shape[-1]).float()).to(torch.bfloat16).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                db = dy2.sum(0).to(torch.bfloat16).to(b_dtype)
        return dx, dw, db


class EmulatedBF16Linear(nn.Linear):
    """``nn.Linear`` whose bf16 GeMMs (under CPU bf16 autocast, or with bf16 input and weight) run
    as fp32 GeMMs of bf16-rounded operands. Same parameters and state-dict keys as ``nn.Linear``.

    Rounding points are those of bf16 autocast: input, weight and bias rounded to bf16, each GeMM's
    output (Y, dX, dW, db) rounded to bf16 once. Saved for backward: the bf16 input and weight, as
    under native autocast. Elsewhere (fp32, other devices) it is ``nn.Linear``'s own forward.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            autocast_bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            if autocast_bf16 or (x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16):
                return _EmulatedBF16LinearFn.apply(x, self.weight, self.bias)
        return super().forward(x)


def emulate_bf16_linears(module: nn.Module, device: torch.device | str = "cpu") -> int:
    """Turn every plain ``nn.Linear`` in ``module`` into :class:`EmulatedBF16Linear` in place (a class
    swap: parameters, hooks and state-dict keys stay) where :func:`emulate_bf16_gemm` says so for
    ``device``. Subclasses of ``nn.Linear`` (``FP4Linear``, ...) are left alone. Returns the count."""
    if not emulate_bf16_gemm(device):
        return 0
    n = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = EmulatedBF16Linear
            n += 1
    if n:
        notice_once()
    return n


def is_plain_linear(m: nn.Module) -> bool:
    """``nn.Linear`` itself or :class:`EmulatedBF16Linear` (the same layer with emulated bf16 GeMMs)."""
    return type(m) in (nn.Linear, EmulatedBF16Linear)


def high_precision_linear_type(device: torch.device | str = "cpu") -> type:
    """The class :func:`emulate_bf16_linears` leaves a plain ``nn.Linear`` with on ``device``."""
    return EmulatedBF16Linear if emulate_bf16_gemm(device) else nn.Linear
