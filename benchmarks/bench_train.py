"""A whole training step of a recipe's model: bf16, fp32, torchao float8 and FP4, side by side in one run.

For the recipe's model (``model.*``), optimizer (``optimizer.*``: the LightningModule's own AdamW
groups, the same for every row) and sequence length, one training step as ``fp4lightning train``
runs it, outside Lightning: forward and loss under the precision's autocast, backward, the
non-finite check, gradient clipping (``optimizer.grad_clip``), the optimizer and LR-scheduler step.
Rows (``--precisions``):

* ``bf16-mixed``: Lightning's bf16 autocast (``trainer.precision=bf16-mixed``); on a CPU without
  native bf16 GeMMs its linear layers run as training runs them there
  (``fp4lightning.numerics.cpu_bf16.emulate_bf16_linears``: fp32 kernels on bf16-rounded operands);
* ``torchao-float8``: torchao's ``convert_to_float8_training`` with the ``rowwise`` recipe (CUDA,
  sm_89+ only; the output head stays bf16, as FP4's); eager like the other rows, or with
  ``--compile-torchao`` the whole model under ``torch.compile`` as torchao recommends (that row then
  has no time split);
* ``fp4``: the recipe's FP4 configuration (``fp4.preset`` + overrides; ``paper`` in the recipes),
  converted and autocast by ``FP4Precision`` as in training;
* ``w4a4-direct``: the ``w4a4-direct`` preset (no DGE, no OCC);
* ``fp32``: no autocast, fp32 weights and GeMMs (last by default: on CUDA the micro-batch search
  then starts from what the other rows fitted).

**The baseline.** ``bf16-mixed`` and ``fp32`` are the high-precision rows; the ``x baseline``
column and the closing ratio line divide every row's tokens/s by the faster of the two (by median
tokens/s), named in the header with why: whether bf16 GeMMs are native on this device (the CPU's
features as torch and ``/proc/cpuinfo`` see them) or emulated. Where bf16 is slow (a CPU without
bf16 kernels), fp32 is the fair baseline, not a slow bf16.

``--compile`` compiles each decoder block of every row, as the recipe key ``trainer.compile`` does
(``fp4lightning.models.llama.compile_blocks``: RMSNorm, RoPE, SwiGLU and the residual adds fuse, each
FP4Linear is one graph break), the baselines included so that the rows stay comparable; the torchao
row with ``--compile-torchao`` keeps its whole-model compile. The two warm-up steps include the
compile. A compiled row has no time split and no attention-kernel probe (their hooks would break its
graphs). The recipe's own ``trainer.compile`` is not read here: without ``--compile`` every row runs
eagerly; with it, every row's blocks compile under the recipe's ``trainer.compile_memory_budget``
(``trainer.compile_memory_budget=0.5`` on the command line).

Each row starts from the same initial weights (the recipe's seed) and batch: random tokens, or the
first windows of the recipe's prepared data folder when there is one. On CPU the rows' timed steps
interleave (one step of each row in turn), so machine noise hits all rows alike. Printed per row:
step time (min / median / max of ``--steps`` timed steps after two warm-up steps; the median is the
lower median for an even count, a step that was measured), tokens/s and MFU of the median step
(model FLOPs per step, the PaLM count of ``fp4lightning.train.throughput.flops_per_token``, over the
step time and the device's dense bf16 peak; FP4 is simulated, so bf16's peak is the yardstick for
every row), peak memory (on CUDA ``torch.cuda.max_memory_allocated``; on CPU the analytic sum of
parameters, gradients, optimizer state and the bytes autograd saves for backward), and where the
median step's time goes: the decoder's linear layers (FP4Linear in the fp4 rows, Float8Linear in
torchao's, Linear in the baselines), attention (RoPE + ``scaled_dot_product_attention``), the rest of
forward and backward (embedding, norms, MLP activation, output head, loss), the optimizer
(non-finite check, clipping, AdamW) and what none of them covers (``unattributed``), so that the
parts sum to the step. The split is measured inside the timed steps themselves, by forward and
backward hooks on those modules: on CPU they read the clock (everything is attributed), on CUDA they
record CUDA events read after the step (no synchronisation inside the step; ``unattributed`` is then
the step's wall time the device's events do not span, e.g. the first launch).

Micro-batch: ``--micro-batch``; by default on CUDA the largest that fits, halving from
``--start-micro-batch`` on out-of-memory (a row that needs a smaller one than the rows before it says
so), and on CPU the recipe's ``data.micro_batch_size`` capped at 4096 tokens per step.

    .venv/bin/python benchmarks/bench_train.py [--recipe recipes/tiny.yaml] [--steps 5] [--micro-batch B]
        [--seq T] [--precisions bf16-mixed,fp32,fp4] [--peak-tflops X] [--compile] [--json PATH] [key=value ...]

``key=value`` arguments override the recipe as on ``fp4lightning train`` (e.g. ``optimizer.states=fp32``).
``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` here, as for every user of the package (``import
fp4lightning`` sets it before torch is imported; a value already set is kept).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fp4lightning  # noqa: E402,F401  # before torch: sets OMP_WAIT_POLICY's default (fp4lightning/__init__.py)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from fp4lightning.config import FP4Config  # noqa: E402
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_gemm, emulate_bf16_linears  # noqa: E402
from fp4lightning.errors import UsageError  # noqa: E402
from fp4lightning.experiments.occ_fidelity import saved_tensor_bytes  # noqa: E402
from fp4lightning.train.throughput import flops_per_token, peak_tflops  # noqa: E402
from fp4lightning.models.llama import Attention, Llama, compile_blocks  # noqa: E402
from fp4lightning.lightning.nonfinite import detect_nonfinite  # noqa: E402
from fp4lightning.lightning.optim import state_bytes_per_param  # noqa: E402
from fp4lightning.train.recipe import load_recipe  # noqa: E402

ROWS = ("bf16-mixed", "torchao-float8", "fp4", "w4a4-direct", "fp32")
#: the rows every ratio is taken against: the faster of the two (by median tokens/s)
HIGH_PRECISION = ("bf16-mixed", "fp32")
#: where a step's time goes, measured inside the timed steps by module hooks
PARTS = ("linears", "attention", "other_fwd_bwd", "optimizer")
#: the parts plus what none of them covers: they sum to the step time
SPLIT = PARTS + ("unattributed",)
#: CPU default: at most this many tokens per micro-batch (a step of the 1.3B model takes minutes on CPU)
CPU_TOKENS = 4096
WARMUP = 2  # the first step creates the optimizer state (and compiles: --compile, and the CPU path's passes)


def _batch(cfg, vocab: int, b: int, t: int, dev: torch.device):
    """``(b, t + 1)`` tokens: the first windows of the recipe's prepared data, else random tokens."""
    if os.path.exists(os.path.join(cfg.data.dir, "meta.json")):
        from fp4lightning.data import PreparedData

        data = PreparedData(cfg.data.dir)
        arr = data.shards("train")[0]
        if data.tokenizer.vocab_size <= vocab and len(arr) >= b * (t + 1):
            x = torch.from_numpy(arr[: b * (t + 1)].astype("int64")).reshape(b, t + 1)
            return x.to(dev), f"{cfg.data.dir} (first windows)"
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, t + 1), generator=g).to(dev), "random tokens"


