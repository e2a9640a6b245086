"""FP4Linear forward+backward time per FP4 preset, side by side in one run (CPU or GPU).

The block-scaled presets (``nvfp4``, ``mxfp4``, ``mxfp4-rht-sr``) against the paper's
per-token path, on one LLaMA-like layer shape under bf16 autocast, with the weight
changed before every call as training does (so no preset reuses a quantized weight).
Prints the median time of each preset and its ratio to ``paper``.

    .venv/bin/python benchmarks/bench_block.py [--shape 2048x1024x2816] [--iters 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4lightning import FP4Config, FP4Linear  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2048x1024x2816", help="tokens x in_features x out_features")
    p.add_argument("--presets", default="paper,nvfp4,mxfp4,mxfp4-rht-sr")
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    m, k, n = (int(v) for v in a.shape.split("x"))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    x0 = torch.randn(m, k, device=dev)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    layers = {name: FP4Linear.from_linear(nn.Linear(k, n, device=dev), FP4Config.from_preset(name))
              for name in a.presets.split(",")}
    times: dict[str, list[float]] = {name: [] for name in layers}
    for it in range(a.iters + 1):  # round-robin so machine load hits every preset alike
        for name, layer in layers.items():
            x = x0.clone().requires_grad_()
            with torch.no_grad():
                layer.weight.add_(0)  # bumps the version: a fresh weight, as after an optimizer step
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                y = layer(x)
            y.backward(dy)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if it:  # the first round warms up
                times[name].append(time.perf_counter() - t)
    base = statistics.median(times["paper"]) if "paper" in times else None
    print(f"FP4Linear fwd+bwd, {m}x{k}x{n}, bf16 autocast, {dev.type}, median of {a.iters}")
    print("| preset | time (s) | vs paper |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {med / base:.2f}x |" if base else f"| {name} | {med:.3f} | - |")


if __name__ == "__main__":
    main()
