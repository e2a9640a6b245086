"""Data-parallel strategy with FP8 gradient communication (arXiv 2501.17116; docs/distributed.md).

:class:`FP4DDPStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (gloo on CPU,
NCCL on GPUs, multi-node through Lightning's cluster environments and ``torchrun``) with three changes:

- it registers the gradient communication hook of :mod:`fp4lightning.distributed.comm` on every device type
  (stock Lightning registers comm hooks only on CUDA, so on CPU/gloo they are silently never called);
- it logs the bytes each rank sent per optimizer step (``comm/bytes_sent``) through the
  LightningModule's ``log``, so the saving is visible in any logger;
- when a gradient was non-finite on any rank, all ranks hold the same NaN gradient (the hook makes
  sure of that); with a loss scaler in the precision plugin the scaler skips the step and backs off,
  without one the strategy drops the gradients so the optimizer skips the step on every rank.

Any Lightning precision plugin can be passed as ``precision_plugin=`` (for example
``fp4lightning.lightning.precision.FP4Precision``); the strategy does not depend on it.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from fp4lightning.distributed.comm import CommState, register_hook

__all__ = ["FP4DDPStrategy", "FP4FSDPStrategy", "is_fsdp"]

log = logging.getLogger(__name__)

_NONFINITE_POLICIES = ("skip", "propagate")

#: the strategy names (Trainer and Fabric registries alike) and their process start methods
DDP_STRATEGY_NAMES = (("fp4_ddp", "popen"), ("fp4_ddp_spawn", "spawn"), ("fp4_ddp_fork", "fork"))


class FP4DDPStrategy(DDPStrategy):
    """DDP with FP8 (E4M3 by default) gradient all-reduce, byte logging and rank-consistent inf/NaN handling.

    Args:
        grad_format: gradient wire format: ``"e4m3"`` (default; the paper's), ``"e5m2"``, ``"bf16"``
            (PyTorch's ``bf16_compress_hook``) or ``"fp32"`` (plain DDP all-reduce, the baseline).
        scheme: FP8 exchange: ``"auto"`` (default: ``"async_all_gather"`` at W = 2, else
            ``"reduce_scatter"``), ``"reduce_scatter"`` (all_to_all + all_gather, ``2N(W-1)/W`` bytes) or
            ``"all_gather"`` (``N(W-1)`` bytes; used automatically where all_to_all is missing) or
            ``"async_all_gather"`` (one overlapped all_gather per bucket, ``N(W-1)`` bytes: the fastest
            at W = 2, where its bytes equal the reduce-scatter's; see docs/distributed.md).
        nonfinite: ``"skip"`` (default): a step whose synchronised gradient is non-finite is skipped on
            every rank (by the precision plugin's loss scaler if it has one, else by dropping the
            gradients before ``optimizer.step``); ``"propagate"``: leave the NaN gradients to the optimizer.
        log_bytes: log ``comm/bytes_sent`` (this rank, this step) and ``comm/nonfinite_steps``.
        precision_plugin: any Lightning precision plugin (e.g. ``FP4Precision()``).
        **kwargs: everything else goes to :class:`~lightning.pytorch.strategies.DDPStrategy`
            (``process_group_backend``, ``start_method``, ``static_graph``, ``bucket_cap_mb``, ...).

    Attributes:
        last_step_bytes: bytes this rank sent for gradient sync in the latest training batch
            (what ``comm/bytes_sent`` logs).
        total_bytes_sent: running total for this rank.
        nonfinite_steps: training batches whose synchronised gradient was inf/NaN.
        comm_state: the :class:`~fp4lightning.distributed.comm.CommState` the hook works with.
    """

    strategy_name = "fp4_ddp"

    def __init__(
        self,
        grad_format: str = "e4m3",
        *,
        scheme: Literal["auto", "reduce_scatter", "all_gather", "async_all_gather"] = "auto",
        nonfinite: Literal["skip", "propagate"] = "skip",
        log_bytes: bool = True,
        accelerator: Any = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(key) is not None:
                raise ValueError(
                    f"FP4DDPStrategy installs its own gradient communication hook; `{key}` cannot be combined "
                    "with it. Use lightning's DDPStrategy for a custom hook, or choose `grad_format=`."
                )
        if nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r} is not supported; choose one of {_NONFINITE_POLICIES}.")
        # validates grad_format and scheme with messages that list the choices
        self.comm_state = CommState(grad_format=grad_format, scheme=scheme)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self.grad_format = grad_format
        self.nonfinite = nonfinite
        self.log_bytes = log_bytes
        self.last_step_bytes = 0
        self.nonfinite_steps = 0
        self._batch_bytes = 0
        self._batch_nonfinite = False
        self._hook_registered = False

    @property
    def total_bytes_sent(self) -> int:
        """Bytes this rank has sent for gradient synchronisation since the strategy was created."""
        return self.comm_state.total_bytes

    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers comm hooks only on CUDA; the hook below is device-agnostic (gloo and NCCL).
        assert isinstance(self.model, DistributedDataParallel)
        register_hook(self.model, self.comm_state, self.grad_format, self.world_size)
        self._hook_registered = True
        log.debug("FP4DDPStrategy: registered %s gradient communication hook", self.grad_format)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # Counters cover one training batch: in manual optimisation several optimizer steps can follow
        # one backward, and all of them must see the same non-finite decision.
        self._batch_bytes = 0
        self._batch_nonfinite = False
        super().on_train_batch_start(batch, batch_idx)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Run the step; skip it on every rank if the synchronised gradient is non-finite; log bytes sent."""
        # FP4Precision skips (and counts) non-finite steps itself; so does a loss scaler
        has_scaler = getattr(self.precision_plugin, "scaler", None) is not None or \
            getattr(self.precision_plugin, "nonfinite", None) is not None

        def closure_with_sync_check() -> Any:
            result = closure()
            # Read the hook's counters right after backward, before the optimizer can act on them.
            step_bytes, saw_nonfinite = self.comm_state.pop_step()
            self._batch_bytes += step_bytes
            self.last_step_bytes = self._batch_bytes
            if saw_nonfinite and not self._batch_nonfinite:
                self._batch_nonfinite = True
                self.nonfinite_steps += 1
            if self._batch_nonfinite and self.nonfinite == "skip" and not has_scaler:
                rank_zero_warn(
                    "FP4DDPStrategy: non-finite synchronised gradient; skipping this optimizer step on all ranks."
                )
                # Optimizers skip parameters whose grad is None; every rank holds the same NaN, so
                # every rank drops the same step. (A loss scaler instead sees the NaN and backs off.)
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
            return result

        out = super().optimizer_step(optimizer, closure_with_sync_check, model, **kwargs)
        self._log_comm_stats(model)
        return out

    def _log_comm_stats(self, model: Optional[Union[LightningModule, Module]]) -> None:
        if not self.log_bytes or not self._hook_registered:
            return
        module = model if isinstance(model, LightningModule) else self.lightning_module
        # ``log`` is only legal while the loop runs a hook (optimizer_step / training_step)
        if module is None or module._trainer is None or module._current_fx_name is None:
            return
        module.log("comm/bytes_sent", float(self.last_step_bytes), on_step=True, on_epoch=False, batch_size=1)
        module.log("comm/nonfinite_steps", float(self.nonfinite_steps), on_step=True, on_epoch=False, batch_size=1)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"fp4_ddp"`` (+ ``_spawn``/``_fork`` variants) so ``Trainer(strategy="fp4_ddp")`` works."""
        for name, start_method in DDP_STRATEGY_NAMES:
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"DDP with FP8 E4M3 gradient communication, start_method {start_method!r}",
                    start_method=start_method,
                )


FP4DDPStrategy.register_strategies(StrategyRegistry)


class FP4FSDPStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) for pure data parallelism, skipping the gradient
    reduce-scatter on gradient-accumulation micro-batches.

    The LightningModule applies :func:`fp4lightning.distributed.fsdp.fully_shard_fp4` in ``configure_model`` (FP4
    weight all-gather). Stock Lightning blocks gradient sync only for DDP; with FSDP2 every micro-batch
    would reduce-scatter. Here the unsharded gradients accumulate locally and one reduce-scatter runs per
    optimizer step (``FSDPModule.set_requires_gradient_sync``), as ``no_sync`` does for DDP.

    Args:
        data_parallel_size: number of ranks (default: all of them).
        grad_format: gradient reduce-scatter format, read by the LightningModule's ``fully_shard_fp4`` call:
            ``"fp32"`` (default, FSDP2's own) or ``"e4m3"`` / ``"e5m2"`` (:class:`~fp4lightning.distributed.fsdp.FP8ReduceScatter`).
        **kwargs: ``save_distributed_checkpoint``, ``process_group_backend``, ``timeout`` as for
            ``ModelParallelStrategy``.
    """

    strategy_name = "fp4_fsdp"

    def __init__(self, data_parallel_size: Union[int, Literal["auto"]] = "auto", grad_format: str = "fp32",
                 **kwargs: Any) -> None:
        if grad_format not in ("fp32", "e4m3", "e5m2"):
            raise ValueError(f"FP4FSDPStrategy: grad_format={grad_format!r} is not one of ('fp32', 'e4m3', 'e5m2')")
        self.grad_format = grad_format
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # all ranks data-parallel (the parent would put them in TP)
            self._data_parallel_size = len(self.parallel_devices or []) * self.num_nodes
        super().setup_environment()

    @contextmanager
    def block_backward_sync(self):
        from torch.distributed.fsdp import FSDPModule

        mods = [m for m in (self.model.modules() if self.model is not None else []) if isinstance(m, FSDPModule)]
        for m in mods:
            m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for m in mods:
                m.set_requires_gradient_sync(True, recurse=False)


def is_fsdp(strategy: Any) -> bool:
    """Whether ``strategy`` (a name or an instance) shards the model with FSDP: Lightning's ``FSDPStrategy``
    (FSDP1), :class:`FP4FSDPStrategy` and any ``ModelParallelStrategy`` (FSDP2), or their names.

    The one FSDP special case (docs/distributed.md): those strategies keep their own precision plugin,
    so :class:`~fp4lightning.lightning.precision.FP4Precision` cannot drive them; the LightningModule converts
    the layers with ``convert_to_fp4`` in ``configure_model`` instead, under bf16/fp16 autocast.
    """
    if isinstance(strategy, str):
        return strategy.startswith("fsdp") or strategy == FP4FSDPStrategy.strategy_name
    from lightning.pytorch.strategies import FSDPStrategy

    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))