def torchao_float8_unavailable(dev: torch.device) -> str | None:
    """Why torchao's float8 training cannot run on ``dev``, or None when it can."""
    if dev.type != "cuda" or torch.cuda.get_device_capability(dev) < (8, 9):
        return "needs an FP8 GPU"
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # not installed, or built for another torch
        return f"torchao.float8 does not import ({type(e).__name__}: {e})"
    return None


def _is_decoder_linear(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn != "lm_head" and not fqn.endswith(".lm_head")


class Row:
    """One precision's model, optimizer, autocast and step.

    ``compile_backend``: compile each decoder block with this ``torch.compile`` backend (``--compile``:
    ``"inductor"``; tests: ``"aot_eager"``), None for eager blocks. ``compiled`` says what ran compiled:
    ``"model"`` (torchao's row with ``compile_torchao``), ``"blocks"`` or None."""

    def __init__(self, name: str, cfg, dev: torch.device, micro_batch: int, seq: int, compile_torchao: bool = False,
                 compile_backend=None):
        from fp4lightning.train.run import make_module
        from fp4lightning.lightning.precision import FP4Precision

        self.name, self.dev, self.micro_batch, self.seq = name, dev, micro_batch, seq
        llama = cfg.llama_config()
        torch.manual_seed(cfg.seed)
        with torch.device(dev):
            model = Llama(llama)  # the same initial weights for every row
        if name in ("fp4", "w4a4-direct"):
            fp4 = cfg.fp4_config if name == "fp4" else FP4Config.from_preset("w4a4-direct")
            plugin = FP4Precision(fp4, device=dev.type)
            plugin.convert_module(model)  # FP4Linear in place; the head stays bf16 (emulated on CPU where needed)
            self.autocast = plugin.forward_context
            self.preset = cfg.fp4.preset if name == "fp4" else "w4a4-direct"
        elif name == "fp32":
            self.autocast = contextlib.nullcontext  # fp32 weights, activations and GeMMs
            self.preset = None
        else:
            if name == "torchao-float8":
                import logging

                logging.getLogger("torchao").setLevel(logging.ERROR)
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                convert_to_float8_training(
                    model, config=Float8LinearConfig.from_recipe_name("rowwise"),
                    module_filter_fn=lambda m, fqn: (_is_decoder_linear(m, fqn) and m.in_features % 16 == 0
                                                     and m.out_features % 16 == 0))
                if compile_torchao:
                    model.compile()
            emulate_bf16_linears(model, dev)  # as LlamaLightningModule.configure_model on CPUs without bf16 GeMMs
            self.autocast = lambda: torch.autocast(dev.type, dtype=torch.bfloat16)  # Lightning's bf16-mixed
            self.preset = None
        self.compiled = "model" if name == "torchao-float8" and compile_torchao else None
        if compile_backend is not None and self.compiled is None:
            # as LlamaLightningModule.configure_model (trainer.compile, trainer.compile_memory_budget)
            compile_blocks(model, backend=compile_backend, memory_budget=cfg.trainer.compile_memory_budget)
            self.compiled = "blocks"
        # the LightningModule's optimizer (AdamW groups, optimizer.states) and schedule, outside Lightning
        module = make_module(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, precision="bf16-mixed")))
        module.model = model
        opt_cfg = module.configure_optimizers()
        self.module, self.model = module, model
        self.opt, self.sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
        self.clip = cfg.optimizer.grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.n_params = model.num_params()
        self.times: list[float] = []  # seconds of each timed step
        self.splits: list[dict[str, float]] = []  # ms per part of each timed step (eager rows)
        self.last_split: dict[str, float] | None = None
        self.x = None

    def forward_backward(self) -> None:
        with self.autocast():
            loss = self.module._loss(self.x)  # the training step's loss
        loss.backward()

    def optimizer_step(self) -> None:
        # the order of FP4Precision.optimizer_step / NonFiniteGuard + Lightning's clipping
        found_inf = detect_nonfinite(self.opt)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        if not found_inf:
            self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> float:
        """One training step; seconds. An eager row also splits this step's time (``last_split``)."""
        tl = None if self.compiled else _Timeline(self.dev)  # hooks would break a compiled graph
        handles = _hook_parts(self.model, tl) if tl else []
        try:
            _sync(self.dev)
            t0 = time.perf_counter()
            if tl:
                tl.start(t0)
            self.forward_backward()
            if tl:
                tl.push("optimizer")
            self.optimizer_step()
            if tl:
                tl.pop("optimizer")
                tl.end()
            _sync(self.dev)
            t1 = time.perf_counter()
        finally:
            for h in handles:
                h.remove()
        self.last_split = tl.split_ms(t1) if tl else None
        return t1 - t0

    def timed_step(self) -> None:
        """A step whose time (and split) count towards the row's figures."""
        self.times.append(self.step())
        if self.last_split is not None:
            self.splits.append(self.last_split)

    def free(self) -> None:
        self.opt.state.clear()
        self.module = self.model = self.opt = self.sched = self.params = self.x = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Timeline:
    """Time between hook events inside one step, charged to the innermost open part (nested modules:
    an ``Attention`` is charged its own time, its projections go to ``linears``).

    On CPU each event reads the clock: the parts cover the step from its start to its end. On CUDA
    each event records a CUDA event (no synchronisation inside the step) and the intervals between
    them are read once the step has synchronised; ``unattributed`` is the wall time they do not span.
    """

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.acc = dict.fromkeys(PARTS, 0.0)
        self.stack = ["other_fwd_bwd"]
        self.t0 = self.t = 0.0
        self.events: list[tuple[str | None, torch.cuda.Event]] = []  # (part of the interval ending here, event)

    def start(self, t0: float) -> None:
        self.t0 = self.t = t0
        if self.cuda:
            self._record(None)

    def _record(self, part: str | None) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.events.append((part, ev))

    def _mark(self) -> None:
        if self.cuda:
            self._record(self.stack[-1])
            return
        now = time.perf_counter()
        self.acc[self.stack[-1]] += now - self.t
        self.t = now

    def push(self, part: str) -> None:
        self._mark()
        self.stack.append(part)

    def pop(self, part: str) -> None:
        self._mark()
        for i in range(len(self.stack) - 1, 0, -1):  # the last open one (backward may interleave siblings)
            if self.stack[i] == part:
                del self.stack[i]
                break

    def end(self) -> None:
        """The step's last event (before its final synchronisation)."""
        if self.cuda:
            self._record(self.stack[-1])

    def split_ms(self, t1: float) -> dict[str, float]:
        """Milliseconds per part of the step that ended (synchronised) at ``t1``, summing to ``t1 - t0``."""
        if self.cuda:
            for (_, a), (part, b) in zip(self.events, self.events[1:]):
                self.acc[part] += a.elapsed_time(b) / 1e3
        else:
            self.acc[self.stack[-1]] += t1 - self.t  # the final synchronisation (a no-op on CPU)
            self.t = t1
        out = {k: 1e3 * v for k, v in self.acc.items()}
        out["unattributed"] = 1e3 * (t1 - self.t0) - sum(out.values())
        return out


