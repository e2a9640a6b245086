"""LightningModule for LLaMA pretraining with the paper's optimiser and schedule.

arXiv 2501.17116, section 7: AdamW with betas (0.9, 0.95), eps 1e-8, weight decay 0.1,
peak LR 3e-4, linear warmup over the first 5% of steps, cosine decay to 10% of the peak.
Gradient clipping is the Trainer's (``gradient_clip_val``).

The model is built in ``configure_model`` so that strategies that shard it (FSDP) can
build it on the meta device. FP4 conversion is done by the ``FP4Precision`` plugin, or
here right after building the model where that plugin cannot be used (FSDP); see
``fp4lightning.train.run.precision_setup``. With ``compile`` (recipe key ``trainer.compile``) each
decoder block is compiled there too, before FSDP shards it (``fp4lightning.models.llama.compile_blocks``).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics.aggregation import MeanMetric

from fp4lightning.config import FP4Config
from fp4lightning.distributed.fsdp import fully_shard_fp4
from fp4lightning.lightning.log import host_scalar
from fp4lightning.lightning.optim import adamw
from fp4lightning.models.llama import Llama, LlamaConfig, compile_blocks
from fp4lightning.nn.convert import convert_to_fp4, describe_conversion
from fp4lightning.numerics.cpu_bf16 import emulate_bf16_linears

__all__ = ["LlamaLightningModule", "warmup_cosine"]


def warmup_cosine(step: int, max_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, then cosine to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps  # (step + 1): the first step already moves the weights
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LlamaLightningModule(L.LightningModule):
    """Next-token cross-entropy pretraining of :class:`~fp4lightning.models.llama.Llama`.

    Args:
        model: the :class:`LlamaConfig` fields as a dict.
        lr, beta1, beta2, eps, weight_decay: AdamW settings.
        optimizer_states: AdamW's moments: ``"fp32"`` (torch's AdamW), ``"fp16"`` or ``"fp8-fp16"``
            (:class:`~fp4lightning.lightning.optim.LowPrecisionAdamW`; the recipe's ``optimizer.states``).
        max_steps, warmup_fraction, min_lr_ratio: the warmup + cosine schedule.
        fp4: ``None`` for a high-precision run, else the recipe's FP4 spec ``{"preset": ...,
            "overrides": {...}}`` (``FP4Section.spec()``), recorded in the checkpoint for
            ``load_checkpoint(fp4=True)``.
        fp4_config: the :class:`~fp4lightning.config.FP4Config` of that spec, built once by the
            recipe (``RecipeConfig.fp4_config``); needed when ``fp4_in_module`` converts the model.
        fp4_in_module: apply ``fp4`` with ``convert_to_fp4`` right after building the model
            (FSDP); False when the Trainer's ``FP4Precision`` plugin converts it instead.
        recipe: the resolved recipe (plain dict), kept in the checkpoint's hyperparameters.
        tokenizer_json: the tokenizer, stored in every checkpoint (``checkpoint["tokenizer"]``).
        compile: ``torch.compile`` each decoder block with :attr:`compile_backend`, after this module's
            FP4 conversion (if any) and before FSDP; ``None`` (default): the recipe's ``trainer.compile``
            (False without a recipe, and for a checkpoint written before the key existed).
    Batches are ``(B, T + 1)`` int64 token windows.
    """

    def __init__(
        self,
        model: dict[str, Any],
        lr: float = 3e-4,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        max_steps: int = 1000,
        warmup_fraction: float = 0.05,
        min_lr_ratio: float = 0.1,
        fp4: dict[str, Any] | None = None,
        fp4_config: FP4Config | None = None,
        fp4_in_module: bool = True,
        recipe: dict[str, Any] | None = None,
        tokenizer_json: str | None = None,
        optimizer_states: str = "fp32",
        compile: bool | None = None,
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer_json", "fp4_config"])
        if fp4 is not None and fp4_in_module and fp4_config is None:
            raise ValueError("LlamaLightningModule: fp4_in_module converts the model with fp4_config; pass the "
                             "FP4Config (RecipeConfig.fp4_config) along with its spec fp4")
        self.fp4_config = fp4_config
        self.model_config = LlamaConfig(**model)
        self.tokenizer_json = tokenizer_json
        self.model: Llama | None = None
        self.val_loss = MeanMetric()
        self._step_loss_sum = 0.0
        self._step_batches = 0
        self._step_tokens = 0
        self._t_last: float | None = None
        self._val_t0 = 0.0  # when the validation running now started (on_validation_start)

    #: ``torch.compile`` backend of ``compile`` (tests set ``"aot_eager"``: the same graphs, nothing built)
    compile_backend: str | Callable[..., Any] = "inductor"

    @property
    def compiles_blocks(self) -> bool:
        """Whether ``configure_model`` compiles the decoder blocks (``compile``, else ``trainer.compile``)."""
        hp = self.hparams
        if hp.get("compile") is not None:
            return bool(hp.compile)
        return bool(((hp.get("recipe") or {}).get("trainer") or {}).get("compile", False))

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        # called once per fit/validate; inside the strategy's init context (meta device for FSDP)
        if self.model is not None:
            return
        model = Llama(self.model_config)
        if self.hparams.fp4 is not None and self.hparams.fp4_in_module:
            convert_to_fp4(model, self.fp4_config)  # the head is kept quietly; shape skips warn
            rank_zero_info(describe_conversion(model, self.fp4_config))  # as FP4Precision says it
        trainer = getattr(self, "_trainer", None)
        bf16 = trainer is None or "bf16" in str(trainer.precision)
        if bf16 and (self.hparams.fp4 is None or self.hparams.fp4_in_module):
            # bf16 baselines (and the FSDP path's high-precision head) on CPUs without native bf16
            # GeMMs: the same bf16 GeMMs computed with fp32 kernels (fp4lightning.numerics.cpu_bf16); FP4Precision
            # does this itself for the layers it keeps in high precision
            emulate_bf16_linears(model)
        if self.compiles_blocks:
            # lazily, at the first forward: the FP4Precision plugin's conversion (after this hook) is
            # compiled too; before fully_shard_fp4, whose activation checkpointing wraps the compiled forward
            budget = ((self.hparams.get("recipe") or {}).get("trainer") or {}).get("compile_memory_budget")
            compile_blocks(model, backend=self.compile_backend, memory_budget=budget)
            rank_zero_info(f"trainer.compile: {len(model.layers)} decoder blocks under torch.compile; the first "
                           "training step and the first validation compile them")
        if getattr(self, "_device_mesh", None) is not None:  # ModelParallelStrategy: FSDP2 (docs/distributed.md)
            fully_shard_fp4(model, self._device_mesh["data_parallel"], fp4_all_gather=True,
                            activation_checkpointing=True,
                            grad_format=getattr(self.trainer.strategy, "grad_format", "fp32"))
            if any(p.is_meta for p in model.parameters()):
                model.to_empty(device=self.trainer.strategy.root_device)
                model.init_weights()  # LLaMA's init on each shard (Lightning would call nn.Linear's)
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.model(x)  # (B, T, V)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))

    # ------------------------------------------------------------------ training
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._step_loss_sum = self._step_loss_sum + loss.detach()  # stays on device: no sync per micro-batch
        self._step_batches += 1
        self._step_tokens += batch[:, 1:].numel()
        if (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            # one optimizer step ends here: log the mean over its micro-batches
            # the mean over all ranks (as val/loss): rank 0's own micro-batches are 1/world of the batch
            # Lightning reads progress-bar values back after every batch (a host sync on a GPU): only
            # when a bar shows them. Python numbers go in as host tensors (fp4lightning.lightning.log.host_scalar).
            bar = self.trainer.progress_bar_callback is not None
            self.log("train/loss", self._step_loss_sum / self._step_batches, prog_bar=bar, sync_dist=True)
            now = time.perf_counter()
            if self._t_last is not None:
                tps = self._step_tokens * self.trainer.world_size / (now - self._t_last)
                self.log("train/tokens_per_sec", host_scalar(tps), prog_bar=bar)
            self.log("train/lr", host_scalar(self.lr_schedulers().get_last_lr()[0]))
            self._t_last = now
            self._step_loss_sum, self._step_batches, self._step_tokens = 0.0, 0, 0
        return loss

    def on_train_epoch_start(self) -> None:
        self._t_last = None

    def on_validation_start(self) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self) -> None:
        # validation time must not count against throughput: the step after a validation is timed
        # from the end of the step before it with the validation taken out (it used to log nothing,
        # and the CSV logger then repeated the previous step's value)
        if self._t_last is not None:
            self._t_last += time.perf_counter() - self._val_t0

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_loss.update(loss, weight=batch[:, 1:].numel())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # token-weighted mean, synced across ranks
        self.val_loss.reset()
        # already synced by torchmetrics; sync_dist=True only averages equal values (and keeps Lightning quiet)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", torch.exp(loss), sync_dist=True)

    # ------------------------------------------------------------------ optimizer
    def configure_optimizers(self):
        hp = self.hparams
        # no weight decay on the RMSNorm gains (1-D), as in LLaMA / GPT-style training
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        # a checkpoint written before optimizer_states existed trained torch's AdamW: "fp32"
        opt = adamw(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            hp.get("optimizer_states", "fp32"),
            seed=int((hp.recipe or {}).get("seed", 0)),
            lr=hp.lr,
            betas=(hp.beta1, hp.beta2),
            eps=hp.eps,
        )
        warmup = max(1, math.ceil(hp.warmup_fraction * hp.max_steps))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: warmup_cosine(s, hp.max_steps, warmup, hp.min_lr_ratio)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        # A resumed run restores the scheduler's base LRs and each group's current LR from the
        # checkpoint; the schedule must be this recipe's (docs/training.md, "Resuming with a changed
        # schedule"): base LR optimizer.lr, and the LR of the next step recomputed from the new
        # lambda (LambdaLR keeps no lambda in its state, so it is already the new one). Without
        # this a changed optimizer.lr was ignored and the first resumed step ran at the old LR.
        sched = self.lr_schedulers()
        if sched is None:
            return
        opt = sched.optimizer
        sched.base_lrs = [float(self.hparams.lr)] * len(opt.param_groups)
        for group, base, lmbda in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * lmbda(sched.last_epoch)
        sched._last_lr = [group["lr"] for group in opt.param_groups]

    # ------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["tokenizer"] = self.tokenizer_json

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.tokenizer_json = checkpoint.get("tokenizer", self.tokenizer_json)
