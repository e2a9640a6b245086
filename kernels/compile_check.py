"""Compile the kernels for GPU targets on a machine without a GPU (Triton ahead-of-time).

    python -m fp4lightning.kernels.compile_check            # sm_90a (Hopper) and sm_80
    python -m fp4lightning.kernels.compile_check --json     # machine-readable (the tests use it)

Triton's whole compiler - front end, TTGIR passes, LLVM, ptxas - runs on any machine;
only launching needs a GPU. This compiles every kernel of the FP4 path (arXiv
2501.17116, section 3) in its default configuration, with the specialisations the JIT
makes for realistic shapes (16-byte aligned pointers, sizes and strides multiples of
16), and reports per kernel whether it compiled, whether the GeMMs use FP8 wgmma and a
cp.async software pipeline, and ptxas' stack frame (register spills). It is the only
check of the compiled path available without a GPU; it says nothing about speed.

It must run without TRITON_INTERPRET (the interpreter replaces the compiler).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    raise SystemExit("compile_check needs the real Triton compiler: unset TRITON_INTERPRET")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp4lightning.kernels import gemm, quantize  # noqa: E402
from fp4lightning.kernels._common import DOT_BF16, DOT_FP8E4, DOT_FP8E5, DOT_FP16  # noqa: E402

_I = "i32"
_CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _meta(sweep_row, names):
    a, b, kh, stages, warps = sweep_row
    return {names[0]: a, names[1]: b, "BLOCK_KH": kh, "GROUP": 8}, warps, stages


def _cases():
    """(name, arch, kernel, arg types, constexprs, num_warps, num_stages) of every kernel.

    sm_90 cases use the default (first) config of the Hopper sweeps, sm_80 ones that of
    the mma.sync sweeps (``gemm._*_SWEEP_MMA``), as ``gemm._prune`` picks them at run time.
    """
    q_types = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", amax_ptr="*fp32", r_ptr="*bf16", bounds_ptr="*fp32",
                   M=_I, K=_I, KH=_I, stride_xm=_I, stride_qm=_I, stride_rm=_I)
    q_meta = dict(POW2=False, GIVEN_AMAX=False, BLOCK_M=1, BLOCK_KH=2048)
    f8_types = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", amax_ptr="*i32", M=_I, N=_I, stride_xm=_I,
                    stride_qm=_I)
    f_types = dict(a_ptr="*u8", w_ptr="*u8", sa_ptr="*fp32", sw_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16",
                   M=_I, M_BUCKET=_I, N=_I, KH=_I, stride_am=_I, stride_wn=_I, stride_ym=_I)
    d_types = dict(g_ptr="*fp8e5", w_ptr="*u8", sg_ptr="*fp32", y_ptr="*bf16", M=_I, M_BUCKET=_I, N=_I, K=_I, KH=_I,
                   stride_gm=_I, stride_wn=_I, stride_ym=_I)
    w_types = dict(g_ptr="*fp8e5", a_ptr="*u8", sg_ptr="*fp32", w_ptr="*fp32", sw_ptr="*fp32", c_ptr="*fp32",
                   y_ptr="*fp32", M=_I, M_BUCKET=_I, N=_I, K=_I, KH=_I, stride_gm=_I, stride_am=_I, stride_wn=_I, stride_cn=_I,
                   stride_ck=_I, stride_yn=_I)
    fwd, fw, fs = _meta(gemm._FWD_SWEEP[0], ("BLOCK_M", "BLOCK_N"))
    dgr, dw, ds = _meta(gemm._DGRAD_SWEEP[0], ("BLOCK_M", "BLOCK_N"))
    wgr, ww, ws = _meta(gemm._WGRAD_SWEEP[0], ("BLOCK_N", "BLOCK_M"))
    fwd8, fw8, fs8 = _meta(gemm._FWD_SWEEP_MMA[0], ("BLOCK_M", "BLOCK_N"))
    dgr8, dw8, ds8 = _meta(gemm._DGRAD_SWEEP_MMA[0], ("BLOCK_M", "BLOCK_N"))
    wgr8, ww8, ws8 = _meta(gemm._WGRAD_SWEEP_MMA[0], ("BLOCK_N", "BLOCK_M"))
    dge = dict(HAS_DGE=True, DGE_INV_K=0.2, DGE_POW=-0.8, DGE_CLAMP=3.0)
    cases = [
        ("quantize_fp4 one pass", 90, quantize._quantize_fp4_kernel, q_types,
         dict(q_meta, SINGLE_PASS=True, CLAMP=False), 8, 1),
        ("quantize_fp4 two passes + OCC clamp", 90, quantize._quantize_fp4_kernel, q_types,
         dict(q_meta, SINGLE_PASS=False, CLAMP=True), 8, 1),
        ("quantize_fp8 rows e5m2", 90, quantize._quantize_fp8_rows_kernel, f8_types,
         dict(FMAX=57344.0, MANT=2, EMIN=-14, BLOCK_M=4, BLOCK_N=1024), 4, 1),
        ("fp8 column absmax", 90, quantize._col_amax_kernel, f8_types, dict(BLOCK_M=32, BLOCK_N=128), 4, 1),
        ("quantize_fp8 columns e4m3", 90, quantize._quantize_fp8_cols_kernel, f8_types,
         dict(FMAX=448.0, MANT=3, EMIN=-6, BLOCK_M=32, BLOCK_N=128), 4, 1),
        ("fp4_gemm fp8 decode", 90, gemm._fp4_gemm_kernel, f_types,
         dict(fwd, DOT=DOT_FP8E4, HAS_BIAS=True, PRECISE_ACC=True), fw, fs),
        ("fp4_dgrad e5m2 dY", 90, gemm._fp4_dgrad_kernel, d_types, dict(dgr, DOT=DOT_FP8E5, PRECISE_ACC=True), dw, ds),
        ("fp4_dgrad bf16 dY", 90, gemm._fp4_dgrad_kernel, dict(d_types, g_ptr="*bf16"),
         dict(dgr, DOT=DOT_BF16, PRECISE_ACC=True), dw, ds),
        ("fp4_wgrad e5m2 dY + DGE + addend", 90, gemm._fp4_wgrad_kernel, w_types,
         dict(wgr, DOT=DOT_FP8E5, PRECISE_ACC=True, HAS_ADDEND=True, **dge), ww, ws),
        ("fp4_gemm fp16 decode (no FP8 MMA)", 80, gemm._fp4_gemm_kernel, f_types,
         dict(fwd8, DOT=DOT_FP16, HAS_BIAS=True, PRECISE_ACC=True), fw8, fs8),
        ("fp4_dgrad e5m2 dY via fp16 (no FP8 MMA)", 80, gemm._fp4_dgrad_kernel, d_types,
         dict(dgr8, DOT=DOT_FP16, PRECISE_ACC=True), dw8, ds8),
        ("fp4_wgrad bf16 dY + DGE + addend", 80, gemm._fp4_wgrad_kernel, dict(w_types, g_ptr="*bf16"),
         dict(wgr8, DOT=DOT_BF16, PRECISE_ACC=True, HAS_ADDEND=True, **dge), ww8, ws8),
    ]
    return cases


def _stack_bytes(cubin: bytes) -> int | None:
    """ptxas' per-thread stack frame (spills) from the cubin, or None without cuobjdump."""
    if not os.path.exists(_CUOBJDUMP):
        return None
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([_CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    for tok in out.split():
        if tok.startswith("STACK:"):
            return int(tok.split(":")[1])
    return None


def compile_one(name, arch, kernel, types, consts, num_warps, num_stages) -> dict:
    fn = kernel.fn if hasattr(kernel, "configs") else kernel  # unwrap @triton.autotune
    sig = {n: ("constexpr" if n in consts else types[n]) for n in fn.arg_names}
    # the JIT's specialisation for realistic shapes: 16-byte aligned pointers, ints % 16 == 0
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n] != "constexpr"}
    res = {"kernel": name, "arch": f"sm_{arch}"}
    t0 = time.perf_counter()
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as e:  # report, do not stop: one table shows every kernel
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        return res
    ptx = k.asm["ptx"]
    res.update(ok=True, seconds=round(time.perf_counter() - t0, 1), wgmma=ptx.count("wgmma.mma_async"),
               fp8_mma=("e4m3" in ptx or "e5m2" in ptx) and "wgmma.mma_async" in ptx,
               cp_async=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"), shared_bytes=k.metadata.shared,
               stack_bytes=_stack_bytes(k.asm["cubin"]))
    return res


def run(archs=(90, 80)) -> list[dict]:
    return [compile_one(*c) for c in _cases() if c[1] in archs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Compile the FP4 kernels for GPU targets without a GPU")
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="SM versions (90 = Hopper)")
    p.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = p.parse_args(argv)
    results = run(tuple(args.arch))
    if args.json:
        print(json.dumps(results))
    else:
        print(f"# triton {triton.__version__}: default configs compiled ahead of time (no GPU needed)")
        for r in results:
            if r["ok"]:
                print(f"ok    {r['arch']:6} {r['kernel']:42} {r['seconds']:5.1f}s  wgmma={r['wgmma']} "
                      f"fp8_mma={r['fp8_mma']} cp.async={r['cp_async']} smem={r['shared_bytes']} "
                      f"stack={r['stack_bytes']}")
            else:
                print(f"FAIL  {r['arch']:6} {r['kernel']:42} {r['error']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