def _hook_parts(model: nn.Module, tl: _Timeline) -> list:
    """Forward and backward hooks that tell ``tl`` when a decoder linear layer or an attention starts
    and ends; the handles, to remove after the step."""
    handles = []
    for fqn, m in model.named_modules():
        part = "linears" if _is_decoder_linear(m, fqn) else "attention" if isinstance(m, Attention) else None
        if part is None:
            continue
        handles += [
            m.register_forward_pre_hook(lambda *a, p=part: tl.push(p)),
            m.register_forward_hook(lambda *a, p=part: tl.pop(p)),
            m.register_full_backward_pre_hook(lambda *a, p=part: tl.push(p)),
            m.register_full_backward_hook(lambda *a, p=part: tl.pop(p)),
        ]
    return handles


def attention_op(row: Row) -> str:
    """The aten kernel ``scaled_dot_product_attention`` dispatched to in the model's forward
    (flash / cuDNN / memory-efficient / math on CUDA), as the dispatcher sees it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "attention" in name or name.startswith("_flash") or name.startswith("_efficient"):
                seen.add(f"aten::{name}")
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), row.autocast(), Record():
        row.model(row.x[:1, :-1])
    return ", ".join(sorted(seen)) or "unknown"


def _analytic_memory(row: Row) -> tuple[int, int, float]:
    """(bytes: params + grads + optimizer state + saved activations, saved activation bytes, state bytes/param)."""
    def run():
        with row.autocast():
            row.module._loss(row.x)
    saved = saved_tensor_bytes(row.model, run)
    param_b = sum(p.numel() * p.element_size() for p in row.params)
    bpp = state_bytes_per_param(row.opt)
    return param_b * 2 + int(bpp * row.n_params) + saved, saved, bpp


def _build(name: str, cfg, dev: torch.device, micro_batch: int, seq: int, search: bool,
           compile_torchao: bool = False, compile_backend=None) -> Row:
    """The row, warmed up; on CUDA with ``search``, halving the micro-batch on out-of-memory."""
    while True:
        row = oom = None
        try:
            row = Row(name, cfg, dev, micro_batch, seq, compile_torchao, compile_backend)
            row.x, row.source = _batch(cfg, cfg.llama_config().vocab_size, micro_batch, seq, dev)
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(WARMUP):
                row.step()
            return row
        except torch.OutOfMemoryError as e:
            if not search or micro_batch == 1:
                raise
            oom = str(e).splitlines()[0]
        if row is not None:
            row.free()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"# {name}: micro-batch {micro_batch} does not fit ({oom}); trying {micro_batch // 2}", flush=True)
        micro_batch //= 2


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def cpu_features() -> str:
    """This CPU as the bf16 question sees it: its name, torch's ATen kernel level and the ISA flags
    that decide native bf16 GeMMs (``/proc/cpuinfo``; flags omitted where it is not readable)."""
    import platform

    name, flags = "", None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    out = f"{name or platform.processor() or 'CPU'}, ATen {torch.backends.cpu.get_cpu_capability()}"
    if flags is not None:
        out += ", " + " ".join(f"{f}{'' if f in flags else ' absent'}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))
    return out


def bf16_gemms(dev: torch.device) -> str:
    """How the bf16-mixed row's GeMMs run on ``dev``, and why."""
    if dev.type == "cuda":
        return f"native ({torch.cuda.get_device_name(dev)})"
    mode = os.environ.get("FP4LIGHTNING_CPU_BF16_GEMM", "auto") or "auto"
    if emulate_bf16_gemm(dev):
        how = ("emulated: emulate_bf16_linears, fp32 kernels on bf16-rounded operands, as training runs them "
               f"here (FP4LIGHTNING_CPU_BF16_GEMM={mode}")
        how += "; torch has no native bf16 GeMM on this CPU)" if mode == "auto" else ")"
    else:
        how = f"native: oneDNN bf16 kernels (FP4LIGHTNING_CPU_BF16_GEMM={mode})"
    return f"{how}; CPU: {cpu_features()}"


