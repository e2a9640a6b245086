"""A LightningModule that knows nothing of fp4lightning under L.Trainer(plugins=[FP4Precision()], strategy="ddp"):
the gradient format DDP uses is stated once, and the output head is kept whatever its name."""
import lightning.pytorch as L
import pytest
import torch
from torch import nn

from fp4lightning import FP4Linear
from fp4lightning.numerics.cpu_bf16 import high_precision_linear_type
from fp4lightning.lightning.precision import FP4Precision
from fp4lightning.lightning.strategy import FP4DDPStrategy


class Classifier(L.LightningModule):
    def __init__(self, vocab=48, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.body = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
        self.decoder = nn.Linear(d, vocab)
        self.vocab = vocab

    def training_step(self, batch, batch_idx):
        logits = self.decoder(self.body(self.embed(batch[:, :-1])))
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab).float(), batch[:, 1:].reshape(-1))

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, self.vocab, (8, 17)), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


QUIET = dict(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
             enable_progress_bar=False, enable_model_summary=False)


def _fit(strategy):
    model = Classifier()
    L.Trainer(plugins=[FP4Precision()], strategy=strategy, **QUIET).fit(model)
    return model


def test_plain_ddp_says_gradients_travel_in_fp32():
    with pytest.warns(UserWarning) as record:
        model = _fit("ddp")
    msgs = [str(w.message) for w in record]
    grad = [m for m in msgs if "all-reduces gradients" in m]
    assert len(grad) == 1 and "DDPStrategy all-reduces gradients in float32 (plain DDP)" in grad[0], msgs
    assert "FP4DDPStrategy" in grad[0]
    assert isinstance(model.body[0], FP4Linear) and type(model.decoder) is high_precision_linear_type()
    assert not any("keeping decoder (output head" in m for m in msgs)  # the head is kept quietly (INFO)


def test_fp8_ddp_says_fp8(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        _fit(FP4DDPStrategy())
    assert "FP4DDPStrategy all-reduces gradients in FP8 E4M3" in caplog.text
