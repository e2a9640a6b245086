"""convert_to_fp4: in place, keys unchanged, filter honoured, skip warnings, trains; the per-run
summary of which layers run in FP4."""
import logging

import lightning as L
import pytest
import torch
from torch import nn

from fp4lightning import FP4Config, FP4Linear, convert_to_fp4
from fp4lightning.nn.convert import fp4_modules


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


def test_in_place_keys_and_parameters_unchanged(caplog):
    model = TinyLM()
    keys = list(model.state_dict().keys())
    params = {n: p for n, p in model.named_parameters()}
    with pytest.warns(UserWarning) as rec, caplog.at_level(logging.INFO, logger="fp4lightning.nn.convert"):
        out = convert_to_fp4(model)
    assert out is model
    assert list(model.state_dict().keys()) == keys
    for n, p in model.named_parameters():
        assert p is params[n]  # shared, not copied: optimizers keep working
    assert sorted(fp4_modules(model)) == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
    msgs = " ".join(str(w.message) for w in rec)
    # a layer that cannot be converted is a warning; the output head, kept on purpose, an INFO line
    assert "odd" in msgs and "multiple of 16" in msgs and "lm_head" not in msgs
    assert "convert_to_fp4: keeping lm_head (FP4Config.skip_modules)" in caplog.text


def test_module_filter_and_preset_name(caplog):
    model = TinyLM()
    with caplog.at_level(logging.INFO, logger="fp4lightning.nn.convert"):
        convert_to_fp4(model, "w4a4-direct", module_filter_fn=lambda m, fqn: fqn.endswith("up"))
    assert "keeping blocks.0.down (excluded by the module filter)" in caplog.text
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


# ----------------------------------------------------------------------------- foreign models
class MaskedLM(nn.Module):
    """A BERT-like model: the output layer is called ``decoder``; attention is nn.MultiheadAttention."""

    def __init__(self, vocab=96, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.decoder = nn.Linear(d, vocab)

    def forward(self, idx):
        h = self.embed(idx)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.decoder(h + self.ffn(h))


def test_output_head_found_by_structure_and_linear_likes_reported(recwarn, caplog):
    model = MaskedLM()
    with caplog.at_level(logging.INFO, logger="fp4lightning.nn.convert"):
        convert_to_fp4(model)
    assert fp4_modules(model) == ["ffn.0", "ffn.2"]
    assert type(model.decoder) is nn.Linear
    msgs = [str(w.message) for w in recwarn.list if "convert_to_fp4" in str(w.message)]
    assert "keeping decoder (output head: out_features=96 is the vocabulary size" in caplog.text
    assert not any("decoder" in m for m in msgs), msgs  # the head, kept on purpose, is not a warning
    assert any(m.startswith("convert_to_fp4: keeping attn (nn.MultiheadAttention") for m in msgs), msgs
    assert any("keeping attn.out_proj (" in m and "subclass of nn.Linear" in m for m in msgs), msgs
    assert len(msgs) == len(set(msgs)) == 2  # each skipped layer once
    # a tied head is the head too, whatever its name
    tied = MaskedLM(vocab=32)  # vocab == width: only the tying identifies the head
    tied.decoder.weight = tied.embed.weight
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp4lightning.nn.convert"):
        convert_to_fp4(tied)
    assert "keeping decoder (output head: weight tied to an nn.Embedding)" in caplog.text
    assert type(tied.decoder) is nn.Linear
    # the model still runs and trains through the converted layers
    out = model(torch.randint(0, 96, (2, 16)))
    out.float().mean().backward()
    assert model.ffn[0].weight.grad is not None


# ----------------------------------------------------------------------------- the per-run layer summary
class Classifier(L.LightningModule):
    """A user's model whose head maps to 32 labels: no embedding, no head name, so it is converted."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.classifier = nn.Linear(128, 32)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.classifier(self.encoder(x)), y)

    def validation_step(self, batch, batch_idx):
        self.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_and_summary(caplog, tmp_path, **trainer_kwargs) -> list[str]:
    from torch.utils.data import DataLoader, TensorDataset

    from fp4lightning import Trainer

    data = DataLoader(TensorDataset(torch.randn(32, 64), torch.randint(0, 32, (32,))), batch_size=8)
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      default_root_dir=tmp_path, **trainer_kwargs)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer.fit(Classifier(), data, data)
        trainer.validate(trainer.lightning_module, data, verbose=False)  # converts again: says nothing new
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("FP4Precision: ")]


def test_trainer_names_the_layers_it_trains_in_fp4(caplog, tmp_path):
    from fp4lightning import FP4Precision
    from fp4lightning.config import DEFAULT_SKIP_MODULES

    said = _fit_and_summary(caplog, tmp_path, precision="fp4")
    summary = [m for m in said if "Linear layers in" in m]
    assert len(summary) == 1, said  # once per run
    fp4, high, how = summary[0].splitlines()
    assert fp4 == "FP4Precision: Linear layers in FP4 (3): encoder.{0,2} (2), classifier"
    assert high == "FP4Precision: Linear layers in high precision (0): none"
    assert "FP4Config.skip_modules" in how and "DEFAULT_SKIP_MODULES + ('classifier',)" in how
    # the advice, taken: the classifier stays in high precision, and the summary says so
    config = FP4Config(skip_modules=DEFAULT_SKIP_MODULES + ("classifier",))
    fp4, high, _ = next(m for m in _fit_and_summary(caplog, tmp_path, plugins=[FP4Precision(config)])
                        if "Linear layers in" in m).splitlines()
    assert fp4.endswith("Linear layers in FP4 (2): encoder.{0,2} (2)")
    assert high.endswith("Linear layers in high precision (1): classifier (FP4Config.skip_modules)")


def test_summary_collapses_repeated_blocks():
    from fp4lightning.nn.convert import describe_conversion
    from fp4lightning.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=512, dim=64, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=176))
    fp4, high, _ = describe_conversion(model, "nvfp4", who="x").splitlines()  # first and last block kept
    assert fp4 == ("x: Linear layers in FP4 (14): layers.1..2.self_attn.{q_proj,k_proj,v_proj,o_proj} (8), "
                   "layers.1..2.mlp.{gate_proj,up_proj,down_proj} (6)")
    assert high == ("x: Linear layers in high precision (15): layers.{0,3}.self_attn.{q_proj,k_proj,v_proj,o_proj} "
                    "(8), layers.{0,3}.mlp.{gate_proj,up_proj,down_proj} (6) (keep_first_n/keep_last_n); "
                    "lm_head (FP4Config.skip_modules)")