def choose_baseline(results: dict[str, dict]) -> tuple[str | None, str]:
    """(the row every ratio is taken against, why): the fastest high-precision row by median tokens/s."""
    have = {n: results[n]["tokens_per_s"] for n in HIGH_PRECISION if "tokens_per_s" in results.get(n, {})}
    if not have:
        return None, f"none: no high-precision row ({' or '.join(HIGH_PRECISION)}) in --precisions, so no ratios"
    base = max(have, key=have.get)
    if len(have) == 1:
        other = next(n for n in HIGH_PRECISION if n != base)
        return base, f"{base}, the only high-precision row run (add {other} to --precisions to take the faster)"
    figures = ", ".join(f"{n} {v:.0f}" for n, v in have.items())
    return base, f"{base}, the faster high-precision row (median tokens/s: {figures})"


def add_ratios(results: dict[str, dict], base: str | None) -> None:
    """Each measured row's tokens/s over the baseline's (``vs_baseline``: medians), and the range of
    the per-step ratios (``vs_baseline_steps``: step i of the row against step i of the baseline)."""
    if base is None:
        return
    b = results[base]
    b_tps = [b["micro_batch"] * b["seq_len"] / (ms / 1e3) for ms in b["steps_ms"]]
    for r in results.values():
        if "tokens_per_s" not in r:
            continue
        r["vs_baseline"] = r["tokens_per_s"] / b["tokens_per_s"]
        tps = [r["micro_batch"] * r["seq_len"] / (ms / 1e3) for ms in r["steps_ms"]]
        per_step = [x / y for x, y in zip(tps, b_tps)]
        r["vs_baseline_steps"] = [min(per_step), max(per_step)]


