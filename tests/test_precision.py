"""FP4Precision and fp4lightning.Trainer on a real Lightning Trainer: conversion, training, fp16 loss
scaling (skip, back-off, growth, clipping, checkpoints), reduced-precision optimizer states,
save / resume / cross-precision loads."""
import math
import warnings

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fp4lightning.lightning.trainer as fp4_trainer
from fp4lightning.numerics.cpu_bf16 import high_precision_linear_type
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.lightning.optim import LowPrecisionAdamW, to_torch_adamw_state_dict
from fp4lightning.lightning.loss_scaler import DynamicLossScaler
from fp4lightning.lightning.precision import FP4Precision
from tests._spawned import leave

QUIET = dict(accelerator="cpu", enable_progress_bar=False, logger=False, enable_checkpointing=False,
             enable_model_summary=False)
# Mean loss of the last 5 of 40 steps over the first 5, tiny classifier, lr 1e-2: measured
# 0.30-0.40 over 10 runs (fp4 and fp4-fp16).
LOSS_DROP = 0.55


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(autouse=True)
def _quiet_known_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*keeping .*head.* in high precision")
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*LeafSpec.*")
        warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")
        yield


class Classifier(L.LightningModule):
    """An ordinary LightningModule: it knows nothing about fp4lightning."""

    def __init__(self, lr: float = 1e-2, optimizer: str = "adamw", scheduler: bool = False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 16)
        self.lr, self.optimizer_name, self.scheduler = lr, optimizer, scheduler
        self.losses: list[float] = []

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _data(n: int = 640, batch_size: int = 32) -> DataLoader:
    teacher = nn.Linear(32, 16)
    x = torch.randn(n, 32)
    y = teacher(x).argmax(-1).detach()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def _assert_fp4_layout(model: Classifier, compute: str = "bf16") -> None:
    assert type(model.body[0]) is FP4Linear and type(model.body[3]) is FP4Linear
    # the output head stays in high precision (under bf16, its GeMMs emulated on CPUs without native ones)
    assert type(model.head) is (high_precision_linear_type() if compute == "bf16" else nn.Linear)
    assert type(model.body[2]) is nn.LayerNorm
    assert all(p.dtype == torch.float32 for p in model.parameters())


def _assert_learned(model: Classifier) -> None:
    first = sum(model.losses[:5]) / 5
    last = sum(model.losses[-5:]) / 5
    assert math.isfinite(last) and last < LOSS_DROP * first, (first, last)


# ------------------------------------------------------------------------------------------------
# the two ways in


@pytest.mark.parametrize("precision", ["fp4", "fp4-fp16"])
def test_fp4_trainer_precision_string_trains(precision):
    model = Classifier()
    trainer = fp4_trainer.Trainer(precision=precision, max_steps=40, **QUIET)
    assert isinstance(trainer.precision_plugin, FP4Precision)
    assert trainer.precision == ("fp4-fp16" if precision == "fp4-fp16" else "fp4-bf16")
    trainer.fit(model, _data())
    _assert_fp4_layout(model, "fp16" if precision == "fp4-fp16" else "bf16")
    _assert_learned(model)
    if precision == "fp4-fp16":
        assert trainer.precision_plugin.scaler.skipped_steps == 0
        assert trainer.precision_plugin.loss_scale == 2.0**16


def test_plain_lightning_trainer_with_plugin_trains():
    model = Classifier()
    trainer = L.Trainer(plugins=[FP4Precision()], max_steps=40, **QUIET)
    trainer.fit(model, _data())
    _assert_fp4_layout(model)
    _assert_learned(model)


def test_unknown_precision_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"'fp5' is invalid.*'fp4', 'fp4-bf16', 'fp4-fp16'.*'bf16-mixed'"):
        fp4_trainer.Trainer(precision="fp5", **QUIET)
    with pytest.raises(ValueError, match="choose one"):
        fp4_trainer.Trainer(precision="fp4", plugins=[FP4Precision()], **QUIET)
    # Lightning's own strings behave as in Lightning, and Lightning itself was not patched
    assert isinstance(fp4_trainer.Trainer(precision="bf16-mixed", **QUIET).precision_plugin, MixedPrecision)
    with pytest.raises(ValueError, match="'fp4' is invalid"):
        L.Trainer(precision="fp4", **QUIET)
    with pytest.raises(ValueError, match="preset 'nope'.*paper"):
        FP4Precision("nope")
    with pytest.raises(ValueError, match="compute_dtype='fp8'"):
        FP4Precision(compute_dtype="fp8")
    with pytest.raises(ValueError, match="FSDP.*configure_model"):
        fp4_trainer.Trainer(precision="fp4", strategy="fsdp", **QUIET)
    # the project's FSDP2 strategy (a ModelParallelStrategy) is FSDP too: the same way out
    from fp4lightning.lightning.strategy import FP4FSDPStrategy

    with pytest.raises(ValueError, match="FSDP.*configure_model"):
        fp4_trainer.Trainer(precision="fp4", strategy=FP4FSDPStrategy(), **QUIET)
    with pytest.raises(ValueError, match="FSDP.*configure_model"):
        fp4_trainer.Trainer(plugins=[FP4Precision()], strategy="fp4_fsdp", **QUIET)


