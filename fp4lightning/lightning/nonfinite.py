"""One policy for non-finite steps, for every precision (docs/training.md, "Non-finite steps").

A NaN or inf anywhere in a step (the data, an activation, dY, a gradient, the loss) ends up
in the gradients after backward. The policy:

* such a step is **skipped**: the optimizer does not run, so the weights and the optimizer
  state stay as they were (the learning-rate schedule and the step counter move on);
* every skip is **counted** (``train/nonfinite_skips``) and reported on rank 0;
* after ``max_consecutive`` skips in a row the run **stops** with :class:`NonFiniteError`
  (``fp4lightning train`` then names the last good checkpoint and exits non-zero); it also
  stops at once if the weights themselves are non-finite, as no later step can recover;
* with data parallelism the decision is all-reduced, so every rank skips the same steps.

``FP4Precision`` applies the policy inside its ``optimizer_step`` (bf16 and fp16, where the
loss scaler also backs off), and so does ``FP4FabricPrecision`` for ``lightning.Fabric`` (both
through :func:`detect_nonfinite` and :func:`settle_step`, by way of
:class:`~fp4lightning.lightning.loss_scaler.StepPolicyState`); :class:`NonFiniteGuard` applies it for any other precision
plugin (``bf16-mixed``, ``32-true``) and logs the count for all of them. The checkpoint
writer (:mod:`fp4lightning.train.checkpoint`) refuses to write a checkpoint with a non-finite
weight.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Iterable

import lightning as L
import torch
from torch import Tensor
from torch.optim import Optimizer

from fp4lightning.lightning.log import host_scalar

__all__ = ["NonFiniteError", "NonFiniteGuard", "grads_nonfinite", "params_nonfinite", "nonfinite_flag", "any_flag",
           "detect_nonfinite", "settle_step",
           "DEFAULT_MAX_CONSECUTIVE"]

log = logging.getLogger(__name__)

#: consecutive skipped steps after which a run is considered diverged
DEFAULT_MAX_CONSECUTIVE = 20


class NonFiniteError(RuntimeError):
    """Training stopped because its steps (or weights) stayed non-finite; the message names the step."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


