"""The DGE-experiment tooling (fp4lightning.experiments.dge_probe) and compare's seed statistics,
checked against hand-computed cases."""
from __future__ import annotations

import math

import pytest
import torch

from fp4lightning.experiments.compare import paired_diff, paired_gap, parse_variant, spread
from fp4lightning.config import FP4Config
from fp4lightning.numerics.dge import dge_derivative
from fp4lightning.experiments.dge_probe import interval_position, model_weight_stats, weight_quant_stats
from fp4lightning.numerics.dge import frozen_dge_factor
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.train.recipe import load_recipe

# Two rows chosen by hand, away from rounding ties and histogram bin edges.
#   row 0: amax 6 -> scale 1;   scaled  6,  1.33, -2.35, 0.08
#   row 1: amax 1.5 -> scale 4; scaled -6,  2.0,   0.84, 0.0
HAND_W = [[6.0, 1.33, -2.35, 0.08], [-1.5, 0.5, 0.21, 0.0]]
# positions inside the E2M1 interval: (|x| - left) / delta
HAND_POS = [1.0, 0.66, 0.35, 0.16, 1.0, 0.0, 0.68, 0.0]
# round to nearest: 1.33 -> 1.5, -2.35 -> -2, 0.08 -> 0, 0.84 -> 1 (i.e. 0.25 unscaled)
HAND_ERR2 = 0.17 ** 2 + 0.35 ** 2 + 0.08 ** 2 + 0.04 ** 2
HAND_NORM2 = sum(v * v for row in HAND_W for v in row)
HAND_DIST = 0.34 + 0.35 + 0.16 + 0.32
HAND_HIST = [2, 1, 0, 1, 0, 0, 2, 0, 0, 2]  # bins of 0.1 over [0, 1]; 1.0 falls in the last


def test_weight_quant_stats_hand_case():
    w = torch.tensor(HAND_W)
    pos, delta = interval_position(torch.tensor([6.0, 1.33, -2.35, 0.08, -6.0, 2.0, 0.84, 0.0]))
    torch.testing.assert_close(pos, torch.tensor(HAND_POS), atol=1e-5, rtol=0)
    assert delta.tolist() == [2.0, 0.5, 1.0, 0.5, 2.0, 1.0, 0.5, 0.5]
    s = weight_quant_stats(w, FP4Config())
    assert s["n"] == 8 and s["hist"] == HAND_HIST
    assert s["err2"] == pytest.approx(HAND_ERR2, abs=1e-6)
    assert s["norm2"] == pytest.approx(HAND_NORM2, rel=1e-6)
    assert s["dist"] == pytest.approx(HAND_DIST, abs=1e-5)
    # f'(u) = (1/k) |2u - 1|^(1/k - 1), clamped at 3; zero only outside [-6, 6]
    hand_dge = sum(min(3.0, 0.2 * abs(2 * p - 1) ** (0.2 - 1)) if abs(2 * p - 1) > 0 else 3.0 for p in HAND_POS)
    assert s["dge"] == pytest.approx(hand_dge, rel=1e-4)


def test_model_weight_stats_pools_layers():
    layer_a = FP4Linear(32, 16, bias=False)
    layer_b = FP4Linear(16, 16, bias=False)
    model = torch.nn.Sequential(layer_a, layer_b)
    sa, sb = weight_quant_stats(layer_a.weight), weight_quant_stats(layer_b.weight)
    pooled = model_weight_stats(model)
    assert pooled["layers"] == 2 and pooled["n"] == 512 + 256
    assert pooled["rel_err"] == pytest.approx((sa["err2"] + sb["err2"]) / (sa["norm2"] + sb["norm2"]))
    assert pooled["sqnr_db"] == pytest.approx(-10 * math.log10(pooled["rel_err"]))
    assert sum(pooled["position_hist"]) == pytest.approx(1.0)
    # weights on the grid: zero error, every position at an interval end
    with torch.no_grad():
        layer_b.weight.copy_(torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0]).repeat(32).reshape(16, 16))
    assert weight_quant_stats(layer_b.weight)["err2"] == 0.0
    assert weight_quant_stats(layer_b.weight)["dist"] == pytest.approx(0.0, abs=1e-6)