def test_fp16_where_autocast_cannot_run_says_so():
    # fp16 autocast does run on CPU with this torch (the fp4-fp16 training test uses it); a device
    # type autocast does not know must fail before training, naming the way out
    plugin = FP4Precision(compute_dtype="fp16", device="meta")
    with pytest.raises(RuntimeError, match="autocast does not support device type 'meta'.*fp4-fp16"):
        plugin.connect(nn.Linear(16, 16), [], [])


def test_more_than_one_device_selects_fp4_ddp_strategy():
    strategy_mod = pytest.importorskip("fp4lightning.lightning.strategy")
    trainer = fp4_trainer.Trainer(precision="fp4", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, strategy_mod.FP4DDPStrategy)
    assert isinstance(trainer.strategy.precision_plugin, FP4Precision)
    trainer = fp4_trainer.Trainer(plugins=[FP4Precision(compute_dtype="fp16")], strategy="ddp_spawn",
                                  accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, strategy_mod.FP4DDPStrategy)
    assert trainer.strategy.precision_plugin.scaler is not None
    single = fp4_trainer.Trainer(precision="fp4", accelerator="cpu", devices=1, logger=False)
    assert not isinstance(single.strategy, strategy_mod.FP4DDPStrategy)


# ------------------------------------------------------------------------------------------------
# fp16 dynamic loss scaling


class _InjectInf(Callback):
    """Puts an inf into one gradient after backward at ``bad_step``; records weights and scales."""

    def __init__(self, bad_step: int):
        self.bad_step = bad_step
        self.changed: dict[int, bool] = {}
        self.scales: dict[int, float] = {}
        self._before = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._before = [p.detach().clone() for p in pl_module.parameters()]

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_step == self.bad_step:
            pl_module.body[3].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        after = list(pl_module.parameters())
        assert all(torch.isfinite(p).all() for p in after), f"non-finite weight after step {step}"
        self.changed[step] = any(not torch.equal(a, b) for a, b in zip(after, self._before))
        self.scales[step] = trainer.precision_plugin.loss_scale


def test_injected_inf_skips_exactly_that_step_and_backs_off():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=1000)
    cb = _InjectInf(bad_step=3)
    trainer = L.Trainer(plugins=[FP4Precision(compute_dtype="fp16", scaler=scaler)], max_steps=6, callbacks=[cb],
                        **QUIET)
    trainer.fit(Classifier(), _data())
    # Lightning counts the skipped step too (as with torch's GradScaler)
    assert cb.changed == {0: True, 1: True, 2: True, 3: False, 4: True, 5: True}
    assert cb.scales == {0: 1024.0, 1: 1024.0, 2: 1024.0, 3: 512.0, 4: 512.0, 5: 512.0}
    assert scaler.skipped_steps == 1


def test_loss_scaler_grows_after_a_run_of_good_steps_and_gives_up_on_divergence():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=2, max_consecutive_skips=3)
    p = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    history = []
    for bad in (False, False, False, True, False, False):
        opt.zero_grad()
        scaler.scale(p.sum() * (float("nan") if bad else 1.0)).backward()
        found = scaler.unscale_(opt)
        assert found == bad
        if not found:
            torch.testing.assert_close(p.grad, torch.ones(4))  # unscaled back to the true gradient
        scaler.update(found)
        history.append(scaler.scale_value)
    assert history == [8.0, 16.0, 16.0, 8.0, 8.0, 16.0]
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row.*diverged"):
        for _ in range(3):
            scaler.update(True)


def test_fp16_clips_unscaled_gradients_at_gradient_clip_val():
    clip = 1e-3
    model = Classifier(lr=1.0, optimizer="sgd")
    before = [p.detach().clone() for p in model.parameters()]
    trainer = L.Trainer(plugins=[FP4Precision(compute_dtype="fp16")], max_steps=1, gradient_clip_val=clip, **QUIET)
    trainer.fit(model, _data())
    # SGD with lr 1 moves the weights by exactly the clipped gradient; clipping the still-scaled
    # gradient would have moved them by clip / 2^16
    delta = torch.sqrt(sum((p.detach() - b).pow(2).sum() for p, b in zip(model.parameters(), before)))
    assert delta.item() == pytest.approx(clip, rel=1e-3)