def _grouped(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


@torch.no_grad()
def nonfinite_flag(tensors: Iterable[Tensor]) -> Tensor | None:
    """A one-element float32 tensor on the first tensor's device, 1.0 where any of ``tensors`` holds an inf
    or NaN, else 0.0; computed without reading it back (None when there are no float tensors)."""
    flags = []
    for gs in _grouped(t for t in tensors if t.is_floating_point()).values():
        # one fused pass per (device, dtype); max-norm of a set is inf/NaN iff one element is
        norms = torch._foreach_norm(gs, float("inf"))
        flags.append((~torch.isfinite(torch.stack(norms))).any())
    return any_flag(flags)


def any_flag(flags: list[Tensor]) -> Tensor | None:
    """The flags OR-ed on the first one's device as a one-element float32 tensor (no host read)."""
    if not flags:
        return None
    # a DTensor's flag (FSDP2's sharded gradients) as the plain tensor of the whole, as bool() reads it
    flags = [f.full_tensor() if hasattr(f, "full_tensor") else f for f in flags]
    device = flags[0].device
    return torch.stack([f.reshape(()).to(device, torch.float32) for f in flags]).amax().reshape(1)


def _any_nonfinite(tensors: Iterable[Tensor]) -> bool:
    flag = nonfinite_flag(tensors)
    return bool(flag) if flag is not None else False


def grads_nonfinite(optimizer: Optimizer) -> bool:
    """True if any gradient of ``optimizer``'s parameters holds an inf or NaN."""
    return _any_nonfinite(_grads(optimizer))


def _grads(optimizer: Optimizer) -> list[Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def params_nonfinite(params: Iterable[Tensor]) -> bool:
    """True if any of ``params`` holds an inf or NaN."""
    return _any_nonfinite(params)


def all_ranks_any(flag: bool | Tensor | None, like: Tensor | None = None) -> bool:
    """``flag`` (a bool, or a one-element tensor from :func:`nonfinite_flag`; None is False) OR-ed over the
    default process group (``flag`` itself when not distributed).

    A tensor flag is reduced where it lies (NCCL: on the GPU) and read once, after the all-reduce: one
    host synchronisation per call, on any number of ranks."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag) if flag is not None else False
    if dist.get_backend() == "gloo":
        device = torch.device("cpu")
    elif isinstance(flag, Tensor):
        device = flag.device
    else:
        device = like.device if like is not None else torch.device("cuda", torch.cuda.current_device())
    if isinstance(flag, Tensor):
        t = flag.reshape(1).to(device, torch.float32)
    else:  # a fill, not a host-to-device copy of a Python number
        t = (torch.ones if flag else torch.zeros)(1, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def detect_nonfinite(optimizer: Optimizer, scaler: Any = None) -> bool:
    """Unscale ``optimizer``'s gradients (fp16: ``scaler.unscale_``) or check them (bf16), then OR the
    result over the ranks: True if any rank holds an inf/NaN gradient. Every rank must call it; it reads
    the device once."""
    found = scaler.unscale_flag_(optimizer) if scaler is not None else nonfinite_flag(_grads(optimizer))
    # DDP's all-reduce already spreads a NaN to every rank; sharded gradients (FSDP) do not
    return all_ranks_any(found)


def settle_step(found_inf: bool, counter: "SkipCounter", step: int, params: Iterable[Tensor],
                scaler: Any = None, who: str = "FP4Precision") -> bool:
    """Apply the policy to one optimizer step whose gradients were checked by :func:`detect_nonfinite`:
    count it (raising :class:`NonFiniteError` when the run must stop), move the fp16 loss scale, and
    return True when the step must be skipped. Shared by the Trainer and the Fabric plugin."""
    counter.record(found_inf, step, params)
    if scaler is not None:
        if found_inf:
            log.info("%s: inf/NaN gradient, loss scale %g -> %g", who, scaler.scale_value,
                     scaler.scale_value * scaler.backoff_factor)
        scaler.update(found_inf)
    return found_inf


def skip_message(step: int, consecutive: int, total: int) -> str:
    return (f"step {step}: non-finite (inf/NaN) gradient; step skipped, weights and optimizer state unchanged "
            f"({consecutive} in a row, {total} in this run)")


#: what a diverged Trainer run (fp4lightning train, recipes) can do; the Fabric plugin passes its own
TRAINER_FIX = ("lower optimizer.lr, check the data (fp4lightning train --verify-data), "
               "or raise trainer.max_nonfinite_skips")


def stop_error(step: int, consecutive: int, weights: bool = False, fix: str = TRAINER_FIX) -> NonFiniteError:
    if weights:
        what = f"the weights are non-finite at step {step}; no later step can recover"
    else:
        what = f"{consecutive} optimizer steps in a row had inf/NaN gradients (the last at step {step})"
    return NonFiniteError(
        f"training stopped: {what}. The run has diverged: {fix}", step=step)


class SkipCounter:
    """Consecutive and total skip counts with the stop rule (shared by the plugin and the callback)."""

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE, fix: str = TRAINER_FIX,
                 name: str = "max_consecutive"):
        if max_consecutive < 1:
            raise ValueError(f"{name} must be >= 1 (skipped steps in a row before training stops), "
                             f"got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self._fix = fix  # the stop message's advice
        self.consecutive = 0
        self.total = 0

    def record(self, skipped: bool, step: int, params: Iterable[Tensor] = ()) -> None:
        """Count one optimizer step; raise :class:`NonFiniteError` when the run must stop."""
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        _rank_zero_print(skip_message(step, self.consecutive, self.total))
        if self.consecutive >= self.max_consecutive:
            raise stop_error(step, self.consecutive, fix=self._fix)
        if params_nonfinite(params):
            raise stop_error(step, self.consecutive, weights=True, fix=self._fix)

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state.get("consecutive", 0))
        self.total = int(state.get("total", 0))


def _rank_zero_print(msg: str) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:
        print(msg, file=sys.stderr, flush=True)


class NonFiniteGuard(L.Callback):
    """Skip, count and stop on non-finite steps for precision plugins that do not do it themselves.

    With ``FP4Precision`` (which skips inside its ``optimizer_step``) this callback only logs
    the plugin's count; with any other plugin it checks the (unscaled, synchronised)
    gradients before the optimizer step, drops them when one is inf/NaN (optimizers skip
    parameters without a gradient, so weights and state stay untouched), and stops after
    ``max_consecutive`` skips in a row.
    """

    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE):
        self.counter = SkipCounter(max_consecutive)

    @staticmethod
    def _plugin_counter(trainer: "L.Trainer") -> SkipCounter | None:
        return getattr(trainer.precision_plugin, "nonfinite", None)

    def on_before_optimizer_step(self, trainer: "L.Trainer", pl_module: "L.LightningModule",
                                 optimizer: Optimizer) -> None:
        if self._plugin_counter(trainer) is not None:
            return  # FP4Precision decides, skips and counts
        found = trainer.strategy.reduce_boolean_decision(grads_nonfinite(optimizer), all=False)
        if found:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
        self.counter.record(found, trainer.global_step + 1, pl_module.parameters())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        counter = self._plugin_counter(trainer) or self.counter
        # a host tensor: a float would be copied to the GPU (a sync)
        pl_module.log("train/nonfinite_skips", host_scalar(counter.total), on_step=True, on_epoch=False, batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        return self.counter.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counter.load_state_dict(state_dict)
