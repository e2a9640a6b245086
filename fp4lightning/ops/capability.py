"""What ``torch._scaled_mm`` runs on a device, found by trying it: the scaled_mm backend's capability
probe and the route each of its GeMMs takes (``ops.gemm`` asks once per device).

The scaled_mm backend (``kernels/scaled_mm.py``) makes three kinds of row-wise scaled FP8 GeMM,
always with an E4M3 second operand:

    forward  E4M3 x E4M3 -> the layer's output dtype (bf16 / fp16 with the bias fused, or fp32)
    dgrad    dY (E5M2, or E4M3 with grad_format='e4m3') x E4M3 -> the layer's output dtype
    wgrad    dY x E4M3 -> fp32

Which of these a device takes depends on the GPU and on how torch was built: cuBLASLt's row-wise
path (sm_90 with recent CUDA builds) takes every output dtype, torch's CUTLASS row-wise kernels
(sm_89, sm_100, sm_90 on older CUDA builds) a bf16 output only, and some GPUs (sm_120) none at all.
A capability number cannot tell these apart, so the first use on a device runs one tiny call of
each kind (``probe``; exact small integers, so a wrong result is caught too) and ``choose_gemm_route``
sends each kind where it works:

1. the call itself;
2. another output dtype of the same operands, then a cast: a refused fp32 output runs as bf16 (the
   rounding a bf16-autocast ``nn.Linear`` makes anyway), a refused bf16 / fp16 output (or fused bias)
   as fp32 with the bias added after;
3. the Triton GeMM (CUDA), else the PyTorch reference.

Where any kind leaves its call, ``describe`` says so in one line. Where no kind runs (sm_120, a
torch without row-wise scaling, no FP8 tensor cores) the backend as a whole is the Triton one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SCALED_MM_KINDS", "GemmRoutes", "choose_gemm_route", "probe", "probe_call", "describe", "kind_name"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: every call the scaled_mm backend makes: (first operand's dtype, output dtype, bias fused)
SCALED_MM_KINDS = (
    (E4M3, BF16, False), (E4M3, BF16, True), (E4M3, FP16, False), (E4M3, FP16, True), (E4M3, FP32, False),
    (E5M2, BF16, False), (E5M2, FP16, False), (E5M2, FP32, False),
)
#: GPUs before Ada / Hopper have no FP8 tensor cores (``torch._scaled_mm`` refuses them)
MIN_FP8_CAPABILITY = (8, 9)
#: the probe's GeMM: M = N = K = 32 (``_scaled_mm`` wants multiples of 16)
PROBE_SIZE = 32


@dataclass(frozen=True)
class GemmRoutes:
    """``backend``: 'scaled_mm' where at least one kind runs on ``_scaled_mm``, else the fallback;
    ``routes``: per kind ``(backend, dtype _scaled_mm writes)``, the dtype None off scaled_mm;
    ``refused``: per kind that did not run as asked, why."""
    backend: str
    routes: dict
    refused: dict


def kind_name(kind: tuple) -> str:
    a, out, bias = kind
    names = {E4M3: "E4M3", E5M2: "E5M2"}
    return f"{names[a]} x E4M3 -> {str(out).removeprefix('torch.')}{' + bias' if bias else ''}"


def _other_outputs(kind: tuple) -> list[tuple]:
    """The calls that can stand in for ``kind`` with a cast after, in order of preference."""
    a, out, bias = kind
    if out == FP32:
        return [(a, BF16, False)]
    return [(a, FP32, False)]  # fp32 then (bias and) one rounding to bf16 / fp16: the same bits' worth


def choose_gemm_route(capability: tuple[int, int] | None, probe_results: dict | None,
                      triton_available: bool = True) -> GemmRoutes:
    """The route of every ``SCALED_MM_KINDS`` entry on a device of ``capability`` ((major, minor); None
    for a CPU) given ``probe_results`` (kind -> None where the call ran and was exact, else why it did
    not; None where torch has no ``_scaled_mm``). The fallback is the Triton GeMM where
    ``triton_available``, else the reference. A pure function: the tests feed it any device."""
    fallback = "triton" if triton_available else "reference"
    if probe_results is None:
        why = "this torch has no torch._scaled_mm"
        return GemmRoutes(fallback, {k: (fallback, None) for k in SCALED_MM_KINDS}, dict.fromkeys(SCALED_MM_KINDS, why))
    if capability is not None and tuple(capability) < MIN_FP8_CAPABILITY:
        why = f"sm_{capability[0]}{capability[1]} has no FP8 tensor cores"
        return GemmRoutes(fallback, {k: (fallback, None) for k in SCALED_MM_KINDS}, dict.fromkeys(SCALED_MM_KINDS, why))
    works = {k for k in SCALED_MM_KINDS if probe_results.get(k, "not probed") is None}
    routes, refused = {}, {}
    for kind in SCALED_MM_KINDS:
        if kind in works:
            routes[kind] = ("scaled_mm", kind[1])
            continue
        refused[kind] = probe_results.get(kind, "not probed")
        stand_in = next((o for o in _other_outputs(kind) if o in works), None)
        routes[kind] = ("scaled_mm", stand_in[1]) if stand_in else (fallback, None)
    backend = "scaled_mm" if works else fallback
    if not works:  # nothing runs on _scaled_mm: the whole backend is the fallback's (its quantizers too)
        routes = {k: (fallback, None) for k in SCALED_MM_KINDS}
    return GemmRoutes(backend, routes, refused)


def describe(where: str, routes: GemmRoutes) -> str | None:
    """One line saying which kinds left their call on ``where`` (a device's name) and where they went;
    None where every kind runs as asked."""
    if not routes.refused:
        return None
    first_kind, first_why = next(iter(routes.refused.items()))
    if routes.backend != "scaled_mm":
        return (f"torch._scaled_mm on {where} runs none of the row-wise FP8 GeMMs FP4Linear needs "
                f"({kind_name(first_kind)}: {first_why}); FP4Linear uses the {routes.backend} GeMMs there")
    went: dict[str, list[str]] = {}
    for kind in routes.refused:
        backend, dtype = routes.routes[kind]
        to = (f"a {str(dtype).removeprefix('torch.')} output then a cast" if backend == "scaled_mm"
              else f"the {backend} GeMM")
        went.setdefault(to, []).append(kind_name(kind))
    moved = "; ".join(f"{', '.join(kinds)} via {to}" for to, kinds in went.items())
    return (f"torch._scaled_mm on {where} refused {len(routes.refused)} of the {len(SCALED_MM_KINDS)} row-wise "
            f"FP8 GeMM kinds FP4Linear uses ({kind_name(first_kind)}: {first_why}); {moved}")


def probe_call(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               out_dtype: torch.dtype, bias: torch.Tensor | None, fast_accum: bool) -> torch.Tensor:
    """The probe's one ``torch._scaled_mm`` call, as ``kernels/scaled_mm.py`` makes it (tests replace
    this to make a device refuse a kind)."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _probe_operands():
    """(a, b, scale_a, scale_b, bias) on the CPU in fp32: entries in {-1, 0, 1}, power-of-two scales and
    small integer biases, so every product, sum, scale and output below 2^8 is exact in every dtype."""
    n = PROBE_SIZE
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    a = ((i * 7 + j * 3) % 3 - 1).float()  # (M, K)
    b = ((i * 5 + j) % 3 - 1).float()  # (N, K)
    scale_a = torch.exp2(-(torch.arange(n) % 2).float()).reshape(n, 1)
    scale_b = torch.exp2((torch.arange(n) % 2).float()).reshape(1, n)
    bias = (torch.arange(n) % 5 - 2).float()
    return a, b, scale_a, scale_b, bias


def probe(device: torch.device, fast_accum: bool = False) -> dict:
    """kind -> None where one tiny ``_scaled_mm`` call of that kind ran on ``device`` and returned the
    exact product, else why not (the exception's first line, or 'wrong result')."""
    a, b, sa, sb, bias = _probe_operands()
    exact = (a @ b.t()) * sa * sb
    results = {}
    for kind in SCALED_MM_KINDS:
        a_dtype, out, has_bias = kind
        try:
            y = probe_call(a.to(device, a_dtype), b.to(device, E4M3).t(), sa.to(device), sb.to(device), out,
                           bias.to(device, out) if has_bias else None, fast_accum)
            if y.is_meta:  # a trace on meta tensors (benchmarks/roofline.py): shapes only, nothing to check
                results[kind] = None
                continue
            want = exact + bias if has_bias else exact
            ok = y.dtype == out and tuple(y.shape) == tuple(want.shape) and torch.equal(y.float().cpu(), want)
            results[kind] = None if ok else "wrong result"
        except Exception as e:  # noqa: BLE001 - any refusal (RuntimeError, NotImplementedError, ...) is an answer
            text = str(e).strip().splitlines()
            results[kind] = f"{type(e).__name__}: {text[0][:200] if text else ''}"
    return results
