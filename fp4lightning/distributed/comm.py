"""FP8 gradient communication for data-parallel training (arXiv 2501.17116; docs/distributed.md).

The paper sends gradients between data-parallel ranks in FP8, reusing MS-AMP: a per-tensor amax is
all-reduced with MAX, every rank derives the same power-of-two scale from it, the gradient is cast to
FP8 E4M3 and summed. Stock NCCL and gloo have no FP8 sum (gloo refuses float8 tensors outright), so
this module implements the sum itself as a DDP communication hook, one call per gradient bucket:

1. ``amax`` of every gradient tensor in the bucket plus a non-finite flag -> ``all_reduce(MAX)``.
   The flag travels separately because NaN does not reliably survive a MAX reduction.
2. If any rank saw inf/NaN, every rank fills the bucket with NaN and stops: all ranks return the
   same non-finite gradient, so a loss scaler (or :class:`~fp4lightning.lightning.strategy.FP4DDPStrategy`)
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

This reduce-scatter hook completes its collectives synchronously and returns an already completed
future: issuing collectives from future callbacks on background threads could interleave buckets
differently on different ranks. :func:`fp8_async_gather_hook` needs one collective per bucket, so it
issues it asynchronously and overlaps it with the rest of backward; at W = 2 its bytes equal the
reduce-scatter's and it is the default there (``scheme="auto"``, :func:`resolve_scheme`). So by default
the amax is MAX-all-reduced (a shared scale) and a gradient is rounded twice (steps 3 and 4) from
W = 3 on, while at W = 2 each rank scales by its own amax, sends the scale with its codes and rounds
once; a shared scale there would need a synchronous amax all-reduce before any rank could encode,
which would undo the overlap. Neither divides by W before sending: the fp32 sum is divided after the
exchange. Every rank ends with the same bits either way (``tests/test_comm_amax.py``).

The FP8 encoding itself (scales, codes, decode-and-sum) is :mod:`fp4lightning.distributed.fp8_codec`,
shared with FSDP's FP8 reduce-scatter and the one-device simulation.
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

from fp4lightning.distributed.fp8_codec import (
    FP8_FORMATS,
    decode_sum_into,
    encode_fp8_into,
    mean_requantize_into,
    pow2_scales,
    tensor_amax,
)
from fp4lightning.errors import UserError

__all__ = [
    "WIRE_FORMATS",
    "CommState",
    "fp8_compress_hook",
    "fp8_async_gather_hook",
    "allreduce_counting_hook",
    "hook_for_format",
    "register_hook",
    "resolve_scheme",
    "fp8_all_reduce_mean_",
    "ring_all_reduce_bytes",
    "lost_peer",
    "PeerLostError",
]

log = logging.getLogger(__name__)

#: wire formats of the gradient all-reduce (FP4DDPStrategy(grad_format=...)); not the dY formats of
#: the backward GeMMs (fp4lightning.numerics.constants.DY_FORMATS)
WIRE_FORMATS = ("e4m3", "e5m2", "bf16", "fp32")
SCHEMES = ("auto", "reduce_scatter", "all_gather", "async_all_gather")

# recent torch deprecates all_gather_into_tensor in favour of all_gather_single (same semantics)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommState:
    """State shared by the gradient communication hooks of one DDP model.

    Args:
        grad_format: wire format of the gradients: ``"e4m3"`` (default, the paper's), ``"e5m2"``,
            ``"bf16"`` (PyTorch's ``bf16_compress_hook``) or ``"fp32"`` (plain all-reduce).
        process_group: group to reduce over; ``None`` means the default (world) group.
        scheme: FP8 exchange, ``"auto"`` (default: ``"async_all_gather"`` at W = 2, where its bytes equal
            the reduce-scatter's and it overlaps with backward, else ``"reduce_scatter"``; resolved by
            :func:`resolve_scheme` when the hook is chosen), ``"reduce_scatter"`` (all_to_all + all_gather),
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
    scheme: str = "auto"
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
# the synchronous FP8 all-reduce: amax all-reduce, then reduce-scatter + all-gather of the codes


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
    segs = flat.split(sizes)

    # ---- 1. agree on per-tensor amax and on finiteness
    amax = _global_amax(segs, group, world, state)
    if amax is None:
        state.step_nonfinite = True
        return flat.fill_(float("nan"))

    # ---- 2. common power-of-two scale per tensor (identical on every rank), quantise
    scales = pow2_scales(amax, fmax)
    use_rs = state.scheme in ("reduce_scatter", "auto") and world > 1  # this function is synchronous
    chunk = math.ceil(n / world)
    codes = torch.empty(chunk * world if use_rs else n, dtype=torch.uint8, device=flat.device)
    codes[n:].zero_()  # byte 0 is +0.0 in both FP8 formats: padding adds nothing
    for seg, s, c in zip(segs, scales, codes[:n].split(sizes)):
        encode_fp8_into(seg, s, c, fmax, dtype8)

    # ---- 3. exchange: the mean's FP8 codes (reduce-scatter) or every rank's codes (all-gather)
    rows = _exchange_codes(codes, n, use_rs, fmt, world, group, state)

    # ---- 4. decode (and, after an all-gather, sum in rank order), undo the scale, into the bucket
    divisor = 1 if rows.shape[0] == 1 else world
    inv = (1.0 / scales.double()).float()  # powers of two: exact
    for out, r, m in zip(segs, rows.split(sizes, dim=1), inv):
        decode_sum_into(r, m.expand(rows.shape[0]), out, dtype8, divisor)
    return flat


def _global_amax(segs: Sequence[Tensor], group: dist.ProcessGroup, world: int, state: CommState) -> Optional[Tensor]:
    """Each segment's amax, the maximum over all ranks (one ``all_reduce(MAX)``, bytes counted in ``state``);
    None when some rank holds an inf/NaN (a flag of its own: NaN does not reliably survive a MAX)."""
    amax = torch.stack([tensor_amax(seg) for seg in segs])  # (T,)
    nonfinite = ~torch.isfinite(amax).all()
    stats = torch.cat([torch.nan_to_num(amax, nan=0.0, posinf=0.0), nonfinite.float().view(1)])
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    state.add_bytes(ring_all_reduce_bytes(stats.numel(), stats.element_size(), world))
    if stats[-1].item() > 0:
        return None
    return stats[:-1]


def _exchange_codes(codes: Tensor, n: int, use_rs: bool, fmt: str, world: int, group: dist.ProcessGroup,
                    state: CommState) -> Tensor:
    """The FP8 codes to decode, as (R, n) rows: the mean's codes (R = 1) from the reduce-scatter, or every
    rank's codes (R = world) from an all-gather, the fallback where the backend lacks all_to_all."""
    if use_rs:
        try:
            return _reduce_scatter_all_gather(codes, fmt, world, group, state)[:n].view(1, n)
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
            codes = codes[:n]
    return _all_gather_rows(codes, world, group, state)


class _MissingCollective(RuntimeError):
    """The backend does not implement all_to_all."""


def _reduce_scatter_all_gather(
    codes: Tensor, fmt: str, world: int, group: dist.ProcessGroup, state: CommState
) -> Tensor:
    """Reduce-scatter (all_to_all, then each rank averages its chunk and re-quantises it with the same
    scale) and all-gather of FP8 ``codes`` (uint8, a multiple of ``world`` long); returns the gathered
    codes of the mean. |mean| <= the common amax * scale <= FP8_MAX, so the re-quantisation cannot
    saturate."""
    dtype8, fmax = FP8_FORMATS[fmt]
    chunk = codes.numel() // world
    received = torch.empty_like(codes)
    try:
        dist.all_to_all_single(received, codes, group=group)  # row j: rank j's codes of my chunk
    except (RuntimeError, NotImplementedError, ValueError) as err:
        # only this first collective may be missing; later failures are real errors
        raise _MissingCollective(str(err)) from err
    state.add_bytes((world - 1) * chunk)
    reduced = mean_requantize_into(received.view(world, chunk), torch.empty(chunk, dtype=torch.uint8,
                                    device=codes.device), fmax, dtype8)
    gathered = torch.empty_like(codes)
    _all_gather_single(gathered, reduced, group=group)
    state.add_bytes((world - 1) * chunk)
    return gathered


def _all_gather_rows(codes: Tensor, world: int, group: dist.ProcessGroup, state: CommState) -> Tensor:
    """Every rank's ``codes`` (uint8, n) as a (world, n) tensor, row r from rank r."""
    n = codes.numel()
    if world == 1:
        return codes.view(1, n)
    rows = torch.empty(world, n, dtype=torch.uint8, device=codes.device)
    _all_gather_single(rows.view(-1), codes, group=group)
    state.add_bytes((world - 1) * n)
    return rows


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


def _own_scale_payload(buf: Tensor, sizes: Sequence[int], fmt: str) -> Tensor:
    """One rank's payload for :func:`fp8_async_gather_hook`: ``uint8`` of ``4 T + N`` bytes, the T fp32
    per-tensor scales (power of two of this rank's own amax; NaN for a non-finite tensor) followed by the
    N FP8 codes (all zero when any tensor is non-finite).

    The scales come first so that they start at byte 0, where a float32 view is aligned whatever N is;
    after them, one-byte codes need no alignment. (Codes first put the scales at byte N, which a float32
    view refuses unless N is a multiple of 4.)"""
    dtype8, fmax = FP8_FORMATS[fmt]
    segs = buf.split(list(sizes))
    t = len(segs)
    amax = torch.stack([tensor_amax(seg) for seg in segs])
    finite = torch.isfinite(amax)
    scales = torch.where(finite, pow2_scales(torch.nan_to_num(amax, nan=0.0, posinf=0.0), fmax),
                         torch.full_like(amax, float("nan")))
    payload = torch.empty(4 * t + buf.numel(), dtype=torch.uint8, device=buf.device)
    payload[:4 * t].view(torch.float32).copy_(scales)
    codes = payload[4 * t:]
    if bool(finite.all()):
        for seg, sc, c in zip(segs, scales, codes.split(list(sizes))):
            encode_fp8_into(seg, sc, c, fmax, dtype8)
    else:
        codes.zero_()
    return payload


def _sum_own_scale_payloads(gathered: Tensor, out: Tensor, sizes: Sequence[int], fmt: str) -> bool:
    """``out`` <- the mean of the W payloads of :func:`_own_scale_payload` in ``gathered`` (W, 4 T + N):
    each decoded and rescaled by its sender's scales, summed in rank order in fp32, divided by W. Returns
    False, with ``out`` filled with NaN, when some sender's scale is non-finite."""
    dtype8 = FP8_FORMATS[fmt][0]
    world, t = gathered.shape[0], len(sizes)
    # copied into a fresh buffer: row r > 0 starts at byte r (4 T + N), which a float32 view refuses for odd N
    all_scales = torch.empty(world, 4 * t, dtype=torch.uint8, device=gathered.device)
    all_scales = all_scales.copy_(gathered[:, :4 * t]).view(torch.float32)  # (W, T)
    if not bool(torch.isfinite(all_scales).all()):
        out.fill_(float("nan"))
        return False
    inv = (1.0 / all_scales.double()).float().t()  # (T, W), powers of two: exact
    for o, rows, m in zip(out.split(list(sizes)), gathered[:, 4 * t:].split(list(sizes), dim=1), inv):
        decode_sum_into(rows, m, o, dtype8, world)  # rank order, then / W
    return True


def fp8_async_gather_hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: FP8 gradient mean with one asynchronous collective per bucket.

    Each rank scales every gradient tensor of the bucket by the power of two of its *own* amax
    (``2^floor(log2(FP8_MAX / amax))``), casts to FP8 and puts the scales (fp32 bytes) in front of the
    codes (:func:`_own_scale_payload`); one ``all_gather`` (``async_op=True``) moves the payload, issued
    from the hook on the autograd thread in bucket order (the same order on every rank), and backward
    continues while it is in flight. The future's callback only decodes: every rank sums the W decoded
    payloads in rank order in fp32, each exactly rescaled by its sender's power-of-two scale, so the result
    is bit-identical on all ranks. No amax all-reduce is needed (the scales travel with the payload); a
    non-finite gradient on a rank travels as a NaN scale and turns the bucket NaN on every rank. One
    rounding (the sender's), not two. Bytes per rank: ``(W - 1) (N + 4 T)`` for N elements in T tensors.
    """
    fmt = state.grad_format
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8_async_gather_hook needs an FP8 grad_format ('e4m3' or 'e5m2'), got {fmt!r}.")
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    sizes = [g.numel() for g in bucket.gradients()]
    state.buckets += 1

    payload = _own_scale_payload(buf, sizes, fmt)
    gathered = torch.empty(world, payload.numel(), dtype=torch.uint8, device=buf.device)
    work = _all_gather_single(gathered.view(-1), payload, group=group, async_op=True)
    state.add_bytes((world - 1) * payload.numel())

    def _reduce(fut: torch.futures.Future) -> Tensor:
        fut.wait()
        if not _sum_own_scale_payloads(gathered, buf, sizes, fmt):
            state.step_nonfinite = True
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


def resolve_scheme(scheme: str, world_size: int) -> str:
    """``"auto"`` -> ``"async_all_gather"`` at ``world_size == 2`` (the same bytes as the reduce-scatter,
    ``N``, one collective per bucket overlapped with backward, one FP8 rounding instead of two), else
    ``"reduce_scatter"`` (``2N(W-1)/W`` bytes against the all-gather's ``N(W-1)``); other schemes as given."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not supported; choose one of {SCHEMES}.")
    if scheme != "auto":
        return scheme
    return "async_all_gather" if world_size == 2 else "reduce_scatter"


def register_hook(ddp: Any, state: CommState, grad_format: str, world_size: int) -> None:
    """Register ``grad_format``'s hook on a ``DistributedDataParallel`` model with ``state`` (the default
    process group; an ``"auto"`` scheme resolved for ``world_size``). The Trainer's ``FP4DDPStrategy`` and
    Fabric's ``FP4FabricDDPStrategy`` both install their hook through this."""
    state.process_group = None  # the default group: the one Lightning / Fabric initialised
    state.scheme = resolve_scheme(state.scheme, world_size)
    ddp.register_comm_hook(state, hook_for_format(grad_format, state.scheme))


def hook_for_format(
    grad_format: str, scheme: str = "reduce_scatter", world_size: Optional[int] = None
) -> Callable[[Any, dist.GradBucket], torch.futures.Future]:
    """The communication hook that implements ``grad_format`` (one of :data:`WIRE_FORMATS`) and ``scheme``
    (``"auto"`` needs ``world_size``, see :func:`resolve_scheme`)."""
    if grad_format in FP8_FORMATS:
        if scheme == "auto":
            if world_size is None:
                raise ValueError("scheme='auto' depends on the world size; pass world_size= or name a scheme.")
            scheme = resolve_scheme(scheme, world_size)
        return fp8_async_gather_hook if scheme == "async_all_gather" else fp8_compress_hook
    if grad_format in ("bf16", "fp32"):
        return allreduce_counting_hook
    raise ValueError(f"grad_format={grad_format!r} is not supported; choose one of {WIRE_FORMATS}.")


# ---------------------------------------------------------------------------------------------
# a peer process that went away

#: what gloo reports (with the OS's wording under it) when the process at the other end of one of its
#: connections is gone: the peer's socket was reset or closed, or this rank wrote into a closed one
PEER_LOST_MESSAGES = ("connection reset by peer", "connection closed by peer", "broken pipe")


class PeerLostError(UserError):
    """Another rank of a multi-process run went away; the command stops with one line (exit status 2)."""


def lost_peer(exc: BaseException, rank: int, world_size: int) -> Optional[str]:
    """``"rank R"`` (or ``"another rank"``) when ``exc``, or an exception it was raised while handling, is
    a collective's error for a peer process that went away (killed, out of memory, crashed); else None.

    ``rank`` and ``world_size`` are this process's. With two ranks the lost one is the other; with more,
    gloo's message names only a socket address, which does not tell the rank."""
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError) and any(m in str(e).lower() for m in PEER_LOST_MESSAGES):
            return f"rank {1 - rank}" if world_size == 2 and rank in (0, 1) else "another rank"
        e = e.__cause__ or e.__context__
    return None