def test_fp16_manual_optimization_scales_and_unscales():
    class Manual(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            x, y = batch
            loss = nn.functional.cross_entropy(self(x), y)
            self.losses.append(loss.item())
            opt.zero_grad()
            self.manual_backward(loss)
            self.grad_norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in self.parameters())).item()
            opt.step()

    model = Manual()
    plugin = FP4Precision(compute_dtype="fp16")
    L.Trainer(plugins=[plugin], max_steps=40, **QUIET).fit(model, _data())
    _assert_fp4_layout(model, "fp16")
    _assert_learned(model)
    # manual_backward went through the scaler: the gradient seen right after it was still scaled
    assert model.grad_norm > 1e3 and plugin.scaler.skipped_steps == 0


def test_loss_scaler_state_round_trips_through_a_checkpoint(tmp_path):
    plugin = FP4Precision(compute_dtype="fp16", scaler=DynamicLossScaler(init_scale=2.0**8, growth_interval=2))
    trainer = L.Trainer(plugins=[plugin], max_steps=5, **QUIET)
    trainer.fit(Classifier(), _data())
    assert plugin.loss_scale == 2.0**10  # grew twice in 5 good steps
    ckpt_path = tmp_path / "fp16.ckpt"
    trainer.save_checkpoint(ckpt_path)
    saved = torch.load(ckpt_path, weights_only=False)["FP4Precision"]
    assert saved["scaler"]["scale"] == 2.0**10 and saved["scaler"]["good_steps"] == 1
    assert saved["precision"] == "fp4-fp16" and saved["config"]["dge"] is True

    class Record(Callback):
        def on_train_start(self, trainer, pl_module):
            self.scale = trainer.precision_plugin.loss_scale
            self.good = trainer.precision_plugin.scaler.good_steps

    rec = Record()
    fresh = FP4Precision(compute_dtype="fp16", scaler=DynamicLossScaler(growth_interval=2))
    L.Trainer(plugins=[fresh], max_steps=6, callbacks=[rec], **QUIET).fit(Classifier(), _data(), ckpt_path=ckpt_path)
    assert (rec.scale, rec.good) == (2.0**10, 1)
    assert fresh.loss_scale == 2.0**11  # the resumed step completed the run of two


# ------------------------------------------------------------------------------------------------
# reduced-precision optimizer states, checkpoints


def test_connect_swaps_adamw_and_keeps_the_scheduler_attached():
    model = Classifier(scheduler=True)
    trainer = fp4_trainer.Trainer(plugins=[FP4Precision(optimizer_states="fp8")], max_steps=3, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. "optimizer.step() has been overridden"
        warnings.filterwarnings("ignore", message=".*(high precision|many workers|LeafSpec).*")
        trainer.fit(model, _data())
    opt = trainer.optimizers[0]
    assert isinstance(opt, LowPrecisionAdamW)
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.optimizer is opt
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)  # the scheduler drove the new optimizer
    s = opt.state[model.body[0].weight]
    assert s["exp_avg_q"].dtype == torch.float8_e4m3fn and s["exp_avg_sq_q"].dtype == torch.float16
    assert s["step"] == 3


