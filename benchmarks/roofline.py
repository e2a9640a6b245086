"""Roofline model of one FP4Linear forward + backward on an H200, traced on any machine (issue 47).

What a layer costs on the GPU is its kernel launches: how many, how many bytes each moves, how many
FLOPs each GeMM does. This tool counts them without a GPU (torchao's ``float8_roofline.py`` does the
same for float8 training, from a hand-written kernel list; here the list is traced from the code):

* **The trace.** One ``FP4Linear`` forward + backward of the CUDA path (the ``scaled_mm`` backend, the
  default on sm_89+) runs on *meta* tensors, which hold shapes and dtypes but no data, so the 7B shapes
  trace in well under a second and nothing executes. Inside the trace the layer's code sees a CUDA
  device (``Tensor.device`` / ``Tensor.is_cuda`` answer ``cuda:0`` to code outside torch, device
  arguments are mapped back to meta, ``torch.cuda`` answers as an H200 would, and every ``_scaled_mm``
  kind runs, as on the H200's cuBLASLt), so the CUDA-only branches are the ones taken. All of this is
  monkeypatching of this process for the duration of the trace (restored after); library behaviour is
  unchanged.
* **Triton kernels** are recorded at launch (``JITFunction.run``; the interpreter's too), not run:
  kernel name, grid, and the bytes of its tensor arguments.
* **torch ops** are classified by a ``TorchDispatchMode``: GeMMs (``mm``, ``addmm``, ``_scaled_mm``,
  ...), memory-bound kernels (everything else that launches), no launch (views, ``empty``), and host
  syncs (``.item()``, ``nonzero``, a device-to-host copy).
* **The layer** is one inside a bf16-autocast model: bf16 input (M tokens x K) that needs its gradient,
  fp32 master weight (N x K), bf16 output gradient, no gradient accumulation, the weight quantized
  inside the forward (no cache hit), and a bias (``nn.Linear``'s and ``FP4Linear``'s default, as issue
  47 counted and as ``scripts/gpu_check.sh``'s layer table measures; ``--no-bias`` for the LLaMA
  models' linears, which have none). The trace runs the step twice and keeps the second (per-shape
  caches warm, as in training).

The model: each launch takes ``max(bytes / HBM_BW, flops / rate) + LAUNCH_S``. Bytes are counted
from the tensors each kernel touches: every tensor argument once (read or written), views counted by
the elements they address, an in-place argument twice, gathers and scatters one 32-byte sector per
element they touch (``TRITON_BYTES``, ``_aten_bytes``). This is a model, not a measurement: it has no
caches, no overlap between kernels and no host time; the GPU figures it is to be compared with are
``scripts/gpu_check.sh``'s (docs/perf.md).

Baselines, modelled the same way:

* ``bf16``: ``nn.Linear`` traced as autocast runs it (the fp32 weight and bias cast to bf16, three
  GeMMs, the bias gradient, autograd's casts of the gradients back to fp32).
* ``torchao-float8``: torchao's row-wise float8 training (``Float8LinearConfig.from_recipe_name
  ("rowwise")``), not traced (torchao is not a dependency) but built from the kernel list torchao's own
  roofline gives for it (``torchao/testing/training/roofline_utils.py``, recipe ``rowwise``, no fusion
  with the previous op): input 2 cast kernels, weight 3, dY 2, then 3 ``_scaled_mm`` GeMMs with bf16
  outputs and autograd's cast of the bf16 dW to the fp32 master weight's dtype. The weight kernels read
  the fp32 master weight (4 bytes per element; torchao's table assumes a bf16 weight); the bias as
  ``Float8Linear`` adds it (a cast and an add; the bias gradient and its cast).

    python benchmarks/roofline.py                      # per-launch tables and the totals
    python benchmarks/roofline.py --json               # {"shapes": {"4096x4096": {"bf16": {...}, ...}}}
    python benchmarks/roofline.py --preset paper --shapes 4096x11008
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

# --------------------------------------------------------------------------- constants (H200)
#: HBM3e peak, NVIDIA H200 datasheet: 4.8 TB/s
HBM_PEAK = 4.8e12
#: what the model's memory-bound kernels reach: 3.5 TB/s, 0.73 of peak (issue 47's static estimate;
#: a device-to-device copy of the bf16 input ran at 3.7-4.1 TB/s on the H200, docs/perf.md "FP4 Triton
#: kernels"; the earlier FP4 quantizers reached 1.0-2.0 TB/s there)
HBM_BW = 3.5e12
#: dense bf16 GeMM: torch.matmul measured 684-713 TFLOP/s at the three 7B shapes on the H200
#: (docs/perf.md, "FP4 Triton kernels"; datasheet peak 989)
BF16_RATE = 700e12
#: FP8 GeMM (torch._scaled_mm, row-wise scales): 1.68-1.74x bf16 torch.matmul at the 7B shapes, 1.58-1.78x
#: over all shapes measured on the H200 (same table); issue 47's static estimate used 1.7x
FP8_RATE = 1.7 * BF16_RATE
#: fp32 GeMM without TF32 (torch's default for matmul): H200 datasheet FP32 67 TFLOP/s, at the bf16
#: GeMM's 0.71 of peak
FP32_RATE = 0.71 * 67e12
#: per launch: issue 47's static estimate (torchao's roofline_utils measured 2 us for a one-element
#: Triton kernel on an H100, GPU time only; a short kernel between long ones also pays ramp-up and tail)
LAUNCH_S = 5e-6
#: a gather or scatter touches one 32-byte DRAM sector per element
SECTOR = 32
#: CUDA kernels of one call of these torch ops, where more than one: torch's sort of one segment
#: longer than 4096 elements fills the indices, copies the values, then runs CUB's onesweep radix sort
#: (a histogram, a scan, one pass per 8-bit digit of a 32-bit key); nonzero_static counts, selects and
#: fills the padding
MULTI_LAUNCH = {"sort": 7, "nonzero_static": 3}

#: the three 7B shapes (in_features x out_features) at 8192 tokens
SHAPES_7B = ((4096, 4096), (4096, 11008), (11008, 4096))
TOKENS = 8192
PRESETS = ("bf16", "w4a4-direct", "paper", "torchao-float8")


@dataclasses.dataclass
class Launch:
    """One torch op or Triton kernel of the trace (``launches`` CUDA kernels; 0 for host-only work)."""

    name: str  # "aten.mm", "triton._quantize_fp4_kernel", ...
    kind: str  # "gemm" | "memory" | "sync" | "h2d"
    phase: str  # "forward" | "backward"
    bytes: int = 0
    flops: int = 0
    rate: float = 0.0  # FLOP/s of a GeMM
    grid: tuple | None = None
    launches: int = 1
    shapes: str = ""

    @property
    def time_s(self) -> float:
        """Predicted H200 time: ``max(bytes / HBM_BW, flops / rate) + launches * LAUNCH_S``."""
        compute = self.flops / self.rate if self.flops else 0.0
        return max(self.bytes / HBM_BW, compute) + self.launches * LAUNCH_S


# --------------------------------------------------------------------------- bytes of a tensor
def _footprint(t: torch.Tensor) -> int:
    """Bytes of the elements a (possibly strided, broadcast) view addresses."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _key(t: torch.Tensor) -> tuple:
    """Two views that address the same elements of one buffer count once."""
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(_footprint(t) for t in {_key(t): t for t in tensors}.values())


