"""Logging from a training step without a host synchronisation."""
from __future__ import annotations

import torch

__all__ = ["host_scalar"]


def host_scalar(value: float) -> torch.Tensor:
    """``value`` as a 0-dim fp32 tensor in host memory, for ``LightningModule.log``.

    Lightning turns a Python number into a tensor on the module's device: on a GPU that is a blocking
    host-to-device copy, which waits for all the work queued so far (a host synchronisation inside
    the training step, tests/test_step_sync.py). A host tensor stays where it is.
    """
    return torch.full((), float(value), dtype=torch.float32)
