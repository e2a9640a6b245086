"""FP4Linear under the block-scaled recipes (fp4lightning.nn.block_linear): nvfp4, mxfp4, mxfp4-rht-sr.

Checks the three GeMMs against their definition (quantize each operand along the GeMM's
reduction dimension, multiply), against a float64 nn.Linear (SQNR), stochastic rounding's
reproducibility and unbiasedness through the layer, DGE/OCC composition, the config
validation and keep_first_n / keep_last_n in the converter.
"""
import warnings

import pytest
import torch
from torch import nn

from fp4lightning import FP4Config, FP4Linear, convert_to_fp4
from fp4lightning.nn.convert import fp4_modules, positional_keep
from fp4lightning.config import SR_OPERANDS
from fp4lightning.nn import block_linear
from fp4lightning.numerics.block_formats import block_gemm_reference, quantize_block, sr_seed_from_checksum
from fp4lightning.numerics.dge import dge_derivative
from fp4lightning.numerics.hadamard import apply_rht, rht_matrix
from tests._numerics import above, below, heavy_tailed, sqnr

PRESETS = ["nvfp4", "mxfp4", "mxfp4-rht-sr"]
# Measured (8 seeds, x = heavy_tailed(128, 256), W ~ N(0, 1/K), dY ~ N(0, 1)) SQNR
# vs float64 nn.Linear over the three presets: y 13.6-17.9 dB, dx 12.4-15.9, dW 12.1-15.2.
MIN_SQNR_DB = {"y": 12.0, "dx": 10.0, "dw": 9.0}
# averaging 32 stochastic-rounding draws of dW must beat one draw by well over 10*log10(32)/2 dB
SR_DRAWS = 32
SR_MIN_GAIN_DB = 6.0


def _layer(cfg, k=256, n=128):
    lin = nn.Linear(k, n)
    nn.init.normal_(lin.weight, std=k ** -0.5)
    return FP4Linear.from_linear(lin, cfg)


def _run(layer, x, dy):
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone()


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp4"])
def test_gemms_match_their_definition(preset, one_thread):
    """RTN presets are deterministic: each output equals the quantize-then-multiply it stands for."""
    cfg = FP4Config.from_preset(preset, keep_first_n=0, keep_last_n=0, stochastic_rounding=())
    fmt = {"nvfp4": "nvfp4", "mxfp4": "mxfp4"}[preset]
    layer = _layer(cfg)
    x, dy = heavy_tailed(96, 256), torch.randn(96, 128)
    y, dx, dw = _run(layer, x, dy)
    w = layer.weight.detach()
    two_d = cfg.weight_block_2d
    qw = quantize_block(w, fmt, block_2d=two_d)
    assert torch.equal(y, block_gemm_reference(quantize_block(x, fmt), qw) + layer.bias.detach())
    qwt = quantize_block(w.t().contiguous(), fmt, block_2d=two_d)  # 2-D tiles: the same values, transposed
    assert torch.equal(dx, block_gemm_reference(quantize_block(dy, fmt), qwt))
    g, a = dy, x
    if cfg.rht_wgrad:
        q = rht_matrix(cfg.rht_seed)
        g, a = apply_rht(g, q, 0), apply_rht(a, q, 0)
    want = block_gemm_reference(quantize_block(g.t().contiguous(), fmt), quantize_block(a.t().contiguous(), fmt))
    assert torch.equal(dw, want)


@pytest.mark.parametrize("preset", PRESETS)
def test_against_float64_linear(preset, one_thread):
    layer = _layer(FP4Config.from_preset(preset))
    x, dy = heavy_tailed(128, 256), torch.randn(128, 128)
    y, dx, dw = _run(layer, x, dy)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    above(sqnr(y, x.double() @ w.t() + b), MIN_SQNR_DB["y"], "y SQNR dB")
    above(sqnr(dx, dy.double() @ w), MIN_SQNR_DB["dx"], "dx SQNR dB")
    above(sqnr(dw, dy.double().t() @ x.double()), MIN_SQNR_DB["dw"], "dw SQNR dB")


def test_autocast_and_3d_inputs_follow_nn_linear(one_thread):
    layer = _layer(FP4Config.from_preset("nvfp4"))
    x = torch.randn(2, 24, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 24, 128)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.shape == x.shape
    assert layer.weight.grad.dtype == torch.float32 and torch.isfinite(layer.weight.grad).all()


