"""`fp4lightning compare` on a two-variant, few-step run: PNG and tables appear (a smoke
test of the tool, not a result), and the OCC fidelity report works on real activations."""
from __future__ import annotations

import json

import pytest
import torch

from fp4lightning.analysis import VARIANTS, capture_linear_inputs, occ_fidelity_report
from fp4lightning.block_analysis import ACT_FORMATS
from fp4lightning.cli import main as cli_main
from fp4lightning.compare import variant_overrides
from fp4lightning.models.llama import Llama, llama_config
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides


def test_variant_overrides_and_errors():
    assert variant_overrides("bf16") == ["trainer.precision=bf16-mixed"]
    assert variant_overrides("fp4") == ["trainer.precision=fp4", "fp4.preset=paper"]
    assert variant_overrides("fp4-no-dge")[-1] == "fp4.preset=fp4-no-dge"
    with pytest.raises(ValueError, match="unknown variant 'fp3'"):
        variant_overrides("fp3")


@pytest.mark.slow
def test_compare_two_variants_writes_png_and_tables(tmp_path_factory):
    corpus = prepared_test_corpus(tmp_path_factory)
    out = tmp_path_factory.mktemp("compare")
    args = ["compare", *tiny_overrides(corpus, out / "unused", "schedule.max_steps=6", "trainer.val_every_n_steps=3",
                                       "model.max_seq_len=512"),
            "--variants", "bf16,fp4", "--out", str(out), "--eval-limit", "4"]
    assert cli_main(args) == 0
    png = out / "loss_curves.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"
    md = (out / "comparison.md").read_text()
    assert "| bf16 |" in md and "| fp4 |" in md and "vs BF16" in md
    assert "Zero-shot" in md and "OCC fidelity" in md
    summary = json.loads((out / "comparison.json").read_text())
    assert set(summary["variants"]) == {"bf16", "fp4"}
    for v in summary["variants"].values():
        assert v["val_loss"] > 0 and v["train_loss"] > 0 and v["zero_shot"]
    assert len(summary["occ_fidelity"]["rows"]) == len(VARIANTS)
    assert "Quantization fidelity of every FP4 format" in md and "NVFP4" in md
    assert len(summary["block_fidelity"]["activations"]) == len(ACT_FORMATS)


def test_occ_report_on_model_activations():
    cfg = llama_config("tiny", vocab_size=256, dim=64, n_layers=2, n_heads=2, ffn_dim=176, max_seq_len=32)
    model = Llama(cfg)
    acts = capture_linear_inputs(model, [torch.randint(0, 256, (2, 32))])
    assert len(acts) == 2 * 7 and "lm_head" not in acts  # head is not quantized
    rows = occ_fidelity_report(acts)
    snr = {r["variant"]: r["snr_db"] for r in rows}
    # compensation restores the clamped outliers exactly: it can only help, and a smaller
    # alpha compensates more of the tail
    assert snr["clamp + comp, alpha=0.999"] > snr["clamp only, alpha=0.999"]
    assert snr["clamp + comp, alpha=0.97"] > snr["clamp + comp, alpha=0.99"] > snr["clamp + comp, alpha=0.999"]
    assert all(0.5 < r["cosine"] <= 1.0 and r["mse"] > 0 for r in rows)
