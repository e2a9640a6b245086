"""No host synchronisation inside an FP4 training step (issue 40).

A GPU runs ahead of Python only while Python never waits for it. Three things make Python wait:
reading a device value (``.item()``, ``bool(t)``, ``float(t)``: ``aten::_local_scalar_dense``),
an op whose output shape depends on the data (``aten::nonzero``, ``masked_select``, ``unique``...),
and turning a Python number into a device tensor (``torch.tensor(x, device="cuda")``: a blocking
host-to-device copy; ``aten::lift_fresh``; Lightning's ``self.log(name, float)`` does this on the
module's device). On CPU none of them waits, but the profiler records the same ops, so a few steps
through the real Lightning Trainer with ``FP4Precision`` on CPU count what the GPU would wait for.

The FP4 layers run the path CUDA takes on an FP8 GPU (``FP4LIGHTNING_BACKEND=scaled_mm``: the
residual of OCC compacted with ``nonzero_static``, no data-dependent shape). The Triton backend
gives the same counts (measured under the interpreter, too slow for the suite). The CPU-only
reference backend builds its sparse OCC residual with ``nonzero``; it is never CUDA's default.
"""
from __future__ import annotations

import collections
import dataclasses

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.profiler import ProfilerActivity, profile, record_function

from fp4lightning.train.module import LlamaLightningModule
from fp4lightning.train.throughput import ThroughputMetrics, flops_per_token
from fp4lightning.models.config import llama_config
from fp4lightning.lightning.nonfinite import NonFiniteGuard
from fp4lightning.lightning.precision import FP4Precision

from ._numerics import needs_cpu_scaled_mm
from ._spawned import leave

READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique",
         "aten::_unique2", "aten::unique_consecutive", "aten::equal")
UPLOADS = ("aten::lift_fresh",)
ACCUM, STEPS, LOG_EVERY = 2, 6, 2
STEP_MARK, LOG_MARK = "test_step_sync.step", "test_step_sync.log"


class _MarkedLogger(CSVLogger):
    """A real logger that marks, in the profile, the steps on which Lightning writes the logs."""

    def log_metrics(self, metrics, step=None):
        with record_function(LOG_MARK):
            super().log_metrics(metrics, step)


class _ProfileSteps(L.Callback):
    """Profiles from the start of the third optimizer step and marks where each optimizer step begins.
    The first steps do one-time work: the first creates the optimizer state, and Lightning sets up a
    store for each metric the first time it is logged (train/tflops and tokens/s from the second step)."""

    prof = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % ACCUM:
            return
        if trainer.global_step == 2:
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
        with record_function(STEP_MARK):
            pass

    def on_train_end(self, trainer, pl_module):
        self.prof.__exit__(None, None, None)


def _per_step(prof) -> list[tuple[collections.Counter, bool]]:
    """(op counts, whether the logs were written) per whole optimizer step in the profile."""
    steps: list[tuple[collections.Counter, list]] = []
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        if e.name == STEP_MARK:
            steps.append((collections.Counter(), [False]))
        elif steps and e.name == LOG_MARK:
            steps[-1][1][0] = True
        elif steps and e.name in READS + UPLOADS:
            steps[-1][0][e.name] += 1
    return [(c, logged[0]) for c, logged in steps[:-1]]  # the last one is cut off by the end of training


