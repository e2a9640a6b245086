"""Where one forward + backward of a linear layer spends its time: host, kernels, GeMMs (issue 47).

The layer table (``bench_linear.py --layer-table``) times each call with a sync after it, which
cannot tell host overhead, slow kernels and slow GeMMs apart when it misses the roofline's prediction
(``roofline.py``; docs/perf.md). This script splits that time, per layer shape and layer (bf16
``nn.Linear``; FP4Linear ``w4a4-direct`` and ``paper`` on the ``scaled_mm`` backend, or the one
``FP4LIGHTNING_BACKEND`` names; torchao's row-wise float8 as the layer table builds it, when torchao
imports), for one forward + backward under bf16 autocast:

* ``sync_ms``: wall time of one call with a sync after it (what the layer table measured);
* ``b2b_ms``: wall time per call over ``--iters`` calls back to back, one sync at the end (when the
  GPU is the bottleneck the host's time hides behind it);
* ``host_ms``: CPU time until the call returns, no sync (on CUDA kernels launch asynchronously, so this
  is the cost of issuing the call: Python, autograd, the launches);
* ``busy_ms``: from ``torch.profiler`` over ``--profile-calls`` calls, the sum of the device's kernel
  times (copies and memsets included) per call, split into GeMMs and the rest (``gemm_ms``,
  ``other_ms``; a kernel is a GeMM by its name); ``kernels``: each kernel's name, launches per call and
  us per call; ``runtime``: the CUDA runtime/driver calls the host made (launches, syncs). **On a
  machine without a GPU** everything runs on the CPU, synchronously: ``busy_ms`` is then the
  profiler's CPU op self time and ``kernels`` lists aten ops, not kernels;
* ``pred``: the roofline's H200 prediction (total, GeMMs, the rest, launches, and its launch list);
* ``peak_mb``: on CUDA, the most memory one call holds above what was allocated before it
  (``torch.cuda.max_memory_allocated``: saved tensors, operands, scratch; the 1.3B step used more memory in
  FP4 than in bf16); None on CPU;
* ``graph_ms``: the call captured once in a CUDA graph and replayed (no host work at all), or why
  capture failed.

``bound`` says which side is longer: ``host`` (issuing the call takes longer than the kernels run) or
``gpu`` (on CPU, None). The JSON (``--json``) is rewritten after every layer, so a run cut off keeps
what it measured; the CUDA graphs come last, after every other figure.

    python benchmarks/profile_linear.py --json /tmp/profile.json          # the 7B shapes, 8192 tokens
    python benchmarks/profile_linear.py --shapes 256x128x256 --iters 3    # a CPU smoke run
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parent), str(HERE)):  # the checkout's package; the sibling benchmark scripts
    if p not in sys.path:
        sys.path.insert(0, p)

from fp4lightning import FP4Config, FP4Linear  # noqa: E402
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_linears  # noqa: E402

#: LLaMA-2 7B's qkvo, up/gate and down projections at 8192 tokens (tokens x in x out), as the layer table
SHAPES_7B = "8192x4096x4096,8192x4096x11008,8192x11008x4096"
#: the layers, in the order they are measured: (name, FP4Config preset or None)
LAYERS = (("bf16", None), ("w4a4-direct", "w4a4-direct"), ("paper", "paper"), ("torchao-float8", None))
#: a kernel (or, on CPU, an aten op) that is a GeMM, by name: cuBLAS/cuBLASLt (``nvjet_*``, ``*gemm*``,
#: ``*xmma*``, split-K reductions), CUTLASS, this project's Triton GeMMs, torch's matmul ops
GEMM_NAME = re.compile(r"gemm|xmma|nvjet|cutlass|wgmma|splitk|_fp4_(dgrad|wgrad)_kernel"
                       r"|^aten::(_scaled_mm|mm|addmm|bmm|baddbmm|_int_mm)$", re.IGNORECASE)
#: host calls into the CUDA runtime or driver (cudaLaunchKernel, cuLaunchKernelEx, cudaStreamSynchronize, ...)
RUNTIME_NAME = re.compile(r"^cu(da)?[A-Z]")
NAME_CHARS = 160  # kernel names (C++ templates) are cut to this many characters in the JSON


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- the layers
def build_layers(m: int, k: int, n: int, dev: torch.device, names=tuple(name for name, _ in LAYERS)):
    """(x, dy, [(name, module or None, why not)]) of the layers ``names`` for one shape; they share one
    weight and bias."""
    from bench_linear import torchao_rowwise_peer

    lin = nn.Linear(k, n, device=dev)
    emulate_bf16_linears(lin, dev)  # on CPUs without native bf16 GeMMs, as training runs them
    # a bf16 input, as the roofline models it and the layer table feeds it
    x = (torch.randn(m, k, device=dev) * (1 + 9 * (torch.rand(m, k, device=dev) < 0.01))).to(torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    layers = []
    for name, preset in (layer for layer in LAYERS if layer[0] in names):
        if name == "bf16":
            layers.append((name, lin, None))
        elif preset:
            layers.append((name, FP4Linear.from_linear(lin, FP4Config.from_preset(preset)), None))
        else:  # torch.compile'd on CUDA, as the layer table measures it
            peer, why = torchao_rowwise_peer(lin, dev.type == "cuda")
            layers.append((name, peer, why))
    return x, dy, layers


def fwd_bwd(mod: nn.Module, x: torch.Tensor, dy: torch.Tensor, dev: torch.device):
    def call():
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = mod(x)
        y.backward(dy)
    return call


# --------------------------------------------------------------------------- the measurements
def wall_times(call, dev: torch.device, iters: int, warmup: int = 3) -> dict:
    """``sync_ms``, ``b2b_ms`` and ``host_ms`` of ``call`` (module docstring), medians over ``iters``."""
    for _ in range(warmup):
        call()
    _sync(dev)
    synced, host = [], []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        _sync(dev)
        synced.append(time.perf_counter() - t)
    for _ in range(iters):
        t = time.perf_counter()
        call()
        host.append(time.perf_counter() - t)
        _sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(dev)
    b2b = (time.perf_counter() - t) / iters
    return {"sync_ms": _ms(statistics.median(synced)), "b2b_ms": _ms(b2b), "host_ms": _ms(statistics.median(host))}


def profile_calls(call, dev: torch.device, calls: int) -> dict:
    """What ``torch.profiler`` saw over ``calls`` calls (each followed by a sync), per call: the device's
    busy time (on CPU: the ops' self time), GeMMs and the rest, each kernel, the runtime calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    call()  # outside the profile: a first call after others may still allocate
    _sync(dev)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t = time.perf_counter()
        for _ in range(calls):
            call()
            _sync(dev)
        wall = time.perf_counter() - t

    # each kernel (on CPU: each op) by name: launches and time; the host's calls into CUDA likewise
    kernels, runtime = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        on_device = e.device_type != DeviceType.CPU
        if not on_device and RUNTIME_NAME.match(e.name):
            runtime[e.name][0] += 1
            runtime[e.name][1] += e.time_range.elapsed_us()
        elif on_device or not cuda:
            kernels[e.name][0] += 1
            kernels[e.name][1] += e.time_range.elapsed_us() if on_device else e.self_cpu_time_total
    busy = sum(us for _, us in kernels.values()) / calls
    gemm = sum(us for name, (_, us) in kernels.items() if GEMM_NAME.search(name)) / calls
    return {"profiled_ms": _ms(wall / calls), "busy_ms": round(busy / 1e3, 4), "gemm_ms": round(gemm / 1e3, 4),
            "other_ms": round((busy - gemm) / 1e3, 4),
            "kernels_per_call": round(sum(n for n, _ in kernels.values()) / calls, 2),
            "kernels": [{"name": name[:NAME_CHARS], "kind": "gemm" if GEMM_NAME.search(name) else "other",
                         "per_call": round(n / calls, 2), "us_per_call": round(us / calls, 3)}
                        for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])],
            "runtime": [{"name": name, "per_call": round(n / calls, 2), "us_per_call": round(us / calls, 2)}
                        for name, (n, us) in sorted(runtime.items(), key=lambda kv: -kv[1][1])]}


