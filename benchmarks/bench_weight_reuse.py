"""FP4 weight quantized once per optimizer step against once per micro-batch (issue 40).

Times one optimizer step's worth of an ``FP4Linear``'s work - ``--accum`` micro-batches of forward
and backward, then the end of the weight epoch (``weights_updated``, as ``FP4Precision`` does after the
optimizer step) - with ``reuse_weight_quantization`` off and on, alternated in one run, and the weight
quantization alone. Prints the medians and their ratios, and checks that both give the same bits
(output and gradients). The default shape is the 1.3B recipe's MLP up-projection (2048 -> 5504);
``--tokens`` is the micro-batch's token count.

    .venv/bin/python benchmarks/bench_weight_reuse.py --device cuda --tokens 8192 --accum 4
    .venv/bin/python benchmarks/bench_weight_reuse.py --device cpu --tokens 512 --in-features 512 --out-features 1376
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from fp4lightning.config import FP4Config
from fp4lightning.nn.linear import FP4Linear, quantize_weight, reuse_weight_quantization, weights_updated


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _one_step(layer: FP4Linear, xs: list[torch.Tensor], reuse: bool) -> list[torch.Tensor]:
    """``len(xs)`` micro-batches of forward + backward, then the optimizer step's epoch end."""
    outs = []
    with reuse_weight_quantization(reuse):
        for x in xs:
            with torch.autocast(x.device.type, dtype=torch.bfloat16):
                y = layer(x)
            y.float().square().mean().backward()
            outs.append(y.detach())
    weights_updated()
    return outs


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def measure(args) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    layer = FP4Linear(args.in_features, args.out_features, bias=False, device=device,
                      config=FP4Config.from_preset(args.preset))
    xs = [torch.randn(args.tokens, args.in_features, device=device) for _ in range(args.accum)]
    # same bits both ways: outputs and the accumulated weight gradient
    checks = []
    for reuse in (False, True):
        layer.weight.grad = None
        checks.append((_one_step(layer, xs, reuse), layer.weight.grad.clone()))
    same = all(torch.equal(a, b) for a, b in zip(checks[0][0], checks[1][0])) and torch.equal(checks[0][1], checks[1][1])
    times = {"per_micro_batch": [], "once_per_step": [], "quantize_weight": []}
    for _ in range(args.repeats):  # alternated, so drifts in machine load hit both
        for name, reuse in (("per_micro_batch", False), ("once_per_step", True)):
            layer.weight.grad = None
            times[name].append(_timed(lambda: _one_step(layer, xs, reuse), device))
        times["quantize_weight"].append(_timed(lambda: quantize_weight(layer.weight, layer.config), device))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"device": str(device), "shape": [args.tokens, args.in_features, args.out_features], "accum": args.accum,
            "preset": args.preset, "median_s": med, "same_bits": same,
            "step_ratio_once_vs_per_micro_batch": med["once_per_step"] / med["per_micro_batch"],
            "quantize_share_of_micro_batch": med["quantize_weight"] / (med["per_micro_batch"] / args.accum)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--in-features", type=int, default=2048)
    p.add_argument("--out-features", type=int, default=5504)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--preset", default="paper")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    r = measure(args)
    m = r["median_s"]
    print(f"[weight-reuse] {r['device']} tokens x in x out {r['shape']}, {args.accum} micro-batches, {args.preset}")
    print(f"  quantized per micro-batch : {1e3 * m['per_micro_batch']:.2f} ms per optimizer step")
    print(f"  quantized once per step   : {1e3 * m['once_per_step']:.2f} ms per optimizer step "
          f"({r['step_ratio_once_vs_per_micro_batch']:.3f}x)")
    print(f"  weight quantization alone : {1e3 * m['quantize_weight']:.2f} ms "
          f"({100 * r['quantize_share_of_micro_batch']:.1f}% of a micro-batch's forward + backward)")
    print(f"  same bits (outputs, weight gradient): {r['same_bits']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
