"""AdamW with optimizer states in reduced precision (docs/method.md section 6; arXiv 2501.17116, section 4).

The paper keeps the optimizer states in reduced precision, reusing MS-AMP. MS-AMP's level O2 stores
the first moment ``m`` in FP8 E4M3 and the second moment ``v`` in FP16, each with one fp32 scale per
tensor; :class:`LowPrecisionAdamW` does the same:

* per parameter it holds ``exp_avg_q`` (E4M3, 1 byte; or FP16, 2 bytes), ``exp_avg_sq_q`` (FP16,
  2 bytes) and their scales: 3 bytes of state per parameter against 8 for ``torch.optim.AdamW``;
* every step decodes both moments to fp32, applies the ordinary AdamW update (decoupled weight
  decay, bias correction) in fp32 with the fresh moments, then re-encodes them with a new scale
  ``scale = FORMAT_MAX / amax`` so that each tensor's largest element lands on the top of the
  format's range and small elements keep as much range below it as the format has;
* parameters stored in bf16/fp16 get an fp32 master copy (``master``) that the update is applied
  to and that is copied back into the parameter; fp32 parameters are updated in place (no copy);
* FSDP2's sharded parameters (DTensors) keep sharded states: each rank updates its shard, and the
  per-tensor scale comes from the amax over every shard (one ``all_reduce(MAX)`` per moment), so the
  states are the unsharded tensor's, split.
* on CUDA most of the update runs as ``torch._foreach_*`` kernels, one launch per list of parameters
  instead of one per parameter (``foreach=``), with the same arithmetic as the per-parameter loop.

The recipe key ``optimizer.states`` picks the layout (:data:`REDUCED_STATE_FORMATS`, :func:`adamw`):
``fp32`` (torch's AdamW), ``fp16`` (both moments FP16, the paper's text) or ``fp8-fp16`` (O2).

State keys differ from torch's (``exp_avg_q``, not ``exp_avg``) so that a plain ``AdamW`` never
mistakes scaled codes for moments. :meth:`LowPrecisionAdamW.load_state_dict` accepts both its own
state dicts and ``torch.optim.AdamW``'s (it encodes the latter), and :func:`to_torch_adamw_state_dict`
converts the other way, e.g. to resume an FP4 checkpoint with a plain ``AdamW``.
"""
from __future__ import annotations

import math
from functools import wraps
from itertools import chain
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from fp4lightning.numerics.constants import F8E4M3_MAX, F16_MAX, F32_MAX
from fp4lightning.numerics.formats import saturating_cast_

__all__ = [
    "MOMENT_FORMATS",
    "REDUCED_STATE_FORMATS",
    "LowPrecisionAdamW",
    "adamw",
    "state_bytes_per_param",
    "optimizer_state_bytes",
    "to_torch_adamw_state_dict",
]

#: name -> (storage dtype, largest finite value of the format)
MOMENT_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "fp8": (torch.float8_e4m3fn, F8E4M3_MAX),  # E4M3, 448
    "fp16": (torch.float16, F16_MAX),  # 65504
    "fp32": (torch.float32, F32_MAX),  # no compression (a baseline for ablations)
}
_EXP_AVG_FORMATS = ("fp8", "fp16", "fp32")
# v >= 0 spans the square of the gradient's range: E4M3's ~18 binades would flush most of it to zero.
_EXP_AVG_SQ_FORMATS = ("fp16", "fp32")
# amax below this is treated as an all-zero tensor; keeps FORMAT_MAX / amax finite in fp32.
_TINY_AMAX = 1e-30
# The foreach update works on lists of at most this many elements (one larger parameter forms a list
# of its own): its fp32 temporaries (gradient, moments, denominator, scaled moment) then stay about as
# large as the loop's for the largest parameter, not a multiple of the whole model.
_FOREACH_CHUNK_NUMEL = 1 << 25
# The keys torch's Adam/AdamW add to every param group; stripped when converting state dicts and optimizers.
_TORCH_ADAM_GROUP_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused",
                          "decoupled_weight_decay")
_OUR_GROUP_KEYS = ("exp_avg_format", "exp_avg_sq_format")


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2's parameters and the states made like them), else ``t``."""
    return t.to_local() if hasattr(t, "device_mesh") and hasattr(t, "to_local") else t