# --------------------------------------------------------------------------- torch ops
#: GeMMs: FLOPs at the rate of their operands' dtype
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm"}
#: ops whose result the host must wait for (they read device memory or size an output from it)
SYNC_OPS = {"_local_scalar_dense", "is_nonzero", "item", "equal", "allclose", "nonzero", "masked_select",
            "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount"}
#: ops that allocate or re-describe memory without a kernel
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_unsafe_view", "_reshape_alias", "resize_", "set_"}
#: kernels that only write their output
FILLS = {"zeros", "ones", "full", "fill", "fill_", "zero_", "zeros_like", "ones_like", "full_like", "arange",
         "scalar_tensor", "new_zeros", "new_ones", "new_full"}
#: writes (scatters) or reads (gathers) one sector per indexed element of their first argument
SCATTERS = {"scatter", "scatter_", "index_put", "index_put_", "index_copy", "index_copy_", "scatter_add_"}
GATHERS = {"index", "index_select", "gather", "take"}


def _real_device(t: torch.Tensor) -> torch.device:
    return _REAL_DEVICE.__get__(t)


def _on_device(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors of a traced op that live on the (modelled) GPU: meta tensors, 0-dim CPU scalars aside."""
    return [t for t in ts if _real_device(t).type == "meta"]


def _aten_bytes(name: str, args, kwargs, out) -> int:
    ins, outs = _on_device(_tensors((args, kwargs))), _on_device(_tensors(out))
    if name in FILLS:
        return _distinct_bytes(outs)
    if name == "copy_":  # dst written, src read
        return _footprint(args[0]) + _footprint(args[1])
    if name in SCATTERS:  # self written at the indexed elements only
        rest = ins[1:]
        touched = max((t.numel() for t in rest), default=0) * SECTOR
        return _distinct_bytes(rest) + min(_footprint(args[0]), touched)
    if name in GATHERS:  # the source read at the gathered elements only
        src, rest = args[0], ins[1:]
        touched = sum(t.numel() for t in outs) * SECTOR
        return min(_footprint(src), touched) + _distinct_bytes(rest) + _distinct_bytes(outs)
    return _distinct_bytes(ins) + _distinct_bytes(outs)  # an in-place self: read, then written


def _gemm_flops(name: str, args) -> tuple[int, float]:
    """(FLOPs, rate) of a GeMM call."""
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if name == "_scaled_mm" or a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        rate = FP8_RATE
    elif a.dtype in (torch.bfloat16, torch.float16):
        rate = BF16_RATE
    else:
        rate = FP32_RATE
    return 2 * batch * m * k * n, rate


def _describe(ts: list[torch.Tensor]) -> str:
    names = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8",
             torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.int32: "i32", torch.int64: "i64",
             torch.bool: "bool"}
    return " ".join(f"{names.get(t.dtype, str(t.dtype))}{list(t.shape)}" for t in ts if t.dim())


def _transfer(name: str, args, out) -> str | None:
    """'h2d' for a copy from the host to the device, 'sync' for one to the host (it waits for the device)."""
    if name == "_to_copy":
        src, dst = args[0], out
    elif name == "copy_":
        dst, src = args[0], args[1]
    else:
        return None
    if not isinstance(src, torch.Tensor):
        return None
    on = (_real_device(src).type == "meta", _real_device(dst).type == "meta")
    return {(False, True): "h2d", (True, False): "sync"}.get(on)


def _sync_result(name: str, args):
    """What a host-syncing op returns in the trace (meta tensors hold no values)."""
    if name == "nonzero":
        return torch.empty((0, args[0].dim()), dtype=torch.int64, device="meta")
    if name in ("_local_scalar_dense", "item"):
        return False if args[0].dtype == torch.bool else (0 if not args[0].is_floating_point() else 0.0)
    if name in ("is_nonzero", "equal", "allclose"):
        return False
    raise NotImplementedError(f"roofline: the host-syncing op aten.{name} is not modelled")


class _Memory:
    """Device memory the traced ops allocate, live and at its peak: each buffer an op returns counts
    from its allocation until the last tensor on it, views included, is freed (saved tensors too,
    until the backward releases them). Buffers that existed before ``reset`` (the input, the
    parameters) are not counted."""

    def __init__(self):
        self.live: dict[int, list] = {}  # storage -> [bytes, tensors on it]
        self.now = self.peak = 0
        self.peak_at = ""

    def reset(self) -> None:
        self.live.clear()
        self.now = self.peak = 0
        self.peak_at = ""

    def allocated(self, t: torch.Tensor, where: str, view: bool = False) -> None:
        """``t`` returned by an op: a new buffer, or (``view``) one more tensor on a buffer (a view may
        outlive the tensor it was taken of)."""
        key = t.untyped_storage()._cdata
        entry = self.live.get(key)
        if entry is None and view:
            return  # a view of a buffer from before the step
        if entry is None:
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            if self.now > self.peak:
                self.peak, self.peak_at = self.now, where
        entry[1] += 1
        weakref.finalize(t, self._freed, key)

    def _freed(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= self.live.pop(key)[0]


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every torch op of the trace as a ``Launch`` (or nothing, for views and allocations), and
    the memory its outputs hold (``memory``)."""

    def __init__(self):
        super().__init__()
        self.launches: list[Launch] = []
        self.phase = "forward"
        self.memory = _Memory()

    def add(self, **kw) -> None:
        self.launches.append(Launch(phase=self.phase, **kw))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        ins = _tensors((args, kwargs))
        on_dev = bool(_on_device(ins))
        if name in SYNC_OPS and on_dev:
            self.add(name=f"aten.{name}", kind="sync", bytes=_distinct_bytes(_on_device(ins)),
                     shapes=_describe(ins))
            return _sync_result(name, args)
        out = func(*args, **kwargs)
        if not name.endswith("_"):  # an in-place op returns its argument
            for t in _on_device(_tensors(out)):
                self.memory.allocated(t, f"{self.phase}: aten.{name}", view=func.is_view)
        if func.namespace != "aten" or func.is_view or name in NO_KERNEL:
            return out
        outs = _tensors(out)
        if not on_dev and not _on_device(outs):
            return out  # host-side work on CPU tensors
        transfer = _transfer(name, args, out)
        if transfer:
            self.add(name=f"aten.{name}", kind=transfer, bytes=_distinct_bytes(outs + ins), shapes=_describe(ins))
            return out
        if name in GEMM_OPS:
            flops, rate = _gemm_flops(name, args)
            self.add(name=f"aten.{name}", kind="gemm", bytes=_distinct_bytes(_on_device(ins) + _on_device(outs)),
                     flops=flops, rate=rate, shapes=_describe(ins[:2] if name != "addmm" else ins[1:3]))
            return out
        self.add(name=f"aten.{name}", kind="memory", bytes=_aten_bytes(name, args, kwargs, out),
                 launches=MULTI_LAUNCH.get(name, 1), shapes=_describe(ins[:3]))
        return out


# --------------------------------------------------------------------------- Triton kernels
#: per kernel, arguments whose bytes the generic rule (each tensor argument once) misses: "rw" read and
#: written in place; "sparse" touched at one sector per slot of the kernel's first index argument
TRITON_BYTES = {
    "_wgrad_finish_kernel": {"y_ptr": "rw"},
    "_refold_outliers_kernel": {"q_ptr": "sparse", "e_ptr": "sparse"},
    # OCC's quantiles: a gather of the n-element sample from x, the histogram counted and zeroed again
    "_occ_quantile_kernel": {"x_ptr": "sample", "hist_ptr": "rw"},
    # an fp32 input's two-pass select: the sample gathered in each pass, the histograms read and zeroed
    "_occ_quantile32_hi_kernel": {"x_ptr": "sample", "hist_ptr": "rw"},
    "_occ_quantile32_lo_kernel": {"x_ptr": "sample", "hist_ptr": "rw"},
}


def _triton_bytes(kernel: str, bound: dict) -> int:
    rules = TRITON_BYTES.get(kernel, {})
    slots = next((v.numel() for k, v in bound.items() if isinstance(v, torch.Tensor) and "idx" in k), 0)
    seen, total = set(), 0
    for arg, t in bound.items():
        if not isinstance(t, torch.Tensor) or _key(t) in seen:
            continue
        seen.add(_key(t))
        rule = rules.get(arg)
        if rule == "sparse":
            total += min(_footprint(t), slots * SECTOR)
        elif rule == "sample":
            total += min(_footprint(t), int(bound["n"]) * SECTOR)
        else:
            total += _footprint(t) * (2 if rule == "rw" else 1)
    return total


def _record_triton(rec: _Recorder, jit_fn, args, grid, kwargs) -> None:
    """One Triton launch: name, grid and bytes; the kernel does not run."""
    bound = dict(zip(jit_fn.arg_names, args), **kwargs)
    if callable(grid):
        grid = grid(bound)
    grid = tuple(int(g) for g in grid)
    tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
    rec.add(name=f"triton.{jit_fn.fn.__name__}", kind="memory", bytes=_triton_bytes(jit_fn.fn.__name__, bound),
            grid=grid, shapes=_describe(tensors[:3]))


def _triton_patches(rec: _Recorder) -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) that record Triton launches instead of running them."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    def run(self, *args, grid, warmup=False, **kwargs):
        if not warmup:
            _record_triton(rec, self, args, grid, kwargs)

    def tuned_run(self, *args, **kwargs):  # the first config, no benchmarking
        grid = kwargs.pop("grid")
        kwargs.pop("warmup", None)
        _record_triton(rec, self.fn, args, grid, {**kwargs, **self.configs[0].all_kwargs()})

    return [(jit.JITFunction, "run", run), (interpreter.InterpretedFunction, "run", run),
            (autotuner.Autotuner, "run", tuned_run)]


