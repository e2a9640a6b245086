"""Throughput metrics litgpt users expect: model TFLOP/s and model FLOPs utilisation (MFU).

FLOPs per trained token follow the PaLM appendix-B count (also litgpt's and nanoGPT's):
``6 * N + 12 * n_layers * dim * seq_len``, where ``N`` counts the weights of every matrix
multiplication (attention and MLP projections and the output head; the embedding lookup is no
GeMM) and the second term is the attention scores and their weighted sum, forward and
backward. MFU divides the achieved model FLOP/s per device by the device's peak dense
bf16 FLOP/s: FP4 here is *simulated* (FP4-valued operands in higher-precision GeMMs, as in
arXiv 2501.17116, section 5), so there is no FP4 peak to compare with (docs/training.md).
"""
from __future__ import annotations

import time

import lightning.pytorch as L
import torch

from fp4lightning.lightning.log import host_scalar

from fp4lightning.models.llama import LlamaConfig

__all__ = ["flops_per_token", "peak_tflops", "ThroughputMetrics"]

# peak dense bf16 TFLOP/s (vendor data sheets, without sparsity), matched on the device name
_PEAK_BF16_TFLOPS = (
    ("H200", 989.0), ("H100 SXM", 989.0), ("H100 80GB HBM3", 989.0), ("H100 NVL", 835.0), ("H100", 756.0), ("GH200", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A10G", 70.0), ("L40S", 362.0), ("L4", 121.0),
    ("RTX 4090", 165.0), ("RTX 3090", 71.0), ("V100", 125.0),
)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a ``seq_len`` window (PaLM, appendix B)."""
    hd = cfg.dim // cfg.n_heads
    kv = cfg.n_kv_heads or cfg.n_heads
    per_layer = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv * hd + 3 * cfg.dim * cfg.ffn_dim
    n_gemm = cfg.n_layers * per_layer + cfg.vocab_size * cfg.dim  # + the output head
    return 6.0 * n_gemm + 12.0 * cfg.n_layers * cfg.dim * seq_len


def peak_tflops(device: torch.device | str) -> float | None:
    """Peak dense bf16 TFLOP/s of a known CUDA device; None elsewhere (give ``trainer.peak_tflops``)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for key, v in _PEAK_BF16_TFLOPS if key in name), None)


class ThroughputMetrics(L.Callback):
    """Logs ``train/tflops`` (model TFLOP/s per device) and ``train/mfu`` once per optimizer step.

    Args:
        flops_per_token: from :func:`flops_per_token`.
        peak: peak TFLOP/s of one device; None looks the device up (:func:`peak_tflops`) and,
            when unknown, logs ``train/tflops`` only.
    """

    def __init__(self, flops_per_token: float, peak: float | None = None):
        self.flops_per_token = flops_per_token
        self.peak = peak
        self._tokens = 0
        self._t_last: float | None = None
        self._val_t0 = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        if self.peak is None:
            self.peak = peak_tflops(pl_module.device)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._t_last, self._tokens = None, 0

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        # the step after a validation is timed without it (as train/tokens_per_sec)
        if self._t_last is not None:
            self._t_last += time.perf_counter() - self._val_t0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += batch[:, 1:].numel()  # this rank's trained tokens
        if (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        now = time.perf_counter()
        if self._t_last is not None:
            tflops = self._tokens * self.flops_per_token / (now - self._t_last) / 1e12
            pl_module.log("train/tflops", host_scalar(tflops), on_step=True, on_epoch=False, batch_size=1)
            if self.peak:
                pl_module.log("train/mfu", host_scalar(tflops / self.peak), on_step=True, on_epoch=False, batch_size=1)
        self._t_last, self._tokens = now, 0