def _is_plain(t: Tensor) -> bool:
    """Whether ``t`` is a plain tensor or parameter: no DTensor, no other tensor subclass."""
    return type(t) in (Tensor, torch.nn.Parameter)


def _shard_groups(t: Tensor) -> list:
    """The process groups over which the DTensor ``t`` is sharded (none for a plain tensor)."""
    if not (hasattr(t, "device_mesh") and hasattr(t, "placements")):
        return []
    return [t.device_mesh.get_group(d) for d, pl in enumerate(t.placements) if pl.is_shard()]


def _encode_(dst: Tensor, scale_dst: Tensor, x: Tensor, fmt: str, generator: torch.Generator | None = None) -> None:
    """Store fp32 ``x`` into ``dst`` (dtype of ``fmt``) with a fresh per-tensor scale, in place.

    With a ``generator``, FP8 values are rounded stochastically (see :func:`_stochastic_round_e4m3`).
    For a sharded ``dst`` (DTensor), ``x`` is its local shard's values and the amax is the whole tensor's.
    """
    _, fmax = MOMENT_FORMATS[fmt]
    groups = _shard_groups(dst)
    dst, x = _local(dst), _local(x)
    if fmt == "fp32":
        dst.copy_(x)
        scale_dst.fill_(1.0)
        return
    amax = x.abs().amax() if x.numel() else x.new_zeros((), dtype=torch.float32)
    for group in groups:  # every rank must derive the same scale, the unsharded tensor's
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    scale = _scale_from_amax(amax, fmax)
    # saturate: fp32 rounding can put the amax element a hair above FORMAT_MAX, and E4M3 has no inf
    # (an overflowing cast becomes NaN)
    y = x * scale
    if fmt == "fp8" and generator is not None:
        y = _stochastic_round_e4m3(y.clamp_(-fmax, fmax), generator)
    saturating_cast_(y, dst)
    scale_dst.copy_(scale)


def _scale_from_amax(amax: Tensor, fmax: float) -> Tensor:
    """``fmax / amax`` elementwise (1 where ``amax`` is below :data:`_TINY_AMAX`), for one amax or a stack."""
    return torch.where(amax > _TINY_AMAX, fmax / amax.clamp(min=_TINY_AMAX), torch.ones_like(amax))


def _encode_all_(dsts: list[Tensor], scale_dsts: list[Tensor], xs: list[Tensor], fmt: str,
                 rounding: Callable[[int, Tensor], Tensor] | None = None) -> None:
    """:func:`_encode_` for lists of plain tensors (one device, one ``dst`` dtype) with foreach kernels.

    The amaxes come from one ``_foreach_norm(ord=inf)`` and the scales from one computation on their
    stack. ``rounding(i, y)`` rounds the ``i``-th scaled FP8 tensor stochastically; it runs per tensor,
    so that each one draws its own noise as in the loop.
    """
    if fmt == "fp32":
        torch._foreach_copy_(dsts, xs)
        torch._foreach_copy_(scale_dsts, torch.ones(len(xs), device=xs[0].device).unbind(0))
        return
    _, fmax = MOMENT_FORMATS[fmt]
    scales = _scale_from_amax(torch.stack(torch._foreach_norm(xs, ord=math.inf)), fmax).unbind(0)
    ys = torch._foreach_mul(xs, scales)
    if fmt == "fp8" and rounding is not None:
        _foreach_clamp_(ys, fmax)
        ys = [rounding(i, y) for i, y in enumerate(ys)]
    _foreach_clamp_(ys, torch.finfo(dsts[0].dtype).max)  # saturating_cast_ of every tensor
    torch._foreach_copy_(dsts, ys)
    torch._foreach_copy_(scale_dsts, scales)


def _foreach_clamp_(xs: list[Tensor], bound: float) -> None:
    """``x.clamp_(-bound, bound)`` for every ``x``: NaN stays NaN, as with ``clamp_``."""
    torch._foreach_clamp_min_(xs, -bound)
    torch._foreach_clamp_max_(xs, bound)


