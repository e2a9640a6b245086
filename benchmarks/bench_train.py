"""Training-step cost of FP4 against BF16 on the tiny recipe's model, side by side in one run.

For the same model and batch (same initial weights), measures
  * step time (forward + backward + optimizer step), FP4 (``paper`` preset) over bf16 autocast;
  * bytes saved for backward (activations), measured with ``saved_tensors_hooks``;
  * optimizer-state bytes per parameter, torch AdamW against ``LowPrecisionAdamW`` (E4M3/FP16);
  * training memory = parameters + gradients + optimizer state + saved activations (on CPU
    this is the analytic sum of measured tensors; on CUDA also ``max_memory_allocated``).

    .venv/bin/python benchmarks/bench_train.py [--iters N] [--batch 16] [--seq 256]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fp4lightning import FP4Config, LowPrecisionAdamW, convert_to_fp4  # noqa: E402
from fp4lightning.cpu_bf16 import emulate_bf16_gemm, emulate_bf16_linears  # noqa: E402
from fp4lightning.fidelity import saved_tensor_bytes  # noqa: E402
from fp4lightning.models.llama import Llama, llama_config  # noqa: E402
from fp4lightning.optim import state_bytes_per_param  # noqa: E402


def _batch(vocab, b, t, dev):
    data_dir = "data/builtin"
    if os.path.exists(os.path.join(data_dir, "meta.json")):  # real text if prepared
        from fp4lightning.data import PreparedData

        arr = PreparedData(data_dir).shards("train")[0]
        x = torch.from_numpy(arr[: b * (t + 1)].astype("int64")).reshape(b, t + 1)
        return x.to(dev), "built-in corpus"
    return torch.randint(0, vocab, (b, t + 1), device=dev), "random tokens"


def _saved_bytes(model, x, dev):
    def run():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = model(x[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    return saved_tensor_bytes(model, run)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = llama_config("tiny")
    base = Llama(cfg).to(dev)
    # as in training (LlamaLightningModule, FP4Precision): on CPUs without native bf16 GeMMs the
    # high-precision layers' bf16 GeMMs run on fp32 kernels (fp4lightning.cpu_bf16)
    emulate_bf16_linears(base, dev)
    fp4 = convert_to_fp4(copy.deepcopy(base), FP4Config())
    x, src = _batch(cfg.vocab_size, args.batch, args.seq, dev)
    models = {"bf16": base, "fp4": fp4}
    opts = {"bf16": torch.optim.AdamW(base.parameters(), lr=1e-3),
            "fp4": torch.optim.AdamW(fp4.parameters(), lr=1e-3)}

    def step(name):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            logits = models[name](x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = {n: [] for n in models}
    for n in models:
        step(n)  # warm-up, creates optimizer state
    for _ in range(args.iters):  # interleaved, so machine noise hits both alike
        for n in models:
            t = time.perf_counter()
            step(n)
            times[n].append(time.perf_counter() - t)
    med = {n: statistics.median(v) for n, v in times.items()}

    saved = {n: _saved_bytes(m, x, dev) for n, m in models.items()}
    n_params = sum(p.numel() for p in base.parameters())
    lp = LowPrecisionAdamW(fp4.parameters(), lr=1e-3, exp_avg_format="fp8", exp_avg_sq_format="fp16")
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        logits = fp4(x[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
    lp.step()
    opt_bpp = {"AdamW fp32": state_bytes_per_param(opts["bf16"]), "LowPrecisionAdamW E4M3/FP16": state_bytes_per_param(lp)}
    param_b, grad_b = n_params * 4, n_params * 4
    mem = {
        "bf16": param_b + grad_b + opt_bpp["AdamW fp32"] * n_params + saved["bf16"],
        "fp4": param_b + grad_b + opt_bpp["LowPrecisionAdamW E4M3/FP16"] * n_params + saved["fp4"],
    }
    tok = args.batch * args.seq
    print(f"# device={dev} torch={torch.__version__} threads={torch.get_num_threads()} model=tiny "
          f"({n_params / 1e6:.2f}M params) batch={args.batch}x{args.seq} ({src}) iters={args.iters} "
          f"bf16_gemm={'emulated (fp32 kernels)' if emulate_bf16_gemm(dev) else 'native'}")
    print("| quantity | BF16 | FP4 | FP4 / BF16 |")
    print("|---|---|---|---|")
    print(f"| step time (fwd+bwd+AdamW), ms | {1e3 * med['bf16']:.0f} | {1e3 * med['fp4']:.0f} | "
          f"{med['fp4'] / med['bf16']:.2f}x |")
    print(f"| tokens / s | {tok / med['bf16']:.0f} | {tok / med['fp4']:.0f} | {med['bf16'] / med['fp4']:.2f}x |")
    print(f"| saved activations, MB | {saved['bf16'] / 2**20:.1f} | {saved['fp4'] / 2**20:.1f} | "
          f"{saved['fp4'] / saved['bf16']:.3f}x |")
    print(f"| optimizer state, bytes/param | {opt_bpp['AdamW fp32']:.2f} (AdamW) | "
          f"{opt_bpp['LowPrecisionAdamW E4M3/FP16']:.2f} (E4M3/FP16) | "
          f"{opt_bpp['LowPrecisionAdamW E4M3/FP16'] / opt_bpp['AdamW fp32']:.3f}x |")
    print(f"| training memory (params+grads+opt+activations), MB | {mem['bf16'] / 2**20:.1f} | "
          f"{mem['fp4'] / 2**20:.1f} | {mem['fp4'] / mem['bf16']:.3f}x |")
    if dev.type == "cuda":
        print(f"| CUDA max_memory_allocated (whole run), MB | {torch.cuda.max_memory_allocated() / 2**20:.1f} | | |")
    print("\nSaved activations include the output head and attention, which stay high precision in both.")


if __name__ == "__main__":
    main()