# --------------------------------------------------------------------------- the modelled H200
_REAL_DEVICE = torch._C.TensorBase.device
_REAL_IS_CUDA = torch._C.TensorBase.is_cuda
_CUDA0 = torch.device("cuda", 0)
H200_NAME = "NVIDIA H200 (modelled by benchmarks/roofline.py)"


def _asked_from_outside_torch() -> bool:
    """Whether the code reading a tensor's device is the layer's (not torch's own, nor this tool's)."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return not (name == "torch" or name.startswith("torch.") or name == __name__)


def _device(self) -> torch.device:
    d = _REAL_DEVICE.__get__(self)
    return _CUDA0 if d.type == "meta" and _asked_from_outside_torch() else d


def _is_cuda(self) -> bool:
    return _REAL_IS_CUDA.__get__(self) or (_REAL_DEVICE.__get__(self).type == "meta" and _asked_from_outside_torch())


def _meta_for_cuda(v):
    if isinstance(v, torch.device) and v.type == "cuda":
        return torch.device("meta")
    if isinstance(v, str) and v.split(":")[0] == "cuda":
        return "meta"
    return v


class _CudaOnMeta(torch.overrides.TorchFunctionMode):
    """Tensors the layer creates on (or moves to) its CUDA device are created on meta."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {k: (_meta_for_cuda(v) if k == "device" else v) for k, v in (kwargs or {}).items()}
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_full):
            args = tuple(_meta_for_cuda(a) for a in args)
        elif func is torch.Tensor.cuda:
            return args[0].to("meta")
        return func(*args, **kwargs)


