"""This checkout's FP4 CPU path against an earlier git revision of it, interleaved in one process.

On a shared or virtualised machine the speed of a whole process can move by 2x from one run
to the next (docs/perf.md), so two separate benchmark runs cannot show a 10% change. This
script imports the package as it was at ``--rev`` (``git archive`` into a temporary folder,
imported under another name; the package uses relative imports, so the old modules load each
other) next to the working tree's, and times both, interleaved, in the same process on the
same inputs and weights:

* ``layer``: FP4Linear forward + backward (``paper`` and ``w4a4-direct``) under bf16 autocast,
  with bf16 ``nn.Linear`` as the yardstick;
* ``step``: one training step (forward, backward, AdamW) of the tiny recipe's model, FP4
  (``paper``) against BF16.

    .venv/bin/python benchmarks/bench_revisions.py --rev HEAD~3 [--what layer,step] [--shape 2048x1024x2816]

Prints min and median milliseconds per variant and the median ratios new/old and new/bf16.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_linears  # noqa: E402


def import_revision(rev: str, into: str):
    """The ``fp4lightning`` package at git revision ``rev``, imported as ``fp4rev``."""
    archive = os.path.join(into, "rev.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", ROOT, "archive", rev, "fp4lightning"], stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    os.rename(os.path.join(into, "fp4lightning"), os.path.join(into, "fp4rev"))
    sys.path.insert(0, into)
    return importlib.import_module("fp4rev")


def interleaved(fns: dict, iters: int, warmup: int = 2) -> dict:
    """Median and min seconds per callable, timed round-robin so machine drift hits all alike."""
    for f in fns.values():
        for _ in range(warmup):
            f()
    ts: dict = {k: [] for k in fns}
    for _ in range(iters):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t)
    return {k: (statistics.median(v), min(v)) for k, v in ts.items()}


def report(title: str, res: dict, pairs: list[tuple[str, str]]) -> None:
    print(f"\n{title}")
    print("| variant | median ms | min ms |")
    print("|---|---|---|")
    for k, (med, mn) in res.items():
        print(f"| {k} | {1e3 * med:.1f} | {1e3 * mn:.1f} |")
    for a, b in pairs:
        print(f"{a} / {b}: {res[a][0] / res[b][0]:.3f}x (medians)")


def bench_layer(new, old, shape: str, iters: int) -> None:
    m, k, n = (int(v) for v in shape.split("x"))
    lin = torch.nn.Linear(k, n)
    mods = {"bf16 nn.Linear": lin}
    for pre in ("paper", "w4a4-direct"):
        mods[f"old {pre}"] = old.FP4Linear.from_linear(lin, old.FP4Config.from_preset(pre))
        mods[f"new {pre}"] = new.FP4Linear.from_linear(lin, new.FP4Config.from_preset(pre))
    # the yardstick as training runs it: on CPUs without native bf16 GeMMs, fp32 kernels on
    # bf16-rounded operands (fp4lightning.numerics.cpu_bf16; a class swap, the FP4 layers share its weights)
    emulate_bf16_linears(lin)
    x = (torch.randn(m, k) * (1 + 9 * (torch.rand(m, k) < 0.01))).requires_grad_(True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)

    def run(mod):
        def f():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = mod(x)
            y.backward(dy)
        return f

    res = interleaved({name: run(mod) for name, mod in mods.items()}, iters)
    report(f"FP4Linear forward+backward, {m}x{k}->{n}, bf16 autocast", res,
           [("new paper", "old paper"), ("new w4a4-direct", "old w4a4-direct"),
            ("old paper", "bf16 nn.Linear"), ("new paper", "bf16 nn.Linear"),
            ("new w4a4-direct", "bf16 nn.Linear")])


def bench_step(new, old, iters: int) -> None:
    from fp4lightning.models.llama import Llama, llama_config

    cfg = llama_config("tiny")
    base = Llama(cfg)
    models = {"bf16": base, "old fp4": old.convert_to_fp4(copy.deepcopy(base), old.FP4Config()),
              "new fp4": new.convert_to_fp4(copy.deepcopy(base), new.FP4Config())}
    for mod in models.values():  # the bf16 model and the FP4 models' kept head, as FP4Precision does
        emulate_bf16_linears(mod)
    x = torch.randint(0, cfg.vocab_size, (16, 257))
    opts = {name: torch.optim.AdamW(mod.parameters(), lr=1e-3) for name, mod in models.items()}

    def step(name):
        def f():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = models[name](x[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten()).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
        return f

    res = interleaved({name: step(name) for name in models}, iters)
    report("Tiny-model training step (16 x 256 tokens, random), bf16 autocast", res,
           [("new fp4", "old fp4"), ("old fp4", "bf16"), ("new fp4", "bf16")])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="git revision to compare against (e.g. HEAD~3, a commit hash)")
    ap.add_argument("--what", default="layer,step", help="comma-separated: layer, step")
    ap.add_argument("--shape", default="2048x1024x2816", help="layer shape MxKxN (tokens x in -> out)")
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    unknown = set(args.what.split(",")) - {"layer", "step"}
    if unknown:
        ap.error(f"--what: unknown {sorted(unknown)}; choose from layer, step")
    torch.manual_seed(0)
    import fp4lightning as new

    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.rev], capture_output=True, text=True)
    if rev.returncode:
        ap.error(f"--rev {args.rev!r} is not a git revision of {ROOT}: {rev.stderr.strip()}")
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "fp4lightning"], capture_output=True,
                           text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = import_revision(args.rev, tmp)
        print(f"# new = working tree (HEAD {head.stdout.strip()}{', modified' if dirty else ''}), "
              f"old = {rev.stdout.strip()}; device=cpu torch={torch.__version__} threads={torch.get_num_threads()} "
              f"iters={args.iters}")
        if "layer" in args.what:
            bench_layer(new, old, args.shape, args.iters)
        if "step" in args.what:
            bench_step(new, old, args.iters)


if __name__ == "__main__":
    main()