def test_stochastic_rounding_reproducible_and_seeded(one_thread):
    cfg = FP4Config.from_preset("mxfp4-rht-sr")
    x, dy = heavy_tailed(64, 256), torch.randn(64, 128)
    layer = _layer(cfg)
    a, b = _run(layer, x, dy), _run(layer, x, dy)  # same state -> same draws (resume-safe)
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
    layer.config = cfg.replace(sr_seed=1)
    c = _run(layer, x, dy)
    assert not torch.equal(a[2], c[2])
    assert torch.equal(a[0], c[0])  # the forward is round-to-nearest in this preset


def test_device_seeds_change_only_the_random_stream(monkeypatch, one_thread):
    """Off the CPU a stochastic operand's seed is sr_seed_from_checksum of its checksum, on the device (no
    host sync in backward); forced here on CPU. The forward (round to nearest in nvfp4) is unchanged, and
    each stochastic backward GeMM is still its definition, quantized with that seed: only the random
    stream differs from the host-seeded (CPU) one."""
    cfg = FP4Config.from_preset("nvfp4", keep_first_n=0, keep_last_n=0, rht_wgrad=False)
    layer = _layer(cfg)
    x, dy = heavy_tailed(64, 256), torch.randn(64, 128)
    host = _run(layer, x, dy)
    monkeypatch.setattr(block_linear, "host_seeded", lambda device: False)
    y, dx, dw = _run(layer, x, dy)
    assert torch.equal(y, host[0])
    assert not torch.equal(dx, host[1]) and not torch.equal(dw, host[2])

    def sr(t, operand):  # the operand quantized with its device-derived seed
        base = cfg.sr_seed * 1_000_003 + SR_OPERANDS.index(operand) * 7_919
        seed = sr_seed_from_checksum(base, t.view(torch.int32).to(torch.int64).sum())
        return quantize_block(t.contiguous(), "nvfp4", "stochastic", seed=seed)

    w = layer.weight.detach()
    assert torch.equal(dx, block_gemm_reference(sr(dy, "dgrad.g"), quantize_block(w.t().contiguous(), "nvfp4",
                                                                                   block_2d=True)))
    assert torch.equal(dw, block_gemm_reference(sr(dy.t(), "wgrad.g"), quantize_block(x.t().contiguous(), "nvfp4")))


def test_stochastic_rounding_unbiased_through_the_layer(one_thread):
    """Averaging dW over SR seeds converges to the exact product (the RHT is exact too)."""
    cfg = FP4Config.from_preset("mxfp4-rht-sr")
    layer = _layer(cfg)
    x, dy = torch.randn(64, 256), torch.randn(64, 128)
    ref = dy.double().t() @ x.double()
    draws = []
    for s in range(SR_DRAWS):
        layer.config = cfg.replace(sr_seed=s)
        draws.append(_run(layer, x, dy)[2])
    one = sqnr(draws[0], ref)
    mean = sqnr(torch.stack(draws).mean(0), ref)
    above(mean - one, SR_MIN_GAIN_DB, "SR mean minus one draw, dB")
    # round-to-nearest does not average out: the same experiment without SR stays put
    rtn = FP4Config.from_preset("mxfp4", rht_wgrad=True)
    layer.config = rtn
    below(sqnr(_run(layer, x, dy)[2], ref) - mean, -SR_MIN_GAIN_DB, "round-to-nearest minus SR mean, dB")


def test_dge_composes_with_block_scales(one_thread):
    base = FP4Config.from_preset("mxfp4")
    layer = _layer(base)
    x, dy = torch.randn(32, 256), torch.randn(32, 128)
    _, _, dw_ste = _run(layer, x, dy)
    layer.config = base.replace(dge=True)
    _, _, dw_dge = _run(layer, x, dy)
    w = layer.weight.detach()
    q = quantize_block(w, "mxfp4")
    fprime = dge_derivative(w / q.element_scales(), base.dge_k, base.dge_clamp)
    assert torch.equal(dw_dge, dw_ste * fprime)


