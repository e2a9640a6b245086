"""convert_to_fp4: in place, keys unchanged, filter honoured, skip warnings, trains."""
import pytest
import torch
from torch import nn

from fp4lightning import FP4Config, FP4Linear, convert_to_fp4, fp4_modules


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab=64, d=32, n=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.odd = nn.Linear(d, 30)  # 30 is not a multiple of 16: must be skipped
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        h = self.embed(idx)
        for b in self.blocks:
            h = b(h)
        return self.lm_head(h) + self.odd(h).mean() * 0


def test_in_place_keys_and_parameters_unchanged():
    model = TinyLM()
    keys = list(model.state_dict().keys())
    params = {n: p for n, p in model.named_parameters()}
    with pytest.warns(UserWarning) as rec:
        out = convert_to_fp4(model)
    assert out is model
    assert list(model.state_dict().keys()) == keys
    for n, p in model.named_parameters():
        assert p is params[n]  # shared, not copied: optimizers keep working
    assert sorted(fp4_modules(model)) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
    msgs = " ".join(str(w.message) for w in rec)
    assert "lm_head" in msgs and "odd" in msgs and "multiple of 16" in msgs


def test_module_filter_and_preset_name():
    model = TinyLM()
    with pytest.warns(UserWarning, match="excluded by the module filter"):
        convert_to_fp4(model, "w4a4-direct", module_filter_fn=lambda m, fqn: fqn.endswith("up"))
    assert sorted(fp4_modules(model)) == ["blocks.0.up", "blocks.1.up"]
    assert model.blocks[0].up.config == FP4Config.from_preset("w4a4-direct")
    assert type(model.blocks[0].down) is nn.Linear


def test_meta_device_conversion_allocates_nothing():
    with torch.device("meta"):
        model = TinyLM()
    with pytest.warns(UserWarning):
        convert_to_fp4(model)
    assert isinstance(model.blocks[0].up, FP4Linear) and model.blocks[0].up.weight.is_meta


def test_converted_model_trains_and_loss_falls():
    torch.manual_seed(0)
    model = TinyLM(vocab=64, d=32)
    with pytest.warns(UserWarning):
        convert_to_fp4(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # a learnable rule: next token = (token * 5 + 3) mod 64
    idx = torch.randint(0, 64, (16, 33))
    idx[:, 1:] = (idx[:, :-1] * 5 + 3) % 64
    losses = []
    for _ in range(60):
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 64), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses[::10]


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown FP4 preset"):
        convert_to_fp4(TinyLM(), "fp3")
    with pytest.raises(TypeError, match="inside"):
        convert_to_fp4(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="occ_alpha"):
        FP4Config(occ_alpha=1.5)
    with pytest.raises(ValueError, match="grad_format"):
        FP4Config(grad_format="fp16")