def _cast(xs: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """``[x.to(dtype) for x in xs]`` (the same tensor where it has ``dtype``), one foreach copy for the casts."""
    out = [x if x.dtype == dtype else torch.empty_like(x, dtype=dtype) for x in xs]
    todo = [i for i, x in enumerate(xs) if out[i] is not x]
    if todo:
        torch._foreach_copy_([out[i] for i in todo], [xs[i] for i in todo])
    return out


def _mul_scalar_(xs: list[Tensor], value: float) -> None:
    """``x.mul_(value)`` for every ``x``: one foreach op, except for bf16/fp16 tensors (parameters
    without a master copy), which go one by one: the CPU's foreach op rounds a Python scalar to the
    list's dtype first, where ``mul_`` keeps it in fp32 (bf16 would turn 0.997 into 0.99609375)."""
    if xs[0].dtype in (torch.bfloat16, torch.float16):
        for x in xs:
            x.mul_(value)
    else:
        torch._foreach_mul_(xs, value)


def _stochastic_round_e4m3(y: Tensor, generator: torch.Generator) -> Tensor:
    """Round ``y`` (already within +-448) to a neighbouring E4M3 value: in E4M3's normal range
    up with probability equal to the distance from the lower neighbour (unbiased), below it
    (``|y| < 2^-6``, the subnormals) to nearest.

    Round-to-nearest stalls an E4M3 moment: ``m <- 0.9 m + 0.1 g`` moves ``m`` by less than half of
    E4M3's 6-12% spacing whenever ``g`` is close to ``m``, so ``m`` stops following the gradient.
    Among the subnormals the spacing is fixed (2^-9), so stochastic rounding there would turn a
    moment 100x below it into 2^-9 one step in a hundred: noise without bound relative to the
    value, which Adam's normalisation then turns into full-size updates.

    Held-out loss gap to fp32 AdamW (``benchmarks/bench_optim.py``, 4 seeds): this rounding -0.11%
    on average, every seed within 1%; stochastic everywhere +0.29% (up to 1.44%); nearest
    everywhere -0.76% (up to 2.08%). On a small MLP, nearest is +1.2% on average (biased), this +0.08%.
    """
    _, exp = torch.frexp(y)  # y = mant * 2^exp, mant in [0.5, 1): floor(log2|y|) = exp - 1
    ulp = torch.ldexp(torch.ones_like(y), (exp - 1).clamp_(min=-6) - 3)  # 3 mantissa bits
    noise = torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)
    noise = torch.where(y.abs() < 2.0**-6, 0.5, noise)
    # multiples of a power of two: the division and the product are exact in fp32
    return torch.floor(y / ulp + noise).mul_(ulp)


def _decode(q: Tensor, scale: Tensor) -> Tensor:
    return q.float().div_(scale)


