"""Dynamic loss scaling for fp16 compute (arXiv 2501.17116 trains in bf16; fp16 needs this), and the
step policy state of the two FP4 precision plugins.

One implementation shared by the Trainer plugin (:class:`~fp4lightning.lightning.precision.FP4Precision`)
and the Fabric plugin (:class:`~fp4lightning.lightning.fabric.FP4FabricPrecision`): the loss is multiplied
by the scale before backward; the gradients are unscaled and checked for inf/NaN before the step,
which is skipped and the scale halved on overflow, or the scale doubled after ``growth_interval``
good steps (docs/lightning.md). :class:`StepPolicyState` holds, for both plugins, the scaler and the
non-finite skip counter (:mod:`fp4lightning.lightning.nonfinite`), applies them to each optimizer step
and puts both into the plugin's checkpointed state.
"""
from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer

from fp4lightning.config import FP4Config
from fp4lightning.lightning.nonfinite import TRAINER_FIX, SkipCounter, any_flag, detect_nonfinite, settle_step

__all__ = ["DynamicLossScaler", "StepPolicyState"]


class DynamicLossScaler:
    """Dynamic loss scaling for fp16 (the scheme of ``torch.amp.GradScaler``, on any device).

    ``scale(loss)`` multiplies the loss before backward; ``unscale_(optimizer)`` divides the
    gradients of ``optimizer``'s parameters by the scale in place and returns whether any is
    inf/NaN; ``update(found_inf)`` halves the scale on overflow (and counts a skipped step) or
    doubles it after ``growth_interval`` consecutive good steps.

    Args:
        init_scale: starting scale (2^16, as torch).
        growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
        max_consecutive_skips: raise after this many overflowing steps in a row: a loss that is
            still non-finite after the scale has fallen that far is a diverged run, not an overflow.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, max_consecutive_skips: int = 50) -> None:
        if not init_scale > 0:
            raise ValueError(f"DynamicLossScaler: init_scale must be positive, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"DynamicLossScaler: growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1 or max_consecutive_skips < 1:
            raise ValueError("DynamicLossScaler: growth_interval and max_consecutive_skips must be >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.max_consecutive_skips = max_consecutive_skips
        self.good_steps = 0  # consecutive finite steps since the last change of scale
        self.consecutive_skips = 0
        self.skipped_steps = 0  # over the whole run

    def scale(self, loss: Tensor) -> Tensor:
        """``loss * scale`` (in fp32: an fp16 loss times 2^16 would overflow)."""
        return loss.float() * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: Optimizer) -> bool:
        """Divide the gradients by the scale in place; True if any gradient is inf or NaN."""
        flag = self.unscale_flag_(optimizer)
        return bool(flag) if flag is not None else False

    def unscale_flag_(self, optimizer: Optimizer) -> Tensor | None:
        """:meth:`unscale_` without the read: a one-element float32 tensor, 1.0 where a gradient is inf or
        NaN (None when no parameter has a gradient)."""
        grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FP4Precision's loss scaler does not support sparse gradients")
                grads.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found = []
        for (device, _), gs in grads.items():
            found_inf = torch.zeros(1, device=device)
            inv = torch.full((1,), 1.0 / self.scale_value, device=device)
            # one fused kernel per (device, dtype): unscale and flag non-finite values
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found_inf, inv)
            found.append(found_inf)
        return any_flag(found)

    def update(self, found_inf: bool) -> None:
        """Back off on overflow, grow after a run of good steps."""
        if found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= self.max_consecutive_skips:
                raise RuntimeError(
                    f"FP4Precision: {self.consecutive_skips} optimizer steps in a row had inf/NaN gradients; the loss "
                    f"scale is down to {self.scale_value:g}. The model has diverged (a NaN loss is not an fp16 "
                    "overflow): lower the learning rate, check the data, or try precision='fp4-bf16'."
                )
            return
        self.consecutive_skips = 0
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale_value *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "consecutive_skips": self.consecutive_skips, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_skips = int(state.get("consecutive_skips", 0))
        # growth/backoff settings stay those of this run's plugin: they are configuration, not state

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(scale={self.scale_value:g}, good_steps={self.good_steps}, "
                f"skipped_steps={self.skipped_steps})")


class StepPolicyState:
    """What both FP4 precision plugins (``FP4Precision`` and ``FP4FabricPrecision``) keep, apply and
    checkpoint of their step policy: the fp16 loss scale and the non-finite skip counts.

    A plugin calls :meth:`_init_step_policy` from its ``__init__``, :meth:`_scale_loss` before backward,
    and :meth:`_detect_nonfinite` then :meth:`_settle_step` in its optimizer step.
    """

    precision: str
    config: FP4Config
    scaler: DynamicLossScaler | None
    nonfinite: SkipCounter

    def _init_step_policy(self, who: str, compute_dtype: str, scaler: DynamicLossScaler | None,
                          max_consecutive_skips: int, fix: str = TRAINER_FIX) -> None:
        """The fp16 loss scaler (``scaler`` or a fresh one; None with bf16) and the skip counter;
        ``who`` names the plugin in messages, ``fix`` is the stop message's advice."""
        if scaler is not None and compute_dtype != "fp16":
            raise ValueError(f"{who}: a loss scaler is only used with compute_dtype='fp16'; bf16 has fp32's "
                             "range and needs none")
        self._policy_owner = who
        # the default scaler must not give up before the non-finite policy does (max_consecutive_skips)
        self.scaler = (scaler or DynamicLossScaler(max_consecutive_skips=max(50, max_consecutive_skips + 1))
                       ) if compute_dtype == "fp16" else None
        #: skipped-step counter of the non-finite policy (fp4lightning.lightning.nonfinite); read by NonFiniteGuard
        self.nonfinite = SkipCounter(max_consecutive_skips, fix=fix, name=f"{who}: max_consecutive_skips")

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale, or None with bf16."""
        return self.scaler.scale_value if self.scaler is not None else None

    def _scale_loss(self, loss: Tensor) -> Tensor:
        """``loss`` times the fp16 loss scale (unchanged with bf16)."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def _detect_nonfinite(self, optimizer: Optimizer) -> bool:
        """Unscale (fp16) and check ``optimizer``'s gradients; True if any rank holds an inf/NaN.
        Every rank must call it."""
        return detect_nonfinite(optimizer, self.scaler)

    def _settle_step(self, found_inf: bool, step: int, optimizer: Optimizer) -> bool:
        """Count the step, move the fp16 loss scale, and return True when the step must be skipped;
        raises ``NonFiniteError`` when the run must stop."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return settle_step(found_inf, self.nonfinite, step, params, self.scaler, self._policy_owner)

    def state_dict(self) -> dict[str, Any]:
        """The loss scaler, the skip counts and the recipe (Lightning saves it under ``checkpoint["FP4Precision"]``)."""
        out: dict[str, Any] = {"precision": self.precision, "config": self.config.to_dict()}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        out["nonfinite"] = self.nonfinite.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state_dict:
            self.scaler.load_state_dict(state_dict["scaler"])
        self.nonfinite.load_state_dict(state_dict.get("nonfinite", {}))
        saved = state_dict.get("precision")
        if saved is not None and saved != self.precision:
            rank_zero_info(f"{type(self).__name__}: checkpoint was written with precision={saved!r}, resuming with "
                           f"{self.precision!r}")
