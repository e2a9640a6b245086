"""The FP4 weight quantized once per optimizer step, never stale (issue 40).

Under gradient accumulation ``FP4Precision`` reuses each layer's weight quantization across the
micro-batches of one optimizer step (``fp4lightning.nn.linear.reuse_weight_quantization``). An
earlier cache keyed on ``weight._version`` trained on stale weights: torch's fused AdamW and
``.data`` writes do not bump the version. These tests train through the real Trainer with fused
AdamW and hold the reused run to the bits of the run that quantizes every forward.
"""
from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch

import fp4lightning.nn.linear as linear_mod
from fp4lightning.config import FP4Config
from fp4lightning.lightning.precision import FP4Precision
from fp4lightning.models.config import llama_config
from fp4lightning.nn.linear import FP4Linear, reuse_weight_quantization, weights_updated
from fp4lightning.train.module import LlamaLightningModule

ACCUM, STEPS = 3, 3


@pytest.fixture
def counted(monkeypatch):
    """Counts the real weight quantizations (the function still runs)."""
    calls = [0]
    real = linear_mod.quantize_weight

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(linear_mod, "quantize_weight", counting)
    return calls


class _FusedAdamW(LlamaLightningModule):
    """The tiny LLaMA with torch's fused AdamW, whose in-place update leaves ``weight._version`` alone."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                                                   "interval": "step"}}


def _train(reuse, tmp_path, seed=0):
    cfg = dataclasses.replace(llama_config("tiny"), dim=64, n_layers=2, n_heads=2, ffn_dim=128, vocab_size=256,
                              max_seq_len=32)
    torch.manual_seed(seed)
    module = _FusedAdamW(model=dataclasses.asdict(cfg), max_steps=STEPS)
    data = torch.utils.data.DataLoader(torch.randint(0, cfg.vocab_size, (ACCUM * STEPS * 2, 33),
                                                     generator=torch.Generator().manual_seed(seed)), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", plugins=[FP4Precision("paper", reuse_weight_quantization=reuse)],
                        max_steps=STEPS, accumulate_grad_batches=ACCUM, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, data)
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_reuse_under_accumulation_trains_the_same_bits_once_per_step(tmp_path, counted):
    fresh = _train(False, tmp_path / "fresh")
    per_forward = counted[0]
    counted[0] = 0
    reused = _train(None, tmp_path / "reused")  # the default: on, since the Trainer accumulates
    n_layers = 2 * 7
    assert per_forward == n_layers * STEPS * ACCUM
    assert counted[0] == n_layers * STEPS  # once per layer and optimizer step
    assert fresh.keys() == reused.keys()
    for k in fresh:  # fused AdamW moved every weight between steps; none was served stale
        assert torch.equal(fresh[k], reused[k]), k


def _layer():
    torch.manual_seed(1)
    return FP4Linear(64, 32, bias=True, config=FP4Config.from_preset("paper"))


def test_epoch_end_refreshes_after_writes_the_version_misses(counted):
    layer, x = _layer(), torch.randn(8, 64)
    with reuse_weight_quantization():
        layer(x)
        layer(x)
        assert counted[0] == 1
        layer.weight.data.mul_(-0.5)  # no version bump: only the epoch can tell
        weights_updated()
        got = layer(x)
    assert counted[0] == 2
    assert torch.equal(got, layer(x))  # the same bits as quantizing afresh outside the context


def test_version_bump_refreshes_within_an_epoch(counted):
    layer, x = _layer(), torch.randn(8, 64)
    with reuse_weight_quantization():
        layer(x)
        with torch.no_grad():
            layer.weight.mul_(2.0)  # autograd-visible in-place edit (as load_state_dict's copy_)
        got = layer(x)
    assert counted[0] == 2
    assert torch.equal(got, layer(x))


def test_off_outside_the_context_and_freed_by_the_epoch_end(counted):
    layer, x = _layer(), torch.randn(8, 64)
    layer(x)
    layer(x)
    assert counted[0] == 2 and layer._weight_quant is None
    with reuse_weight_quantization():
        layer(x)
    assert layer._weight_quant is not None
    weights_updated()
    assert layer._weight_quant is None  # not held through the optimizer step


def test_reuse_gives_the_same_gradients():
    layer, x = _layer(), torch.randn(8, 64, requires_grad=True)
    y = layer(x)
    y.square().sum().backward()
    ref = (y.detach(), x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    with reuse_weight_quantization():
        layer(x)  # fills the cache
        y = layer(x)
        y.square().sum().backward()
    assert torch.equal(y.detach(), ref[0]) and torch.equal(x.grad, ref[1]) and torch.equal(layer.weight.grad, ref[2])
    weights_updated()


def test_reuse_under_torch_compile(counted):
    """A compiled caller (trainer.compile) reuses too: the lookup sits inside the layer's one graph break."""
    torch._dynamo.reset()
    layer, x = _layer(), torch.randn(8, 64)
    step = torch.compile(lambda t: torch.relu(layer(t)) * 2.0, backend="aot_eager")
    ref = torch.relu(layer(x)) * 2.0
    counted[0] = 0
    with reuse_weight_quantization():
        outs = [step(x) for _ in range(3)]
    weights_updated()
    torch._dynamo.reset()
    assert counted[0] == 1 and all(torch.equal(o, ref) for o in outs)