def _wgrad(layer: FP4Linear, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    layer.weight.grad = None
    layer(x).backward(dy)
    return layer.weight.grad.clone()


def test_frozen_dge_factor_is_ste_times_initial_factor():
    torch.manual_seed(0)
    frozen = FP4Linear(32, 16, bias=False, config=FP4Config(dge=False, occ=False, dge_frozen_factor=True))
    ste = FP4Linear(32, 16, bias=False, config=FP4Config(dge=False, occ=False))
    with torch.no_grad():
        ste.weight.copy_(frozen.weight)
    w0 = frozen.weight.detach().clone()
    s0 = 6.0 / w0.abs().amax(dim=1)
    factor0 = dge_derivative(w0 * s0[:, None])
    for step in range(3):
        x, dy = torch.randn(8, 32), torch.randn(8, 16)
        g_frozen, g_ste = _wgrad(frozen, x, dy), _wgrad(ste, x, dy)
        torch.testing.assert_close(g_frozen, g_ste * factor0, rtol=1e-6, atol=0)
        with torch.no_grad():  # a large move, so the current factor differs from the frozen one
            for layer in (frozen, ste):
                layer.weight.add_(0.3 * torch.sin(layer.weight * 1000 + step))
    s_now = 6.0 / frozen.weight.detach().abs().amax(dim=1)
    factor_now = dge_derivative(frozen.weight.detach() * s_now[:, None])
    assert not torch.allclose(factor_now, factor0)  # the test above could tell the two apart


def test_frozen_dge_factor_refuses_dge_on():
    with pytest.raises(ValueError, match="set dge=False"):
        frozen_dge_factor(torch.randn(16, 16), torch.ones(16), FP4Config(dge_frozen_factor=True))


def test_frozen_variant_reaches_the_recipe():
    v = parse_variant("fp4-dge-frozen")
    cfg = load_recipe(None, v.overrides())
    fp4 = FP4Config.from_preset(cfg.fp4.preset, **cfg.fp4.changes())
    assert fp4.dge is False and fp4.dge_frozen_factor is True and fp4.occ is True


def test_lr_variants():
    v = parse_variant("bf16@lr=1e-3")
    assert (v.base, v.lr, v.preset) == ("bf16", 1e-3, "bf16")
    assert load_recipe(None, v.overrides()).optimizer.lr == 1e-3
    assert parse_variant("fp4@lr=2e-3").overrides() == ["trainer.precision=fp4", "fp4.preset=paper",
                                                         "optimizer.lr=0.002"]
    for bad, msg in (("fp4@lr=x", "not a number"), ("fp4@wd=0.1", "only '@lr=VALUE'"), ("fp4@lr=-1", "positive"),
                     ("fp3@lr=1e-3", "unknown variant 'fp3'")):
        with pytest.raises(ValueError, match=msg):
            parse_variant(bad)


def test_spread_and_paired_gap_hand_case():
    s = spread([4.0, 5.0, 6.0])
    assert (s["mean"], s["std"], s["n"]) == (5.0, 1.0, 3)
    assert spread([4.0])["std"] is None
    g = paired_gap([4.4, 5.5], [4.0, 5.0])  # +10% in both seeds
    assert g["mean"] == pytest.approx(0.1) and g["std"] == pytest.approx(0.0, abs=1e-12)
    d = paired_diff([4.5, 5.25], [4.0, 5.0])  # FP4 minus BF16, per seed
    assert d["values"] == [0.5, 0.25] and d["mean"] == 0.375 and d["std"] == pytest.approx(0.25 / math.sqrt(2))
    with pytest.raises(ValueError, match="2 values against 1"):
        paired_gap([1.0, 2.0], [1.0])
