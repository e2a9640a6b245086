"""FP8 gradient communication for data-parallel training (arXiv 2501.17116; docs/distributed.md).

The paper sends gradients between data-parallel ranks in FP8, reusing MS-AMP: a per-tensor amax is
all-reduced with MAX, every rank derives the same power-of-two scale from it, the gradient is cast to
FP8 E4M3 and summed. Stock NCCL and gloo have no FP8 sum (gloo refuses float8 tensors outright), so
this module implements the sum itself as a DDP communication hook, one call per gradient bucket:

1. ``amax`` of every gradient tensor in the bucket plus a non-finite flag -> ``all_reduce(MAX)``.
   The flag travels separately because NaN does not reliably survive a MAX reduction.
2. If any rank saw inf/NaN, every rank fills the bucket with NaN and stops: all ranks return the
   same non-finite gradient, so a loss scaler (or :class:`~fp4lightning.strategy.FP4DDPStrategy`)
   skips the same step everywhere and the replicas never drift apart.
3. ``scale = 2^floor(log2(FP8_MAX / amax))`` per tensor (identical on every rank), ``q = fp8(g * scale)``.
4. Reduce-scatter: ``all_to_all`` of the FP8 codes (as ``uint8``), so rank r receives chunk r of every
   rank; it sums them in fp32, divides by the world size and re-quantises with the same scale (the
   mean of values bounded by the global amax is bounded by it too, so no second scale is needed).
5. All-gather of the reduced FP8 chunks (``uint8``); every rank dequantises the same bytes, so the
   synchronised gradient is bit-identical on all ranks.

Each rank sends ``2 * ceil(N / W) * (W - 1)`` bytes for N gradient elements (about ``2 N (W-1) / W``),
a quarter of an fp32 ring all-reduce and half of a bf16 one, plus the small amax vector.
Where the backend lacks ``all_to_all`` the hook falls back (once, with a log line) to an
``all_gather`` of the whole FP8 payload and an fp32 sum on every rank (``N (W-1)`` bytes).

The hooks complete their collectives synchronously and return an already completed future:
issuing collectives from future callbacks on background threads could interleave buckets
differently on different ranks.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook checks that the
# ``bucket`` annotation *is* dist.GradBucket, and a string annotation fails that check.
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from fp4lightning.constants import F8E4M3_MAX, F8E5M2_MAX
from fp4lightning.formats import pow2_floor, saturating_cast_

__all__ = [
    "FP8_FORMATS",
    "WIRE_FORMATS",
    "CommState",
    "fp8_compress_hook",
    "fp8_async_gather_hook",
    "allreduce_counting_hook",
    "hook_for_format",
    "fp8_all_reduce_mean_",
    "ring_all_reduce_bytes",
]

log = logging.getLogger(__name__)

# name -> (torch dtype, largest finite magnitude)
FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, F8E4M3_MAX),  # 448
    "e5m2": (torch.float8_e5m2, F8E5M2_MAX),  # 57344
}
#: wire formats of the gradient all-reduce (FP4DDPStrategy(grad_format=...)); not the dY formats of
#: the backward GeMMs (fp4lightning.constants.DY_FORMATS)
WIRE_FORMATS = ("e4m3", "e5m2", "bf16", "fp32")
SCHEMES = ("reduce_scatter", "all_gather", "async_all_gather")

# 2^126 keeps the scale finite in fp32 even for an amax of a few subnormals.
_MAX_SCALE_EXP = 126

# recent torch deprecates all_gather_into_tensor in favour of all_gather_single (same semantics)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommState:
    """State shared by the gradient communication hooks of one DDP model.

    Args:
        grad_format: wire format of the gradients: ``"e4m3"`` (default, the paper's), ``"e5m2"``,
            ``"bf16"`` (PyTorch's ``bf16_compress_hook``) or ``"fp32"`` (plain all-reduce).
        process_group: group to reduce over; ``None`` means the default (world) group.
        scheme: FP8 exchange, ``"reduce_scatter"`` (all_to_all + all_gather, default),
            ``"all_gather"`` (the fallback: all_gather of the whole FP8 payload) or
            ``"async_all_gather"`` (:func:`fp8_async_gather_hook`: one asynchronous all_gather per bucket,
            each rank's own scales in the payload, overlapped with backward; ``N (W-1)`` bytes, which
            equals the reduce-scatter's ``2 N (W-1) / W`` at W = 2).
        check_finite: for ``bf16``/``fp32`` also record whether the reduced gradient is finite
            (costs one pass over the bucket; the FP8 hook gets this for free from its amax).

    Counters (read by the strategy, reset per optimizer step with :meth:`pop_step`):
        ``step_bytes``: bytes this rank sent since the last ``pop_step``;
        ``step_nonfinite``: some bucket was non-finite on some rank since the last ``pop_step``;
        ``total_bytes``, ``buckets``: running totals.
    """

    grad_format: str = "e4m3"
    process_group: Optional[dist.ProcessGroup] = None
    scheme: str = "reduce_scatter"
    check_finite: bool = True
    step_bytes: int = 0
    step_nonfinite: bool = False
    total_bytes: int = 0
    buckets: int = 0
    _fallback_logged: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.grad_format not in WIRE_FORMATS:
            raise ValueError(
                f"grad_format={self.grad_format!r} is not supported; choose one of {WIRE_FORMATS} "
                "('e4m3' is the paper's FP8 gradient format)."
            )
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme={self.scheme!r} is not supported; choose one of {SCHEMES}.")

    def add_bytes(self, n: int) -> None:
        self.step_bytes += n
        self.total_bytes += n

    def pop_step(self) -> tuple[int, bool]:
        """Return ``(bytes sent, saw non-finite)`` since the last call and reset both."""
        out = (self.step_bytes, self.step_nonfinite)
        self.step_bytes = 0
        self.step_nonfinite = False
        return out


# ---------------------------------------------------------------------------------------------
# byte accounting: what one rank puts on the wire


def ring_all_reduce_bytes(numel: int, itemsize: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements (reduce-scatter + all-gather,
    each ``W - 1`` steps of one ``ceil(numel / W)``-element chunk)."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * math.ceil(numel / world_size) * itemsize


# ---------------------------------------------------------------------------------------------
# FP8 quantisation with per-tensor power-of-two scales


def _pow2_scales(amax: Tensor, fp8_max: float) -> Tensor:
    """Largest power of two ``s`` with ``amax * s <= fp8_max`` (1 where amax == 0), fp32."""
    a = amax.double()
    s = pow2_floor(fp8_max / a.clamp_min(torch.finfo(torch.float64).tiny))
    s = s.clamp(2.0**-_MAX_SCALE_EXP, 2.0**_MAX_SCALE_EXP)
    # the division can round up onto a power of two just above the true quotient
    s = torch.where(a * s > fp8_max, s * 0.5, s)
    return torch.where(a > 0, s, torch.ones_like(s)).float()


def _abs_max(seg: Tensor) -> Tensor:
    if seg.numel() == 0:
        return seg.new_zeros((), dtype=torch.float32)
    # aminmax reads the data once without allocating |x|; NaN propagates, unlike in a MAX collective
    lo, hi = torch.aminmax(seg)
    return torch.maximum(hi, lo.neg()).float()


def _decode_fp8_raw_into(codes: Tensor, fmt: str, out: Tensor) -> float:
    """Write the FP8 ``codes`` (uint8) into fp32 ``out`` up to a power-of-two factor, which is
    returned: the exact values are ``out * factor`` (the caller folds it into its own scaling)."""
    if fmt == "e4m3" and codes.device.type == "cpu":
        # torch's CPU float8->float cast is scalar code (~6 ns/element). The e4m3 bits s.eeee.mmm placed
        # as fp16 bits s.0eeee.mmm0000000 are the value / 2^8 (subnormals line up too), and fp16->fp32 is
        # vectorised. Sign-extending int8 -> int16 and shifting by 7 puts the sign in bit 15 but also
        # sets bit 14, which the mask clears. Code 0x7F (NaN) never occurs: the input was finite, saturated.
        bits = codes.view(torch.int8).to(torch.int16)
        bits.bitwise_left_shift_(7).bitwise_and_(~0x4000)
        out.copy_(bits.view(torch.float16))
        return 256.0
    out.copy_(codes.view(FP8_FORMATS[fmt][0]))
    return 1.0


def _decode_fp8_exact_view(codes: Tensor, fmt: str) -> tuple[Tensor, float]:
    """FP8 ``codes`` (uint8) as a tensor that holds the values exactly up to the returned power-of-two
    factor and that fp32 arithmetic accepts: fp16 on CPU for e4m3 (the bit trick of
    :func:`_decode_fp8_raw_into` without its final fp32 copy), else fp32."""
    if fmt == "e4m3" and codes.device.type == "cpu":
        bits = codes.view(torch.int8).to(torch.int16)
        return bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16), 256.0
    return codes.view(FP8_FORMATS[fmt][0]).float(), 1.0


def _decode_fp8_into(codes: Tensor, fmt: str, out: Tensor) -> Tensor:
    """Exact fp32 values of the FP8 ``codes`` (uint8) written into ``out``."""
    factor = _decode_fp8_raw_into(codes, fmt, out)
    return out.mul_(factor) if factor != 1.0 else out


def fp8_all_reduce_mean_(
    flat: Tensor,
    sizes: Optional[Sequence[int]] = None,
    state: Optional[CommState] = None,
) -> Tensor:
    """Average ``flat`` over the ranks of ``state.process_group`` with FP8 on the wire, in place.

    ``flat`` is a 1-D tensor (any float dtype) holding consecutive gradient tensors of
    ``sizes`` elements (one scale per tensor; ``None`` means one scale for all). Returns ``flat``,
    which afterwards holds the same values on every rank, or NaN everywhere on every rank if any
    rank's input was non-finite. Counts sent bytes in ``state``.
    """
    state = state if state is not None else CommState()
    fmt = state.grad_format
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8_all_reduce_mean_ needs an FP8 grad_format ('e4m3' or 'e5m2'), got {fmt!r}.")
    if flat.dim() != 1:
        raise ValueError(f"expected a flat 1-D gradient buffer, got shape {tuple(flat.shape)}.")
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    n = flat.numel()
    sizes = [n] if sizes is None or sum(sizes) != n else list(sizes)
    state.buckets += 1
    dtype8, fmax = FP8_FORMATS[fmt]

    # x is scratch from here on: the bucket buffer itself (overwritten with the result anyway) or an fp32 copy
    x = flat if flat.dtype == torch.float32 else flat.float()
    segs = x.split(sizes)

    # ---- 1. agree on per-tensor amax and on finiteness
    amax = torch.stack([_abs_max(seg) for seg in segs])  # (T,)
    nonfinite = ~torch.isfinite(amax).all()
    stats = torch.cat([torch.nan_to_num(amax, nan=0.0, posinf=0.0), nonfinite.float().view(1)])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    state.add_bytes(ring_all_reduce_bytes(stats.numel(), stats.element_size(), world))
    if stats[-1].item() > 0:
        state.step_nonfinite = True
        return flat.fill_(float("nan"))

    # ---- 2. common power-of-two scale per tensor (identical on every rank), quantise
    scales = _pow2_scales(stats[:-1], fmax).tolist()
    for seg, s in zip(segs, scales):
        seg.mul_(s)  # exact: s is a power of two
    use_rs = state.scheme == "reduce_scatter" and world > 1
    chunk = math.ceil(n / world)
    codes8 = torch.empty(chunk * world if use_rs else n, dtype=dtype8, device=x.device)
    codes8.view(torch.uint8)[n:].zero_()  # byte 0 is +0.0 in both FP8 formats: padding adds nothing
    saturating_cast_(x, codes8[:n])
    codes = codes8.view(torch.uint8)

    # ---- 3. exchange and reduce in fp32; the mean (scaled domain, up to `factor`) lands in x
    if use_rs:
        try:
            factor = _reduce_scatter_all_gather(codes, n, fmt, world, group, state, out=x)
        except _MissingCollective as err:
            if not state._fallback_logged:
                log.warning(
                    "FP8 gradient sync: backend %r lacks all_to_all (%s); falling back to all_gather of the "
                    "FP8 payload (N*(W-1) bytes per rank instead of 2N*(W-1)/W).",
                    dist.get_backend(group),
                    err,
                )
                state._fallback_logged = True
            state.scheme = "all_gather"
            factor = _all_gather_sum(codes[:n], fmt, world, group, state, out=x)
    else:
        factor = _all_gather_sum(codes, fmt, world, group, state, out=x)

    for seg, s in zip(segs, scales):
        m = factor / s  # a power of two: exact
        if m < 2.0**127:
            seg.mul_(m)
        else:  # amax near fp32's max: m would overflow as an fp32 scalar
            seg.mul_(factor).mul_(1.0 / s)
    if x is not flat:
        flat.copy_(x)
    return flat


class _MissingCollective(RuntimeError):
    """The backend does not implement all_to_all."""


def _reduce_scatter_all_gather(
    codes: Tensor, n: int, fmt: str, world: int, group: dist.ProcessGroup, state: CommState, out: Tensor
) -> float:
    chunk = codes.numel() // world
    received = torch.empty_like(codes)
    try:
        dist.all_to_all_single(received, codes, group=group)  # row j: rank j's codes of my chunk
    except (RuntimeError, NotImplementedError, ValueError) as err:
        # only this first collective may be missing; later failures are real errors
        raise _MissingCollective(str(err)) from err
    state.add_bytes((world - 1) * chunk)
    rows = received.view(world, chunk)
    mean = torch.empty(chunk, device=codes.device)
    factor = _decode_fp8_raw_into(rows[0], fmt, mean)
    tmp = torch.empty_like(mean)
    for j in range(1, world):
        _decode_fp8_raw_into(rows[j], fmt, tmp)
        mean += tmp
    mean.mul_(factor).div_(world)
    # |mean| <= common amax * scale <= FP8_MAX, so re-quantising with the same scale cannot overflow
    reduced = saturating_cast_(mean, torch.empty(chunk, dtype=FP8_FORMATS[fmt][0], device=codes.device))
    gathered = torch.empty_like(codes)
    _all_gather_single(gathered, reduced.view(torch.uint8), group=group)
    state.add_bytes((world - 1) * chunk)
    return _decode_fp8_raw_into(gathered[:n], fmt, out)


def _all_gather_sum(
    codes: Tensor, fmt: str, world: int, group: dist.ProcessGroup, state: CommState, out: Tensor
) -> float:
    n = codes.numel()
    if world == 1:
        return _decode_fp8_raw_into(codes, fmt, out)
    parts = [torch.empty_like(codes) for _ in range(world)]
    dist.all_gather(parts, codes, group=group)
    state.add_bytes((world - 1) * n)
    # every rank sums the same bytes in the same (rank) order: bit-identical results
    factor = _decode_fp8_raw_into(parts[0], fmt, out)
    tmp = torch.empty(n, device=codes.device)
    for p in parts[1:]:
        _decode_fp8_raw_into(p, fmt, tmp)
        out += tmp
    out.div_(world)
    return factor


# ---------------------------------------------------------------------------------------------
# DDP communication hooks


def _completed(t: Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def fp8_compress_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients across ranks with FP8 on the wire.

    Register with ``ddp_model.register_comm_hook(CommState("e4m3"), fp8_compress_hook)``.
    One scale per gradient tensor of the bucket; see the module docstring for the algorithm.
    """
    buf = bucket.buffer()
    sizes = [g.numel() for g in bucket.gradients()]
    fp8_all_reduce_mean_(buf, sizes, state)
    return _completed(buf)


def fp8_async_gather_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: FP8 gradient mean with one asynchronous collective per bucket.

    Each rank scales every gradient tensor of the bucket by the power of two of its *own* amax
    (``2^floor(log2(FP8_MAX / amax))``), casts to FP8 and appends the scales (fp32 bytes) to the codes;
    one ``all_gather`` (``async_op=True``) moves the payload, issued from the hook on the autograd thread
    in bucket order (the same order on every rank), and backward continues while it is in flight. The
    future's callback only decodes: every rank sums the W decoded payloads in rank order in fp32, each
    exactly rescaled by its sender's power-of-two scale, so the result is bit-identical on all ranks.
    No amax all-reduce is needed (the scales travel with the payload); a non-finite gradient on a rank
    travels as a NaN scale and turns the bucket NaN on every rank. One rounding (the sender's), not two.
    Bytes per rank: ``(W - 1) (N + 4 T)`` for N elements in T tensors.
    """
    fmt = state.grad_format
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8_async_gather_hook needs an FP8 grad_format ('e4m3' or 'e5m2'), got {fmt!r}.")
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    sizes = [g.numel() for g in bucket.gradients()]
    n, t = buf.numel(), len(sizes)
    state.buckets += 1
    dtype8, fmax = FP8_FORMATS[fmt]

    x = buf if buf.dtype == torch.float32 else buf.float()
    segs = x.split(sizes)
    amax = torch.stack([_abs_max(seg) for seg in segs])
    finite = torch.isfinite(amax)
    scales = torch.where(finite, _pow2_scales(torch.nan_to_num(amax, nan=0.0, posinf=0.0), fmax),
                         torch.full_like(amax, float("nan")))
    payload = torch.empty(n + 4 * t, dtype=torch.uint8, device=buf.device)
    payload[n:].view(torch.float32).copy_(scales)
    if bool(finite.all()):
        for seg, sc in zip(segs, scales.tolist()):
            seg.mul_(sc)  # exact: a power of two (x is scratch: the bucket is overwritten with the mean)
        saturating_cast_(x, payload[:n].view(dtype8))
    else:
        payload[:n].zero_()
    flat_gathered = torch.empty(world * (n + 4 * t), dtype=torch.uint8, device=buf.device)
    work = _all_gather_single(flat_gathered, payload, group=group, async_op=True)
    gathered = flat_gathered.view(world, n + 4 * t)
    state.add_bytes((world - 1) * (n + 4 * t))

    def _reduce(fut: torch.futures.Future) -> Tensor:
        fut.wait()
        all_scales = gathered[:, n:].contiguous().view(torch.float32).view(world, t)
        if not bool(torch.isfinite(all_scales).all()):
            state.step_nonfinite = True
            return buf.fill_(float("nan"))
        out = x  # fp32 scratch (the bucket itself for fp32 gradients)
        mult = (1.0 / world) / all_scales.double()  # powers of two when W is one: exact
        for r in range(world):
            vals, factor = _decode_fp8_exact_view(gathered[r, :n], fmt)
            for seg_out, seg_in, m in zip(out.split(sizes), vals.split(sizes), (mult[r] * factor).tolist()):
                if r == 0:
                    torch.mul(seg_in, m, out=seg_out)
                else:
                    seg_out.add_(seg_in, alpha=m)
        if out is not buf:
            buf.copy_(out)
        return buf

    return work.get_future().then(_reduce)


def allreduce_counting_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook for the ``fp32`` and ``bf16`` baselines.

    ``fp32`` is PyTorch's ``allreduce_hook`` (same result as DDP without a hook), ``bf16`` is its
    ``bf16_compress_hook``; both add the ring all-reduce bytes to ``state`` and record non-finite
    results so the strategy can skip the step.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    state.buckets += 1
    if state.grad_format == "bf16":
        fut = default_hooks.bf16_compress_hook(group, bucket)
        itemsize = 2
    elif state.grad_format == "fp32":
        fut = default_hooks.allreduce_hook(group, bucket)
        itemsize = buf.element_size()
    else:
        raise ValueError(f"allreduce_counting_hook handles 'fp32' and 'bf16', got {state.grad_format!r}.")
    state.add_bytes(ring_all_reduce_bytes(buf.numel(), itemsize, world))
    if not state.check_finite:
        return fut

    def _record(f: torch.futures.Future) -> Tensor:
        out = f.value()
        out = out[0] if isinstance(out, (list, tuple)) else out
        if not bool(torch.isfinite(out).all()):
            state.step_nonfinite = True
        return out

    return fut.then(_record)


def hook_for_format(
    grad_format: str, scheme: str = "reduce_scatter"
) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """The communication hook that implements ``grad_format`` (one of :data:`WIRE_FORMATS`) and ``scheme``."""
    if grad_format in FP8_FORMATS:
        return fp8_async_gather_hook if scheme == "async_all_gather" else fp8_compress_hook
    if grad_format in ("bf16", "fp32"):
        return allreduce_counting_hook
    raise ValueError(f"grad_format={grad_format!r} is not supported; choose one of {WIRE_FORMATS}.")