def _parse(argv) -> tuple[argparse.Namespace, object, list[str], int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="recipes/tiny.yaml", help="the recipe whose model and optimizer to time")
    ap.add_argument("--steps", "--iters", type=int, default=5, help="timed steps per row (after 2 warm-up steps)")
    ap.add_argument("--micro-batch", "--batch", type=int, default=None,
                    help="sequences per step (default: CUDA the largest that fits, CPU see above)")
    ap.add_argument("--start-micro-batch", type=int, default=64, help="CUDA: first micro-batch tried")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the recipe's data.seq_len)")
    ap.add_argument("--precisions", default=",".join(ROWS), help=f"comma-separated rows out of {', '.join(ROWS)}")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak TFLOP/s of the device for MFU (default: known GPUs; none on CPU)")
    ap.add_argument("--compile-torchao", action="store_true",
                    help="torch.compile the torchao-float8 row's model (torchao's recommended use)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each decoder block of every row, as the recipe key trainer.compile does")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    args = ap.parse_args(argv)
    cfg = load_recipe(args.recipe, args.overrides)
    rows = [r.strip() for r in args.precisions.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad or not rows:
        raise UsageError(f"--precisions: {bad or 'none given'} not among {', '.join(ROWS)}")
    llama = cfg.llama_config()
    seq = args.seq or cfg.data.seq_len
    if not 0 < seq <= llama.max_seq_len:
        raise UsageError(f"--seq {seq} must be between 1 and the model's max_seq_len {llama.max_seq_len}")
    for k, v in (("--steps", args.steps), ("--micro-batch", args.micro_batch or 1),
                 ("--start-micro-batch", args.start_micro_batch)):
        if v < 1:
            raise UsageError(f"{k} must be >= 1, got {v}")
    return args, cfg, rows, seq


def _run_rows(args, cfg, rows: list[str], dev: torch.device, seq: int, fpt: float, peak) -> dict[str, dict]:
    """Every row built, warmed up and timed; its figures by name, in ``rows`` order."""
    search = dev.type == "cuda" and args.micro_batch is None
    micro_batch = args.micro_batch or (args.start_micro_batch if dev.type == "cuda"
                                       else max(1, min(cfg.data.micro_batch_size, CPU_TOKENS // seq)))
    results: dict[str, dict] = {}
    built: dict[str, Row] = {}
    # CPU: every row is built first and the timed steps interleave, so machine noise hits all rows
    # alike; CUDA: one row at a time (four 1.3B models and their optimizer states would not fit)
    interleave = dev.type != "cuda"
    for name in rows:
        why = torchao_float8_unavailable(dev) if name == "torchao-float8" else None
        if why:
            results[name] = {"skipped": why}
            continue
        row = _build(name, cfg, dev, micro_batch, seq, search, args.compile_torchao,
                     "inductor" if args.compile else None)
        micro_batch = row.micro_batch  # later rows start from what fitted
        if interleave:
            built[name] = row
            continue
        for _ in range(args.steps):
            row.timed_step()
        results[name] = _measure(row, fpt, peak)
        row.free()
    for _ in range(args.steps if interleave else 0):
        for row in built.values():
            row.timed_step()
    for name, row in built.items():
        results[name] = _measure(row, fpt, peak)
    return {name: results[name] for name in rows}


def _print_header(args, cfg, dev, seq: int, fpt: float, peak, results: dict, why: str) -> str:
    """The lines above the table; returns the peak-memory kind."""
    llama = cfg.llama_config()
    measured = [r for r in results.values() if "skipped" not in r]
    mem_kind = "CUDA max_memory_allocated" if dev.type == "cuda" else \
        "analytic: params + grads + optimizer state + saved activations"
    src = measured[0]["data"] if measured else "-"
    print(f"# recipe={args.recipe} model={llama.dim}x{llama.n_layers} ({measured[0]['params'] / 1e6 if measured else 0:.1f}M "
          f"params) seq={seq} optimizer.states={cfg.optimizer.states} grad_clip={cfg.optimizer.grad_clip} "
          f"fp4.preset={cfg.fp4.preset} data={src}")
    print(f"# device={dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}) torch={torch.__version__} "
          f"threads={torch.get_num_threads()} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} "
          f"steps={args.steps} (min / median / max, after {WARMUP} warm-up"
          + ("; rows interleaved step by step" if dev.type != "cuda" else "") + ") "
          f"bf16_gemm={'emulated (fp32 kernels)' if emulate_bf16_gemm(dev) else 'native'}")
    print(f"# bf16-mixed's GeMMs: {bf16_gemms(dev)}")
    print(f"# baseline: {why}")
    print(f"# MFU: model FLOPs per token {fpt / 1e9:.3f} GFLOP (PaLM count, fp4lightning.train.throughput) x tokens / step time / "
          + (f"peak {peak:g} TFLOP/s (dense bf16)" if peak else "no peak known for this device (--peak-tflops)"))
    print(f"# peak memory: {mem_kind}")
    print("# time split: the median step's, measured inside the timed steps by module hooks ("
          + ("CUDA events, no synchronisation" if dev.type == "cuda" else "the clock")
          + "); attention = RoPE + SDPA; the parts and unattributed sum to the step")
    return mem_kind


def _print_table(results: dict[str, dict], base: str | None) -> None:
    print()
    print("| precision | micro-batch | step ms min / median / max | tokens/s | x baseline | MFU % | peak mem GB | "
          "linears ms | attention ms | other fwd+bwd ms | optimizer ms | unattributed ms | saved activations MiB | "
          "attention kernel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        notes = [r["preset"]] if name == "fp4" and "preset" in r else []
        notes += ["baseline"] if name == base else []
        notes += {"model": ["compiled"], "blocks": ["blocks compiled"]}.get(r.get("compiled"), [])
        label = f"{name} ({', '.join(notes)})" if notes else name
        if "skipped" in r:
            print(f"| {label} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        s = r["split_ms"] or dict.fromkeys(SPLIT)
        steps = " / ".join(f"{r[k]:.1f}" for k in ("step_ms_min", "step_ms", "step_ms_max"))
        print(f"| {label} | {r['micro_batch']} | {steps} | {r['tokens_per_s']:.0f} | "
              f"{_fmt(r.get('vs_baseline'), '.2f')} | "
              f"{_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.3g')} | {r['peak_mem_gb']:.3f} | "
              f"{' | '.join(_fmt(s[k], '.1f') for k in SPLIT)} | {_mb(r['saved_activation_bytes'])} | {r['attention_op']} |")
    if base is not None:
        ratios = ", ".join(f"{n} {r['vs_baseline']:.2f}x (per step {r['vs_baseline_steps'][0]:.2f}-"
                           f"{r['vs_baseline_steps'][1]:.2f}x)" for n, r in results.items()
                           if n != base and "vs_baseline" in r)
        if ratios:
            print(f"\ntokens/s over the baseline {base} ({results[base]['tokens_per_s']:.0f} tokens/s): {ratios}")


def main(argv=None) -> int:
    try:
        args, cfg, rows, seq = _parse(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    peak = args.peak_tflops or peak_tflops(dev)
    fpt = flops_per_token(cfg.llama_config(), seq)
    results = _run_rows(args, cfg, rows, dev, seq, fpt, peak)
    base, why = choose_baseline(results)
    add_ratios(results, base)
    mem_kind = _print_header(args, cfg, dev, seq, fpt, peak, results, why)
    _print_table(results, base)
    if args.json:
        setup = {"recipe": args.recipe, "overrides": list(args.overrides), "device": str(dev),
                 "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "cpu": cpu_features() if dev.type == "cpu" else None, "bf16_gemms": bf16_gemms(dev),
                 "baseline": base, "baseline_why": why,
                 "torch": torch.__version__, "seq_len": seq, "steps": args.steps, "peak_tflops": peak,
                 "flops_per_token": fpt, "peak_mem_kind": mem_kind, "optimizer_states": cfg.optimizer.states,
                 "compile_blocks": args.compile, "compile_torchao": args.compile_torchao}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({**results, "setup": setup}, f, indent=2)
            f.write("\n")
    return 0


def _mb(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.1f}"


def _measure(row: Row, fpt: float, peak: float | None) -> dict:
    """The row's figures: the median timed step (the lower median for an even count: a measured step,
    whose split is reported), the min and max, memory, the attention kernel."""
    step_s = statistics.median_low(row.times)
    i = row.times.index(step_s)
    tokens = row.micro_batch * row.seq
    out = {"micro_batch": row.micro_batch, "seq_len": row.seq, "step_ms": 1e3 * step_s,
           "step_ms_min": 1e3 * min(row.times), "step_ms_max": 1e3 * max(row.times),
           "steps_ms": [1e3 * t for t in row.times],
           "tokens_per_s": tokens / step_s, "tflops": fpt * tokens / step_s / 1e12}
    out["mfu"] = out["tflops"] / peak if peak else None
    if row.preset:
        out["preset"] = row.preset
    if row.dev.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(row.dev) / 1e9
        out["saved_activation_bytes"] = None
    if row.compiled:  # hooks and the dispatch probe would break the compiled graphs
        out["compiled"] = row.compiled
    out["split_ms"] = row.splits[i] if len(row.splits) == len(row.times) else None
    out["attention_op"] = "n/a (compiled)" if row.compiled else attention_op(row)
    if row.dev.type != "cuda":
        total, saved, _ = _analytic_memory(row)
        out["peak_mem_gb"] = total / 1e9
        out["saved_activation_bytes"] = saved
    out["optimizer_state_bytes_per_param"] = state_bytes_per_param(row.opt)
    out["params"] = row.n_params
    out["data"] = row.source
    return out


if __name__ == "__main__":
    sys.exit(main())