def test_occ_composes_and_helps_on_outliers(one_thread):
    base = FP4Config.from_preset("mxfp4")
    layer = _layer(base)
    x, dy = heavy_tailed(128, 256, outlier_scale=60.0), torch.randn(128, 128)
    w, b = layer.weight.detach().double(), layer.bias.detach().double()
    ref = x.double() @ w.t() + b
    y_plain = _run(layer, x, dy)[0]
    layer.config = base.replace(occ=True, occ_quantile="exact")
    y_occ, dx, dw = _run(layer, x, dy)
    above(sqnr(y_occ, ref) - sqnr(y_plain, ref), 0.0, "OCC minus plain y SQNR, dB")
    above(sqnr(dw, dy.double().t() @ x.double()), MIN_SQNR_DB["dw"], "dw SQNR dB")


def test_config_validation_names_the_key():
    with pytest.raises(ValueError, match="block_format"):
        FP4Config(block_format="block8_e5m2")
    with pytest.raises(ValueError, match="stochastic_rounding.*unknown operand"):
        FP4Config(block_format="block32_e8m0", stochastic_rounding=("wgrad.x",))
    with pytest.raises(TypeError, match="stochastic_rounding"):
        FP4Config(block_format="block32_e8m0", stochastic_rounding="wgrad.g")
    with pytest.raises(ValueError, match="rht_wgrad needs a block format"):
        FP4Config(rht_wgrad=True)
    with pytest.raises(ValueError, match="weight_block_2d.*block16_e4m3"):
        FP4Config(block_format="block32_e8m0", weight_block_2d=True)
    with pytest.raises(ValueError, match="keep_last_n"):
        FP4Config(keep_last_n=-1)
    cfg = FP4Config(block_format="block32_e8m0", stochastic_rounding=["wgrad.g"])
    assert cfg.stochastic_rounding == ("wgrad.g",)


def test_presets_are_what_their_docstrings_say():
    nv = FP4Config.from_preset("nvfp4")
    assert (nv.block_format, nv.weight_block_2d, nv.rht_wgrad) == ("block16_e4m3", True, True)
    assert set(nv.stochastic_rounding) == {"dgrad.g", "wgrad.g"} and not nv.dge and not nv.occ
    mx = FP4Config.from_preset("mxfp4")
    assert mx.block_format == "block32_e8m0" and mx.stochastic_rounding == () and not mx.rht_wgrad
    sr = FP4Config.from_preset("mxfp4-rht-sr")
    assert sr.rht_wgrad and all(o.split(".")[0] in ("dgrad", "wgrad") for o in sr.stochastic_rounding)


def test_keep_first_and_last_blocks_in_high_precision(caplog):
    import logging

    from fp4lightning.models.llama import Llama, llama_config

    model = Llama(llama_config("tiny", n_layers=4, dim=64, n_heads=2, ffn_dim=128, vocab_size=256))
    assert positional_keep(model, 1, 2) == ["layers.0.", "layers.2.", "layers.3."]
    with warnings.catch_warnings(record=True) as rec, caplog.at_level(logging.INFO, logger="fp4lightning.nn.convert"):
        warnings.simplefilter("always")
        convert_to_fp4(model, FP4Config.from_preset("nvfp4"))
    # kept on purpose (the recipe): an INFO line, not a warning
    assert "layers.3.mlp.up_proj (keep_first_n/keep_last_n)" in caplog.text
    assert not any("keep_first_n" in str(w.message) for w in rec)
    names = fp4_modules(model)
    assert names and all(n.startswith(("layers.1.", "layers.2.")) for n in names)
    assert any(n.startswith("layers.1.") for n in names) and any(n.startswith("layers.2.") for n in names)
    # no list of blocks (an MLP): its Linear layers count as the blocks
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    assert positional_keep(mlp, 1, 0) == ["0."] and positional_keep(mlp, 0, 1) == ["4."]
    assert positional_keep(mlp, 1, 1) == ["0.", "4."] and positional_keep(mlp, 9, 0) == ["0.", "2.", "4."]


def test_repr_names_the_block_recipe():
    from fp4lightning import FP4Config, FP4Linear

    r = repr(FP4Linear(32, 16, config=FP4Config.from_preset("nvfp4")))
    assert "block=block16_e4m3(w 16x16)" in r and "rht(wgrad)" in r and "sr(" in r and "dY=" not in r
    assert "block=" not in repr(FP4Linear(32, 16, config=FP4Config.from_preset("paper")))
