"""Benchmark and self-check of the FP4 kernels in one run (arXiv 2501.17116, section 3).

    python benchmarks/bench_kernels.py
    python benchmarks/bench_kernels.py --quick   # two GeMM shapes, one layer shape

On a GPU it prints one table with
  * quantize throughput as a fraction of a device-to-device copy's bandwidth (bytes
    read + written per second; issue target >= 0.70);
  * forward FP4 GeMM TFLOP/s next to torch bf16 matmul and torch._scaled_mm FP8
    (row-wise scales) at 4096^3, 8192^3 and the LLaMA-2 1.3B / 7B layer shapes
    (8192 tokens), plus the two backward GeMMs (E5M2 dY, DGE fused);
  * FP4Linear forward+backward time over bf16 nn.Linear (autocast, fp32 weights);
  * a correctness check of every kernel against its PyTorch reference at one size,
and exits non-zero if a check fails. Sized to finish in under 8 minutes on an H100/H200
(first-call autotuning included).

Without a GPU the same table is produced by the PyTorch *reference* path at small
sizes (the numbers then say nothing about the kernels), and the checks run the Triton
kernels under the interpreter (TRITON_INTERPRET=1 is set here before they are defined).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernel definitions

import triton  # noqa: E402

from fp4lightning.ops import gemm as gemm_dispatch  # noqa: E402
from fp4lightning.config import FP4Config  # noqa: E402
from fp4lightning.numerics.constants import E2M1_MAX, F8E4M3_MAX  # noqa: E402
from fp4lightning.nn.linear import FP4Linear  # noqa: E402
from fp4lightning.numerics.dge import dge_derivative  # noqa: E402
from fp4lightning.numerics.formats import decode_e2m1, unpack_fp4  # noqa: E402
from fp4lightning.numerics.occ import occ_bounds, occ_clamp  # noqa: E402
from fp4lightning.kernels import fp4_triton as kt  # noqa: E402
from fp4lightning.kernels import block, fp8_gemm, gemm  # noqa: E402
from fp4lightning.numerics.block_formats import block_gemm_reference, quantize_mxfp4, quantize_nvfp4  # noqa: E402
from fp4lightning.numerics.absmax import quantize_rows_reference  # noqa: E402

# (label, M tokens, N out, K in). LLaMA-2 7B: dim 4096, FFN 11008; the project's 1.3B
# (fp4lightning.models.llama): dim 2048, FFN 5504. 8192 tokens = 4 sequences of 2048.
# The first GPU_PRIMARY shapes are timed before the FP4Linear rows, the rest after them, so
# a run cut off by scripts/gpu_check.sh's time limit still has the target rows
# (8192^3 forward against bf16 and _scaled_mm, the quantizers, FP4Linear at the 7B shapes).
GPU_GEMM_SHAPES = [
    ("square", 8192, 8192, 8192),
    ("square", 4096, 4096, 4096),
    ("7B qkvo", 8192, 4096, 4096),
    ("7B up/gate", 8192, 11008, 4096),
    ("7B down", 8192, 4096, 11008),
    ("1.3B qkvo", 8192, 2048, 2048),
    ("1.3B up/gate", 8192, 5504, 2048),
    ("1.3B down", 8192, 2048, 5504),
]
GPU_PRIMARY = 1
CPU_GEMM_SHAPES = [
    ("square", 256, 256, 256),
    ("square", 512, 512, 512),
    ("1.3B qkvo", 256, 2048, 2048),
    ("1.3B up/gate", 256, 5504, 2048),
    ("7B qkvo", 256, 4096, 4096),
]
GPU_QUANT_SHAPES = [(8192, 4096), (8192, 11008)]
CPU_QUANT_SHAPES = [(1024, 1024)]
GPU_LINEAR_SHAPES = [(8192, 4096, 4096), (8192, 4096, 11008)]  # tokens, in, out
CPU_LINEAR_SHAPES = [(512, 512, 512)]
# Kernel vs reference: same math, so anything below this means a bug, not rounding.
CHECK_SQNR_DB = 80.0
# cuBLAS's FP8 GeMM on Hopper: its tensor cores add each instruction's products in reduced precision
# (the Triton FP8 GeMMs measured 79-80 dB at scale; tests/test_kernels.py GPU_FP8_GEMM_SQNR_DB)
SCALED_MM_CHECK_SQNR_DB = 74.0


# --------------------------------------------------------------------------- timing
def _time_ms(fn) -> float:
    """Median wall time of ``fn`` in ms (CUDA events via triton's do_bench on a GPU)."""
    if CUDA:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    ts = []
    budget = time.perf_counter() + 2.0
    while len(ts) < 3 or (len(ts) < 20 and time.perf_counter() < budget):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def _rate(x: float, unit: str) -> str:
    """``x`` per second with an SI prefix that keeps 3 significant digits readable."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.1f} {prefix}{unit}/s"
    return f"{x / 1e3:.1f} k{unit}/s"


class Table:
    """Rows printed the moment they are measured (a crash or a timeout keeps what was done)."""

    WIDTHS = (9, 44, 34, 9, 18, 0)

    def __init__(self):
        self.rows: list[tuple[str, ...]] = []
        head = ("section", "case", "shape", "ms", "rate", "relative")
        print(" | ".join(h.ljust(w) for h, w in zip(head, self.WIDTHS)), flush=True)
        print("-+-".join("-" * max(w, 8) for w in self.WIDTHS), flush=True)

    def add(self, section, case, shape, ms, rate, rel):
        row = (section, case, shape, "" if ms is None else f"{ms:.3f}", rate, rel)
        self.rows.append(row)
        print(" | ".join(str(c).ljust(w) for c, w in zip(row, self.WIDTHS)), flush=True)

    def note(self, text):
        print(f"#   {text}", flush=True)


def _winner(kernel) -> str:
    """The autotuner's pick for the last launch of ``kernel`` (an @triton.autotune object)."""
    cfg = getattr(kernel, "best_config", None)
    if cfg is None:
        return "n/a"
    kw = ",".join(f"{k}={v}" for k, v in cfg.kwargs.items() if k != "GROUP")
    return f"{kw},warps={cfg.num_warps},stages={cfg.num_stages}"


def kt_tma(fn):
    """Run ``fn`` with FP4LIGHTNING_TMA=1 (the expand path's GeMM loads its tiles through TMA)."""
    before = os.environ.get("FP4LIGHTNING_TMA")
    os.environ["FP4LIGHTNING_TMA"] = "1"
    try:
        return fn()
    finally:
        if before is None:
            os.environ.pop("FP4LIGHTNING_TMA", None)
        else:
            os.environ["FP4LIGHTNING_TMA"] = before


# --------------------------------------------------------------------------- sections
def bench_quantize(table: Table, dev, shapes):
    quant = kt.triton_quantize_rows if CUDA else (lambda x: quantize_rows_reference(x))
    clamped = kt.triton_quantize_rows_clamped if CUDA else (
        lambda x, b: gemm_dispatch.quantize_fp4_clamped(x, b))  # CPU: the reference (occ_clamp + quantize_rows)
    fp8 = kt.triton_quantize_fp8 if CUDA else (lambda x, dim, fmt: gemm_dispatch.quantize_fp8_reference(x, dim, fmt))
    for m, k in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        shape = f"{m}x{k} bf16"
        t_copy = _time_ms(lambda: dst.copy_(x))
        copy_bw = 2 * x.numel() * 2 / (t_copy * 1e-3)
        table.add("quantize", "copy (D2D baseline)", shape, t_copy, _rate(copy_bw, "B"), "1.00")
        bounds = occ_bounds(x, 0.99)
        cases = [
            ("fp4 rows -> packed", lambda: quant(x), x.numel() * 2 + x.numel() // 2 + m * 4),
            ("fp4 rows + OCC clamp, dense residual", lambda: clamped(x, bounds),
             x.numel() * 4 + x.numel() // 2 + m * 4),
            ("fp8 e5m2, per row", lambda: fp8(x, 1, "e5m2"), x.numel() * 3 + m * 4),
            ("fp8 e5m2, per column", lambda: fp8(x, 0, "e5m2"), x.numel() * 3 + k * 4),
        ]
        # FP4Config.occ_fold_e4m3's quantizer: OCC's residual folded into one E4M3 operand (reads
        # 2 B, writes 1 B per element); on CPU the reference (one compiled pass)
        folded = kt.triton_quantize_rows_folded if CUDA else gemm_dispatch.quantize_fp4_folded
        cases.append(("fp4 rows + OCC folded -> E4M3 (occ_fold_e4m3)", lambda: folded(x, bounds),
                      x.numel() * 3 + m * 4))
        if CUDA:  # the layout FP4Linear's wgrad reads
            cases.append(("fp8 e5m2, per column, column-major out",
                          lambda: kt.triton_quantize_fp8(x, 0, "e5m2", column_major=True), x.numel() * 3 + k * 4))
            # what FP4Linear's backward runs: the FP4 scale of the reduction dimension folded in
            d_col = torch.rand(k, device=dev) + 0.5
            d_row = torch.rand(m, device=dev) + 0.5
            cases.append(("fp8 e5m2, per row, x * (1/s_w) (dgrad operand)",
                          lambda: kt.triton_quantize_fp8(x, 1, "e5m2", divide_by=d_col), x.numel() * 3 + m * 4 + k * 4))
            cases.append(("fp8 e5m2, per column, col-major, x * (1/s_a) (wgrad operand)",
                          lambda: kt.triton_quantize_fp8(x, 0, "e5m2", column_major=True, divide_by=d_row),
                          x.numel() * 3 + k * 4 + m * 4))
        for name, fn, nbytes in cases:
            t = _time_ms(fn)
            bw = nbytes / (t * 1e-3)
            table.add("quantize", name, shape, t, _rate(bw, "B"), f"{bw / copy_bw:.2f} of copy")


def _scaled_mm_fp8(a, w):
    """torch._scaled_mm with row-wise scales (tensor-wise where row-wise is unsupported)."""
    a8 = (a.float() / a.float().abs().amax(1, keepdim=True) * F8E4M3_MAX).to(torch.float8_e4m3fn)
    w8 = (w.float() / w.float().abs().amax(1, keepdim=True) * F8E4M3_MAX).to(torch.float8_e4m3fn)
    sa = torch.rand(a.shape[0], 1, device=a.device) + 0.5
    sb = torch.rand(1, w.shape[0], device=a.device) + 0.5
    try:
        torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        return lambda: torch._scaled_mm(a8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), "row-wise"
    except Exception:
        one = torch.ones((), device=a.device)
        return lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), "tensor-wise"


def bench_gemms(table: Table, dev, shapes):
    for label, m, n, k in shapes:
        shape = f"{label} {m}x{n}x{k}"
        flop = 2.0 * m * n * k
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)

        def tf(ms):
            return _rate(flop / (ms * 1e-3), "FLOP")

        t_bf16 = _time_ms(lambda: a @ w.t())
        table.add("gemm fwd", "torch bf16 matmul", shape, t_bf16, tf(t_bf16), "1.00x bf16")
        t_fp8 = None
        try:
            fn, how = _scaled_mm_fp8(a, w)
            t_fp8 = _time_ms(fn)
            table.add("gemm fwd", f"torch._scaled_mm fp8 ({how}, cuBLAS)", shape, t_fp8, tf(t_fp8),
                      f"{t_bf16 / t_fp8:.2f}x bf16")
        except Exception as e:  # e.g. a GPU without FP8 support
            table.add("gemm fwd", "torch._scaled_mm fp8", shape, None, f"n/a ({type(e).__name__})", "")
        a_p, a_s = quantize_rows_reference(a)
        w_p, w_s = quantize_rows_reference(w)
        if CUDA:
            dec = "fp8" if kt.has_fp8_mma(dev) else "fp16"
            for fast in (False, True):
                acc = "fast accum" if fast else "precise accum"
                t = _time_ms(lambda: kt.triton_fp4_gemm(a_p, a_s, w_p, w_s, k, out_dtype=torch.bfloat16, fast_accum=fast))
                table.add("gemm fwd", f"fp4_gemm (Triton, {dec} decode, {acc})", shape, t, tf(t),
                          f"{t_bf16 / t:.2f}x bf16" + (f", {t_fp8 / t:.2f}x fp8" if t_fp8 else ""))
                table.note(f"autotune winner fp4_gemm {acc}: {_winner(gemm._fp4_gemm_kernel)}")
            expand = kt.has_fp8_mma(dev)
            if expand:  # the expand path: codes -> E4M3 bytes, then a plain FP8 GeMM (kernels/fp8_gemm.py)
                a8, w8 = fp8_gemm.triton_expand_fp4(a_p, k), fp8_gemm.triton_expand_fp4(w_p, k)
                t = _time_ms(lambda: (fp8_gemm.triton_expand_fp4(a_p, k), fp8_gemm.triton_expand_fp4(w_p, k)))
                table.add("gemm fwd", "expand A and W to E4M3 (alone)", shape, t, _rate((a_p.numel() + w_p.numel()) * 3 / (t * 1e-3), "B"),
                          f"{t / t_bf16:.2f}x bf16 GeMM time")
                for fast in (False, True):
                    acc = "fast accum" if fast else "precise accum"
                    t = _time_ms(lambda: kt.triton_fp4_gemm(a_p, a_s, w_p, w_s, k, out_dtype=torch.bfloat16,
                                                            fast_accum=fast, path="expand"))
                    table.add("gemm fwd", f"fp4_gemm (Triton, expand path, {acc})", shape, t, tf(t),
                              f"{t_bf16 / t:.2f}x bf16" + (f", {t_fp8 / t:.2f}x fp8" if t_fp8 else ""))
                    t = _time_ms(lambda: fp8_gemm.triton_fp8_gemm(a8, w8, torch.bfloat16, row_scale=a_s, col_scale=w_s,
                                                                  precise_acc=not fast))
                    table.add("gemm fwd", f"  its FP8 GeMM alone (expanded operands, {acc})", shape, t, tf(t),
                              f"{t_bf16 / t:.2f}x bf16" + (f", {t_fp8 / t:.2f}x fp8" if t_fp8 else ""))
                    table.note(f"autotune winner fp8_gemm {acc}: {_winner(fp8_gemm._fp8_gemm_kernel)}")
                    if not (label == "square" or label.startswith("7B")):
                        continue
                    try:  # the same with TMA operand loads (FP4LIGHTNING_TMA=1)
                        t = _time_ms(lambda: kt_tma(lambda: kt.triton_fp4_gemm(
                            a_p, a_s, w_p, w_s, k, out_dtype=torch.bfloat16, fast_accum=fast, path="expand")))
                        table.add("gemm fwd", f"fp4_gemm (Triton, expand path, TMA, {acc})", shape, t, tf(t),
                                  f"{t_bf16 / t:.2f}x bf16" + (f", {t_fp8 / t:.2f}x fp8" if t_fp8 else ""))
                        table.note(f"autotune winner fp8_gemm TMA {acc}: {_winner(fp8_gemm._fp8_gemm_tma_kernel)}")
                    except Exception as e:  # report and go on: the other rows still count
                        table.add("gemm fwd", f"fp4_gemm (expand path, TMA, {acc})", shape, None,
                                  f"FAILED ({type(e).__name__}: {str(e)[:60]})", "")
            if label == "square":  # block-scaled formats (no FP4 tensor cores: decoded to bf16)
                for fmt, quant in (("mxfp4", block.triton_quantize_mxfp4), ("nvfp4", block.triton_quantize_nvfp4)):
                    qa, qw = quant(a), quant(w)
                    factor = 1.0 if fmt == "mxfp4" else qa[2] * qw[2]
                    t = _time_ms(lambda: block.triton_block_gemm(qa[0], qa[1], qw[0], qw[1], fmt, factor))
                    table.add("gemm fwd", f"block_gemm {fmt} (Triton, bf16 dot)", shape, t, tf(t),
                              f"{t_bf16 / t:.2f}x bf16")
            dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            g1, s1 = kt.triton_quantize_fp8(dy, 1, "e5m2")
            g2, s2 = kt.triton_quantize_fp8(dy, 0, "e5m2", column_major=True)  # FP4Linear's layout
            # fast-accumulation backward rows at the square shapes only (time budget)
            for fast in (False, True) if label == "square" else (False,):
                acc = "fast accum" if fast else "precise accum"
                t = _time_ms(lambda: kt.triton_fp4_dgrad(g1, s1, w_p, k, out_dtype=torch.bfloat16, fast_accum=fast))
                table.add("gemm bwd", f"fp4_dgrad (e5m2 dY, {acc})", shape, t, tf(t), f"{t_bf16 / t:.2f}x bf16 fwd")
                table.note(f"autotune winner fp4_dgrad {acc}: {_winner(gemm._fp4_dgrad_kernel)}")
                t = _time_ms(lambda: kt.triton_fp4_wgrad(g2, s2, a_p, k, dge_weight=w, dge_weight_scale=w_s, fast_accum=fast))
                table.add("gemm bwd", f"fp4_wgrad (e5m2 dY, DGE, {acc})", shape, t, tf(t),
                          f"{t_bf16 / t:.2f}x bf16 fwd")
                table.note(f"autotune winner fp4_wgrad {acc}: {_winner(gemm._fp4_wgrad_kernel)}")
                if expand:  # codes expanded (transposed) to E5M2 inside each call
                    t = _time_ms(lambda: kt.triton_fp4_dgrad(g1, s1, w_p, k, out_dtype=torch.bfloat16, fast_accum=fast,
                                                             path="expand"))
                    table.add("gemm bwd", f"fp4_dgrad (e5m2 dY, {acc}, expand path)", shape, t, tf(t),
                              f"{t_bf16 / t:.2f}x bf16 fwd")
                    t = _time_ms(lambda: kt.triton_fp4_wgrad(g2, s2, a_p, k, dge_weight=w, dge_weight_scale=w_s,
                                                             fast_accum=fast, path="expand"))
                    table.add("gemm bwd", f"fp4_wgrad (e5m2 dY, DGE, {acc}, expand path)", shape, t, tf(t),
                              f"{t_bf16 / t:.2f}x bf16 fwd")
                    table.note(f"autotune winner fp8_gemm (last: wgrad) {acc}: {_winner(fp8_gemm._fp8_gemm_kernel)}")
                    if label == "square":
                        try:
                            t = _time_ms(lambda: kt_tma(lambda: kt.triton_fp4_dgrad(
                                g1, s1, w_p, k, out_dtype=torch.bfloat16, fast_accum=fast, path="expand")))
                            table.add("gemm bwd", f"fp4_dgrad (e5m2 dY, {acc}, expand path, TMA)", shape, t, tf(t),
                                      f"{t_bf16 / t:.2f}x bf16 fwd")
                            t = _time_ms(lambda: kt_tma(lambda: kt.triton_fp4_wgrad(
                                g2, s2, a_p, k, dge_weight=w, dge_weight_scale=w_s, fast_accum=fast, path="expand")))
                            table.add("gemm bwd", f"fp4_wgrad (e5m2 dY, DGE, {acc}, expand path, TMA)", shape, t,
                                      tf(t), f"{t_bf16 / t:.2f}x bf16 fwd")
                        except Exception as e:
                            table.add("gemm bwd", f"expand path, TMA, {acc}", shape, None,
                                      f"FAILED ({type(e).__name__}: {str(e)[:60]})", "")
        else:
            t = _time_ms(lambda: gemm_dispatch.fp4_gemm_reference(a_p, a_s, w_p, w_s, k, torch.bfloat16))
            table.add("gemm fwd", "fp4_gemm_reference (PyTorch)", shape, t, tf(t), f"{t_bf16 / t:.2f}x bf16")


def bench_linear(table: Table, dev, shapes):
    for m, k, n in shapes:
        shape = f"{m} tok, {k}->{n}"
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        base = torch.nn.Linear(k, n, device=dev)

        def step(mod):
            def run():
                # training re-quantizes the weight after every optimizer step: drop the
                # FP4Linear weight cache so each timed call pays for it too
                if "_wq_cache" in mod.__dict__:
                    mod._wq_cache = None
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    y = mod(x)
                y.backward(dy)
            return run

        t_ref = _time_ms(step(base))
        table.add("linear", "nn.Linear bf16 autocast fwd+bwd", shape, t_ref, "", "1.00x time")
        paths = ["decode", "expand", "expand+TMA"] if CUDA and kt.has_fp8_mma(dev) else [None]
        scaled = CUDA and gemm_dispatch.scaled_mm_unavailable(dev) is None
        for preset in ("w4a4-direct", "fp4-no-occ", "paper"):
            mod = FP4Linear.from_linear(base, FP4Config.from_preset(preset))
            for path in paths:  # the Triton backend's GeMM paths
                with _env(FP4LIGHTNING_GEMM_PATH=path and path.split("+")[0], FP4LIGHTNING_BACKEND=CUDA and "triton"):
                    t = _time_ms(step(mod)) if path != "expand+TMA" else kt_tma(lambda: _time_ms(step(mod)))
                table.add("linear", f"FP4Linear {preset} fwd+bwd" + (f" ({path} path)" if path else ""), shape, t,
                          f"{t_ref / t:.2f}x speed", f"{t / t_ref:.2f}x time")
            if scaled:  # the vendor FP8 GeMM (kernels/scaled_mm.py; `paper` folds OCC into E4M3 there)
                with _env(FP4LIGHTNING_BACKEND="scaled_mm"):
                    t = _time_ms(step(mod))
                table.add("linear", f"FP4Linear {preset} fwd+bwd (scaled_mm)", shape, t, f"{t_ref / t:.2f}x speed",
                          f"{t / t_ref:.2f}x time")
        # `paper` with OCC folded into the E4M3 activation operand: forward and weight gradient are
        # FP8 GeMMs (expand path by construction), no bf16 compensation GeMMs (docs/perf.md)
        if not CUDA or kt.has_fp8_mma(dev):
            mod = FP4Linear.from_linear(base, FP4Config.from_preset("paper", occ_fold_e4m3=True))
            with _env(FP4LIGHTNING_BACKEND=CUDA and "triton"):
                t = _time_ms(step(mod))
            table.add("linear", "FP4Linear paper, OCC folded in E4M3 (occ_fold_e4m3) fwd+bwd", shape, t,
                      f"{t_ref / t:.2f}x speed", f"{t / t_ref:.2f}x time")


class _env:
    """Set environment variables for a block (a falsy value leaves the variable alone), restoring them after."""

    def __init__(self, **values):
        self.values = {k: v for k, v in values.items() if v}
        self.before = {}

    def __enter__(self):
        for k, v in self.values.items():
            self.before[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_occ_parts(table: Table, dev, shape):
    """Where ``paper``'s OCC time goes on the Triton backend, part by part, at one layer shape (tokens,
    in, out): the quantile, the clamped quantizer against the plain one, the compact residual
    (no host sync), and the two dense compensation GeMMs (docs/perf.md, "OCC on the GPU")."""
    with _env(FP4LIGHTNING_BACKEND=CUDA and "triton"):
        _bench_occ_parts(table, dev, shape)


def _bench_occ_parts(table: Table, dev, shape):
    from fp4lightning.nn.linear import _compact_residual, _compact_wgrad, _mm_f32

    m, k, n = shape
    label = f"{m} tok, {k}->{n}"
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    w_p, w_s, _ = gemm_dispatch.quantize_fp4(torch.randn(n, k, device=dev))
    bounds = occ_bounds(x, 0.99)
    t_plain = _time_ms(lambda: gemm_dispatch.quantize_fp4(x))
    table.add("occ", "quantize X, no OCC (the baseline)", label, t_plain, "", "1.00x")
    parts = [("occ_bounds (65,536 samples)", lambda: occ_bounds(x, 0.99))]
    _, _, _, r = gemm_dispatch.quantize_fp4_clamped(x, bounds)
    r = r.to(torch.bfloat16)
    parts.append(("quantize X with OCC clamp + dense residual", lambda: gemm_dispatch.quantize_fp4_clamped(x, bounds)))
    resid = _compact_residual(r, 0.99)
    parts.append(("compact residual (nonzero_static)", lambda: _compact_residual(r, 0.99)))
    w_q = gemm_dispatch.decode_packed_fp4(w_p, k, torch.bfloat16)
    parts.append(("decode W_q to bf16 (forward compensation)", lambda: gemm_dispatch.decode_packed_fp4(w_p, k, torch.bfloat16)))
    parts.append(("forward compensation R W_q^T (bf16 GeMM)", lambda: _mm_f32(r, w_q.t())))
    parts.append(("wgrad compensation dY^T R (scatter + bf16 GeMM)", lambda: _compact_wgrad(dy, resid, (m, k))))
    for name, fn in parts:
        t = _time_ms(fn)
        table.add("occ", name, label, t, "", f"{t / t_plain:.2f}x")


def run_checks(table: Table, dev) -> bool:
    """Every kernel against its reference at one size; returns True when all pass."""
    m, n, k = (2048, 1536, 2049) if CUDA else (96, 80, 113)  # odd K on purpose
    x = torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev))
    w = torch.randn(n, k, device=dev)
    dy = torch.randn(m, n, device=dev)
    ok_all = True

    def report(case, ok, detail):
        nonlocal ok_all
        ok_all &= bool(ok)
        table.add("check", case, f"{m}x{n}x{k}", None, detail, "ok" if ok else "FAIL")

    def sq(actual, ref):
        ref = ref.double()
        err = (actual.double() - ref).pow(2).sum().item()
        return math.inf if err == 0 else 10 * math.log10(ref.pow(2).sum().item() / err)

    def db(v):
        return "identical" if v == math.inf else f"SQNR {v:.0f} dB"

    for mode in ("float", "pow2"):
        c, s = kt.triton_quantize_rows(x.bfloat16(), scale_mode=mode)
        rc, rs = quantize_rows_reference(x.bfloat16(), mode)
        report(f"quantize_rows {mode} vs reference", torch.equal(c, rc) and torch.equal(s, rs), "bitwise")
    bounds = occ_bounds(x, 0.99, "exact")
    c, s, r = kt.triton_quantize_rows_clamped(x, bounds)
    xc, rr = occ_clamp(x, bounds)
    rc, rs = quantize_rows_reference(xc)
    same = torch.equal(c, rc) and torch.equal(s, rs) and torch.equal(r, rr)
    report("quantize_rows_clamped (OCC) vs reference", same, "bitwise")
    for dim in (1, 0):
        q, s = kt.triton_quantize_fp8(dy, dim, "e5m2")
        rq, rs = gemm_dispatch.quantize_fp8_reference(dy, dim, "e5m2")
        same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
        report(f"quantize_fp8 e5m2 dim={dim} vs reference", same, "bitwise")
    a_p, a_s = kt.triton_quantize_rows(x)
    w_p, w_s = kt.triton_quantize_rows(w)
    y = kt.triton_fp4_gemm(a_p, a_s, w_p, w_s, k)
    v = sq(y, gemm_dispatch.fp4_gemm_reference(a_p, a_s, w_p, w_s, k))
    report("fp4_gemm vs reference", v >= CHECK_SQNR_DB, db(v))
    expand = kt.has_fp8_mma(dev)
    if expand:
        same = torch.equal(kt.triton_fp4_gemm(a_p, a_s, w_p, w_s, k, path="expand"), y)
        report("fp4_gemm expand path vs decode path", same, "bitwise")
    w_q = decode_e2m1(unpack_fp4(w_p, k), torch.float64)
    a_q = decode_e2m1(unpack_fp4(a_p, k), torch.float64)
    for fmt in ("e5m2", "e4m3", "bf16"):
        g1, s1 = gemm_dispatch.quantize_fp8(dy / w_s[None, :], 1, fmt)
        ref = (g1.double() / s1.double()[:, None]) @ w_q
        v = sq(kt.triton_fp4_dgrad(g1, s1, w_p, k), ref)
        report(f"fp4_dgrad {fmt} vs float64", v >= CHECK_SQNR_DB, db(v))
        if expand and fmt != "bf16":
            v = sq(kt.triton_fp4_dgrad(g1, s1, w_p, k, path="expand"), ref)
            report(f"fp4_dgrad {fmt} expand path vs float64", v >= CHECK_SQNR_DB, db(v))
        g2, s2 = gemm_dispatch.quantize_fp8(dy / a_s[:, None], 0, fmt)
        # DGE of the value the quantizer rounds: W * s_w saturated to +/-6 (arXiv 2501.17116, 3.2)
        dge = dge_derivative((w * w_s[:, None]).clamp(-E2M1_MAX, E2M1_MAX)).double()
        ref = ((g2.double() / s2.double()[None, :]).t() @ a_q) * dge
        v = sq(kt.triton_fp4_wgrad(g2, s2, a_p, k, dge_weight=w, dge_weight_scale=w_s), ref)
        report(f"fp4_wgrad {fmt} + DGE vs float64", v >= CHECK_SQNR_DB, db(v))
        if expand and fmt != "bf16":
            v = sq(kt.triton_fp4_wgrad(g2, s2, a_p, k, dge_weight=w, dge_weight_scale=w_s, path="expand"), ref)
            report(f"fp4_wgrad {fmt} + DGE expand path vs float64", v >= CHECK_SQNR_DB, db(v))
    kb = k - k % 32  # block formats: K a multiple of the block
    for fmt, quant, tquant in (("mxfp4", quantize_mxfp4, block.triton_quantize_mxfp4),
                               ("nvfp4", quantize_nvfp4, block.triton_quantize_nvfp4)):
        ra, rw = quant(x[:, :kb].cpu()), quant(w[:, :kb].cpu())
        got = tquant(x[:, :kb])
        same = torch.equal(got[0].cpu(), ra.codes) and torch.equal(got[1].cpu().view(torch.uint8),
                                                                  ra.scales.view(torch.uint8))
        report(f"quantize_{fmt} vs reference", same, "bitwise")
        factor = 1.0 if fmt == "mxfp4" else (ra.global_scale * rw.global_scale).to(dev)
        y = block.triton_block_gemm(ra.codes.to(dev), ra.scales.to(dev), rw.codes.to(dev), rw.scales.to(dev),
                                    fmt, factor)
        v = sq(y.cpu(), block_gemm_reference(ra, rw))
        report(f"block_gemm {fmt} vs reference", v >= CHECK_SQNR_DB, db(v))
    if not CUDA or gemm_dispatch.scaled_mm_unavailable(dev) is None:
        ok_all &= _check_scaled_mm(report, sq, db, x, w, dy)
    return ok_all