class LowPrecisionAdamW(Optimizer):
    """AdamW whose moments are stored in FP8 E4M3 / FP16 with per-tensor scales (MS-AMP O2).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        exp_avg_format: storage of the first moment: ``"fp8"`` (E4M3, default), ``"fp16"``, ``"fp32"``.
        exp_avg_sq_format: storage of the second moment: ``"fp16"`` (default) or ``"fp32"``.
        master_weights: keep an fp32 master copy of bf16/fp16 parameters (default True). Without it
            the update is rounded into the low-precision parameter every step.
        stochastic_rounding: round FP8 moments stochastically (default True; round-to-nearest
            lets an E4M3 moment stall, see :func:`_stochastic_round_e4m3`). The random numbers come
            from a generator re-seeded from ``(seed, step, parameter index)``: runs are reproducible,
            resume bit-exactly from a checkpoint, and data-parallel replicas stay identical.
        seed: seed of that generator.
        foreach: run the update as ``torch._foreach_*`` kernels over lists of parameters (per param
            group, device and dtypes, in lists of at most :data:`_FOREACH_CHUNK_NUMEL` elements)
            instead of ~15 kernels per parameter. ``None`` (default): when every parameter is a plain
            CUDA tensor; ``False``: never; ``True``: on any device. DTensor (FSDP2-sharded), other
            tensor-subclass and empty parameters always take the per-parameter path (for a DTensor
            it all-reduces the amax over the shards).
            The elementwise arithmetic is the loop's, op for op (bitwise the same on CPU); the
            stochastic rounding of FP8 moments stays per parameter, each drawing its own noise, and so
            does the decoding division by each tensor's scale (a broadcast operand, which CUDA's
            foreach kernels run one tensor at a time).

    The formats may also be set per param group. ``amsgrad``, ``maximize`` and sparse gradients
    are not supported.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        exp_avg_format: str = "fp8",
        exp_avg_sq_format: str = "fp16",
        master_weights: bool = True,
        stochastic_rounding: bool = True,
        seed: int = 0,
        foreach: bool | None = None,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"LowPrecisionAdamW: invalid learning rate {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"LowPrecisionAdamW: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"LowPrecisionAdamW: betas must be in [0, 1), got {betas}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"LowPrecisionAdamW: invalid weight_decay {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        exp_avg_format=exp_avg_format, exp_avg_sq_format=exp_avg_sq_format)
        self.master_weights = master_weights
        self.stochastic_rounding = stochastic_rounding
        self.seed = int(seed)
        self.foreach = foreach
        self._generators: dict[torch.device, torch.Generator] = {}
        super().__init__(params, defaults)
        for group in self.param_groups:
            _check_formats(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_formats(self.param_groups[-1])

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        m_dtype = MOMENT_FORMATS[group["exp_avg_format"]][0]
        v_dtype = MOMENT_FORMATS[group["exp_avg_sq_format"]][0]
        state = self.state[p]
        state["step"] = 0
        state["exp_avg_q"] = torch.zeros_like(p, dtype=m_dtype, memory_format=torch.preserve_format)
        state["exp_avg_scale"] = torch.ones((), dtype=torch.float32, device=p.device)
        state["exp_avg_sq_q"] = torch.zeros_like(p, dtype=v_dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq_scale"] = torch.ones((), dtype=torch.float32, device=p.device)
        if self.master_weights and p.dtype in (torch.bfloat16, torch.float16):
            state["master"] = p.detach().float()
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW update; ``closure`` re-evaluates the loss (as for any torch optimizer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        foreach = self._foreach_now()
        index = -1
        for group in self.param_groups:
            batch = []
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LowPrecisionAdamW does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if len(state) == 0:
                    state = self._init_state(p, group)
                state["step"] = int(state["step"]) + 1
                if foreach and _is_plain(p) and p.numel():
                    batch.append((p, index))
                else:
                    self._update_one(p, group, index)
            for chunk in _foreach_chunks(batch, self.state):
                self._update_many(chunk, group)
        return loss

    def _foreach_now(self) -> bool:
        """Whether this step takes the foreach path (for the parameters it can take)."""
        if self.foreach is not None:
            return bool(self.foreach)
        params = [p for g in self.param_groups for p in g["params"]]
        return bool(params) and all(p.is_cuda and _is_plain(p) for p in params)

    def _update_one(self, p: Tensor, group: dict[str, Any], index: int) -> None:
        """The update of one parameter (whose step counter is already advanced), kernel by kernel."""
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        state = self.state[p]
        t = state["step"]
        g = _local(p.grad).float()
        m = _decode(_local(state["exp_avg_q"]), state["exp_avg_scale"])  # fp32, same shape as p
        v = _decode(_local(state["exp_avg_sq_q"]), state["exp_avg_sq_scale"])
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        # fp32 parameters are their own master; low-precision ones have an fp32 copy
        w = _local(state.get("master", p))
        if wd != 0.0:
            w.mul_(1.0 - lr * wd)
        bias_c1 = 1.0 - beta1**t
        bias_c2 = 1.0 - beta2**t
        denom = (v.sqrt() / math.sqrt(bias_c2)).add_(eps)
        w.addcdiv_(m.to(w.dtype), denom.to(w.dtype), value=-lr / bias_c1)
        if "master" in state:
            _local(p).copy_(w)
        # the update above used the fresh fp32 moments; only storage is lossy
        gen = self._generator(p.device, t, index) if self.stochastic_rounding else None
        _encode_(state["exp_avg_q"], state["exp_avg_scale"], m, group["exp_avg_format"], gen)
        _encode_(state["exp_avg_sq_q"], state["exp_avg_sq_scale"], v, group["exp_avg_sq_format"])

    def _update_many(self, items: list[tuple[Tensor, int]], group: dict[str, Any]) -> None:
        """:meth:`_update_one` for ``(parameter, index)`` pairs of one :func:`_foreach_chunks` list, with
        foreach kernels: the same ops in the same order with the same constants."""
        lr = float(group["lr"])
        beta1, beta2 = group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        params = [p for p, _ in items]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        g = _cast([p.grad for p in params], torch.float32)
        m = _cast([s["exp_avg_q"] for s in states], torch.float32)  # _decode
        torch._foreach_div_(m, [s["exp_avg_scale"] for s in states])
        v = _cast([s["exp_avg_sq_q"] for s in states], torch.float32)
        torch._foreach_div_(v, [s["exp_avg_sq_scale"] for s in states])
        torch._foreach_lerp_(m, g, 1.0 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, value=1.0 - beta2)
        w = [s.get("master", p) for s, p in zip(states, params)]
        if wd != 0.0:
            _mul_scalar_(w, 1.0 - lr * wd)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**t) for t in steps])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(w, _cast(m, w[0].dtype), _cast(denom, w[0].dtype),
                                [-lr / (1.0 - beta1**t) for t in steps])
        if "master" in states[0]:
            torch._foreach_copy_(params, w)

        def rounding(i: int, y: Tensor) -> Tensor:  # the loop's generator for (step, index) of the i-th
            return _stochastic_round_e4m3(y, self._generator(params[i].device, steps[i], items[i][1]))

        _encode_all_([s["exp_avg_q"] for s in states], [s["exp_avg_scale"] for s in states], m,
                     group["exp_avg_format"], rounding if self.stochastic_rounding else None)
        _encode_all_([s["exp_avg_sq_q"] for s in states], [s["exp_avg_sq_scale"] for s in states], v,
                     group["exp_avg_sq_format"])

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        # a counter-based stream: no generator state to checkpoint or to keep in sync across ranks
        gen.manual_seed((self.seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + index) % (2**63))
        return gen

    def moments(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """The decoded fp32 ``(exp_avg, exp_avg_sq)`` of parameter ``p`` (zeros before its first step)."""
        state = self.state.get(p)
        if not state:
            return torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32)
        return (_decode(state["exp_avg_q"], state["exp_avg_scale"]),
                _decode(state["exp_avg_sq_q"], state["exp_avg_sq_scale"]))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW`` (whose moments are encoded).

        ``torch.optim.Optimizer.load_state_dict`` casts every floating-point state tensor to its
        parameter's dtype, which would decode E4M3 codes to fp32 and round an fp32 master copy
        to bf16; the tensors are put back in their stored dtypes afterwards.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"LowPrecisionAdamW.load_state_dict: the state dict has {len(saved_groups)} param groups, "
                             f"the optimizer {len(self.param_groups)}; build the optimizer with the same groups")
        groups = []
        for saved, current in zip(saved_groups, self.param_groups):
            g = {k: v for k, v in saved.items() if k not in _TORCH_ADAM_GROUP_KEYS}
            for key in _OUR_GROUP_KEYS:
                g.setdefault(key, current[key])
            groups.append(g)
        id_to_param = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                               chain.from_iterable(g["params"] for g in self.param_groups)))
        id_to_group = {pid: g for g in groups for pid in g["params"]}
        state = {}
        for pid, s in state_dict["state"].items():
            if "exp_avg" in s and "exp_avg_q" not in s:
                s = self._encode_torch_state(id_to_param[pid], s, id_to_group[pid])
            state[pid] = s
        super().load_state_dict({"state": state, "param_groups": groups})
        for pid, s in state.items():
            p = id_to_param[pid]
            for key, value in s.items():
                if torch.is_tensor(value):
                    self.state[p][key] = value.to(device=p.device, copy=True)
            self.state[p]["step"] = int(s["step"])

    def _encode_torch_state(self, p: Tensor, s: dict[str, Any], group: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"step": int(s["step"])}
        for name, fmt_key in (("exp_avg", "exp_avg_format"), ("exp_avg_sq", "exp_avg_sq_format")):
            x = s[name].float()
            q = torch.empty_like(x, dtype=MOMENT_FORMATS[group[fmt_key]][0])
            scale = torch.ones((), dtype=torch.float32, device=x.device)
            _encode_(q, scale, x, group[fmt_key])
            out[f"{name}_q"], out[f"{name}_scale"] = q, scale
        if self.master_weights and p.dtype in (torch.bfloat16, torch.float16):
            # torch's AdamW kept no master copy: the parameter is the best value there is
            out["master"] = p.detach().float()
        return out


def _foreach_chunks(items: list[tuple[Tensor, int]], state: Any) -> Iterable[list[tuple[Tensor, int]]]:
    """Split ``(parameter, index)`` pairs into lists that foreach kernels take together: one device and
    one dtype of parameter, gradient, master copy and each moment per list, and at most
    :data:`_FOREACH_CHUNK_NUMEL` elements per list unless one parameter alone has more."""
    buckets: dict[tuple, list[tuple[Tensor, int]]] = {}
    for p, index in items:
        s = state[p]
        key = (p.device, p.dtype, p.grad.dtype, "master" in s, s["exp_avg_q"].dtype, s["exp_avg_sq_q"].dtype)
        buckets.setdefault(key, []).append((p, index))
    for bucket in buckets.values():
        chunk, numel = [], 0
        for p, index in bucket:
            if chunk and numel + p.numel() > _FOREACH_CHUNK_NUMEL:
                yield chunk
                chunk, numel = [], 0
            chunk.append((p, index))
            numel += p.numel()
        yield chunk


def _check_formats(group: dict[str, Any]) -> None:
    if group["exp_avg_format"] not in _EXP_AVG_FORMATS:
        raise ValueError(f"LowPrecisionAdamW: exp_avg_format={group['exp_avg_format']!r} is not one of "
                         f"{_EXP_AVG_FORMATS} ('fp8' is E4M3, MS-AMP's choice)")
    if group["exp_avg_sq_format"] not in _EXP_AVG_SQ_FORMATS:
        raise ValueError(f"LowPrecisionAdamW: exp_avg_sq_format={group['exp_avg_sq_format']!r} is not one of "
                         f"{_EXP_AVG_SQ_FORMATS} (the second moment needs FP16's range)")
    for key in ("amsgrad", "maximize"):
        if group.get(key):
            raise ValueError(f"LowPrecisionAdamW does not support {key}=True; use torch.optim.AdamW")


def to_torch_adamw_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Convert a :class:`LowPrecisionAdamW` state dict into one ``torch.optim.AdamW`` loads.

    Moments are decoded to fp32 (``AdamW.load_state_dict`` casts them to the parameter dtype);
    fp32 master copies are dropped, since ``AdamW`` keeps none. Use it on a Lightning checkpoint as
    ``ckpt["optimizer_states"][i] = to_torch_adamw_state_dict(ckpt["optimizer_states"][i])``.
    """
    state = {}
    for pid, s in state_dict["state"].items():
        if "exp_avg_q" not in s:
            state[pid] = s  # already torch's layout
            continue
        state[pid] = {
            "step": torch.tensor(float(s["step"])),
            "exp_avg": _decode(s["exp_avg_q"], s["exp_avg_scale"]),
            "exp_avg_sq": _decode(s["exp_avg_sq_q"], s["exp_avg_sq_scale"]),
        }
    groups = []
    for g in state_dict["param_groups"]:
        g = {k: v for k, v in g.items() if k not in _OUR_GROUP_KEYS}
        g.update(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=True)
        groups.append(g)
    return {"state": state, "param_groups": groups}


