"""Reduced-precision optimizer states (docs/method.md section 6): memory and loss trajectory against fp32 AdamW.

Trains the same small LLaMA (byte-level, real text) from the same initial weights on the same
batches with

* ``torch.optim.AdamW``                       (fp32 moments: 8 bytes of state per parameter),
* ``LowPrecisionAdamW(exp_avg_format="fp8")``   (E4M3 first moment, FP16 second: 3 bytes),
* ``LowPrecisionAdamW(exp_avg_format="fp16")``  (FP16 / FP16: 4 bytes),

and reports bytes of optimizer state per parameter, the held-out loss at the end and its gap to
AdamW. The text is the Python standard library's source, which ships with every Python (real,
offline, no download). ``--fp4`` trains the model through ``FP4Precision``'s conversion and bf16
autocast instead of in fp32; ``--noise`` adds an AdamW run on another batch order, to compare the
gap with run-to-run noise. ``--step-time`` instead times one optimizer step of LowPrecisionAdamW's
per-parameter loop against its foreach path (``foreach=False`` / ``True``) on the same parameters, and
checks that both end with the same bits (parameters, moment codes, scales, master copies).

    .venv/bin/python benchmarks/bench_optim.py                 # ~4 min on 2 busy CPU cores
    .venv/bin/python benchmarks/bench_optim.py --seeds 0 1 2 3 --variants adamw fp8 fp8-nearest fp16
    .venv/bin/python benchmarks/bench_optim.py --model tiny --steps 300 --fp4
    .venv/bin/python benchmarks/bench_optim.py --step-time --step-params 200   # CUDA if there is one
    .venv/bin/python benchmarks/bench_optim.py --step-time --device cpu --threads 1   # on busy CPU cores
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F

from fp4lightning.models.llama import Llama, llama_config
from fp4lightning.lightning.optim import LowPrecisionAdamW, state_bytes_per_param
from fp4lightning.lightning.precision import FP4Precision


def load_text(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, in a fixed (sorted) order."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
    data = b"".join(chunks)[:max_bytes]
    if len(data) < 1_000_000:
        sys.exit(f"bench_optim: found only {len(data)} bytes of text under {root}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(data: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - seq - 1, (steps, batch), generator=gen)
    return [torch.stack([data[s:s + seq + 1] for s in row.tolist()]) for row in starts]


def lm_loss(model: torch.nn.Module, chunk: torch.Tensor) -> torch.Tensor:
    logits = model(chunk[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())


#: optimizer variants: name -> LowPrecisionAdamW keyword arguments (None: torch.optim.AdamW)
VARIANTS: dict[str, dict | None] = {
    "adamw": None,
    "fp8": dict(exp_avg_format="fp8"),
    "fp8-nearest": dict(exp_avg_format="fp8", stochastic_rounding=False),
    "fp16": dict(exp_avg_format="fp16"),
}


def run(name: str, init: torch.nn.Module, train: list[torch.Tensor], held_out: list[torch.Tensor],
        lr: float, fp4: bool) -> dict:
    model = copy.deepcopy(init)
    plugin = FP4Precision() if fp4 else None
    if plugin is not None:
        plugin.convert_module(model)
    kwargs = VARIANTS[name]
    if kwargs is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    else:
        opt = LowPrecisionAdamW(model.parameters(), lr=lr, weight_decay=0.1, **kwargs)
    warmup = max(1, len(train) // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s / len(train), 1.0))))
    ctx = plugin.forward_context if plugin is not None else torch.enable_grad
    losses = []
    t0 = time.perf_counter()
    for chunk in train:
        with ctx():
            loss = lm_loss(model, chunk)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    with torch.no_grad(), ctx():
        held = sum(lm_loss(model, c).item() for c in held_out) / len(held_out)
    return {
        "optimizer": name,
        "bytes_per_param": state_bytes_per_param(opt),
        "bytes_per_param_no_master": state_bytes_per_param(opt, include_master=False),
        "train_loss_last20": sum(losses[-20:]) / 20,
        "held_out_loss": held,
        "seconds": seconds,
        "losses": losses,
    }


#: --step-time: parameter shapes, cycled (a weight matrix, a norm, a bias, a small projection)
STEP_SHAPES = [(256, 256), (256,), (1024,), (64, 512)]


def _timed_step(opt: LowPrecisionAdamW, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> float:
    for p, g in zip(params, grads):
        p.grad = g
    if params[0].is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step()
    if params[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _same_bits(opt_a: LowPrecisionAdamW, a: torch.Tensor, opt_b: LowPrecisionAdamW, b: torch.Tensor) -> bool:
    """Parameter, moment codes, scales and master copy of ``a`` and ``b`` are the same bits."""
    pairs = [(a, b)] + [(opt_a.state[a][k], opt_b.state[b][k]) for k in opt_a.state[a] if k != "step"]
    return all(x.dtype == y.dtype and torch.equal(x.detach().reshape(-1).view(torch.uint8),
                                                  y.detach().reshape(-1).view(torch.uint8)) for x, y in pairs)


def step_time(n_params: int, steps: int, device: str, dtype: torch.dtype) -> list[dict]:
    """Median step time of the loop and the foreach path, per moment layout; the two are timed in
    alternation (one step each, ``steps`` times) so that load on the machine hits both alike."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(STEP_SHAPES[i % len(STEP_SHAPES)], generator=gen).to(device, dtype) for i in range(n_params)]
    grad_sets = [[torch.randn(t.shape, generator=gen).to(device, dtype) for t in init] for _ in range(3)]
    rows = []
    for name in ("fp8", "fp8-nearest", "fp16"):
        runs = {}
        for foreach in (False, True):
            params = [torch.nn.Parameter(t.clone()) for t in init]
            runs[foreach] = (params, LowPrecisionAdamW(params, lr=1e-3, weight_decay=0.1, foreach=foreach,
                                                       **VARIANTS[name]), [])
        for i in range(steps + 2):  # two warm-up steps
            for foreach, (params, opt, times) in runs.items():
                seconds = _timed_step(opt, params, grad_sets[i % len(grad_sets)])
                if i >= 2:
                    times.append(seconds)
        loop, fe = (sorted(runs[f][2])[steps // 2] for f in (False, True))
        same = all(_same_bits(runs[False][1], a, runs[True][1], b) for a, b in zip(runs[False][0], runs[True][0]))
        rows.append({"states": name, "loop_ms": loop * 1e3, "foreach_ms": fe * 1e3, "ratio": loop / fe,
                     "same_bits": same})
    return rows


def main_step_time(args: argparse.Namespace) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.step_dtype]
    numel = sum(math.prod(STEP_SHAPES[i % len(STEP_SHAPES)]) for i in range(args.step_params))
    print(f"LowPrecisionAdamW step time: {args.step_params} {args.step_dtype} parameters ({numel / 1e6:.2f}M "
          f"elements, shapes {STEP_SHAPES} cycled) on {device}, {torch.get_num_threads()} threads, "
          f"median of {args.step_steps} steps")
    print(f"{'states':<14}{'loop ms':>10}{'foreach ms':>12}{'loop/foreach':>14}{'same bits':>11}")
    rows = step_time(args.step_params, args.step_steps, device, dtype)
    for r in rows:
        print(f"{r['states']:<14}{r['loop_ms']:>10.2f}{r['foreach_ms']:>12.2f}{r['ratio']:>14.2f}"
              f"{str(r['same_bits']):>11}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "step_time": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="'small' (dim 128, 2 layers) or 'tiny' (dim 256, 4 layers)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run of every variant per seed")
    ap.add_argument("--variants", nargs="+", default=["adamw", "fp8", "fp16"],
                    help=f"optimizers to compare, the first is the reference; choose from {list(VARIANTS)}")
    ap.add_argument("--fp4", action="store_true", help="train through FP4Precision (FP4 GeMMs, bf16 autocast)")
    ap.add_argument("--noise", action="store_true", help="also run the reference on another batch order")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--step-time", action="store_true",
                    help="time the optimizer step, per-parameter loop against foreach, and exit")
    ap.add_argument("--step-params", type=int, default=200, help="--step-time: number of parameters")
    ap.add_argument("--step-steps", type=int, default=20, help="--step-time: timed steps per path")
    ap.add_argument("--step-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="--step-time: parameter dtype (bf16 keeps fp32 master weights)")
    ap.add_argument("--device", default=None, help="--step-time: device (default: cuda if available, else cpu)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (on cores busy with other work, 1 avoids threads waiting on each other)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step_time:
        main_step_time(args)
        return
    if args.model not in ("small", "tiny"):
        ap.error(f"--model {args.model!r}: choose 'small' or 'tiny'")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants {unknown}: choose from {list(VARIANTS)}")

    overrides = dict(vocab_size=256, max_seq_len=args.seq)
    if args.model == "small":
        overrides.update(dim=128, n_layers=2, n_heads=4, ffn_dim=352)
    data = load_text(4_000_000)
    split = int(0.95 * len(data))
    ref_name = args.variants[0]
    all_results = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        init = Llama(llama_config("tiny", **overrides))
        train = batches(data[:split], args.steps, args.batch, args.seq, seed + 1)
        held_out = batches(data[split:], 8, args.batch, args.seq, seed + 2)
        n_params = sum(p.numel() for p in init.parameters())
        print(f"seed {seed}: model {args.model}, {n_params / 1e6:.2f}M params, {args.steps} steps of "
              f"{args.batch}x{args.seq} bytes, {'FP4 GeMMs + bf16 autocast' if args.fp4 else 'fp32'}")
        results = [run(name, init, train, held_out, args.lr, args.fp4) for name in args.variants]
        if args.noise:
            other = batches(data[:split], args.steps, args.batch, args.seq, seed + 3)
            noise = run(ref_name, init, other, held_out, args.lr, args.fp4)
            noise["optimizer"] = f"{ref_name} (other batch order)"
            results.append(noise)
        ref = results[0]["held_out_loss"]
        print(f"{'optimizer':<28}{'state B/param':>14}{'held-out loss':>15}{'gap':>10}{'train loss':>12}{'s':>7}")
        for r in results:
            r["seed"] = seed
            r["gap"] = (r["held_out_loss"] - ref) / ref
            print(f"{r['optimizer']:<28}{r['bytes_per_param']:>14.3f}{r['held_out_loss']:>15.4f}{r['gap']:>+9.2%}"
                  f"{r['train_loss_last20']:>12.4f}{r['seconds']:>7.1f}")
        all_results += results
    if len(args.seeds) > 1:
        print(f"mean held-out gap to {ref_name} over seeds {args.seeds}:")
        for name in dict.fromkeys(r["optimizer"] for r in all_results):
            gaps = [r["gap"] for r in all_results if r["optimizer"] == name]
            print(f"  {name:<28}{sum(gaps) / len(gaps):>+8.2%}  (min {min(gaps):+.2%}, max {max(gaps):+.2%})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": all_results}, f, indent=1)


if __name__ == "__main__":
    main()