def graph_ms(call, dev: torch.device, iters: int) -> tuple[float | None, str | None]:
    """(ms per replay of ``call`` captured in a CUDA graph, None) or (None, why not, one line)."""
    if dev.type != "cuda":
        return None, "no CUDA graphs on CPU"
    stream = torch.cuda.current_stream()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
            for _ in range(3):
                call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
        ms = _ms((time.perf_counter() - t) / iters)
        del graph
        return ms, None
    except Exception as e:  # noqa: BLE001 - a layer that cannot be captured says why and the run goes on
        return None, f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e) else ''}"
    finally:
        torch.cuda.set_stream(stream)  # a capture that raised leaves its stream current


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 4)


# --------------------------------------------------------------------------- the roofline beside it
def predictions(shapes: list[tuple[int, int, int]], names) -> tuple[dict, str | None]:
    """``{"KxN": {layer: pred}}`` from ``roofline.py`` (the H200 model; traced on meta tensors, before
    anything runs on the device), or ({}, why not)."""
    try:
        import roofline
    except Exception as e:  # noqa: BLE001
        return {}, f"benchmarks/roofline.py does not import: {type(e).__name__}: {e}"
    out = {}
    for m, k, n in shapes:
        row = out[f"{k}x{n}"] = {}
        for name in names:
            try:
                launches = roofline.trace_layer(name, m, k, n)
            except Exception as e:  # noqa: BLE001 - one layer's trace failing keeps the others
                row[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
                continue
            gemm = sum(x.time_s for x in launches if x.kind == "gemm")
            total = roofline.predicted_s(launches)
            try:  # memory is modelled for the traced layers only
                mem = roofline.layer_memory(name, m, k, n) if name != "torchao-float8" else {}
            except Exception:  # noqa: BLE001 - the time prediction stands without it
                mem = {}
            row[name] = {"ms": _ms(total), "gemm_ms": _ms(gemm), "other_ms": _ms(total - gemm),
                         "peak_mib": round(mem["peak_mb"] * 1e6 / 2 ** 20, 1) if mem else None,
                         "launches": roofline.count_launches(launches),
                         "launch_list": [{"name": x.name, "kind": x.kind, "phase": x.phase, "launches": x.launches,
                                          "us": round(x.time_s * 1e6, 2)} for x in launches]}
    return out, None


# --------------------------------------------------------------------------- printing
def print_header() -> None:
    print("| shape | layer | sync ms | b2b ms | host ms | busy ms | GeMM ms | other ms | kernels | bound "
          "| pred ms | pred GeMM | pred other | pred launches |", flush=True)
    print("|---" * 14 + "|", flush=True)


def print_layer(shape: str, name: str, r: dict, top: int) -> None:
    p = r.get("pred") or {}

    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)
    print(f"| {shape} | {name} | {f(r['sync_ms'])} | {f(r['b2b_ms'])} | {f(r['host_ms'])} | {f(r['busy_ms'])} | "
          f"{f(r['gemm_ms'])} | {f(r['other_ms'])} | {f(r['kernels_per_call'], 'g')} | {r['bound'] or 'n/a'} | "
          f"{f(p.get('ms'))} | {f(p.get('gemm_ms'))} | {f(p.get('other_ms'))} | {f(p.get('launches'), 'd')} |",
          flush=True)
    pred = sorted(p.get("launch_list") or [], key=lambda x: -x["us"])
    for i in range(min(top, max(len(r["kernels"]), len(pred)))):
        got = r["kernels"][i] if i < len(r["kernels"]) else None
        want = pred[i] if i < len(pred) else None
        left = f"{got['us_per_call']:9.1f} us x{got['per_call']:<4g} {got['kind']:5s} {got['name'][:70]}" if got else ""
        right = f"{want['us']:8.1f} us x{want['launches']:<2d} {want['kind']:6s} {want['name'][:50]}" if want else ""
        print(f"|   {left:<105s} || {right}", flush=True)
    if r.get("peak_mb") is not None:
        model = f" (model: {p['peak_mib']:.1f} MiB)" if p.get("peak_mib") is not None else ""
        print(f"|   peak memory of one call: {r['peak_mb']:.1f} MiB above what it started with{model}", flush=True)
    for x in r["runtime"][:4]:
        print(f"|   host: {x['name']} x{x['per_call']:g} per call, {x['us_per_call']:.1f} us", flush=True)