@needs_cpu_scaled_mm()
def test_fp4_step_reads_the_device_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    cfg = dataclasses.replace(llama_config("tiny"), dim=64, n_layers=2, n_heads=2, ffn_dim=128, vocab_size=256,
                              max_seq_len=32)
    # the 1.3B recipe's optimizer (optimizer.states=fp16: LowPrecisionAdamW, step counters on the host);
    # torch's AdamW is fused on CUDA (fp4lightning.lightning.optim.adamw), its CPU form reads host-side counters
    module = LlamaLightningModule(model=dataclasses.asdict(cfg), max_steps=STEPS, optimizer_states="fp16")
    data = torch.utils.data.DataLoader(torch.randint(0, cfg.vocab_size, (ACCUM * STEPS * 4, 33)), batch_size=4)
    prof = _ProfileSteps()
    trainer = L.Trainer(
        accelerator="cpu", plugins=[FP4Precision("paper")], max_steps=STEPS, accumulate_grad_batches=ACCUM,
        gradient_clip_val=1.0, log_every_n_steps=LOG_EVERY, logger=_MarkedLogger(tmp_path),
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        callbacks=[prof, NonFiniteGuard(), ThroughputMetrics(flops_per_token(cfg, 32))],
    )
    trainer.fit(module, data)
    steps = _per_step(prof.prof)
    assert len(steps) == STEPS - 3 and any(logged for _, logged in steps) and not all(logged for _, logged in steps)
    for i, (ops, logged) in enumerate(steps, start=3):
        # no Python number becomes a device tensor inside a step (metrics are logged as host tensors)
        assert ops["aten::lift_fresh"] == 0, (i, dict(ops))
        assert not any(ops[name] for name in READS[1:]), (i, dict(ops))  # no data-dependent shapes
        # The budget: ONE read per optimizer step, the non-finite decision (FP4Precision.optimizer_step ->
        # nonfinite.detect_nonfinite: is any gradient inf/NaN? skip the step), not one per layer or micro-batch.
        # On a logging step (every trainer.log_every_n_steps) Lightning also reads back each logged value.
        reads = ops["aten::_local_scalar_dense"]
        if logged:
            assert 1 < reads <= 1 + len(trainer.logged_metrics), (i, dict(ops))
        else:
            assert reads == 1, (i, dict(ops))


def test_torch_adamw_is_fused_on_cuda_only():
    """torch's AdamW (optimizer.states=fp32) runs fused on a GPU; CPU runs keep torch's default (same numbers)."""
    from fp4lightning.lightning.optim import adamw

    model = torch.nn.Linear(16, 16)
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": (p for p in [model.bias]), "weight_decay": 0.0}]
    cpu = adamw(groups, "fp32", lr=1e-3)
    assert not cpu.defaults.get("fused") and [len(g["params"]) for g in cpu.param_groups] == [1, 1]
    if torch.cuda.is_available():
        gpu = adamw(model.cuda().parameters(), "fp32", lr=1e-3)
        assert gpu.defaults["fused"] is True


def _detect_worker(rank: int, port: int, out: str) -> None:
    import json
    import os

    import torch.distributed as dist

    from fp4lightning.lightning.loss_scaler import DynamicLossScaler
    from fp4lightning.lightning.nonfinite import detect_nonfinite

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        p = torch.nn.Parameter(torch.randn(64, 32))
        q = torch.nn.Parameter(torch.randn(32, dtype=torch.bfloat16))
        opt = torch.optim.SGD([p, q], lr=0.1)
        results = {}
        for case, scaler in (("bf16", None), ("fp16", DynamicLossScaler())):
            for nan_rank in (None, 1):
                p.grad, q.grad = torch.randn(64, 32), torch.randn(32, dtype=torch.bfloat16)
                if rank == nan_rank:
                    p.grad[3, 4] = float("nan")
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    found = detect_nonfinite(opt, scaler)
                ops = collections.Counter(e.name for e in prof.events())
                results[f"{case}-{nan_rank}"] = [found, ops["aten::_local_scalar_dense"], ops["aten::lift_fresh"]]
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()
    leave()  # the result is on disk: no interpreter teardown (tests/_spawned.py)


@needs_cpu_scaled_mm()
def test_multi_rank_nonfinite_decision_reads_the_device_once(tmp_path):
    """Over two real gloo ranks the skip decision costs one read per step (it cost three: a read of the
    local flag, an upload of it as a new tensor, a read of the all-reduced one) and agrees on every rank."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_detect_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case in ("bf16", "fp16"):
            assert got[f"{case}-None"][0] is False and got[f"{case}-1"][0] is True, (rank, got)
        for found, reads, uploads in got.values():
            assert reads == 1 and uploads == 0, (rank, got)