def _h200_routes():
    """Every ``_scaled_mm`` kind on ``_scaled_mm`` itself: the H200's cuBLASLt row-wise path takes every
    output dtype (``ops.capability`` probes this on a real device)."""
    from fp4lightning.ops import capability

    return capability.choose_gemm_route((9, 0), {k: None for k in capability.SCALED_MM_KINDS}, True)


def _library_patches(rec: _Recorder) -> list[tuple[object, str, object]]:
    from fp4lightning.ops import gemm

    def synchronize(*_a, **_k):
        rec.add(name="torch.cuda.synchronize", kind="sync", launches=0)

    patches = [
        (torch.Tensor, "device", property(_device)), (torch.Tensor, "is_cuda", property(_is_cuda)),
        (torch.cuda, "is_available", lambda: True), (torch.cuda, "is_bf16_supported", lambda *a, **k: True),
        (torch.cuda, "current_device", lambda: 0), (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)),
        (torch.cuda, "get_device_name", lambda *a, **k: H200_NAME), (torch.cuda, "synchronize", synchronize),
    ]
    if hasattr(gemm, "scaled_mm_routes"):
        routes = _h200_routes()
        patches.append((gemm, "scaled_mm_routes", lambda device: routes))
    # the kernels' wrappers pick launch parameters (and check devices) by whether Triton interprets
    for name, mod in list(sys.modules.items()):
        if name.startswith("fp4lightning.kernels") and isinstance(getattr(mod, "INTERPRET", None), bool):
            patches.append((mod, "INTERPRET", False))
    return patches