def optimizer_state_bytes(optimizer: Optimizer) -> dict[str, int]:
    """Bytes held in ``optimizer.state``, per state key (``exp_avg_q``, ``master``, ``exp_avg`` ...)."""
    out: dict[str, int] = {}
    for s in optimizer.state.values():
        for key, value in s.items():
            if torch.is_tensor(value):
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out


def state_bytes_per_param(optimizer: Optimizer, include_master: bool = True) -> float:
    """Bytes of optimizer state per parameter element (``torch.optim.AdamW``: 8.0 plus its step counters).

    Counts every tensor in ``optimizer.state`` (moments, scales, step counters and, unless
    ``include_master=False``, fp32 master copies) over the elements of all parameters in
    ``optimizer.param_groups``. Call it after the first step: states are created lazily.
    """
    n = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    if n == 0:
        raise ValueError("state_bytes_per_param: the optimizer holds no parameters")
    by_key = optimizer_state_bytes(optimizer)
    total = sum(v for k, v in by_key.items() if include_master or k != "master")
    return total / n


#: ``optimizer_states=`` of the precision plugin and the recipe's ``optimizer.states`` (``fp8-fp16``, the same
#: as ``fp8``) -> (first-moment, second-moment) format of LowPrecisionAdamW
REDUCED_STATE_FORMATS: dict[str, tuple[str, str]] = {"fp8": ("fp8", "fp16"), "fp8-fp16": ("fp8", "fp16"),
                                                     "fp16": ("fp16", "fp16")}


