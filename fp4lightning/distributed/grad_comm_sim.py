"""One device, the rounding of the data-parallel gradient exchange (recipe key ``trainer.grad_comm``).

With several devices the gradients travel in the recipe's wire format (:mod:`fp4lightning.distributed.comm`): each
gradient tensor of a bucket is scaled by the power of two of its amax (``2^floor(log2(FP8_MAX /
amax))``), cast to FP8 (round to nearest even, saturating), sent, decoded and averaged in fp32; in bf16
(PyTorch's ``bf16_compress_hook``) each element is rounded to bf16. A single device exchanges nothing,
so without this module a one-device run of a recipe would train on gradients the multi-device run of
the same recipe never sees.

:class:`GradCommSimulation` applies that round trip to every gradient before the optimizer step:
with one scale per gradient tensor, the granularity of the DDP hooks (one scale per tensor of a
bucket, so buckets need not be formed) and of FSDP's ``FP8ReduceScatter`` (one per parameter). The
encoder and decoder are the exchange's own (:mod:`fp4lightning.distributed.fp8_codec`), so the codes
are the exchange's bit for bit. At one rank every FP8 scheme of comm.py
reduces to this one rounding: the asynchronous all-gather rounds once with the rank's own scale, and
the reduce-scatter's second rounding re-encodes a value already on the grid of the same scale (exact).

What it models, exactly: the rounding of the *mean* gradient, Q((g_0 + ... + g_{W-1}) / W), with the
exchange's scales and codes. A W-rank run rounds each rank's part instead and averages the decoded
values, (Q(g_0) + ... + Q(g_{W-1})) / W (each rank its own scale at W = 2). The two agree bit for bit
only when every rank holds the same gradient (identical data). With each rank on its own data they are
two roundings of the same scheme within the same error bound (half an FP8 step per element, per rank),
not the same bits: on the 2-rank test model with each rank on half the batch, both land about 2% (in
norm) from the exact mean gradient and 2.9% from each other (``tests/test_whole_method.py``). So a
one-device run measures the cost of FP8 rounding of the gradient, not the exact trajectory of a W-rank run.

The round trip runs in ``on_before_optimizer_step``, where the exchange's result would stand: after
the gradient accumulation (DDP synchronises only the last micro-batch's backward, on the accumulated
gradient) and before gradient clipping. With fp16 loss scaling the gradients are unscaled by then;
the loss scale is a power of two, so the codes are those of the scaled gradient. A gradient holding
inf/NaN is left as it is: the non-finite policy skips that step (the exchange would turn the bucket
NaN, with the same outcome).
"""
from __future__ import annotations

import lightning as L
import torch
from torch import Tensor

from fp4lightning.distributed.comm import WIRE_FORMATS
from fp4lightning.distributed.fp8_codec import FP8_FORMATS, decode_sum_into, encode_fp8_into, pow2_scales, tensor_amax

__all__ = ["GradCommSimulation", "round_trip_"]


@torch.no_grad()
def round_trip_(grad: Tensor, fmt: str) -> Tensor:
    """``grad`` (any float dtype) <- what the one-rank exchange in wire format ``fmt`` returns, in place:
    FP8 (``"e4m3"``, ``"e5m2"``) codes with the power-of-two scale of the tensor's amax, decoded; ``"bf16"``
    rounded to bf16; ``"fp32"`` unchanged. A non-finite tensor is left unchanged."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"round_trip_: wire format {fmt!r} is not one of {WIRE_FORMATS}")
    if fmt == "fp32" or grad.numel() == 0:
        return grad
    if fmt == "bf16":  # bf16_compress_hook: the bucket cast to bf16 and back
        return grad.copy_(grad.to(torch.bfloat16))
    amax = tensor_amax(grad.reshape(-1))
    if not bool(torch.isfinite(amax)):
        return grad
    dtype8, fmax = FP8_FORMATS[fmt]
    flat = grad.reshape(-1)  # a view of a contiguous gradient, else a copy written back below
    scale = pow2_scales(amax.view(1), fmax)
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=grad.device)
    encode_fp8_into(flat, scale[0], codes, fmax, dtype8)
    inv = (1.0 / scale.double()).float()  # a power of two: exact
    decode_sum_into(codes.view(1, -1), inv, flat, dtype8, 1)  # one rank's row, divided by W = 1
    if flat.data_ptr() != grad.data_ptr() or not grad.is_contiguous():
        grad.copy_(flat.view_as(grad))
    return grad


class GradCommSimulation(L.Callback):
    """Round every gradient as the data-parallel exchange in wire format ``fmt`` would (one device).

    ``fmt`` is a wire format of :mod:`fp4lightning.distributed.comm` (``"e4m3"``, ``"e5m2"``, ``"bf16"``;
    ``"fp32"`` does nothing). ``fp4lightning train`` adds it when ``trainer.grad_comm`` is not fp32 and
    the run has one device; with more, the strategy's communication hook does the rounding itself.
    """

    def __init__(self, fmt: str):
        if fmt not in WIRE_FORMATS:
            raise ValueError(f"GradCommSimulation: wire format {fmt!r} is not one of {WIRE_FORMATS}")
        self.fmt = fmt

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.world_size > 1:  # the communication hook has rounded them already
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad
                    round_trip_(g.to_local() if hasattr(g, "to_local") else g, self.fmt)
