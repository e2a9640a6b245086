"""FP4 training with ``lightning.Fabric``: :class:`FP4FabricPrecision` (arXiv 2501.17116, sections 3-4).

Fabric and the Trainer call precision plugins through different methods (Fabric's
``backward(tensor, module)`` / ``optimizer_step(optimizer)`` against the Trainer's hooks that
reach ``model.trainer``), so :class:`~fp4lightning.lightning.precision.FP4Precision` only serves the
Trainer and refuses Fabric with a pointer here. This plugin shares its core: the same layer
swap (:func:`~fp4lightning.nn.convert.convert_to_fp4`, output head kept in high precision), the
same bf16/fp16 autocast around the non-GeMM work, the same non-finite-step policy
(:mod:`fp4lightning.lightning.nonfinite`: a step whose gradients hold an inf/NaN is skipped, counted, the
decision all-reduced across ranks, and training stops with ``NonFiniteError`` after
``max_consecutive_skips`` in a row), and for fp16 the same
:class:`~fp4lightning.lightning.loss_scaler.DynamicLossScaler` (halve the scale on a skipped step, grow it
after a run of good steps). See docs/lightning.md::

    fabric = L.Fabric(accelerator="cuda", plugins=[FP4FabricPrecision("paper")])
    model, optimizer = fabric.setup(model, optimizer)
    loss = model(x).loss
    fabric.backward(loss)
    optimizer.step()

Reduced-precision optimizer states: build :class:`~fp4lightning.lightning.optim.LowPrecisionAdamW`
yourself before ``fabric.setup`` (Fabric has no hook through which a plugin swaps optimizers).

FP8 gradient communication between data-parallel ranks (the paper's section 6):
:class:`FP4FabricDDPStrategy`, Fabric's ``DDPStrategy`` with the communication hook of
:class:`~fp4lightning.lightning.strategy.FP4DDPStrategy` (also ``L.Fabric(strategy="fp4_ddp")``)::

    fabric = L.Fabric(devices=2, strategy=FP4FabricDDPStrategy("e4m3"), plugins=[FP4FabricPrecision()])
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Literal

import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy as FabricDDPStrategy
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from fp4lightning.config import FP4Config
from fp4lightning.distributed.comm import CommState, register_hook
from fp4lightning.lightning.loss_scaler import DynamicLossScaler, StepPolicyState
from fp4lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE
from fp4lightning.lightning.precision import COMPUTE_DTYPES, convert_for_training
from fp4lightning.lightning.strategy import DDP_STRATEGY_NAMES
from fp4lightning.nn.convert import describe_conversion

__all__ = ["FP4FabricPrecision", "FP4FabricDDPStrategy"]


class FP4FabricPrecision(StepPolicyState, FabricPrecision):
    """Fabric precision plugin: FP4 GeMMs in every eligible ``nn.Linear``, bf16/fp16 autocast around them.

    Args:
        config: an :class:`~fp4lightning.config.FP4Config` or a preset name (default ``"paper"``).
        compute_dtype: ``"bf16"`` (default) or ``"fp16"`` (adds dynamic loss scaling).
        module_filter_fn: ``fn(module, fqn) -> bool``; False keeps that Linear in high precision.
        weights_dtype: ``None`` (as built) or ``torch.bfloat16`` for modules built under
            ``fabric.init_module()``.
        scaler: a :class:`~fp4lightning.lightning.loss_scaler.DynamicLossScaler` for fp16 (default: a fresh one).
        max_consecutive_skips: a step whose gradients hold an inf/NaN is skipped (bf16 and fp16;
            weights and optimizer state untouched, the decision all-reduced across ranks); after
            this many in a row ``optimizer.step()`` raises :class:`~fp4lightning.lightning.nonfinite.NonFiniteError`.
    """

    precision: Literal["fp4-bf16", "fp4-fp16"] = "fp4-bf16"

    def __init__(self, config: FP4Config | str | None = None, *, compute_dtype: str = "bf16",
                 module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
                 weights_dtype: torch.dtype | None = None, scaler: DynamicLossScaler | None = None,
                 max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE) -> None:
        if isinstance(config, str):
            config = FP4Config.from_preset(config)
        if config is not None and not isinstance(config, FP4Config):
            raise TypeError(f"FP4FabricPrecision: config must be an FP4Config or a preset name, "
                            f"got {type(config).__name__}")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"FP4FabricPrecision: compute_dtype={compute_dtype!r} is not one of {list(COMPUTE_DTYPES)}")
        self.config = config or FP4Config()
        self.module_filter_fn = module_filter_fn
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype]
        self.precision = f"fp4-{compute_dtype}"  # type: ignore[assignment]
        self.weights_dtype = weights_dtype
        self._init_step_policy("FP4FabricPrecision", compute_dtype, scaler, max_consecutive_skips,
                               fix="lower the learning rate, check the data, or raise "
                                   "FP4FabricPrecision(max_consecutive_skips=...)")
        self._steps = 0  # optimizer steps taken or skipped (Fabric has no global step)
        self._device: str | None = None
        self._found_inf: dict[int, bool] = {}  # optimizer id -> checked this step, with inf/NaN?

    # ------------------------------------------------------------------ model
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the eligible ``nn.Linear`` layers for ``FP4Linear`` in place (as the Trainer plugin)."""
        n = convert_for_training(module, self.config, self.module_filter_fn, self.weights_dtype, self.compute_dtype)
        if n == 0:
            rank_zero_warn("FP4FabricPrecision: the model has no Linear layer that can run in FP4; training runs in "
                           f"plain {self.precision.split('-')[1]} autocast")
        else:
            rank_zero_info(describe_conversion(module, self.config, self.module_filter_fn, who="FP4FabricPrecision"))
        param = next(iter(module.parameters()), None)
        if param is not None and param.device.type != "meta":
            self._device = param.device.type
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return nullcontext() if self.weights_dtype is None else _DtypeContextManager(self.weights_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        device = self._device or ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device_type=device, dtype=self.compute_dtype, cache_enabled=False)

    def convert_output(self, data: Any) -> Any:
        # the loss leaves autocast in its compute dtype; hand fp32 to the user's code (as Fabric's AMP)
        return apply_to_collection(data, Tensor, lambda t: t.float() if t.is_floating_point() else t)

    # ------------------------------------------------------------------ backward / step
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self._scale_loss(tensor).backward(*args, **kwargs)

    def _check(self, optimizer: Optimizer) -> bool:
        """Unscale (fp16) and check the gradients once per step, on every rank."""
        if id(optimizer) not in self._found_inf:
            self._found_inf[id(optimizer)] = self._detect_nonfinite(optimizer)
        return self._found_inf[id(optimizer)]

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Divide the gradients by the loss scale once per step (``fabric.clip_gradients`` calls this).

        When a gradient holds an inf/NaN the step will be skipped: the gradients are dropped here
        (set to None, as the Trainer's ``NonFiniteGuard`` does) so that clipping does not raise on a
        non-finite norm; ``optimizer.step()`` then skips and counts the step."""
        if self._check(optimizer):
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Unscale (fp16) and check the gradients on every rank, then step, or skip the step (fp16:
        and back the scale off); raises ``NonFiniteError`` after too many skips in a row."""
        found_inf = self._check(optimizer)
        del self._found_inf[id(optimizer)]
        self._steps += 1
        if self._settle_step(found_inf, self._steps, optimizer):
            return None
        return optimizer.step(**kwargs)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The loss scaler, the skip counts (with the optimizer-step count) and the recipe: put it into the
        state given to ``fabric.save`` (Fabric does not save a precision plugin by itself)."""
        out = super().state_dict()
        out["nonfinite"]["steps"] = self._steps
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._steps = int(state_dict.get("nonfinite", {}).get("steps", 0))


class FP4FabricDDPStrategy(FabricDDPStrategy):
    """Fabric's ``DDPStrategy`` with FP8 gradient all-reduce (arXiv 2501.17116, section 6).

    The gradient communication hook of :class:`~fp4lightning.lightning.strategy.FP4DDPStrategy` (the Trainer's),
    registered on the ``DistributedDataParallel`` wrapper ``fabric.setup`` builds, on every device type
    (gloo on CPU, NCCL on GPUs). A non-finite gradient on any rank becomes a NaN gradient on every rank,
    so :class:`FP4FabricPrecision` skips the same step everywhere. Registered with Fabric as
    ``"fp4_ddp"`` (``"fp4_ddp_spawn"``, ``"fp4_ddp_fork"``).

    Args:
        grad_format: gradient wire format: ``"e4m3"`` (default; the paper's), ``"e5m2"``, ``"bf16"`` or
            ``"fp32"`` (plain all-reduce, the baseline; bytes still counted).
        scheme: the FP8 exchange, as for ``FP4DDPStrategy`` (``"auto"``: one overlapped all-gather per
            bucket at 2 ranks, else reduce-scatter; see docs/distributed.md).
        **kwargs: everything else goes to Fabric's ``DDPStrategy`` (``process_group_backend``,
            ``start_method``, ``timeout``, and ``DistributedDataParallel``'s own keyword arguments).

    Attributes:
        comm_state: the :class:`~fp4lightning.distributed.comm.CommState` the hook works with.
        total_bytes_sent: bytes this rank has sent for gradient synchronisation so far.
    """

    def __init__(self, grad_format: str = "e4m3", *, scheme: str = "auto", **kwargs: Any) -> None:
        # validates grad_format and scheme with messages that list the choices
        self.comm_state = CommState(grad_format=grad_format, scheme=scheme)
        super().__init__(**kwargs)
        self.grad_format = grad_format

    def setup_module(self, module: nn.Module) -> DistributedDataParallel:
        ddp = super().setup_module(module)
        register_hook(ddp, self.comm_state, self.grad_format, self.world_size)
        fp8 = self.grad_format in ("e4m3", "e5m2")
        wire = f"FP8 {self.grad_format.upper()} ({self.comm_state.scheme})" if fp8 else self.grad_format
        rank_zero_info(f"FP4FabricDDPStrategy: gradients all-reduced in {wire}")
        return ddp

    @property
    def total_bytes_sent(self) -> int:
        """Bytes this rank has sent for gradient synchronisation since the strategy was created."""
        return self.comm_state.total_bytes

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fp4_ddp"`` (+ ``_spawn``/``_fork``) so ``L.Fabric(strategy="fp4_ddp")`` works."""
        for name, start_method in DDP_STRATEGY_NAMES:
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description="DDP with FP8 E4M3 gradient communication, "
                                           f"start_method {start_method!r}", start_method=start_method)


FP4FabricDDPStrategy.register_strategies(STRATEGY_REGISTRY)