def adamw(params: Iterable[Tensor] | Iterable[dict[str, Any]], states: str = "fp32", *, seed: int = 0,
          **kwargs: Any) -> Optimizer:
    """AdamW with the recipe's ``optimizer.states``: ``"fp32"`` is ``torch.optim.AdamW``; a key of
    :data:`REDUCED_STATE_FORMATS` is a :class:`LowPrecisionAdamW` with those moment formats (``seed`` keys
    its stochastic rounding). ``kwargs`` (lr, betas, eps, weight_decay) go to either.

    torch's AdamW is ``fused=True`` when every parameter is a plain CUDA tensor: one fused kernel per
    step instead of torch's default foreach kernels, and no per-parameter bias-correction arithmetic on
    the host (the default keeps the step counters there and reads each one every step). Elsewhere (CPU
    runs, FSDP2's DTensors) torch's default stays, so CPU training computes what it always did."""
    if states == "fp32":
        params, flat = list(params), []
        for i, g in enumerate(params):  # groups' params as lists: a generator would be spent by the check
            if isinstance(g, dict):
                params[i] = g = {**g, "params": [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])}
            flat += g["params"] if isinstance(g, dict) else [g]
        if "fused" not in kwargs and flat and all(
                p.is_cuda and p.is_floating_point() and type(p) in (Tensor, torch.nn.Parameter) for p in flat):
            kwargs["fused"] = True
        return torch.optim.AdamW(params, **kwargs)
    if states not in REDUCED_STATE_FORMATS:
        raise ValueError(f"optimizer states {states!r} are not one of {['fp32', *REDUCED_STATE_FORMATS]}")
    m_fmt, v_fmt = REDUCED_STATE_FORMATS[states]
    return LowPrecisionAdamW(params, exp_avg_format=m_fmt, exp_avg_sq_format=v_fmt, seed=seed, **kwargs)