@contextlib.contextmanager
def _patched(patches):
    missing = object()
    saved = [(owner, attr, owner.__dict__.get(attr, missing) if isinstance(owner, type) else
              getattr(owner, attr, missing)) for owner, attr, _ in patches]
    try:
        for owner, attr, value in patches:
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            if old is missing:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


@contextlib.contextmanager
def modelled_h200():
    """Inside: the layer's code runs its CUDA path on meta tensors and every launch is recorded
    (yields the ``_Recorder``); everything patched is restored on exit, caches that saw the modelled
    device included."""
    from fp4lightning.numerics import occ
    from fp4lightning.ops import gemm

    for mod in ("fp4lightning.kernels.fp4_triton", "fp4lightning.kernels.scaled_mm"):
        importlib.import_module(mod)  # imported before the patches: their INTERPRET flags are patched
    rec = _Recorder()
    sample_cache = dict(getattr(occ, "_SAMPLE_INDEX", {}))
    old_backend = os.environ.get("FP4LIGHTNING_BACKEND")
    os.environ["FP4LIGHTNING_BACKEND"] = "scaled_mm"
    gemm.scaled_mm_unavailable.cache_clear()
    try:
        with _patched(_library_patches(rec) + _triton_patches(rec)), _CudaOnMeta():
            yield rec
    finally:
        gemm.scaled_mm_unavailable.cache_clear()
        if old_backend is None:
            os.environ.pop("FP4LIGHTNING_BACKEND", None)
        else:
            os.environ["FP4LIGHTNING_BACKEND"] = old_backend
        if hasattr(occ, "_SAMPLE_INDEX"):
            occ._SAMPLE_INDEX.clear()
            occ._SAMPLE_INDEX.update(sample_cache)


# --------------------------------------------------------------------------- the trace
def _layer_step(rec: _Recorder, preset: str, tokens: int, in_features: int, out_features: int,
                bias: bool, input_dtype: torch.dtype = torch.bfloat16) -> None:
    """One forward + backward of the layer in a bf16-autocast model, recorded by ``rec``."""
    from fp4lightning.config import FP4Config
    from fp4lightning.nn.linear import FP4Linear

    x = torch.empty(tokens, in_features, dtype=input_dtype, device="meta", requires_grad=True)
    dy = torch.empty(tokens, out_features, dtype=torch.bfloat16, device="meta")
    if preset == "bf16":
        layer = torch.nn.Linear(in_features, out_features, bias=bias, device="meta")
    else:
        layer = FP4Linear(in_features, out_features, bias=bias, device="meta", config=FP4Config.from_preset(preset))
    rec.launches.clear()
    rec.memory.reset()
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    kept: dict[int, int] = {}  # buffers from before the step that the backward keeps alive (the input)

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in rec.memory.live:
            kept[key] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cuda", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with rec:
            rec.phase = "forward"
            if preset == "bf16":  # autocast's casts, written out: autocast does not act on meta tensors
                y = torch.nn.functional.linear(x.to(torch.bfloat16), layer.weight.to(torch.bfloat16),
                                               layer.bias.to(torch.bfloat16) if bias else None)
            else:
                y = layer(x)
    rec.held_after_forward = rec.memory.now - y.untyped_storage().nbytes() + sum(kept.values())
    with rec:
        rec.phase = "backward"
        # the autograd engine itself: ``y.backward`` would run inside _CudaOnMeta's handler, where the
        # mode is off for everything the backward calls
        torch.autograd.Variable._execution_engine.run_backward(
            (y,), (dy,), False, False, (), allow_unreachable=True, accumulate_grad=True)