# --------------------------------------------------------------------------- the run
def peak_mb(call, dev: torch.device) -> float | None:
    """``peak_mb`` of one ``call`` (module docstring): CUDA's allocator high-water mark above the memory
    allocated before it; None off CUDA (the CPU allocator keeps no high-water mark)."""
    if dev.type != "cuda":
        return None
    _sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    call()
    _sync(dev)
    return round((torch.cuda.max_memory_allocated(dev) - before) / 2 ** 20, 1)


def measure_layer(call, dev: torch.device, iters: int, calls: int) -> dict:
    r = wall_times(call, dev, iters)
    r["peak_mb"] = peak_mb(call, dev)
    r.update(profile_calls(call, dev, calls))
    # on CPU everything is host time: nothing to compare
    r["bound"] = ("host" if r["host_ms"] > r["busy_ms"] else "gpu") if dev.type == "cuda" else None
    r["graph_ms"], r["graph_error"] = None, "not run"
    return r


def run(shapes: str = SHAPES_7B, device: str | None = None, iters: int = 10, calls: int = 3, graphs: bool = True,
        json_path: str | None = None, top: int = 8, names=tuple(name for name, _ in LAYERS)) -> dict:
    """Measure every layer at every shape (module docstring); returns what ``json_path`` receives."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    parsed = [tuple(int(v) for v in s.split("x")) for s in shapes.split(",")]
    pred, why_no_pred = predictions(parsed, names)  # first: nothing has run on the device yet
    with scaled_mm_backend(dev):
        record = _header(dev, iters, calls, why_no_pred)
        print(f"# profile: device={record['device']} torch={record['torch']} triton={record['triton']} FP4 backend="
              f"{record['fp4_backend']} iters={iters} profiled calls={calls}\n# busy = {record['busy_is']}\n"
              f"# pred = {record['pred_is']}\n# under each row: the measured kernels (us per call, launches per "
              "call) || the predicted launches, longest first; host: CUDA runtime calls per call (the profiling "
              "loop's sync after each call included)", flush=True)
        if dev.type == "cuda":  # the profiler's first start (CUPTI) outside the first layer's profile
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                torch.ones(1, device=dev).add_(1)
                _sync(dev)
        print_header()
        kept = []
        for m, k, n in parsed:
            x, dy, layers = build_layers(m, k, n, dev, names)
            row = record["shapes"][f"{k}x{n}"] = {"tokens": m, "layers": {}}
            for name, mod, why in layers:
                row["layers"][name] = measure_or_why(f"{k}x{n}", name, mod, why, x, dy, dev, iters, calls, top, pred)
                _write(json_path, record)
            kept.append((f"{k}x{n}", x, dy, layers))
        if graphs:  # last: a capture that fails badly must not cost the other figures
            for shape, x, dy, layers in kept:
                graph_rows(record["shapes"][shape]["layers"], shape, layers, x, dy, dev, iters)
                _write(json_path, record)
    return record


@contextlib.contextmanager
def scaled_mm_backend(dev: torch.device):
    """The FP4 layers on the ``scaled_mm`` backend, the one the roofline models, where it runs and
    ``FP4LIGHTNING_BACKEND`` names no other; the environment as it was afterwards."""
    from fp4lightning.ops import gemm

    before = os.environ.get("FP4LIGHTNING_BACKEND")
    if (before or "auto").lower() == "auto" and gemm.scaled_mm_unavailable(dev) is None:
        os.environ["FP4LIGHTNING_BACKEND"] = "scaled_mm"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FP4LIGHTNING_BACKEND", None)
        else:
            os.environ["FP4LIGHTNING_BACKEND"] = before


def graph_rows(rows: dict, shape: str, layers, x, dy, dev: torch.device, iters: int) -> None:
    """``graph_ms`` / ``graph_error`` of each measured layer of one shape (printed)."""
    for name, mod, _ in layers:
        r = rows[name]
        if "error" not in r:
            r["graph_ms"], r["graph_error"] = graph_ms(fwd_bwd(mod, x, dy, dev), dev, iters)
            print(f"| {shape} | {name} | CUDA graph: "
                  f"{r['graph_error'] or format(r['graph_ms'], '.3f') + ' ms per replay'} |", flush=True)


def measure_or_why(shape, name, mod, why, x, dy, dev, iters, calls, top, pred) -> dict:
    """One layer's figures (printed), or ``{"error": why}`` when it is missing or fails."""
    if mod is None:
        print(f"| {shape} | {name} | n/a ({why}) |", flush=True)
        return {"error": why}
    try:
        r = measure_layer(fwd_bwd(mod, x, dy, dev), dev, iters, calls)
    except Exception as e:  # noqa: BLE001 - one failing layer keeps the others' figures
        print(f"| {shape} | {name} | FAILED ({type(e).__name__}: {e}) |"[:400], flush=True)
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    r["pred"] = pred.get(shape, {}).get(name)
    print_layer(shape, name, r, top)
    return r