def swap_to_low_precision_adamw(optimizer: Optimizer, states: str, lr_schedulers: Iterable[Any] = ()
                                ) -> tuple[Optimizer, str | None]:
    """Replace a ``torch.optim.AdamW`` by a :class:`LowPrecisionAdamW` with the same groups and state.

    ``states`` is a key of :data:`REDUCED_STATE_FORMATS` (``"fp8"``: E4M3 first moment, FP16
    second, as MS-AMP O2). LR schedulers (Lightning's configs or bare schedulers) pointing at the old
    optimizer are re-pointed at the new one. Returns ``(optimizer, reason)``: ``reason`` is None
    when the result is a LowPrecisionAdamW, else why the optimizer was kept as it is.
    """
    if isinstance(optimizer, LowPrecisionAdamW):
        return optimizer, None
    if type(optimizer) is not torch.optim.AdamW:
        return optimizer, (f"only torch.optim.AdamW is swapped for LowPrecisionAdamW; keeping "
                           f"{type(optimizer).__name__} as it is")
    unsupported = [k for k in ("amsgrad", "maximize") if any(g.get(k) for g in optimizer.param_groups)]
    if unsupported:
        return optimizer, (f"AdamW with {', '.join(unsupported)}=True has no reduced-precision version; "
                           "keeping torch.optim.AdamW")
    m_fmt, v_fmt = REDUCED_STATE_FORMATS[states]
    groups = [{k: v for k, v in g.items() if k not in _TORCH_ADAM_GROUP_KEYS} for g in optimizer.param_groups]
    new = LowPrecisionAdamW(groups, lr=optimizer.defaults["lr"], betas=optimizer.defaults["betas"],
                            eps=optimizer.defaults["eps"], weight_decay=optimizer.defaults["weight_decay"],
                            exp_avg_format=m_fmt, exp_avg_sq_format=v_fmt)
    if optimizer.state:
        new.load_state_dict(optimizer.state_dict())
    for config in lr_schedulers:
        scheduler = getattr(config, "scheduler", config)
        if getattr(scheduler, "optimizer", None) is optimizer:
            scheduler.optimizer = new
            _track_step_calls(new)
    return new, None


def _track_step_calls(optimizer: Optimizer) -> None:
    """Mark ``optimizer.step`` the way an LR scheduler does when it is built.

    A scheduler wraps its optimizer's ``step`` at construction to warn when ``scheduler.step()``
    runs first; a scheduler re-pointed at a new optimizer would otherwise warn that ``step``
    was overridden. Mirrors ``torch.optim.lr_scheduler.LRScheduler.__init__``.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return func(optimizer, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]
