"""FP4Linear against bf16 nn.Linear, side by side in one run (CPU or GPU).

Prints, per LLaMA-like layer shape:
  * forward+backward time of FP4Linear (``paper`` and ``w4a4-direct`` presets) over
    bf16-autocast nn.Linear, all layers timed round-robin (one call each per round) in one run;
  * the same ratio for a peer that simulates less: torchao's float8 training with
    ``Float8LinearConfig(emulate=True)`` (tensorwise E4M3 activations and weights, E5M2 output
    gradients; no DGE, no OCC), when torchao imports (scripts/test.sh installs it as the
    test-only ``oracle`` extra; otherwise the column reads n/a);
  * OCC's share of the FP4Linear forward as training runs it (with grad: quantile + clamp +
    compensation + the residual kept for backward), the two forwards alternated call by call;
  * DGE's share of the ``paper`` forward+backward (``paper`` against ``paper`` with STE, timed in
    the same rounds): an upper bound on what caching the DGE factor could save;
  * bytes saved for backward, FP4Linear over bf16 nn.Linear (saved_tensors_hooks);
and, once, the OCC quantile estimate's cost and error against the exact quantile. With
``--breakdown``, also where the ``paper`` forward+backward spends its time: each part
(OCC's quantile, the clamped quantizer, the residual's CSR, the weight quantizer, the three GeMMs
with their epilogues, the two FP8 quantizers of dY, OCC's sparse product) timed around its call,
median per call over the rounds, against the bf16 layer's whole forward+backward.

    .venv/bin/python benchmarks/bench_linear.py [--shapes 2048x1024x2816,...] [--iters N] [--breakdown]

``--layer-table`` (what scripts/gpu_check.sh runs on a GPU) instead times, per layer shape, the
forward+backward of bf16 ``nn.Linear``, torchao's row-wise float8 training
(``Float8LinearConfig.from_recipe_name('rowwise')``, torch.compile'd as torchao runs it; row n/a where
torchao does not import), and FP4Linear ``w4a4-direct`` and ``paper`` on each GeMM path (on CUDA:
``scaled_mm``, ``triton``; on CPU, for a smoke test: ``scaled_mm``, ``reference``), one layer after the
other, each row printed as it is measured; ``--json PATH`` writes them (rewritten after each shape):

    python benchmarks/bench_linear.py --layer-table --json docs/perf/h200.json
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
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_gemm, emulate_bf16_linears  # noqa: E402
from fp4lightning.experiments.occ_fidelity import saved_tensor_bytes  # noqa: E402
from fp4lightning.numerics.occ import occ_bounds, occ_clamp  # noqa: E402

DEFAULT_SHAPES = "2048x1024x2816,2048x2816x1024,2048x2048x2048"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, dev, iters, warmup=2):
    for _ in range(warmup):
        fn()
    _sync(dev)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _time_rounds(fns, dev, iters, warmup=2, raw=False):
    """Medians of each of ``fns`` timed round-robin: one call of each per round, so that the
    machine's drift (this project's 2-core VM moves 15% between minutes) hits all of them alike.
    ``raw``: the per-round times instead (lists, one per function)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    ts = [[] for _ in fns]
    for _ in range(iters):
        for fn, t_fn in zip(fns, ts):
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            t_fn.append(time.perf_counter() - t)
    return ts if raw else [statistics.median(t_fn) for t_fn in ts]


def _paired_share(t_with, t_without):
    """Median over rounds of ``(with - without) / with``, each round's pair timed back to back
    (a difference of two medians is noise-bound when the part is ~10% of the whole)."""
    return max(0.0, statistics.median((a - b) / a for a, b in zip(t_with, t_without)))


def saved_bytes(module, x, dev):
    def run():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            module(x)
    return saved_tensor_bytes(module, run)


def torchao_float8_peer(lin: nn.Linear):
    """A copy of ``lin`` as torchao's emulated float8 training layer, or None without torchao."""
    import copy
    import logging
    try:
        logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA extensions do not load on CPU
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - any import failure means: no peer row
        print(f"# torchao float8 peer: not available ({type(e).__name__}: {e})")
        return None
    wrapper = nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(wrapper, config=Float8LinearConfig(emulate=True))
    return wrapper