def _header(dev: torch.device, iters: int, calls: int, why_no_pred: str | None) -> dict:
    import triton

    from fp4lightning.ops import gemm

    cuda = dev.type == "cuda"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "fp4_backend": gemm.backend_for(dev), "iters": iters,
            "profiled_calls": calls,
            "busy_is": ("CUDA kernel time per call (torch.profiler, ProfilerActivity.CUDA; copies and memsets "
                        "included)" if cuda else "CPU op self time per call (torch.profiler on CPU: no GPU here)"),
            "pred_is": "benchmarks/roofline.py, the modelled H200" + (f" (not available: {why_no_pred})"
                                                                      if why_no_pred else ""),
            "shapes": {}}


def _write(path: str | None, record: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES_7B, help="comma-separated MxKxN (tokens x in -> out)")
    ap.add_argument("--iters", type=int, default=10, help="timed calls of each kind (default 10)")
    ap.add_argument("--profile-calls", type=int, default=3, help="calls under torch.profiler (default 3)")
    ap.add_argument("--layers", default=",".join(name for name, _ in LAYERS),
                    help="comma-separated, of: " + ", ".join(name for name, _ in LAYERS) + " (default: all)")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA graph replay")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--top", type=int, default=8, help="kernels printed per layer (the JSON has all)")
    ap.add_argument("--json", metavar="PATH", help="write the figures as JSON (rewritten after every layer)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"\d+x\d+x\d+(,\d+x\d+x\d+)*", args.shapes):
        ap.error(f"--shapes {args.shapes!r}: give MxKxN triples (tokens x in x out), comma-separated")
    if args.iters < 1 or args.profile_calls < 1:
        ap.error("--iters and --profile-calls take a positive count")
    from fp4lightning.nn.linear import check_fp4_shape

    for spec in args.shapes.split(","):
        why = check_fp4_shape(*(int(v) for v in spec.split("x")[1:]))
        if why:
            ap.error(f"--shapes {spec}: FP4Linear cannot take it ({why})")
    names = tuple(args.layers.split(","))
    unknown = sorted(set(names) - {name for name, _ in LAYERS})
    if unknown:
        ap.error(f"--layers: unknown {', '.join(unknown)}; choose from {', '.join(name for name, _ in LAYERS)}")
    run(args.shapes, args.device, args.iters, args.profile_calls, not args.no_graph, args.json, args.top, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