def trace_layer(preset: str, tokens: int = TOKENS, in_features: int = 4096, out_features: int = 4096,
                bias: bool = True, input_dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The launches of one forward + backward of a linear layer (tokens x in_features -> out_features)
    inside a bf16-autocast model, on the modelled H200: ``preset`` is ``bf16`` (``nn.Linear``), an
    ``FP4Config`` preset (``FP4Linear`` on the CUDA path, weight quantized in the forward), or
    ``torchao-float8`` (modelled, not traced: ``torchao_float8_rowwise``). ``input_dtype``: bf16, as
    the LLaMA models' o and down projections get it, or fp32, as q, k, v, gate and up get it under bf16
    autocast (the residual stream and the RMSNorm before them are fp32). Nothing runs on any device;
    at any shape this takes well under a second."""
    if preset == "torchao-float8":
        if input_dtype != torch.bfloat16:
            raise ValueError("roofline: torchao-float8 is modelled for a bf16 input only")
        return torchao_float8_rowwise(tokens, in_features, out_features, bias)
    with modelled_h200() as rec:
        for _ in range(2):  # the second step is kept: per-shape caches (OCC's sample index) are warm
            _layer_step(rec, preset, tokens, in_features, out_features, bias, input_dtype)
    return list(rec.launches)


def layer_memory(preset: str, tokens: int = TOKENS, in_features: int = 4096, out_features: int = 4096,
                 bias: bool = True, input_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Device memory of the traced forward + backward (``trace_layer``'s layer), from the buffers its ops
    allocate: ``held_mb``, what the forward leaves for the backward besides its output (what it saves,
    the input included where it is saved, as ``nn.Linear`` saves it; for ``bf16`` autocast's bf16
    weight among them; the fp32 parameters, which exist anyway, not counted); ``peak_mb``, the most the
    step's own ops hold at once (the output and the gradients included; the input and the output
    gradient not), and the op that reached it. No allocator is modelled (no caching, no fragmentation)."""
    if preset == "torchao-float8":
        raise ValueError("layer_memory: torchao-float8 is modelled from a kernel list, not traced; its memory "
                         "is not modelled")
    with modelled_h200() as rec:
        for _ in range(2):
            _layer_step(rec, preset, tokens, in_features, out_features, bias, input_dtype)
        return {"held_mb": round(rec.held_after_forward / 1e6, 2), "peak_mb": round(rec.memory.peak / 1e6, 2),
                "peak_at": rec.memory.peak_at}


def count_launches(launches: list[Launch]) -> int:
    """CUDA kernel launches (host-to-device copies and a device-to-host copy included)."""
    return sum(x.launches for x in launches)


def count_host_syncs(launches: list[Launch]) -> int:
    """Points where the host waits for the device."""
    return sum(1 for x in launches if x.kind == "sync")


def non_gemm_bytes(launches: list[Launch]) -> int:
    """Bytes moved by every launch but the GeMMs."""
    return sum(x.bytes for x in launches if x.kind != "gemm")


def predicted_s(launches: list[Launch]) -> float:
    return sum(x.time_s for x in launches)


# --------------------------------------------------------------------------- torchao float8, modelled
def torchao_float8_rowwise(tokens: int, in_features: int, out_features: int, bias: bool = True) -> list[Launch]:
    """torchao row-wise float8 training of the same layer, from torchao's own kernel list for the
    ``rowwise`` recipe (``torchao/testing/training/roofline_utils.py``, no fusion with the previous op),
    with the weight read in fp32 (the master weight of a bf16-autocast model) and autograd's cast of
    the bf16 weight gradient to fp32. A bias is added as ``Float8Linear`` adds it (``output +
    bias.to(output.dtype)``: a cast and an add; backward: dY summed over tokens, cast to fp32)."""
    m, k, n = tokens, in_features, out_features
    bf16, fp8, w = 2, 1, 4
    casts = [
        ("forward", "input: x -> x_fp8 rows, x^T bf16", m * k * (bf16 + fp8 + bf16)),
        ("forward", "weight: W -> W_fp8 rows", n * k * (w + fp8)),
        ("backward", "weight: W -> W^T", n * k * (w + w)),
        ("backward", "weight: W^T -> W^T_fp8 rows", n * k * (w + fp8)),
        ("backward", "input: x^T -> x^T_fp8 rows", m * k * (bf16 + fp8)),
        ("backward", "dY: dY -> dY_fp8 rows, dY^T bf16", m * n * (bf16 + fp8 + bf16)),
        ("backward", "dY: dY^T -> dY^T_fp8 rows", m * n * (bf16 + fp8)),
    ]
    out = [Launch(name=f"torchao cast ({what})", kind="memory", phase=phase, bytes=b) for phase, what, b in casts]
    gemms = [("forward", "y", m, k, n), ("backward", "dx", m, n, k), ("backward", "dW", n, m, k)]
    for phase, what, a, r, c in gemms:  # (a x r) @ (r x c): FP8 operands, bf16 output
        out.append(Launch(name=f"torchao _scaled_mm ({what})", kind="gemm", phase=phase,
                          bytes=(a * r + r * c) * fp8 + a * c * bf16, flops=2 * a * r * c, rate=FP8_RATE))
    out.append(Launch(name="autograd: dW bf16 -> fp32", kind="memory", phase="backward", bytes=n * k * (bf16 + w)))
    if bias:
        out += [Launch(name="bias cast", kind="memory", phase="forward", bytes=n * (w + bf16)),
                Launch(name="output + bias", kind="memory", phase="forward", bytes=2 * m * n * bf16 + n * bf16),
                Launch(name="dbias = dY.sum(0)", kind="memory", phase="backward", bytes=m * n * bf16 + n * bf16),
                Launch(name="autograd: dbias bf16 -> fp32", kind="memory", phase="backward", bytes=n * (bf16 + w))]
    return out


# --------------------------------------------------------------------------- the floor
def w4a4_direct_floor(tokens: int, in_features: int, out_features: int, bias: bool = True) -> list[Launch]:
    """The fewest launches and bytes that any implementation of ``w4a4-direct``'s numerics on the
    vendor's FP8 GeMMs can have, in this model: a lower bound for the traced layer, not a design.

    The numerics fix what must move. A (per-token absmax) and W (per-channel absmax) are each read once
    and written as both E4M3 layouts the GeMMs take (the forward's operand and wgrad's / dgrad's
    transposed one: Hopper's FP8 GeMMs read both operands K-major), in one launch for the two tensors.
    dY is read twice: its dgrad operand (per-token scale, W's channel scale folded in) in one pass, and
    its wgrad operand (per-output-channel scale of dY times A's token scale) in a second launch, because
    each of that operand's values waits on the absmax of a whole column of dY, known only after every
    row is read, and no grid-wide barrier exists inside one launch. The scales, the bias cast and the
    bias gradient ride in those passes. The three GeMMs are the traced ones."""
    m, k, n = tokens, in_features, out_features
    bf16, fp8, f32 = 2, 1, 4
    quantize = (m * k * (bf16 + 2 * fp8) + m * f32 + n * k * (f32 + 2 * fp8) + n * f32
                + (n * (f32 + bf16) if bias else 0))
    rows = m * n * (bf16 + fp8) + m * f32 + n * f32 * (3 if bias else 2)  # W's scale in; amax, dbias out
    cols = m * n * (bf16 + fp8) + m * f32 + n * f32 * 2  # A's scale and the column amax in; scale out
    gemms = [x for x in trace_layer("w4a4-direct", m, k, n, bias) if x.kind == "gemm"]
    return ([Launch(name="floor: quantize A and W (both layouts each)", kind="memory", phase="forward",
                    bytes=quantize), gemms[0],
             Launch(name="floor: dY row pass (dgrad operand)", kind="memory", phase="backward", bytes=rows),
             Launch(name="floor: dY column pass (wgrad operand)", kind="memory", phase="backward", bytes=cols)]
            + gemms[1:])


# --------------------------------------------------------------------------- report
def summarize(launches: list[Launch]) -> dict:
    return {"launches": count_launches(launches), "pred_ms": round(predicted_s(launches) * 1e3, 4),
            "host_syncs": count_host_syncs(launches), "bytes": sum(x.bytes for x in launches),
            "bytes_outside_gemms": non_gemm_bytes(launches), "gemms": sum(x.kind == "gemm" for x in launches)}


def model(tokens: int = TOKENS, shapes=SHAPES_7B, presets=PRESETS, bias: bool = True,
          input_dtype: torch.dtype = torch.bfloat16) -> dict:
    """``{"shapes": {"KxN": {preset: summary, ...}}}`` with each preset's predicted time against bf16's."""
    out = {}
    for k, n in shapes:
        row = {p: summarize(trace_layer(p, tokens, k, n, bias, input_dtype)) for p in presets}
        for p in presets:
            if p != "torchao-float8":
                row[p].update(layer_memory(p, tokens, k, n, bias, input_dtype))
        base = row.get("bf16", {}).get("pred_ms")
        for entry in row.values():
            if base:
                entry["x_bf16"] = round(entry["pred_ms"] / base, 3)
        out[f"{k}x{n}"] = row
    return {"shapes": out}


def floor_table(tokens: int, shapes, bias: bool = True) -> str:
    """``w4a4_direct_floor`` against the traced ``w4a4-direct``, both as multiples of bf16's time."""
    lines = ["| shape (in x out) | launches | MB outside GeMMs | predicted ms | x bf16 | traced x bf16 |",
             "|---|---|---|---|---|---|"]
    for k, n in shapes:
        floor, base = w4a4_direct_floor(tokens, k, n, bias), predicted_s(trace_layer("bf16", tokens, k, n, bias))
        traced = predicted_s(trace_layer("w4a4-direct", tokens, k, n, bias))
        lines.append(f"| {k}x{n} | {count_launches(floor)} | {non_gemm_bytes(floor) / 1e6:.0f} | "
                     f"{predicted_s(floor) * 1e3:.3f} | {predicted_s(floor) / base:.3f} | {traced / base:.3f} |")
    return "\n".join(lines)


def launch_table(launches: list[Launch]) -> str:
    lines = ["| phase | kernel | grid | operands | launches | MB | GFLOP | predicted us |",
             "|---|---|---|---|---|---|---|---|"]
    for x in launches:
        grid = "x".join(map(str, x.grid)) if x.grid else ""
        lines.append(f"| {x.phase} | {x.name}{' (host sync)' if x.kind == 'sync' else ''} | {grid} | {x.shapes} | "
                     f"{x.launches} | {x.bytes / 1e6:.2f} | {x.flops / 1e9:.1f} | {x.time_s * 1e6:.1f} |")
    return "\n".join(lines)


def totals_table(result: dict) -> str:
    lines = ["| shape (in x out) | preset | launches | host syncs | MB outside GeMMs | predicted ms | x bf16 | "
             "MB held for the backward | peak MB |", "|---|---|---|---|---|---|---|---|---|"]
    for shape, row in result["shapes"].items():
        for preset, e in row.items():
            ratio = e.get("x_bf16", float("nan"))
            held, peak = (f"{e[key]:.0f}" if key in e else "n/a" for key in ("held_mb", "peak_mb"))
            lines.append(f"| {shape} | {preset} | {e['launches']} | {e['host_syncs']} | "
                         f"{e['bytes_outside_gemms'] / 1e6:.0f} | {e['pred_ms']:.3f} | {ratio:.2f} | {held} | {peak} |")
    return "\n".join(lines)


def _parse_shapes(p: argparse.ArgumentParser, text: str) -> tuple:
    """``--shapes`` as ((in, out), ...), or one line naming the problem (exit status 2)."""
    from fp4lightning.nn.linear import check_fp4_shape

    try:
        shapes = tuple(tuple(int(v) for v in s.split("x")) for s in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        p.error(f"--shapes {text!r}: give IN x OUT pairs, comma-separated, such as 4096x11008,11008x4096")
    for k, n in shapes:
        why = check_fp4_shape(k, n)
        if why:
            p.error(f"--shapes {k}x{n}: FP4Linear cannot take it ({why})")
    return shapes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print the totals as JSON only")
    p.add_argument("--tokens", type=int, default=TOKENS, help=f"tokens per step (default {TOKENS})")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES_7B),
                   help="IN x OUT pairs, comma-separated (default: the three 7B shapes)")
    p.add_argument("--preset", action="append", choices=PRESETS, help="only these presets (repeatable)")
    p.add_argument("--no-bias", action="store_true", help="layers without a bias (the LLaMA models' linears)")
    p.add_argument("--input-dtype", choices=("bf16", "fp32"), default="bf16",
                   help="the layer's input: bf16 (default; the o and down projections) or fp32 (q, k, v, gate "
                        "and up under bf16 autocast; torchao float8 is not modelled for it)")
    args = p.parse_args(argv)
    input_dtype = torch.float32 if args.input_dtype == "fp32" else torch.bfloat16
    if args.tokens < 1:
        p.error(f"--tokens {args.tokens}: give a positive token count")
    shapes = _parse_shapes(p, args.shapes)
    presets = tuple(args.preset) if args.preset else PRESETS
    if input_dtype != torch.bfloat16:
        presets = tuple(x for x in presets if x != "torchao-float8")
    if "bf16" not in presets:
        presets = ("bf16",) + presets  # the ratios' reference
    result = model(args.tokens, shapes, presets, bias=not args.no_bias, input_dtype=input_dtype)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Predicted H200 (model, not a measurement): HBM {HBM_BW / 1e12:.1f} TB/s, bf16 GeMM "
          f"{BF16_RATE / 1e12:.0f} TFLOP/s, FP8 GeMM {FP8_RATE / 1e12:.0f} TFLOP/s, {LAUNCH_S * 1e6:.0f} us a launch; "
          f"{args.tokens} tokens, {args.input_dtype} input, bf16 autocast, {'no bias' if args.no_bias else 'with a bias'}\n")
    for k, n in shapes:
        for preset in presets:
            print(f"## {preset}, {args.tokens} x {k} -> {n}\n")
            print(launch_table(trace_layer(preset, args.tokens, k, n, not args.no_bias, input_dtype)) + "\n")
    print(totals_table(result))
    if "w4a4-direct" in presets and input_dtype == torch.bfloat16:  # the floor is counted for a bf16 input
        print("\nThe floor of `w4a4-direct` (the fewest launches and bytes its numerics allow on the vendor's FP8 "
              "GeMMs; `w4a4_direct_floor`):\n")
        print(floor_table(args.tokens, shapes, not args.no_bias))
    return 0


if __name__ == "__main__":
    sys.exit(main())