def _check_scaled_mm(report, sq, db, x, w, dy) -> bool:
    """The scaled_mm backend's three GeMMs (kernels/scaled_mm.py: torch._scaled_mm on the Triton
    quantizers' operands) against float64, at K cut to a multiple of 16 (what _scaled_mm reads)."""
    from fp4lightning.kernels import scaled_mm as sm

    ks = x.shape[1] - x.shape[1] % 16
    ok_all = True
    a_p, a_s, a8 = kt.triton_quantize_rows(x[:, :ks], e4m3=True)
    w_p, w_s, w8 = kt.triton_quantize_rows(w[:, :ks], e4m3=True)
    a_q, w_q = a8.double(), w8.double()
    ok = torch.equal(a_q, decode_e2m1(unpack_fp4(a_p, ks), torch.float64))
    report("quantize_rows E4M3 operand vs its codes", ok, "bitwise")
    ok_all &= ok
    v = sq(sm.scaled_fp4_gemm(a8, a_s, w8, w_s), (a_q @ w_q.t()) / (a_s.double()[:, None] * w_s.double()[None, :]))
    report("scaled_mm forward vs float64", v >= SCALED_MM_CHECK_SQNR_DB, db(v))
    ok_all &= v >= SCALED_MM_CHECK_SQNR_DB
    for fmt in ("e5m2", "e4m3"):
        g1, s1 = kt.triton_quantize_fp8(dy, 1, fmt, divide_by=w_s)
        v = sq(sm.scaled_fp4_dgrad(g1, s1, sm.e4m3_cols(w_p, ks)), (g1.double() / s1.double()[:, None]) @ w_q)
        report(f"scaled_mm dgrad {fmt} vs float64", v >= SCALED_MM_CHECK_SQNR_DB, db(v))
        ok_all &= v >= SCALED_MM_CHECK_SQNR_DB
        g2, s2 = kt.triton_quantize_fp8(dy, 0, fmt, column_major=True, divide_by=a_s)
        dge = dge_derivative((w[:, :ks] * w_s[:, None]).clamp(-E2M1_MAX, E2M1_MAX)).double()
        ref = ((g2.double() / s2.double()[None, :]).t() @ a_q) * dge
        v = sq(sm.scaled_fp4_wgrad(g2, s2, sm.e4m3_cols(a_p, ks), dge_weight=w[:, :ks], dge_weight_scale=w_s), ref)
        report(f"scaled_mm wgrad {fmt} + DGE vs float64", v >= SCALED_MM_CHECK_SQNR_DB, db(v))
        ok_all &= v >= SCALED_MM_CHECK_SQNR_DB
    return ok_all


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="two GeMM shapes and one layer shape")
    p.add_argument("--skip-checks", action="store_true", help="timings only")
    p.add_argument("--checks-only", action="store_true", help="the kernel-vs-reference checks only, no timings")
    args = p.parse_args(argv)

    dev = torch.device("cuda" if CUDA else "cpu")
    gemm_shapes = GPU_GEMM_SHAPES if CUDA else CPU_GEMM_SHAPES
    linear_shapes = GPU_LINEAR_SHAPES if CUDA else CPU_LINEAR_SHAPES
    if args.quick:
        gemm_shapes, linear_shapes = gemm_shapes[:1] + gemm_shapes[-1:], linear_shapes[:1]
    if CUDA:
        name = torch.cuda.get_device_name(dev)
        cap = torch.cuda.get_device_capability(dev)
        print(f"# device: {name} (sm_{cap[0]}{cap[1]}); Triton kernels, compiled")
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        print("# device: CPU - no GPU: timings below are the PyTorch REFERENCE path at small sizes,")
        print("#   not the Triton kernels; the checks run the kernels under the Triton interpreter.")
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"triton {triton.__version__}  command: {' '.join([os.path.basename(sys.argv[0])] + sys.argv[1:])}")
    t0 = time.perf_counter()
    table = Table()
    ok = True
    if not args.skip_checks and (CUDA or args.checks_only):
        ok = run_checks(table, dev)  # first: a wrong result shows even if the timings run out of time
        if not ok:
            print("# kernel checks FAILED (timings follow anyway)", flush=True)
        if args.checks_only:
            print(f"# total {time.perf_counter() - t0:.0f} s; checks {'passed' if ok else 'FAILED'}")
            return 0 if ok else 1
    bench_quantize(table, dev, GPU_QUANT_SHAPES if CUDA else CPU_QUANT_SHAPES)
    first = GPU_PRIMARY if CUDA and not args.quick else len(gemm_shapes)
    bench_gemms(table, dev, gemm_shapes[:first])
    bench_linear(table, dev, linear_shapes)
    bench_occ_parts(table, dev, linear_shapes[0])
    bench_gemms(table, dev, gemm_shapes[first:])
    if not args.skip_checks and not CUDA:
        ok = run_checks(table, dev)
    verdict = "skipped" if args.skip_checks else ("passed" if ok else "FAILED")
    print(f"# total {time.perf_counter() - t0:.0f} s; checks {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