@pytest.mark.slow
def test_save_resume_and_cross_precision_loads(tmp_path):
    data = _data()
    # 1. FP4 training with FP8/FP16 optimizer states, checkpointed
    model = Classifier()
    trainer = fp4_trainer.Trainer(plugins=[FP4Precision(optimizer_states="fp8")], max_steps=8, **QUIET)
    trainer.fit(model, data)
    fp4_ckpt = tmp_path / "fp4.ckpt"
    trainer.save_checkpoint(fp4_ckpt)
    ckpt = torch.load(fp4_ckpt, weights_only=False)
    weights = {k: v for k, v in ckpt["state_dict"].items()}
    assert all(v.dtype == torch.float32 for v in weights.values())  # weights are kept in high precision
    opt_state = ckpt["optimizer_states"][0]["state"]
    assert opt_state[0]["exp_avg_q"].dtype == torch.float8_e4m3fn

    # 2. resume in FP4: optimizer state restored in its own formats, step count continues
    resumed = Classifier()
    t2 = fp4_trainer.Trainer(plugins=[FP4Precision(optimizer_states="fp8")], max_steps=10, **QUIET)
    t2.fit(resumed, data, ckpt_path=fp4_ckpt)
    assert t2.global_step == 10
    st = t2.optimizers[0].state[resumed.body[0].weight]
    assert st["exp_avg_q"].dtype == torch.float8_e4m3fn and st["step"] == 10

    # 3. the FP4 checkpoint's weights load into a plain model (strict: same keys) and run in bf16
    plain = Classifier()
    plain.load_state_dict(ckpt["state_dict"])
    for k, v in plain.state_dict().items():
        assert torch.equal(v, weights[k])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = plain(torch.randn(8, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()

    # 4. plain bf16-mixed Lightning resumes the FP4 run (optimizer state converted for torch's AdamW)
    ckpt["optimizer_states"] = [to_torch_adamw_state_dict(s) for s in ckpt["optimizer_states"]]
    converted = tmp_path / "fp4_as_adamw.ckpt"
    torch.save(ckpt, converted)
    plain_model = Classifier()
    t3 = L.Trainer(precision="bf16-mixed", max_steps=12, **QUIET)
    t3.fit(plain_model, data, ckpt_path=converted)
    assert type(plain_model.body[0]) is nn.Linear and t3.global_step == 12
    assert t3.optimizers[0].state[plain_model.body[0].weight]["exp_avg"].dtype == torch.float32
    bf16_ckpt = tmp_path / "bf16.ckpt"
    t3.save_checkpoint(bf16_ckpt)

    # 5. ... and back: FP4 resumes the bf16 run, encoding torch AdamW's moments
    back = Classifier()
    t4 = fp4_trainer.Trainer(plugins=[FP4Precision(optimizer_states="fp8")], max_steps=14, **QUIET)
    t4.fit(back, data, ckpt_path=bf16_ckpt)
    _assert_fp4_layout(back)
    st = t4.optimizers[0].state[back.body[0].weight]
    assert st["exp_avg_q"].dtype == torch.float8_e4m3fn and st["step"] == 14
    assert all(torch.isfinite(p).all() for p in back.parameters())


def test_meta_device_init_then_convert():
    plugin = FP4Precision(weights_dtype=torch.bfloat16)
    with torch.device("meta"), plugin.module_init_context():
        model = Classifier()
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    plugin.convert_module(model)
    assert type(model.body[0]) is FP4Linear and type(model.head) is high_precision_linear_type()
    assert model.body[0].weight.is_meta  # nothing was materialised
    model.to_empty(device="cpu")
    for m in model.modules():
        if hasattr(m, "reset_parameters") and m is not model:
            m.reset_parameters()
    with plugin.forward_context():
        out = model(torch.randn(4, 32))
    assert out.shape == (4, 16) and torch.isfinite(out).all()
    # Trainer.init_module goes through the same contexts
    trainer = L.Trainer(plugins=[FP4Precision(weights_dtype=torch.bfloat16)], **QUIET)
    with trainer.init_module(empty_init=True):
        model = Classifier()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# data parallel: an inf on one rank makes every rank skip the same step


def _ddp_worker(rank: int, port: int, out_dir: str, seed: int) -> None:
    import json
    import os

    import torch.distributed as dist

    # what torchrun sets: Lightning then treats the two processes as launched from outside
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        L.seed_everything(seed, verbose=False)
        model = Classifier()

        class InjectOnRank1(_InjectInf):
            # the inf must enter before DDP reduces the gradients: a hook on the gradient as it is
            # produced, on rank 1 only (on_after_backward runs after the reduction)
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
                if trainer.global_rank == 1 and trainer.global_step == self.bad_step:
                    def poison(grad):
                        grad = grad.clone()
                        grad[0, 0] = float("inf")
                        return grad

                    self._handle = pl_module.body[3].weight.register_hook(poison)

            def on_after_backward(self, trainer, pl_module):
                if getattr(self, "_handle", None) is not None:
                    self._handle.remove()
                    self._handle = None

        cb = InjectOnRank1(bad_step=2)
        trainer = fp4_trainer.Trainer(precision="fp4-fp16", devices=2, max_steps=5, callbacks=[cb], **QUIET)
        trainer.fit(model, _data())
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"strategy": type(trainer.strategy).__name__, "changed": cb.changed, "scales": cb.scales,
                       "params": params.tolist(), "skipped": trainer.precision_plugin.scaler.skipped_steps}, f)
    finally:
        dist.destroy_process_group()
    leave()  # the result is on disk: no interpreter teardown (tests/_spawned.py)


@pytest.mark.slow
def test_ddp_inf_on_one_rank_skips_the_same_step_everywhere(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    mp.spawn(_ddp_worker, args=(port, str(tmp_path), seed), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    expected_strategy = "FP4DDPStrategy"
    try:
        import fp4lightning.lightning.strategy  # noqa: F401
    except ImportError:
        expected_strategy = "DDPStrategy"
    for r in (r0, r1):
        assert r["strategy"] == expected_strategy
        assert r["changed"] == {"0": True, "1": True, "2": False, "3": True, "4": True}
        assert r["scales"] == {"0": 2.0**16, "1": 2.0**16, "2": 2.0**15, "3": 2.0**15, "4": 2.0**15}
        assert r["skipped"] == 1
    assert r0["params"] == r1["params"]  # the replicas did not drift apart
