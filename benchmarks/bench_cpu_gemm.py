"""CPU GeMM speed by dtype, side by side in one run: fp32, torch's own bf16 kernel, and the bf16
emulation of ``fp4lightning.numerics.cpu_bf16`` (fp32 kernels on bf16-rounded operands, output rounded to
bf16), plus whether this CPU has a native bf16 GeMM (what ``FP4LIGHTNING_CPU_BF16_GEMM=auto``
decides from).

    .venv/bin/python benchmarks/bench_cpu_gemm.py [--shapes 512x512x512,2048x192x4096] [--iters 3]

The native bf16 row can take seconds per call on CPUs without a bf16 kernel; ``--skip-native``
leaves it out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4lightning.numerics import cpu_bf16  # noqa: E402

# 512^3; the tiny model's output head (4096 tokens x 192 -> 4096); an FFN projection of the tiny model
DEFAULT_SHAPES = "512x512x512,4096x192x4096,4096x192x512"


def _time(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--skip-native", action="store_true", help="do not time torch's own bf16 kernel")
    args = ap.parse_args()
    print(f"# torch={torch.__version__} threads={torch.get_num_threads()} cpu_capability="
          f"{torch.backends.cpu.get_cpu_capability()} native_bf16_gemm={cpu_bf16._cpu_has_native_bf16_gemm()} "
          f"auto_mode_emulates={cpu_bf16.emulate_bf16_gemm('cpu')}")
    print("| shape (M x K -> N) | fp32 GFLOP/s | bf16 native GFLOP/s | bf16 emulated GFLOP/s | native / emulated time |")
    print("|---|---|---|---|---|")
    for s in args.shapes.split(","):
        m, k, n = (int(v) for v in s.split("x"))
        a32, b32 = torch.randn(m, k), torch.randn(k, n)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        flop = 2.0 * m * k * n
        t32 = _time(lambda: a32 @ b32, args.iters)
        t_emu = _time(lambda: cpu_bf16.emulated_mm(a16, b16), args.iters)
        t_nat = None if args.skip_native else _time(lambda: a16 @ b16, args.iters)
        nat = "skipped" if t_nat is None else f"{flop / t_nat / 1e9:.2f}"
        ratio = "-" if t_nat is None else f"{t_nat / t_emu:.1f}x"
        print(f"| {m}x{k}->{n} | {flop / t32 / 1e9:.1f} | {nat} | {flop / t_emu / 1e9:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
