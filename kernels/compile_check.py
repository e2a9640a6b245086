"""Compile the kernels for GPU targets on a machine without a GPU (Triton ahead-of-time).

    python -m fp4lightning.kernels.compile_check                # sm_90a (Hopper) and sm_80
    python -m fp4lightning.kernels.compile_check --json         # machine-readable (the tests use it)
    python -m fp4lightning.kernels.compile_check --dump DIR     # also DIR/<case>.cubin + DIR/<case>.json
    python -m fp4lightning.kernels.compile_check --all-configs  # every autotune row, not only the defaults

Triton's whole compiler - front end, TTGIR passes, LLVM, ptxas - runs on any machine;
only launching needs a GPU. This compiles every kernel of the FP4 path (arXiv
2501.17116, section 3) in its default configuration, with the specialisations the JIT
makes for realistic shapes (16-byte aligned pointers, sizes and strides multiples of
16), and reports per kernel whether it compiled, whether the GeMMs use FP8 wgmma and a
cp.async software pipeline, and ptxas' stack frame (register spills).

For the GeMMs it also reads the SASS (cuobjdump) and finds the main loop (the backward
branch whose body holds the tensor-core instructions) and reports a static roofline
per main-loop iteration of one thread block:

* ``loop_instructions``: SASS instructions per warp per iteration;
* ``tensor_ops``: tensor-core instructions (QGMMA / HGMMA / HMMA) per warp per iteration;
* ``issue_cycles`` = loop_instructions * num_warps / 4 (four schedulers per SM, one
  instruction per cycle each);
* ``tensor_cycles`` = 2 * block_m * block_n * block_k / (dense tensor FLOP per SM per
  cycle: 8192 for FP8 and 4096 for fp16/bf16 on sm_90, 2048 fp16/bf16 on sm_80);
* ``issue_per_tensor`` = issue_cycles / tensor_cycles: above 1 the loop cannot keep the
  tensor cores busy however fast memory is (instruction-bound).

It is the only check of the compiled path available without a GPU; it is a bound, not
a measurement of speed.

It must run without TRITON_INTERPRET (the interpreter replaces the compiler).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("compile_check needs the real Triton compiler: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp4lightning.numerics.constants import (F8E4M3_EMIN, F8E4M3_MANT_BITS, F8E4M3_MAX, F8E5M2_EMIN,  # noqa: E402
                                    F8E5M2_MANT_BITS, F8E5M2_MAX)
from fp4lightning.kernels import fp8_gemm, gemm, quantile, quantize, scaled_mm  # noqa: E402
from fp4lightning.kernels._common import DOT_BF16, DOT_FP8E4, DOT_FP8E5, DOT_FP16  # noqa: E402

_I = "i32"
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


# dense tensor-core FLOP per SM per cycle (H100/H200 and A100 datasheet rates / SMs / clock)
_TENSOR_FLOP_PER_CYCLE = {(90, "fp8"): 8192, (90, "fp16"): 4096, (90, "bf16"): 4096,
                          (80, "fp16"): 2048, (80, "bf16"): 2048}
_MMA_DTYPE = {DOT_FP8E4: "fp8", DOT_FP8E5: "fp8", DOT_FP16: "fp16", DOT_BF16: "bf16"}
_TENSOR_OPS = re.compile(r"\b(QGMMA|HGMMA|IGMMA|HMMA|QMMA|IMMA)\b")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _case(name, arch, kind, kernel, types, consts, row, names, is_default):
    """One compile case; ``row`` is a sweep row (rows, cols, BLOCK_KH, stages, warps)."""
    a, b, kh, stages, warps = row
    meta = {names[0]: a, names[1]: b, "BLOCK_KH": kh, "GROUP": 8}
    consts = dict(consts, **meta)
    # output tile and K per main-loop iteration of each GeMM
    if kind == "forward":
        bm, bn, bk = a, b, 2 * kh  # two codes per packed byte along K
    elif kind == "dgrad":
        bm, bn, bk = a, 2 * kh, b  # output columns are the packed K; reduction over N
    else:  # wgrad
        bm, bn, bk = a, 2 * kh, b
    return dict(name=name, arch=arch, kind=kind, fn=kernel, types=types, consts=consts, num_warps=warps,
                num_stages=stages, block_m=bm, block_n=bn, block_k=bk,
                mma_dtype=_MMA_DTYPE[consts["DOT"]], is_default=is_default)


def _cases(all_configs: bool = False):
    """Every compile case: the quantizers, and the GeMMs in their default configuration
    (the first row of the Hopper sweeps for sm_90, of the mma.sync sweeps for sm_80, as
    ``gemm._prune_to_family`` picks them with autotuning off), or every row with ``all_configs``."""
    q_types = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", amax_ptr="*fp32", r_ptr="*bf16", bounds_ptr="*fp32",
                   e_ptr="*u8", i_ptr="*fp32", b_ptr="*fp32", bo_ptr="*i16", M=_I, K=_I, KH=_I, stride_xm=_I, stride_qm=_I, stride_rm=_I, stride_em=_I)
    f8_types = dict(x_ptr="*bf16", d_ptr="*fp32", q_ptr="*u8", s_ptr="*fp32", amax_ptr="*i32", i_ptr="*fp32", M=_I,
                    N=_I, stride_xm=_I, stride_qm=_I, stride_qn=_I, e_ptr="*fp32", c_ptr="*i32", ROWS=_I,
                    b_ptr="*fp32", p_ptr="*fp32", cnt_ptr="*i32")
    f_types = dict(a_ptr="*u8", w_ptr="*u8", sa_ptr="*fp32", sw_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16",
                   M=_I, M_BUCKET=_I, N=_I, KH=_I, stride_am=_I, stride_wn=_I, stride_ym=_I)
    d_types = dict(g_ptr="*fp8e5", w_ptr="*u8", sg_ptr="*fp32", y_ptr="*bf16", M=_I, M_BUCKET=_I, N=_I, K=_I,
                   KH=_I, stride_gm=_I, stride_wn=_I, stride_ym=_I)
    w_types = dict(g_ptr="*fp8e5", a_ptr="*u8", sg_ptr="*fp32", w_ptr="*fp32", sw_ptr="*fp32", c_ptr="*fp32",
                   y_ptr="*fp32", M=_I, M_BUCKET=_I, N=_I, K=_I, KH=_I, stride_gm=_I, stride_gn=_I, stride_am=_I, stride_wn=_I,
                   stride_cn=_I, stride_ck=_I, stride_yn=_I)
    dge = dict(HAS_DGE=True, DGE_INV_K=0.2, DGE_POW=-0.8, DGE_CLAMP=3.0)
    cases = _quantizer_cases(q_types, f8_types)
    for c in cases:
        c.update(block_m=None, block_n=None, block_k=None, mma_dtype=None, is_default=True)
    fwd = ("BLOCK_M", "BLOCK_N")
    gemms = [
        # (name, arch, kind, kernel, types, constexprs, sweep, row names)
        ("fp4_gemm fp8", 90, "forward", gemm._fp4_gemm_kernel, f_types,
         dict(DOT=DOT_FP8E4, HAS_BIAS=True, PRECISE_ACC=True, UNSCALE=4096.0), gemm._FWD_SWEEP, fwd),
        ("fp4_gemm fp8 fast-accum", 90, "forward", gemm._fp4_gemm_kernel, f_types,
         dict(DOT=DOT_FP8E4, HAS_BIAS=True, PRECISE_ACC=False, UNSCALE=4096.0), gemm._FWD_SWEEP, fwd),
        ("fp4_dgrad e5m2 dY", 90, "dgrad", gemm._fp4_dgrad_kernel, d_types,
         dict(DOT=DOT_FP8E5, PRECISE_ACC=True, UNSCALE=16384.0), gemm._DGRAD_SWEEP, fwd),
        ("fp4_dgrad bf16 dY", 90, "dgrad", gemm._fp4_dgrad_kernel, dict(d_types, g_ptr="*bf16"),
         dict(DOT=DOT_BF16, PRECISE_ACC=True, UNSCALE=1.0), gemm._DGRAD_SWEEP, fwd),
        # column-major dY (G_T) is what FP4Linear's Triton path hands over (ops.gemm.quantize_fp8)
        ("fp4_wgrad e5m2 dY + DGE + addend", 90, "wgrad", gemm._fp4_wgrad_kernel, w_types,
         dict(DOT=DOT_FP8E5, PRECISE_ACC=True, UNSCALE=16384.0, G_T=True, HAS_ADDEND=True, TWO_PHASE=True, EPI_N=16, **dge),
         gemm._WGRAD_SWEEP, ("BLOCK_N", "BLOCK_M")),
        ("fp4_wgrad e5m2 row-major dY + DGE", 90, "wgrad", gemm._fp4_wgrad_kernel, w_types,
         dict(DOT=DOT_FP8E5, PRECISE_ACC=True, UNSCALE=16384.0, G_T=False, HAS_ADDEND=False, TWO_PHASE=True, EPI_N=16, **dge),
         gemm._WGRAD_SWEEP, ("BLOCK_N", "BLOCK_M")),
        ("fp4_gemm fp16 (no FP8 MMA)", 80, "forward", gemm._fp4_gemm_kernel, f_types,
         dict(DOT=DOT_FP16, HAS_BIAS=True, PRECISE_ACC=True, UNSCALE=1.0), gemm._FWD_SWEEP_MMA, fwd),
        ("fp4_dgrad e5m2 dY via fp16 (no FP8 MMA)", 80, "dgrad", gemm._fp4_dgrad_kernel, d_types,
         dict(DOT=DOT_FP16, PRECISE_ACC=True, UNSCALE=1.0), gemm._DGRAD_SWEEP_MMA, fwd),
        ("fp4_wgrad bf16 dY + DGE + addend", 80, "wgrad", gemm._fp4_wgrad_kernel, dict(w_types, g_ptr="*bf16"),
         dict(DOT=DOT_BF16, PRECISE_ACC=True, UNSCALE=1.0, G_T=False, HAS_ADDEND=True, TWO_PHASE=True, EPI_N=16, **dge), gemm._WGRAD_SWEEP_MMA, ("BLOCK_N", "BLOCK_M")),
    ]
    for name, arch, kind, kernel, types, consts, sweep, names in gemms:
        for i, row in enumerate(sweep if all_configs else sweep[:1]):
            label = name if i == 0 else f"{name} cfg{i}"
            cases.append(_case(label, arch, kind, kernel, types, consts, row, names, is_default=(i == 0)))
    cases += _expand_cases(all_configs)
    cases += _scaled_mm_cases()
    return cases


def _scaled_mm_cases():
    """The Triton kernels around the scaled_mm backend's ``torch._scaled_mm`` GeMMs
    (kernels/scaled_mm.py): the weight gradient's epilogue (addend, DGE factor)."""
    bn, bk = scaled_mm.FINISH_BLOCK
    bm, bkh = scaled_mm.REFOLD_T_BLOCK
    blk = scaled_mm.REFOLD_OUTLIER_BLOCK
    refold = [
        dict(name="scaled_mm paper: refold codes * 2^-shift -> E4M3^T", arch=90, kind="quantize",
             fn=scaled_mm._refold_codes_kernel,
             types=dict(q_ptr="*u8", s_ptr="*fp32", f_ptr="*fp32", e_ptr="*u8", M=_I, KH=_I, stride_q=_I,
                        stride_e=_I),
             consts=dict(BLOCK_M=bm, BLOCK_KH=bkh, TRANSPOSED=True, GIVEN_P=False), num_warps=4, num_stages=1, block_m=None, block_n=None,
             block_k=None, mma_dtype=None, is_default=True, elements_per_thread=bm * 2 * bkh // 128),
        dict(name="scaled_mm paper: refold the compact residual's outliers^T", arch=90, kind="quantize",
             fn=scaled_mm._refold_outliers_kernel,
             types=dict(idx_ptr="*i32", v_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", f_ptr="*fp32", e_ptr="*u8",
                        N_SLOTS=_I, MK=_I, K=_I, stride_q=_I, stride_e=_I, count_ptr="*i64"),
             consts=dict(BLOCK=blk, TRANSPOSED=True, GIVEN_P=False, HAS_COUNT=True), num_warps=4, num_stages=1, options=dict(enable_fp_fusion=False), block_m=None,
             block_n=None, block_k=None, mma_dtype=None, is_default=True, elements_per_thread=blk // 128),
    ]
    return refold + [dict(name="scaled_mm wgrad epilogue + addend * DGE, overflow NaN", arch=90, kind="quantize",
                 fn=scaled_mm._wgrad_finish_kernel,
                 types=dict(y_ptr="*fp32", c_ptr="*fp32", w_ptr="*fp32", sw_ptr="*fp32", N=_I, K=_I, stride_y=_I,
                            stride_cn=_I, stride_ck=_I, stride_w=_I, flag_ptr="*i1"),
                 consts=dict(HAS_ADDEND=True, HAS_DGE=True, HAS_FLAG=True, DGE_INV_K=0.2, DGE_POW=-0.8,
                             DGE_CLAMP=3.0, BLOCK_N=bn, BLOCK_K=bk),
                 num_warps=4, num_stages=1, block_m=None, block_n=None, block_k=None, mma_dtype=None,
                 is_default=True, elements_per_thread=bn * bk // 128)]


#: Shapes the quantizer cases are compiled for (LLaMA-2 7B, 8192 tokens): the launch parameters
#: are the ones ``kernels/quantize.py`` picks for them, so the table describes what runs.
QUANT_TOKENS, QUANT_DIM, QUANT_FFN = 8192, 4096, 11008


def _quantizer_cases(q_types, f8_types):
    """The quantize kernels as FP4Linear launches them at the 7B shapes (``fp4_launch_params``,
    ``fp8_rows_launch_params``, ``fp8_cols_launch_params``). ``elements_per_thread`` is one
    iteration's elements over the threads, so ``ins/elem`` (all SASS instructions over it) is
    the per-element cost of a straight-line kernel, and about that of a looped one (each loop
    body counted once)."""
    cases = []

    def fp4(name, k, clamp, e4m3=False, bias=False):  # FP4Linear's launches write 1 / scale too (STORE_INV)
        bm, bkh, single, warps = quantize.fp4_launch_params((k + 1) // 2)
        cases.append(dict(name=f"{name}, K={k}" + ("" if single else " (two passes)"), arch=90, kind="quantize",
                          fn=quantize._quantize_fp4_kernel, types=q_types, num_warps=warps, num_stages=1,
                          consts=dict(POW2=False, GIVEN_AMAX=False, BLOCK_M=bm, BLOCK_KH=bkh, SINGLE_PASS=single,
                                      CLAMP=clamp, E4M3=e4m3, STORE_INV=not clamp, BIAS_BF16=bias),
                          elements_per_thread=bm * 2 * bkh // (32 * warps)))

    fp4("quantize_fp4 rows", QUANT_DIM, False)
    fp4("quantize_fp4 rows + OCC clamp + residual", QUANT_DIM, True)
    fp4("quantize_fp4 rows", QUANT_FFN, False)
    fp4("quantize_fp4 rows + E4M3 operand (scaled_mm)", QUANT_DIM, False, e4m3=True)
    fp4("quantize_fp4 rows + E4M3 operand (scaled_mm)", QUANT_FFN, False, e4m3=True)
    # the weight's launch also casts the layer's fp32 bias for the bf16 epilogue
    fp4("quantize_fp4 rows + E4M3 operand + bf16 bias (scaled_mm weight)", QUANT_DIM, False, e4m3=True, bias=True)
    e5 = dict(FMAX=F8E5M2_MAX, MANT=F8E5M2_MANT_BITS, EMIN=F8E5M2_EMIN)
    # STORE_INV: the scaled_mm backend's launches also write 1 / scale
    for n in (QUANT_DIM, QUANT_FFN):  # dgrad's operand dY / s_w, one scale per row
        bm, bn, single, warps = quantize.fp8_rows_launch_params(n)
        cases.append(dict(name=f"quantize_fp8 rows e5m2 / divisor, N={n}" + ("" if single else " (two passes)"),
                          arch=90, kind="quantize", fn=quantize._quantize_fp8_rows_kernel, types=f8_types,
                          consts=dict(e5, DIV=1, BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=single, STORE_INV=True,
                                      COL_AMAX=False), num_warps=warps,
                          num_stages=1, elements_per_thread=bm * bn // (32 * warps)))
        # COL_AMAX: with a weight gradient to take, the column pass's absmax rides in this pass
        cases.append(dict(name=f"quantize_fp8 rows e5m2 / divisor + column absmax, N={n}" +
                          ("" if single else " (two passes)"), arch=90, kind="quantize",
                          fn=quantize._quantize_fp8_rows_kernel, types=f8_types,
                          consts=dict(e5, DIV=1, BLOCK_M=bm, BLOCK_N=bn, SINGLE_PASS=single, STORE_INV=True,
                                      COL_AMAX=True), num_warps=warps, num_stages=1,
                          elements_per_thread=bm * bn // (32 * warps)))
    cases += _fold_cases()
    # wgrad's operand dY / s_a, one scale per column, column-major out: absmax pass, then encode
    (am, an, aw), (bm, bn, warps) = quantize.fp8_cols_launch_params(QUANT_TOKENS, QUANT_DIM, column_major=True)
    cases.append(dict(name="fp8 column absmax / divisor", arch=90, kind="quantize", fn=quantize._col_amax_kernel,
                      types=f8_types, consts=dict(DIV=2, BLOCK_M=am, BLOCK_N=an), num_warps=aw, num_stages=1,
                      elements_per_thread=am * an // (32 * aw)))
    cases.append(dict(name="quantize_fp8 columns e5m2 / divisor, column-major", arch=90, kind="quantize",
                      fn=quantize._quantize_fp8_cols_kernel, types=f8_types,
                      consts=dict(e5, DIV=2, BLOCK_M=bm, BLOCK_N=bn, STORE_INV=True, RESET=True, BIAS=False,
                                  SUM_BLOCK=max(1, 2048 // bn)), num_warps=warps,
                      num_stages=1, elements_per_thread=bm * bn // (32 * warps)))
    # on a GPU with a bias, its gradient rides in the column pass (the strips' last tiles add the partial sums)
    cases.append(dict(name="quantize_fp8 columns e5m2 / divisor, column-major + bias gradient", arch=90,
                      kind="quantize", fn=quantize._quantize_fp8_cols_kernel, types=f8_types,
                      consts=dict(e5, DIV=2, BLOCK_M=bm, BLOCK_N=bn, STORE_INV=True, RESET=True, BIAS=True,
                                  SUM_BLOCK=max(1, 2048 // bn)), num_warps=warps, num_stages=1,
                      elements_per_thread=bm * bn // (32 * warps)))
    return cases


def _fold_cases():
    """OCC folded into an E4M3 activation operand (FP4Config.occ_fold_e4m3; the scaled_mm backend's
    `paper`), launched without FMA contraction as FP4Linear launches it."""
    fold_types = dict(x_ptr="*bf16", e_ptr="*u8", s_ptr="*fp32", amax_ptr="*fp32", bounds_ptr="*fp32", M=_I, K=_I,
                      stride_xm=_I, stride_em=_I, q_ptr="*u8", sa_ptr="*fp32", r_ptr="*bf16", stride_qm=_I,
                      stride_rm=_I, i_ptr="*i32", v_ptr="*bf16", n_ptr="*i64", o_ptr="*i1", ctr_ptr="*i64", CAP=_I)
    cases = []
    for k in (QUANT_DIM, QUANT_FFN):
        bm, bk, single, warps = quantize.fold_launch_params(k)
        # SAVE: the scaled_mm backend's `paper` also writes the packed codes and the compact residual
        # (COMPACT); both round OCC's fp32 bounds to x's dtype themselves (ROUND_BOUNDS)
        for save in (False, True):
            name = "quantize_fp4 folded e4m3 (OCC)" + (" + codes + residual (scaled_mm paper)" if save else "")
            cases.append(dict(name=f"{name}, K={k}" + ("" if single else " (two passes)"),
                              arch=90, kind="quantize", fn=quantize._quantize_fp4_fold_kernel, types=fold_types,
                              consts=dict(POW2=False, GIVEN_AMAX=False, SINGLE_PASS=single, BLOCK_M=bm, BLOCK_K=bk,
                                          MANT=F8E4M3_MANT_BITS, EMIN=F8E4M3_EMIN, SAVE=save, COMPACT=save,
                                          ROUND_BOUNDS=True),
                              num_warps=warps, num_stages=1, options=dict(enable_fp_fusion=False),
                              elements_per_thread=bm * bk // (32 * warps)))
    # `paper`'s OCC quantiles of a bf16 activation (kernels/quantile.py): one launch, 1024 samples a program
    cases.append(dict(name="occ quantiles of a bf16 sample (histogram, one launch)", arch=90, kind="quantize",
                      fn=quantile._occ_quantile_kernel,
                      types=dict(x_ptr="*i16", hist_ptr="*i32", ctr_ptr="*i32", out_ptr="*fp32", N=_I, n=_I,
                                 STRIDE="i64", R0=_I, R1=_I, R2=_I, R3=_I, F0=_I, F1=_I),
                      consts=dict(SAMPLED=True, INTERP0=True, INTERP1=True, CHUNK=quantile.CHUNK, SCAN=quantile.SCAN,
                                  BINS=quantile.BINS), num_warps=4, num_stages=1,
                      options=dict(enable_fp_fusion=False), elements_per_thread=quantile.CHUNK // 128))
    # ... and of an fp32 activation (q, k, v, gate, up under bf16 autocast): a two-pass radix select
    q32 = dict(x_ptr="*i32", hist_ptr="*i32", ctr_ptr="*i32", sel_ptr="*i32", N=_I, n=_I, STRIDE="i64")
    cases.append(dict(name="occ quantiles of an fp32 sample, high 16 bits (first of two launches)", arch=90,
                      kind="quantize", fn=quantile._occ_quantile32_hi_kernel,
                      types=dict(q32, R0=_I, R1=_I, R2=_I, R3=_I),
                      consts=dict(SAMPLED=True, CHUNK=quantile.CHUNK, SCAN=quantile.SCAN, BINS=quantile.BINS),
                      num_warps=4, num_stages=1, options={}, elements_per_thread=quantile.CHUNK // 128))
    cases.append(dict(name="occ quantiles of an fp32 sample, low 16 bits (second launch)", arch=90,
                      kind="quantize", fn=quantile._occ_quantile32_lo_kernel,
                      types=dict(q32, out_ptr="*fp32", F0=_I, F1=_I),
                      consts=dict(SAMPLED=True, CHUNK=quantile.CHUNK, SCAN=quantile.SCAN, BINS=quantile.BINS),
                      num_warps=4, num_stages=1, options=dict(enable_fp_fusion=False),
                      elements_per_thread=quantile.CHUNK // 128))
    return cases


def _expand_cases(all_configs: bool):
    """The ``expand`` path (kernels/fp8_gemm.py): the expansion kernels and the plain FP8 GeMM
    in the three epilogues FP4Linear uses (default config: the first row of its sweep)."""
    x_types = dict(p_ptr="*u8", y_ptr="*u8", R=_I, KH=_I, KY=_I, RY=_I, stride_p=_I, stride_y=_I)
    cases = [dict(name=f"expand to {fmt}{' transposed' if t else ''}", arch=90, kind="expand", fn=fp8_gemm._expand_kernel,
                  types=x_types, consts=dict(TRANSPOSE=t, MANT=mant, HALF=half, BLOCK_R=64, BLOCK_KH=64), num_warps=4,
                  num_stages=1, block_m=None, block_n=None, block_k=None, mma_dtype=None, is_default=True,
                  elements_per_thread=64 * 128 // 128)
             for fmt, mant, half, t in (("e4m3", 3, 0x30, False), ("e5m2", 2, 0x38, True))]
    cases.append(dict(name="transpose e4m3 (folded wgrad operand)", arch=90, kind="expand",
                      fn=fp8_gemm._transpose_kernel,
                      types=dict(x_ptr="*u8", y_ptr="*u8", R=_I, C=_I, stride_x=_I, stride_y=_I),
                      consts=dict(BLOCK_R=64, BLOCK_C=64), num_warps=4, num_stages=1, block_m=None, block_n=None,
                      block_k=None, mma_dtype=None, is_default=True, elements_per_thread=64 * 64 // 128))
    g_types = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", sr_ptr="*fp32", sc_ptr="*fp32", bias_ptr="*bf16", c_ptr="*fp32",
                   w_ptr="*fp32", sw_ptr="*fp32", y_ptr="*bf16", M=_I, M_BUCKET=_I, N=_I, K=_I, stride_am=_I, stride_bn=_I,
                   stride_cm=_I, stride_ck=_I, stride_wm=_I, stride_ym=_I)
    e5 = dict(g_types, a_ptr="*fp8e5", b_ptr="*fp8e5")
    none = dict(HAS_BIAS=False, HAS_ADDEND=False, HAS_DGE=False, TWO_PHASE=False, EPI_M=16, DGE_INV_K=0.2,
                DGE_POW=-0.8, DGE_CLAMP=3.0, COL_SCALE=0)
    variants = [
        ("fp8_gemm forward (expand path)", "forward", g_types,
         dict(none, DOT=DOT_FP8E4, PRECISE_ACC=True, ROW_SCALE=1, COL_SCALE=1, HAS_BIAS=True)),
        ("fp8_gemm forward fast-accum (expand path)", "forward", g_types,
         dict(none, DOT=DOT_FP8E4, PRECISE_ACC=False, ROW_SCALE=1, COL_SCALE=1, HAS_BIAS=True)),
        ("fp8_gemm dgrad e5m2 (expand path)", "dgrad", e5, dict(none, DOT=DOT_FP8E5, PRECISE_ACC=True, ROW_SCALE=1)),
        ("fp8_gemm wgrad e5m2 + DGE + addend (expand path)", "wgrad", dict(e5, y_ptr="*fp32"),
         dict(none, DOT=DOT_FP8E5, PRECISE_ACC=True, ROW_SCALE=2, HAS_ADDEND=True, HAS_DGE=True, TWO_PHASE=True)),
        # FP4Config.occ_fold_e4m3: E5M2 dY against the folded E4M3 activations, mixed FP8 types
        ("fp8_gemm wgrad e5m2 x e4m3 folded + DGE (expand path)", "wgrad",
         dict(e5, b_ptr="*fp8e4nv", y_ptr="*fp32"),
         dict(none, DOT=DOT_FP8E5, PRECISE_ACC=True, ROW_SCALE=2, HAS_DGE=True, TWO_PHASE=True)),
    ]
    for tma in (False, True):
        for name, kind, types, consts in variants:
            if tma:  # the same GeMM with TMA operand loads (FP4LIGHTNING_TMA=1)
                if "fast-accum" in name:
                    continue
                name = name.replace("(expand path)", "(expand path, TMA)")
                types = {k: v for k, v in types.items() if k not in ("a_ptr", "b_ptr", "stride_am", "stride_bn")}
            for i, (a, b, bk, stages, warps, _where) in enumerate(fp8_gemm._SWEEP if all_configs else fp8_gemm._SWEEP[:1]):
                t = types
                if tma:
                    el = "fp8e5" if consts["DOT"] == DOT_FP8E5 else "fp8e4nv"
                    el_b = "fp8e4nv" if "e4m3 folded" in name else el
                    t = dict(types, a_desc=f"tensordesc<{el}[{a}, {bk}]>", b_desc=f"tensordesc<{el_b}[{b}, {bk}]>")
                cases.append(dict(name=name if i == 0 else f"{name} cfg{i}", arch=90, kind=kind,
                                  fn=fp8_gemm._fp8_gemm_tma_kernel if tma else fp8_gemm._fp8_gemm_kernel,
                                  types=t, consts=dict(consts, BLOCK_M=a, BLOCK_N=b, BLOCK_K=bk, GROUP=8),
                                  num_warps=warps, num_stages=stages, block_m=a, block_n=b, block_k=bk,
                                  mma_dtype="fp8", is_default=(i == 0)))
    return cases


def _cuobjdump(cubin: bytes, flag: str) -> str | None:
    if not os.path.exists(_CUOBJDUMP):
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([_CUOBJDUMP, flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def _resources(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, ptxas stack frame bytes = spills) from the cubin."""
    out = _cuobjdump(cubin, "--dump-resource-usage")
    regs = stack = None
    for tok in (out or "").split():
        if tok.startswith("REG:"):
            regs = int(tok.split(":")[1])
        elif tok.startswith("STACK:"):
            stack = int(tok.split(":")[1])
    return regs, stack


def main_loop(sass: str) -> dict | None:
    """The main loop of a GeMM's SASS: the backward branch whose body holds the most
    tensor-core instructions. Returns instruction and tensor-op counts per iteration."""
    lines = [(int(a, 16), ins.strip()) for a, ins in _SASS_LINE.findall(sass)]
    best = None
    for addr, ins in lines:
        m = re.search(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ins)
        if not m or m.group(1) is None:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [i for a, i in lines if target <= a <= addr]
        tensor = sum(1 for i in body if _TENSOR_OPS.search(i))
        if tensor and (best is None or tensor > best["tensor_ops"]):
            ops = {}
            for i in body:
                op = re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0]
                ops[op] = ops.get(op, 0) + 1
            best = dict(loop_instructions=len(body), tensor_ops=tensor,
                        top_ops=dict(sorted(ops.items(), key=lambda kv: -kv[1])[:6]))
    return best


def compile_one(case: dict, dump: str | None = None) -> dict:
    fn = case["fn"].fn if hasattr(case["fn"], "configs") else case["fn"]  # unwrap @triton.autotune
    consts, types = case["consts"], case["types"]
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    # the JIT's specialisation for realistic shapes: 16-byte aligned pointers, ints % 16 == 0
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n] != "constexpr" and not sig[n].startswith("tensordesc")}
    arch = case["arch"]
    res = {k: case[k] for k in ("name", "kind", "num_warps", "num_stages", "block_m", "block_n", "block_k",
                                "mma_dtype", "is_default")}
    res.update(kernel=case["kind"], case=case["name"], arch=arch)
    t0 = time.perf_counter()
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32),
                           options=dict(num_warps=case["num_warps"], num_stages=case["num_stages"],
                                        **case.get("options", {})))
    except Exception as e:  # report, do not stop: one table shows every kernel
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        return res
    ptx = k.asm["ptx"]
    cubin = k.asm["cubin"]
    regs, stack = _resources(cubin)
    res.update(ok=True, seconds=round(time.perf_counter() - t0, 1), wgmma=ptx.count("wgmma.mma_async"),
               fp8_mma=("e4m3" in ptx or "e5m2" in ptx) and "wgmma.mma_async" in ptx,
               cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
               tma=ptx.count("cp.async.bulk.tensor"), shared_bytes=k.metadata.shared,
               n_regs=regs, spill_bytes=stack, stack_bytes=stack)
    sass = _cuobjdump(cubin, "-sass")
    if sass:
        res["sass_instructions"] = len(_SASS_LINE.findall(sass))
        if case.get("elements_per_thread"):  # straight-line kernels: the cost of one element
            res["sass_per_element"] = round(res["sass_instructions"] / case["elements_per_thread"], 1)
    if case["block_k"] is not None:
        loop = main_loop(sass) if sass else None
        if loop:
            issue = loop["loop_instructions"] * case["num_warps"] / 4
            tensor = (2 * case["block_m"] * case["block_n"] * case["block_k"]
                      / _TENSOR_FLOP_PER_CYCLE[(arch, case["mma_dtype"])])
            res.update(loop, issue_cycles=issue, tensor_cycles=tensor, issue_per_tensor=round(issue / tensor, 3))
    if dump:
        os.makedirs(dump, exist_ok=True)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"sm{arch}_{case['name']}").strip("_")
        with open(os.path.join(dump, stem + ".cubin"), "wb") as f:
            f.write(cubin)
        with open(os.path.join(dump, stem + ".json"), "w") as f:
            json.dump(res, f, indent=1)
    return res


def run(archs=(90, 80), all_configs: bool = False, dump: str | None = None) -> list[dict]:
    return [compile_one(c, dump) for c in _cases(all_configs) if c["arch"] in archs]


def _cell(v, spec=""):
    return "-" if v is None else format(v, spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Compile the FP4 kernels for GPU targets without a GPU")
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="SM versions (90 = Hopper)")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    p.add_argument("--dump", metavar="DIR", help="write DIR/<case>.cubin and DIR/<case>.json for every case")
    p.add_argument("--all-configs", action="store_true", help="every autotune row, not only the defaults")
    args = p.parse_args(argv)
    results = run(tuple(args.arch), args.all_configs, args.dump)
    if args.json:
        print(json.dumps(results))
    else:
        print(f"# triton {triton.__version__}: compiled ahead of time (no GPU needed). Per main-loop iteration "
              "of one block: SASS instructions per warp, tensor ops per warp, issue cycles / tensor cycles")
        print(f"{'':5} {'arch':5} {'case':50} {'tile MxNxK':14} {'w/s':5} {'mma':5} {'loop ins':>8} {'tensor':>6} "
              f"{'issue/tensor':>12} {'regs':>4} {'spill':>5} {'ins/elem':>8}")
        for r in results:
            if not r["ok"]:
                print(f"FAIL  sm_{r['arch']:<3} {r['case']:50} {r['error']}")
                continue
            tile = "-" if r["block_k"] is None else f"{r['block_m']}x{r['block_n']}x{r['block_k']}"
            print(f"{'ok':5} sm_{r['arch']:<3} {r['case']:50} {tile:14} {r['num_warps']}/{r['num_stages']:<3} "
                  f"{_cell(r['mma_dtype']):5} {_cell(r.get('loop_instructions')):>8} {_cell(r.get('tensor_ops')):>6} "
                  f"{_cell(r.get('issue_per_tensor'), '.2f'):>12} {_cell(r['n_regs']):>4} {_cell(r['spill_bytes']):>5} "
                  f"{_cell(r.get('sass_per_element')):>8}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