def bench_shape(m, k, n, dev, iters, fold=False):
    lin = nn.Linear(k, n, device=dev)
    peer = torchao_float8_peer(lin)
    # the bf16 baseline as training runs it: on CPUs without native bf16 GeMMs, fp32 kernels on
    # bf16-rounded operands (fp4lightning.numerics.cpu_bf16; the FP4 layers' GeMMs do the same)
    emulate_bf16_linears(lin, dev)
    fp4 = FP4Linear.from_linear(lin, FP4Config())
    fp4_noocc = FP4Linear.from_linear(lin, FP4Config(occ=False))
    fp4_direct = FP4Linear.from_linear(lin, FP4Config.from_preset("w4a4-direct"))
    fp4_nodge = FP4Linear.from_linear(lin, FP4Config(dge=False))
    x = (torch.randn(m, k, device=dev) * (1 + 9 * (torch.rand(m, k, device=dev) < 0.01))).requires_grad_(True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

    def fwd_bwd(mod):
        def run():  # FP4Linear quantizes W on every call (it keeps no weight cache)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                y = mod(x)
            y.backward(dy)
        return run

    def fwd(mod):
        def run():  # as training runs it: with grad, so the residual for backward is built too
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                mod(x)
        return run

    # every layer timed round-robin, one call each per round, so machine noise hits all alike;
    # `paper` without DGE bounds what DGE costs (and so what caching its factor could save)
    # with `fold`: `paper` with OCC's compensation folded into an E4M3 operand (the occ_fold_e4m3
    # variant, docs/perf.md "OCC on the GPU"), last in each round
    fp4_fold = [FP4Linear.from_linear(lin, FP4Config(occ_fold_e4m3=True))] if fold else []
    mods = [lin, fp4, fp4_direct, fp4_nodge] + ([peer] if peer is not None else []) + fp4_fold
    t_all = _time_rounds([fwd_bwd(mod) for mod in mods], dev, iters, raw=True)
    t_bf16, t_fp4, t_direct, _, *t_rest = (statistics.median(t) for t in t_all)  # [3]: paper, STE
    t_fold = t_rest.pop() if fold else None
    t_peer = t_rest[0] if t_rest else None
    dge_share = _paired_share(t_all[1], t_all[3])
    # OCC's share: forwards with and without OCC alternated call by call, 3x the iterations
    occ_share = _paired_share(*_time_rounds([fwd(fp4), fwd(fp4_noocc)], dev, 3 * iters, raw=True))
    b_fp4, b_bf16 = saved_bytes(fp4, x, dev), saved_bytes(lin, x, dev)
    return dict(shape=f"{m}x{k}->{n}", bf16_ms=t_bf16 * 1e3, fp4_ms=t_fp4 * 1e3, ratio=t_fp4 / t_bf16, direct_ratio=t_direct / t_bf16,
                dge_share=dge_share,
                peer_ratio=None if t_peer is None else t_peer / t_bf16,
                fold_ratio=None if t_fold is None else t_fold / t_bf16,
                occ_share=occ_share, bytes_ratio=b_fp4 / b_bf16, fp4_mb=b_fp4 / 2**20, bf16_mb=b_bf16 / 2**20)


def bench_quantile(dev, m=2048, k=1024, alpha=0.99, reps=5):
    x = torch.randn(m, k, device=dev) * (1 + 9 * (torch.rand(m, k, device=dev) < 0.01))
    exact = occ_bounds(x, alpha, "exact")
    t_exact = _time(lambda: occ_bounds(x, alpha, "exact"), dev, reps, 1)
    t_sample = _time(lambda: occ_bounds(x, alpha, "sample"), dev, reps, 1)
    t_sort = _time(lambda: torch.sort(x.reshape(-1)), dev, reps, 1)
    errs, fracs = [], []
    for _ in range(20):
        b = occ_bounds(x, alpha, "sample")
        errs.append(((b - exact).abs() / exact.abs()).max().item())
        _, r = occ_clamp(x, b)
        fracs.append((r != 0).float().mean().item())
    return dict(t_exact=t_exact * 1e3, t_sample=t_sample * 1e3, t_sort=t_sort * 1e3,
                max_rel_err=max(errs), frac_mean=statistics.mean(fracs), frac_sd=statistics.pstdev(fracs))


#: the parts of FP4Linear's forward+backward that --breakdown times: (module, function, label)
BREAKDOWN_PARTS = (
    ("ops.gemm", "occ_bounds", "OCC quantile (sampled)"),
    ("ops.gemm", "quantize_fp4_clamped", "FP4 quantize X (OCC clamp, residual)"),
    ("nn.linear", "_sparse_residual", "OCC residual -> CSR of R^T"),
    ("nn.linear", "quantize_weight", "FP4 quantize W"),
    ("ops.gemm", "fp4_gemm", "forward GeMM + epilogue"),
    ("ops.gemm", "quantize_fp8_divided", "FP8 quantize dY (dgrad and wgrad operands)"),
    ("ops.gemm", "fp4_dgrad", "dgrad GeMM + epilogue"),
    ("nn.linear", "_sparse_wgrad", "OCC compensation dY^T R (sparse)"),
    ("ops.gemm", "fp4_wgrad", "wgrad GeMM + DGE epilogue"),
)


def bench_breakdown(m, k, n, dev, iters):
    """Median ms per training step of each part in BREAKDOWN_PARTS of a ``paper`` FP4Linear, and the
    step's and the bf16 layer's whole forward+backward, all timed in the same rounds."""
    import importlib

    lin = nn.Linear(k, n, device=dev)
    emulate_bf16_linears(lin, dev)
    fp4 = FP4Linear.from_linear(lin, FP4Config())
    x = (torch.randn(m, k, device=dev) * (1 + 9 * (torch.rand(m, k, device=dev) < 0.01))).requires_grad_(True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    spent: dict[str, float] = {}
    patched = []
    for mod_name, fn_name, label in BREAKDOWN_PARTS:
        mod = importlib.import_module(f"fp4lightning.{mod_name}")
        orig = getattr(mod, fn_name)

        def timed(*a, _orig=orig, _label=label, **kw):
            _sync(dev)
            t = time.perf_counter()
            out = _orig(*a, **kw)
            _sync(dev)
            spent[_label] = spent.get(_label, 0.0) + time.perf_counter() - t
            return out
        setattr(mod, fn_name, timed)
        patched.append((mod, fn_name, orig))
    try:
        per_round = {label: [] for _, _, label in BREAKDOWN_PARTS}
        whole = {"bf16": [], "fp4": []}
        for i in range(2 + iters):
            for name, mod in (("bf16", lin), ("fp4", fp4)):
                spent.clear()
                _sync(dev)
                t = time.perf_counter()
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    y = mod(x)
                y.backward(dy)
                _sync(dev)
                if i >= 2:  # two warm-up rounds
                    whole[name].append(time.perf_counter() - t)
                    if name == "fp4":
                        for label in per_round:
                            per_round[label].append(spent.get(label, 0.0))
    finally:
        for mod, fn_name, orig in patched:
            setattr(mod, fn_name, orig)
    med = {label: statistics.median(v) * 1e3 for label, v in per_round.items()}
    # the weight quantizer calls quantize_fp4 inside; no part here is nested in another
    return med, statistics.median(whole["fp4"]) * 1e3, statistics.median(whole["bf16"]) * 1e3


#: the layer table's shapes (tokens x in x out): LLaMA-2 7B's qkvo, up/gate and down at 8192 tokens
TABLE_SHAPES = "8192x4096x4096,8192x4096x11008,8192x11008x4096"


def torchao_rowwise_peer(lin: nn.Linear, compile_it: bool):
    """A copy of ``lin`` as torchao's row-wise float8 training layer (torch.compile'd when asked), or
    (None, why) without torchao."""
    import copy
    import logging
    try:
        logging.getLogger("torchao").setLevel(logging.ERROR)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as e:  # noqa: BLE001 - any import failure means: no peer row
        return None, f"torchao not importable ({type(e).__name__}: {e})"
    wrapper = nn.Sequential(copy.deepcopy(lin))
    convert_to_float8_training(wrapper, config=Float8LinearConfig.from_recipe_name("rowwise"))
    return (torch.compile(wrapper) if compile_it else wrapper), None


def _commit() -> str:
    import subprocess
    if os.environ.get("FP4LIGHTNING_COMMIT"):
        return os.environ["FP4LIGHTNING_COMMIT"]
    try:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy of the tree without .git
        return "unknown"


def layer_table(shapes: str, dev: torch.device, iters: int, json_path: str | None, compile_peer: bool) -> dict:
    """Per shape, fwd+bwd ms of each layer (module docstring, ``--layer-table``); returns the record
    that ``json_path`` receives."""
    import datetime
    import json

    import triton

    from fp4lightning.ops import gemm as gemm_dispatch

    cuda = dev.type == "cuda"
    paths = ["scaled_mm", "triton"] if cuda else ["scaled_mm", "reference"]
    if cuda and gemm_dispatch.scaled_mm_unavailable(dev):
        paths = ["triton"]
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  commit=_commit(), torch=torch.__version__, triton=triton.__version__,
                  device=torch.cuda.get_device_name(dev) if cuda else "cpu", tokens=None,
                  default_backend=gemm_dispatch.backend_for(dev), paths=paths,
                  triton_autotune=os.environ.get("FP4LIGHTNING_AUTOTUNE", "1") != "0",
                  fp8_fast_accum=os.environ.get("FP4LIGHTNING_FP8_FAST_ACCUM", "0") == "1",
                  input_dtype="bfloat16",
                  what=("median ms of forward + backward (bf16 autocast, fp32 master weights, bf16 input as the "
                        "roofline models it); '<preset>' on the "
                        "first of `paths`, '<preset> <path>' on the others; `paper` on scaled_mm runs OCC folded "
                        "into the E4M3 operand, on triton with the dense compensation GeMMs"),
                  layers={})
    print(f"# layer table: device={record['device']} torch={record['torch']} triton={record['triton']} "
          f"commit={record['commit'][:12]} default backend={record['default_backend']} iters={iters}", flush=True)
    print("| layer (in x out) | tokens | layer | GeMM path | fwd+bwd ms | / bf16 |", flush=True)
    print("|---|---|---|---|---|---|", flush=True)
    for spec in shapes.split(","):
        m, k, n = (int(v) for v in spec.split("x"))
        record["tokens"] = m if record["tokens"] in (None, m) else "per shape"
        key = f"{k}x{n}"
        row = record["layers"][key] = {}
        lin = nn.Linear(k, n, device=dev)
        emulate_bf16_linears(lin, dev)
        # a bf16 input, as the o and down projections get it and the roofline models it (q, k, v, gate and
        # up get fp32 under autocast: `roofline.py --input-dtype fp32`)
        x = (torch.randn(m, k, device=dev) * (1 + 9 * (torch.rand(m, k, device=dev) < 0.01))).to(torch.bfloat16)
        x.requires_grad_(True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

        def fwd_bwd(mod, backend=None):
            def run():
                if backend is not None:
                    os.environ["FP4LIGHTNING_BACKEND"] = backend
                with torch.autocast(dev.type, dtype=torch.bfloat16):
                    y = mod(x)
                y.backward(dy)
            return run

        peer, why = torchao_rowwise_peer(lin, compile_peer and cuda)
        fp4 = {p: FP4Linear.from_linear(lin, FP4Config.from_preset(p)) for p in ("w4a4-direct", "paper")}
        # bf16, the FP4 layers on the first path, torchao (its compile takes a while), the other paths
        layers = [("bf16", None, lin)] + [(p, paths[0], mod) for p, mod in fp4.items()]
        layers += [("torchao-float8", None, peer)]
        layers += [(f"{p} {path}", path, mod) for path in paths[1:] for p, mod in fp4.items()]
        before = os.environ.get("FP4LIGHTNING_BACKEND")
        t_bf16 = None
        try:
            for name, path, mod in layers:
                if mod is None:
                    row[name] = None
                    print(f"| {key} | {m} | {name} | - | n/a | | ({why})", flush=True)
                    continue
                try:
                    ms = 1e3 * _time(fwd_bwd(mod, path), dev, iters, warmup=3)
                except Exception as e:  # noqa: BLE001 - one failing layer must not lose the others' rows
                    row[name] = None
                    print(f"| {key} | {m} | {name} | {path or '-'} | FAILED | | ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160] if str(e) else ''})", flush=True)
                    continue
                row[name] = round(ms, 4)
                t_bf16 = ms if name == "bf16" else t_bf16
                rel = f"{ms / t_bf16:.2f}x" if t_bf16 else ""
                print(f"| {key} | {m} | {name} | {path or '-'} | {ms:.3f} | {rel} |", flush=True)
                if json_path:  # after every row: a run cut off by its time limit keeps what it measured
                    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
                    with open(json_path, "w") as f:
                        json.dump(record, f, indent=1)
                        f.write("\n")
        finally:
            if before is None:
                os.environ.pop("FP4LIGHTNING_BACKEND", None)
            else:
                os.environ["FP4LIGHTNING_BACKEND"] = before
        del lin, x, dy, layers, peer, fp4
        if cuda:
            torch.cuda.empty_cache()
    return record


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxKxN (tokens x in -> out)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--breakdown", action="store_true", help="also time the parts of the paper layer's fwd+bwd")
    ap.add_argument("--fold", action="store_true",
                    help="also time `paper` with OCC folded into E4M3 (FP4Config.occ_fold_e4m3, opt-in)")
    ap.add_argument("--layer-table", action="store_true",
                    help="the per-layer table of bf16, torchao row-wise float8 and FP4 on each GeMM path instead")
    ap.add_argument("--json", metavar="PATH", help="with --layer-table: write the table as JSON")
    ap.add_argument("--peer-eager", action="store_true", help="with --layer-table: do not torch.compile torchao's layer")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.layer_table:
        layer_table(args.shapes if args.shapes != DEFAULT_SHAPES else TABLE_SHAPES, dev, args.iters, args.json,
                    not args.peer_eager)
        return
    from fp4lightning.numerics import cpu_fused as fused

    print(f"# device={dev} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"backend={os.environ.get('FP4LIGHTNING_BACKEND', 'auto')} compiled={fused.compile_enabled(dev)} "
          f"bf16_gemm={'emulated (fp32 kernels)' if emulate_bf16_gemm(dev) else 'native'}")
    print("| shape (tokens x in -> out) | bf16 fwd+bwd ms | FP4 fwd+bwd ms | FP4/bf16 time | w4a4-direct/bf16 time "
          "| torchao float8 emulate/bf16 time | OCC share of FP4 fwd | DGE share of FP4 fwd+bwd | saved MB bf16 | saved MB FP4 | FP4/bf16 saved bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in args.shapes.split(","):
        m, k, n = (int(v) for v in s.split("x"))
        r = bench_shape(m, k, n, dev, args.iters, args.fold)
        print(f"| {r['shape']} | {r['bf16_ms']:.1f} | {r['fp4_ms']:.1f} | {r['ratio']:.2f}x | {r['direct_ratio']:.2f}x | "
              f"{'n/a' if r['peer_ratio'] is None else format(r['peer_ratio'], '.2f') + 'x'} | {100 * r['occ_share']:.0f}% | {100 * r['dge_share']:.0f}% | {r['bf16_mb']:.1f} | {r['fp4_mb']:.1f} | {r['bytes_ratio']:.3f}x |")
        if r["fold_ratio"] is not None:
            print(f"|   (`paper` with OCC folded in E4M3, FP4Config.occ_fold_e4m3: {r['fold_ratio']:.2f}x bf16 time, "
                  f"{r['fold_ratio'] / r['ratio']:.2f}x `paper`'s) |")
    if args.breakdown:
        print("\nWhere the `paper` FP4Linear forward+backward spends its time (median ms per call over the rounds; "
              "the parts' sum is below the whole: autograd, reshapes and the bias gradient are not in a part):")
        for s in args.shapes.split(","):
            m, k, n = (int(v) for v in s.split("x"))
            med, t_fp4, t_bf16 = bench_breakdown(m, k, n, dev, args.iters)
            parts = ", ".join(f"{label} {ms:.1f}" for label, ms in sorted(med.items(), key=lambda kv: -kv[1]))
            print(f"  {m}x{k}->{n}: whole {t_fp4:.1f} ms (bf16 nn.Linear {t_bf16:.1f} ms; parts sum "
                  f"{sum(med.values()):.1f}): {parts}")
    q = bench_quantile(dev)
    print("\nOCC quantile on a 2048x1024 activation (alpha=0.99):")
    print(f"  exact (two partial sorts, topk) {q['t_exact']:.1f} ms | sampled (65,536) {q['t_sample']:.2f} ms | "
          f"full sort {q['t_sort']:.1f} ms")
    print(f"  sampled bound max relative error {100 * q['max_rel_err']:.2f}% over 20 draws; clamped fraction "
          f"{100 * q['frac_mean']:.3f}% +/- {100 * q['frac_sd']:.3f}% (target 2.000%)")


if __name__ == "__main__":
    main()
