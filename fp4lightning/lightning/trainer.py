"""``fp4lightning.Trainer``: Lightning's Trainer, plus ``precision="fp4"`` (docs/lightning.md).

Lightning's precision strings are a closed list with no registry (``Trainer(precision="fp4")``
raises in ``lightning.fabric.connector``), so FP4 enters through the two doors Lightning does
leave open: a precision plugin in ``plugins=[...]``, or a strategy instance that carries one. This
subclass turns the string into those before Lightning sees it:

* ``"fp4"`` / ``"fp4-bf16"`` -> ``FP4Precision()`` (bf16 autocast around the FP4 GeMMs);
  ``"fp4-fp16"`` -> ``FP4Precision(compute_dtype="fp16")`` (fp16 autocast, dynamic loss scaling);
* with more than one device (or node), data parallelism uses
  ``fp4lightning.lightning.strategy.FP4DDPStrategy(precision_plugin=...)``, whose gradients travel in FP8;
  the same happens when an ``FP4Precision`` is passed in ``plugins=``.

Everything else is passed to ``lightning.pytorch.Trainer`` unchanged, and nothing in Lightning
is patched: ``lightning.pytorch.Trainer(plugins=[FP4Precision()])`` trains the same model.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Iterator
from typing import Any, Optional, Union, get_args

import lightning.pytorch as pl
from lightning.pytorch.accelerators import (
    Accelerator,
    AcceleratorRegistry,
    CPUAccelerator,
    CUDAAccelerator,
    MPSAccelerator,
)
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy

from fp4lightning.lightning.precision import FP4Precision
from fp4lightning.lightning.precision_names import FP4_PRECISIONS
from fp4lightning.lightning.strategy import FP4DDPStrategy, is_fsdp

__all__ = ["Trainer", "quiet_lightning"]

#: What Lightning prints on every run that no user can act on: torch 2.13 deprecates a pytree class
#: Lightning itself still builds, and tips advertising Lightning's cloud logger and model registry
#: (shown whenever the default logger or checkpoint callback is used). Silenced only while a
#: ``fp4lightning.Trainer`` is built or runs (a library does not change its caller's warning filters).
NOISE_WARNINGS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)
NOISE_LOG_SUBSTRINGS = ("litlogger", "litmodels")
#: ModelCheckpoint's warning that its folder already holds files: when a fit resumes from a
#: checkpoint, that folder holding the run's earlier checkpoints is the expected case
RESUME_WARNING = r"Checkpoint directory .* exists and is not empty"
#: the loggers Lightning's ``rank_zero_info`` writes to (it names the last of them imported)
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in NOISE_LOG_SUBSTRINGS)


@contextlib.contextmanager
def quiet_lightning(resuming: bool = False, extra_warnings: tuple[str, ...] = ()) -> Iterator[None]:
    """Hide :data:`NOISE_WARNINGS`, :data:`NOISE_LOG_SUBSTRINGS` and ``extra_warnings`` (message
    regexes) inside the block; with ``resuming`` also :data:`RESUME_WARNING`. Every other warning
    and log line passes."""
    drop = _DropNoise()
    logs = [logging.getLogger(name) for name in _RANK_ZERO_LOGGERS]
    for log in logs:
        log.addFilter(drop)
    try:
        with warnings.catch_warnings():
            for pattern in (*NOISE_WARNINGS, *extra_warnings, *((RESUME_WARNING,) if resuming else ())):
                warnings.filterwarnings("ignore", message=pattern)
            yield
    finally:
        for log in logs:
            log.removeFilter(drop)

# strategy strings that mean "DDP" -> FP4DDPStrategy keyword arguments giving the same behaviour
_DDP_STRATEGIES: dict[str, dict[str, Any]] = {
    "auto": {"start_method": "popen"},
    "ddp": {"start_method": "popen"},
    "ddp_spawn": {"start_method": "spawn"},
    "ddp_fork": {"start_method": "fork"},
    "ddp_notebook": {"start_method": "fork"},
    "ddp_find_unused_parameters_true": {"start_method": "popen", "find_unused_parameters": True},
}


def _lightning_precisions() -> tuple:
    # the Literal types Lightning validates against (private names: read only, never patched)
    from lightning.fabric.plugins.precision.precision import (
        _PRECISION_INPUT_INT,
        _PRECISION_INPUT_STR,
        _PRECISION_INPUT_STR_ALIAS,
    )

    return get_args(_PRECISION_INPUT_STR) + get_args(_PRECISION_INPUT_INT) + get_args(_PRECISION_INPUT_STR_ALIAS)


def _world_size(accelerator: Any, devices: Any, num_nodes: Any) -> Optional[int]:
    """How many processes Lightning will start, or None when it cannot be told up front.

    Uses the accelerators' public ``parse_devices`` / ``auto_device_count``; anything unusual is
    left to Lightning, which reports bad values with its own messages.
    """
    try:
        acc = _accelerator_class(accelerator)
        if acc is None:
            return None
        if devices == "auto":
            n = acc.auto_device_count()
        else:
            n = len(acc.get_parallel_devices(acc.parse_devices(devices)))
        return n * int(num_nodes)
    except Exception:
        return None


def _accelerator_class(accelerator: Any) -> Optional[type]:
    """The accelerator class Lightning will pick for ``accelerator`` (None: ``"gpu"`` without a GPU)."""
    if isinstance(accelerator, Accelerator):
        return type(accelerator)
    if accelerator not in ("auto", "gpu"):
        return type(AcceleratorRegistry.get(accelerator))
    if CUDAAccelerator.is_available():
        return CUDAAccelerator
    if MPSAccelerator.is_available():
        return MPSAccelerator
    return CPUAccelerator if accelerator == "auto" else None


class Trainer(pl.Trainer):
    """``lightning.pytorch.Trainer`` that also accepts ``precision="fp4"``, ``"fp4-bf16"``, ``"fp4-fp16"``.

    The FP4 strings map to :class:`~fp4lightning.lightning.precision.FP4Precision` (and, with more than one
    device, to ``FP4DDPStrategy``, which sends gradients in FP8). Every other argument and every
    other precision value behaves exactly as in Lightning's Trainer. For FP4 options (a preset,
    fp16 loss-scaler settings, reduced-precision optimizer states) pass the plugin instead:
    ``Trainer(plugins=[FP4Precision("fp4-no-dge", optimizer_states="fp8")])``.
    """

    def __init__(self, *, precision: Optional[Union[str, int]] = None, plugins: Any = None,
                 strategy: Union[str, Strategy] = "auto", **kwargs: Any) -> None:
        plugin_list = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        fp4_plugin: Optional[FP4Precision] = None
        if isinstance(precision, str) and precision in FP4_PRECISIONS:
            if any(isinstance(p, Precision) for p in plugin_list):
                raise ValueError(f"fp4lightning.Trainer: got both precision={precision!r} and a precision plugin in "
                                 "plugins=; choose one (FP4Precision(...) in plugins= takes every FP4 option)")
            fp4_plugin = FP4Precision(compute_dtype=FP4_PRECISIONS[precision])
            plugin_list.append(fp4_plugin)
            precision = None
        elif precision is not None:
            valid = _lightning_precisions()
            if valid and precision not in valid:
                raise ValueError(
                    f"Precision {precision!r} is invalid. Allowed precision values: "
                    f"{', '.join(repr(p) for p in FP4_PRECISIONS)} (FP4 training, fp4lightning) "
                    f"and Lightning's {', '.join(repr(p) for p in valid)}")
        else:
            fp4_plugin = next((p for p in plugin_list if isinstance(p, FP4Precision)), None)

        if fp4_plugin is not None and is_fsdp(strategy):
            raise ValueError(
                "fp4lightning.Trainer: Lightning's FSDP strategy only accepts its own FSDPPrecision plugin, so "
                "FP4Precision cannot drive it. For FSDP use precision='bf16-mixed' and convert the model in "
                "LightningModule.configure_model with fp4lightning.convert_to_fp4(model, config) (as "
                "fp4lightning.train.run does), or use strategy='ddp' for FP4 with FP8 gradient communication")
        if fp4_plugin is not None and isinstance(strategy, str) and strategy in _DDP_STRATEGIES:
            world = _world_size(kwargs.get("accelerator", "auto"), kwargs.get("devices", "auto"),
                                kwargs.get("num_nodes", 1))
            if world is not None and world > 1:
                # the plugin now travels with the strategy; Lightning refuses it in both places
                plugin_list = [p for p in plugin_list if p is not fp4_plugin]
                strategy = FP4DDPStrategy(precision_plugin=fp4_plugin, **_DDP_STRATEGIES[strategy])
        if precision is not None:
            kwargs["precision"] = precision
        with quiet_lightning():
            super().__init__(plugins=plugin_list or None, strategy=strategy, **kwargs)

    # Lightning's entry points, run inside quiet_lightning (a fit from a checkpoint is a resume)
    def fit(self, *args: Any, **kwargs: Any) -> None:
        ckpt_path = inspect.signature(pl.Trainer.fit).bind(self, *args, **kwargs).arguments.get("ckpt_path")
        with quiet_lightning(resuming=ckpt_path is not None):
            return super().fit(*args, **kwargs)

    def validate(self, *args: Any, **kwargs: Any) -> Any:
        with quiet_lightning():
            return super().validate(*args, **kwargs)

    def test(self, *args: Any, **kwargs: Any) -> Any:
        with quiet_lightning():
            return super().test(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with quiet_lightning():
            return super().predict(*args, **kwargs)


def _signature() -> inspect.Signature:
    # Lightning's own parameters, so that help(), IDEs and argument parsers (LightningCLI) see them;
    # precision widened from Lightning's closed Literal to admit the FP4 strings.
    sig = inspect.signature(pl.Trainer.__init__)
    params = [p.replace(annotation=Optional[Union[str, int]]) if p.name == "precision" else p
              for p in sig.parameters.values()]
    return sig.replace(parameters=params)


Trainer.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
for _name in ("fit", "validate", "test", "predict"):  # Lightning's signatures and docs, for help() and IDEs
    _method = getattr(Trainer, _name)
    _method.__signature__ = inspect.signature(getattr(pl.Trainer, _name))
    _method.__doc__ = getattr(pl.Trainer, _name).__doc__
