"""lightning.Fabric: FP4FabricPrecision trains a model; FP4Precision (the Trainer's plugin) refuses Fabric."""
import lightning as L
import pytest
import torch
from torch import nn

from fp4lightning import FP4Linear
from fp4lightning.nn.convert import fp4_modules
from fp4lightning.lightning.fabric import FP4FabricPrecision
from fp4lightning.lightning.loss_scaler import DynamicLossScaler
from fp4lightning.lightning.precision import FP4Precision

VOCAB, D = 64, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.down(torch.relu(self.up(h)))
        return self.lm_head(h)


def _batch():
    # a learnable rule: next token = (token * 5 + 3) mod 64
    idx = torch.randint(0, VOCAB, (16, 33))
    idx[:, 1:] = (idx[:, :-1] * 5 + 3) % VOCAB
    return idx


def _loss(model, idx):
    logits = model(idx[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), idx[:, 1:].reshape(-1))


@pytest.mark.parametrize("compute_dtype", ["bf16", "fp16"])
def test_fabric_training_loop(compute_dtype):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP4FabricPrecision("paper", compute_dtype=compute_dtype)])
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fabric.setup(model, opt)
    # the hidden layers run in FP4, the output head stays in high precision
    assert set(fp4_modules(model.module)) == {"up", "down"}
    assert not isinstance(model.module.lm_head, FP4Linear)
    idx = _batch()
    losses = []
    for _ in range(12):
        loss = _loss(model, idx)
        opt.zero_grad()
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses[::3]
    precision = fabric.strategy.precision
    if compute_dtype == "fp16":
        assert precision.loss_scale == 2.0**16 and precision.scaler.skipped_steps == 0
    else:
        assert precision.loss_scale is None


def test_fabric_fp16_skips_a_non_finite_step():
    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=[FP4FabricPrecision(compute_dtype="fp16", scaler=DynamicLossScaler(init_scale=1024.0))])
    model = TinyLM()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model, _batch()) * float("inf")
    fabric.backward(loss)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was skipped
    assert fabric.strategy.precision.loss_scale == 512.0
    opt.zero_grad()
    fabric.backward(_loss(model, _batch()))
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert fabric.strategy.precision.state_dict()["scaler"]["skipped_steps"] == 1


def test_trainer_plugin_refuses_fabric_before_converting():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[FP4Precision()])
    model = TinyLM()
    with pytest.raises(TypeError, match=r"FP4FabricPrecision"):
        fabric.setup(model)
    assert not fp4_modules(model)  # refused before any layer was swapped


@pytest.mark.parametrize("compute_dtype", ["bf16", "fp16"])
def test_fabric_non_finite_policy(compute_dtype):
    """The non-finite policy of the Trainer plugin holds under Fabric too, in bf16 as in fp16: a step
    with an inf/NaN gradient is skipped (weights and optimizer state untouched), counted, and after
    ``max_consecutive_skips`` in a row training stops with NonFiniteError naming the step."""
    from fp4lightning.lightning.nonfinite import NonFiniteError

    fabric = L.Fabric(accelerator="cpu", devices=1,
                      plugins=[FP4FabricPrecision(compute_dtype=compute_dtype, max_consecutive_skips=3)])
    model = TinyLM()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    precision = fabric.strategy.precision
    fabric.backward(_loss(model, _batch()))
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v["exp_avg"].clone() for k, v in opt.optimizer.state.items()}
    for i in range(2):
        fabric.backward(_loss(model, _batch()) * float("nan"))
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # skipped
        assert all(torch.equal(v["exp_avg"], state_before[k]) for k, v in opt.optimizer.state.items())
        assert precision.nonfinite.consecutive == i + 1
    # a good step resets the run of skips (the total stays)
    fabric.backward(_loss(model, _batch()))
    opt.step()
    opt.zero_grad()
    assert precision.nonfinite.consecutive == 0 and precision.nonfinite.total == 2
    state = precision.state_dict()
    assert state["nonfinite"] == {"consecutive": 0, "total": 2, "steps": 4}
    fresh = FP4FabricPrecision(compute_dtype=compute_dtype)
    fresh.load_state_dict(state)  # what fabric.load restores on resume
    assert fresh.state_dict()["nonfinite"] == state["nonfinite"]
    for _ in range(2):
        fabric.backward(_loss(model, _batch()) * float("nan"))
        opt.step()
        opt.zero_grad()
    fabric.backward(_loss(model, _batch()) * float("nan"))
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row.*step 7.*max_consecutive_skips"):
        opt.step()


def test_fabric_bad_skip_limit_names_the_argument():
    with pytest.raises(ValueError, match=r"FP4FabricPrecision: max_consecutive_skips must be >= 1"):
        FP4FabricPrecision(max_consecutive_skips=0)
