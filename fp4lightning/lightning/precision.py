"""The Lightning precision plugin for FP4 training (arXiv 2501.17116, sections 3, 4 and 6).

:class:`FP4Precision` is what ``Trainer(precision="fp4")`` means. Like Lightning's
TransformerEngine plugin it is thin:

* ``convert_module`` swaps the model's ``nn.Linear`` layers for ``FP4Linear`` in place with
  :func:`~fp4lightning.nn.convert.convert_to_fp4` (the output head, embeddings and norms stay in
  high precision; Lightning's DDP strategy ignores the return value, hence in place);
* ``forward_context`` runs everything that is not an FP4 GeMM under ``torch.autocast`` in bf16
  (default) or fp16; the FP4 layers manage their own dtypes;
* with fp16, a :class:`~fp4lightning.lightning.loss_scaler.DynamicLossScaler`: the loss is multiplied by the scale in ``pre_backward``; in
  ``optimizer_step`` the gradients are unscaled, checked for inf/NaN, clipped (Lightning's
  ``gradient_clip_val``), and the step is skipped and the scale halved on overflow, or the scale
  doubled after ``growth_interval`` good steps. Its state goes into checkpoints;
* ``connect`` can swap ``torch.optim.AdamW`` for :class:`~fp4lightning.lightning.optim.LowPrecisionAdamW`
  (first moment FP8 E4M3, second FP16) so the optimizer states are in reduced precision too
  (:func:`~fp4lightning.lightning.optim.swap_to_low_precision_adamw`).

Non-finite steps (bf16 and fp16 alike, docs/training.md "Non-finite steps"): a step whose
gradients hold an inf/NaN is skipped, counted, and after ``max_consecutive_skips`` in a row
training stops with :class:`~fp4lightning.lightning.nonfinite.NonFiniteError`.

Data parallelism: the inf/NaN check reads each rank's own gradients after backward. DDP has
already synchronised them, and both a plain all-reduce and the FP8 hook of
:mod:`fp4lightning.distributed.comm` turn a non-finite gradient on any rank into a non-finite gradient on
every rank; the flag is also all-reduced (one scalar), so every rank reaches the same skip
decision and the same scale even when a value turns non-finite after synchronisation.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, Literal

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision.utils import _DtypeContextManager
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import LBFGS, Optimizer

from fp4lightning.config import FP4Config
from fp4lightning.lightning.loss_scaler import DynamicLossScaler, StepPolicyState
from fp4lightning.lightning.nonfinite import DEFAULT_MAX_CONSECUTIVE
from fp4lightning.lightning.optim import REDUCED_STATE_FORMATS, swap_to_low_precision_adamw
from fp4lightning.nn.convert import convert_to_fp4, describe_conversion, fp4_modules
from fp4lightning.nn.linear import reuse_weight_quantization, weights_updated
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_linears
from fp4lightning.numerics.compile_progress import claim_notice
from fp4lightning.numerics.cpu_fused import compile_enabled

__all__ = ["FP4Precision", "COMPUTE_DTYPES", "convert_for_training"]


#: names accepted for ``compute_dtype`` -> the autocast dtype of the non-GeMM operations
COMPUTE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Lightning's model summary knows only its own precision names and warns on every fit that it counts
# 32 bits per parameter for ours; that is right (the weights are fp32 master copies) and cannot be
# told to it otherwise, so the warning says nothing a user can act on
warnings.filterwarnings("ignore", message=r"Precision fp4-(bf16|fp16) is not supported by the model summary")


def convert_for_training(module: nn.Module, config: FP4Config, module_filter_fn, weights_dtype: torch.dtype | None,
                         compute_dtype: torch.dtype) -> int:
    """What both FP4 plugins (Trainer and Fabric) do to the model, in place: cast the weights, swap the eligible
    ``nn.Linear`` layers for ``FP4Linear``, route the layers kept in high precision through the CPU's bf16
    GeMM emulation under bf16 compute. Returns the number of FP4 layers."""
    if weights_dtype is not None:
        module.to(dtype=weights_dtype)
    convert_to_fp4(module, config, module_filter_fn)
    if compute_dtype == torch.bfloat16:  # the layers kept in high precision (the output head)
        emulate_bf16_linears(module)
    return len(fp4_modules(module))


class FP4Precision(StepPolicyState, Precision):
    """FP4 GeMMs in every eligible ``nn.Linear``, bf16/fp16 autocast around them (arXiv 2501.17116).

    Args:
        config: an :class:`~fp4lightning.config.FP4Config` or a preset name (``"paper"``, the
            default; ``"w4a4-direct"``, ``"fp4-no-dge"``, ``"fp4-no-occ"``).
        compute_dtype: dtype of the non-GeMM operations under autocast: ``"bf16"`` (default) or
            ``"fp16"`` (adds dynamic loss scaling). A ``torch.dtype`` is accepted too.
        module_filter_fn: ``fn(module, fqn) -> bool``; False keeps that Linear in high precision.
            Replaces ``config.skip_modules`` (by default the output head: ``lm_head``, ``head``, ``output``).
        optimizer_states: ``None`` (default) keeps the optimizers of ``configure_optimizers``;
            ``"fp8"`` swaps each ``torch.optim.AdamW`` for :class:`~fp4lightning.lightning.optim.LowPrecisionAdamW`
            with an FP8 E4M3 first and FP16 second moment (MS-AMP O2); ``"fp16"`` keeps both in FP16.
        weights_dtype: ``None`` (default) leaves the parameters as built (fp32 for an ordinary model);
            ``torch.bfloat16`` stores them in bf16 (the optimizer then keeps fp32 master copies).
        device: autocast device type (``"cuda"``, ``"cpu"``, ...); by default the device the
            parameters are on when training starts.
        scaler: a :class:`DynamicLossScaler` to use with fp16 (default: a fresh one).
        max_consecutive_skips: a step whose gradients hold an inf/NaN is skipped (bf16 and fp16;
            weights and optimizer state untouched, the decision all-reduced across ranks); after
            this many in a row training stops with :class:`~fp4lightning.lightning.nonfinite.NonFiniteError`.
        reuse_weight_quantization: quantize each FP4 weight once per optimizer step instead of once per
            micro-batch (:func:`~fp4lightning.nn.linear.reuse_weight_quantization`; same bits). ``None``
            (default): when the Trainer accumulates gradients, where it saves work; ``False`` never (it
            holds the quantized weights from the forward to the optimizer step); ``True`` always.
    """

    precision: Literal["fp4-bf16", "fp4-fp16"] = "fp4-bf16"

    def __init__(
        self,
        config: FP4Config | str | None = None,
        *,
        compute_dtype: str | torch.dtype = "bf16",
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        optimizer_states: str | None = None,
        weights_dtype: torch.dtype | None = None,
        device: str | None = None,
        scaler: DynamicLossScaler | None = None,
        max_consecutive_skips: int = DEFAULT_MAX_CONSECUTIVE,
        reuse_weight_quantization: bool | None = None,
    ) -> None:
        if isinstance(config, str):
            config = FP4Config.from_preset(config)
        if config is not None and not isinstance(config, FP4Config):
            raise TypeError(f"FP4Precision: config must be an FP4Config or a preset name, got {type(config).__name__}")
        self.config = config or FP4Config()
        self.module_filter_fn = module_filter_fn
        if isinstance(compute_dtype, torch.dtype):
            names = {v: k for k, v in COMPUTE_DTYPES.items()}
            if compute_dtype not in names:
                raise ValueError(f"FP4Precision: compute_dtype={compute_dtype} is not one of {list(COMPUTE_DTYPES)}")
            compute_dtype = names[compute_dtype]
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"FP4Precision: compute_dtype={compute_dtype!r} is not one of {list(COMPUTE_DTYPES)}")
        self.compute_dtype = COMPUTE_DTYPES[compute_dtype]
        self.precision = f"fp4-{compute_dtype}"  # type: ignore[assignment]
        if optimizer_states is not None and optimizer_states not in REDUCED_STATE_FORMATS:
            raise ValueError(f"FP4Precision: optimizer_states={optimizer_states!r} is not one of "
                             f"{[None, *REDUCED_STATE_FORMATS]}")
        self.optimizer_states = optimizer_states
        if weights_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"FP4Precision: weights_dtype={weights_dtype} is not supported; use None (as built), torch.float32 or "
                "torch.bfloat16 (fp16 weights would also need fp16 gradients, which the loss scaler cannot unscale "
                "without losing range)")
        self.weights_dtype = weights_dtype
        self.device = device
        self._resolved_device: str | None = None  # where connect() found the parameters
        self._init_step_policy("FP4Precision", compute_dtype, scaler, max_consecutive_skips)
        self._checked_device: str | None = None
        self._said_layers = False  # the layer summary (describe_conversion) is printed
        self._said_compile = False
        self.reuse_weight_quantization = reuse_weight_quantization
        self._module: nn.Module | None = None  # connect()'s model: its trainer says whether it accumulates

    # ------------------------------------------------------------------ model

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the eligible ``nn.Linear`` layers of ``module`` for ``FP4Linear``, in place."""
        _refuse_fabric(sys._getframe(1))
        n = convert_for_training(module, self.config, self.module_filter_fn, self.weights_dtype, self.compute_dtype)
        if n == 0:
            rank_zero_warn("FP4Precision: the model has no Linear layer that can run in FP4 (feature sizes must be "
                           "multiples of 16 and the output head is skipped); training runs in plain "
                           f"{self.precision.split('-')[1]} autocast")
        elif not self._said_layers:  # once per run: a validate() after fit converts again
            self._said_layers = True
            rank_zero_info(describe_conversion(module, self.config, self.module_filter_fn, who="FP4Precision"))
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        """Default dtype for tensors created under ``Trainer.init_module()`` (``weights_dtype``, if set)."""
        if self.weights_dtype is None:
            return contextlib.nullcontext()
        return _DtypeContextManager(self.weights_dtype)

    def module_init_context(self) -> AbstractContextManager:
        """Context for building the model (also on the meta device).

        Layers are not replaced while the model is built: ``convert_module`` converts them once
        the model exists, so the output-head rule and the shape checks apply the same way whether
        the model was built on the meta device, on a device, or before the Trainer existed.
        """
        stack = ExitStack()
        stack.enter_context(self.tensor_init_context())
        return stack

    def forward_context(self) -> AbstractContextManager:
        """Autocast to ``compute_dtype`` for the non-GeMM work; FP4Linear disables it inside."""
        device = self._device_type()
        return torch.autocast(device_type=device, dtype=self.compute_dtype, cache_enabled=False)

    @contextlib.contextmanager
    def train_step_context(self):
        """The forward's autocast, and the weights' FP4 quantization reused across the micro-batches of one
        optimizer step (``reuse_weight_quantization``; :meth:`optimizer_step` ends each step's cache)."""
        with self.forward_context(), reuse_weight_quantization(self._reuses_weights()):
            yield

    def _reuses_weights(self) -> bool:
        if self.reuse_weight_quantization is not None:
            return self.reuse_weight_quantization
        trainer = getattr(self._module, "_trainer", None)
        return int(getattr(trainer, "accumulate_grad_batches", 1) or 1) > 1

    def _device_type(self) -> str:
        if self.device is not None:
            return self.device
        if self._resolved_device is not None:
            return self._resolved_device
        return "cuda" if torch.cuda.is_available() else "cpu"

    # ------------------------------------------------------------------ optimizers

    def connect(self, model: nn.Module, optimizers: list[Optimizer],
                lr_schedulers: list[Any]) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Resolve the autocast device, check the dtype runs there, swap in reduced-precision AdamW."""
        self._module = model
        param = next(iter(model.parameters()), None)
        if param is not None and param.device.type != "meta":
            self._resolved_device = param.device.type
        self._check_compute_dtype(self._device_type())
        _say_grad_format(model)
        self._say_compile(model)
        if self.optimizer_states is not None:
            optimizers = [self._swap_optimizer(opt, lr_schedulers) for opt in optimizers]
        return model, optimizers, lr_schedulers

    def _say_compile(self, model: nn.Module) -> None:
        """Say once, before the first step, that it compiles the CPU path (fp4lightning.numerics.cpu_fused): a minute or
        more in which the progress bar stays at 0."""
        if self._said_compile or self._device_type() != "cpu" or not compile_enabled(torch.device("cpu")):
            return
        if fp4_modules(model):
            self._said_compile = True
            if claim_notice():  # once per process (fp4lightning.numerics.compile_progress)
                rank_zero_info("FP4Precision: compiling the CPU kernels (first step only; a minute or more)")

    def _check_compute_dtype(self, device: str) -> None:
        if self._checked_device == device:
            return
        name = self.precision.split("-")[1]
        other = "fp4-bf16" if name == "fp16" else "fp4-fp16"
        if not torch.amp.is_autocast_available(device):
            raise RuntimeError(f"FP4Precision: torch.autocast does not support device type {device!r}, so "
                               f"precision='{self.precision}' cannot run there; train on 'cpu' or 'cuda'")
        if device == "cuda" and self.compute_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise RuntimeError("FP4Precision: this GPU has no bf16 support; use precision='fp4-fp16' "
                               "(FP4Precision(compute_dtype='fp16'), with dynamic loss scaling)")
        try:  # a tiny probe: some backends accept the autocast context but have no kernels for the dtype
            with torch.autocast(device_type=device, dtype=self.compute_dtype):
                a = torch.ones(16, 16, device=device)
                out = a @ a
            if out.dtype != self.compute_dtype:
                raise RuntimeError(f"autocast produced {out.dtype}")
        except Exception as err:
            raise RuntimeError(f"FP4Precision: {name} autocast does not work on device {device!r} with torch "
                               f"{torch.__version__} ({err}); use precision='{other}'") from err
        self._checked_device = device

    def _swap_optimizer(self, optimizer: Optimizer, lr_schedulers: list[Any]) -> Optimizer:
        new, kept_because = swap_to_low_precision_adamw(optimizer, self.optimizer_states, lr_schedulers)
        if kept_because is not None:
            rank_zero_warn(f"FP4Precision(optimizer_states={self.optimizer_states!r}): {kept_because}")
        elif new is not optimizer:
            m_fmt, v_fmt = REDUCED_STATE_FORMATS[self.optimizer_states]  # type: ignore[index]
            rank_zero_info(f"FP4Precision: optimizer states in reduced precision (first moment {m_fmt}, "
                           f"second {v_fmt})")
        return new

    # ------------------------------------------------------------------ loss scaling

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return super().pre_backward(self._scale_loss(tensor), module)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any],  # type: ignore[override]
                       **kwargs: Any) -> Any:
        """Closure, (unscale,) check for inf/NaN on every rank, clip, then step or skip (and update the scale)."""
        if isinstance(optimizer, LBFGS):
            if self.scaler is None:  # LBFGS re-evaluates the closure inside step: Lightning's path, no check
                try:
                    return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
                finally:
                    weights_updated()
            raise RuntimeError("FP4Precision with fp16 loss scaling cannot drive LBFGS (it re-evaluates the closure "
                               "inside step); use precision='fp4-bf16'")
        closure_result = closure()
        # training_step returned None: Lightning skipped backward, there is nothing to step
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return closure_result
        # unscale before the hooks and clipping: both must see true gradient magnitudes
        found_inf = self._detect_nonfinite(optimizer)
        self._after_closure(model, optimizer)
        step = int(model.trainer.global_step) + 1 if getattr(model, "_trainer", None) is not None else 0
        # raises NonFiniteError when the run must stop
        if self._settle_step(found_inf, step, optimizer):
            return closure_result
        try:
            return optimizer.step(**kwargs)
        finally:
            weights_updated()  # the next forward quantizes the new weights



def _say_grad_format(model: nn.Module) -> None:
    """Say once, on rank 0, in which format a data-parallel strategy communicates gradients."""
    if not isinstance(model, DistributedDataParallel):
        return
    trainer = getattr(model.module, "_trainer", None)
    strategy = getattr(trainer, "strategy", None)
    name = type(strategy).__name__ if strategy is not None else "DDP"
    fmt = getattr(strategy, "grad_format", None)
    if fmt is not None:
        wire = f"FP8 {fmt.upper()}" if fmt in ("e4m3", "e5m2") else fmt
        rank_zero_info(f"FP4Precision: {name} all-reduces gradients in {wire} (arXiv 2501.17116, section 6)")
        return
    dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float32)
    rank_zero_warn(f"FP4Precision: {name} all-reduces gradients in {str(dtype).replace('torch.', '')} (plain DDP), "
                   "not in FP8 as the paper does (section 6); for FP8 gradient communication use "
                   "fp4lightning.Trainer(precision='fp4') or strategy=fp4lightning.FP4DDPStrategy()")


def _refuse_fabric(caller) -> None:
    """Fabric drives a plugin through other methods than the Trainer: point it at the Fabric plugin."""
    if isinstance(caller.f_locals.get("self"), Fabric):
        raise TypeError("FP4Precision is the Lightning Trainer's plugin and cannot drive lightning.Fabric "
                        "(fabric.backward would fail); use Fabric(plugins=[fp4lightning.lightning.fabric.FP4FabricPrecision()])")
