"""Triton block-FP4 kernels (kernels/block.py) against the PyTorch reference, under the interpreter.

Codes and scales bitwise; the GeMM against the reference block GeMM to fp32 rounding.
Shapes stay <= 128 (the interpreter runs ~0.4 s per 256^3 GeMM).
"""
import pytest
import torch

from fp4lightning.numerics.block_formats import block_gemm_reference, quantize_mxfp4, quantize_nvfp4
from tests._numerics import above, heavy_tailed, sqnr

kb = pytest.importorskip("fp4lightning.kernels.block", reason="triton is not importable here")

#: kernels run on CUDA tensors when there is a GPU (compiled), else on CPU under the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 accumulation order differs from the reference matmul's: ~1e-7 relative
GEMM_MIN_SQNR_DB = 100.0


def _inputs(m, k):
    x = heavy_tailed(m, k) * torch.exp(torch.randn(m, 1) * 2)
    x[0, :32] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_quantizer_bitwise(dtype):
    x = _inputs(24, 96).to(dtype)
    q, s = (t.cpu() for t in kb.triton_quantize_mxfp4(x.to(DEV)))
    ref = quantize_mxfp4(x)
    assert torch.equal(s, ref.scales) and torch.equal(q, ref.codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_quantizer_bitwise(dtype):
    x = _inputs(24, 64).to(dtype)
    q, s, g = (t.cpu() for t in kb.triton_quantize_nvfp4(x.to(DEV)))
    ref = quantize_nvfp4(x)
    assert torch.equal(g, ref.global_scale)
    assert torch.equal(s.view(torch.uint8), ref.scales.view(torch.uint8)) and torch.equal(q, ref.codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("k, block_k", [(64, 64), (96, 64), (96, 32)])  # one tile, a K tail, several tiles
def test_block_gemm_matches_reference(fmt, k, block_k):
    a, w = _inputs(40, k), torch.randn(24, k)  # 2-3 MXFP4 / 4-6 NVFP4 K blocks
    quant = quantize_mxfp4 if fmt == "mxfp4" else quantize_nvfp4
    qa, qw = quant(a), quant(w)
    factor = 1.0 if fmt == "mxfp4" else qa.global_scale * qw.global_scale
    dev = [t.to(DEV) for t in (qa.codes, qa.scales, qw.codes, qw.scales)]
    got = kb.triton_block_gemm(*dev, fmt, factor if isinstance(factor, float) else factor.to(DEV),
                               block_m=32, block_n=32, block_k=block_k).cpu()
    above(sqnr(got, block_gemm_reference(qa, qw).double()), GEMM_MIN_SQNR_DB, "SQNR dB")


def test_kernel_inputs_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        kb.triton_quantize_mxfp4(torch.randn(4, 48, device=DEV))
    with pytest.raises(ValueError, match="empty input"):
        kb.triton_quantize_nvfp4(torch.randn(0, 32, device=DEV))
    q, s = kb.triton_quantize_mxfp4(torch.randn(4, 64, device=DEV))
    with pytest.raises(ValueError, match="shapes do not match"):
        kb.triton_block_gemm(q, s, q[:, :16], s, "mxfp4")
    with pytest.raises(ValueError, match="block_k=16 must be a multiple of the mxfp4 block size 32"):
        kb.triton_block_gemm(q, s, q, s, "mxfp4", block_k=16)
    with pytest.raises(ValueError, match="powers of two >= 16, got block_k=48"):
        kb.triton_block_gemm(q, s, q, s, "nvfp4", block_k=48)
    # layouts and dtypes the kernel cannot read are refused or made readable, never misread
    with pytest.raises(TypeError, match="a_scales must be torch.uint8"):  # fp32 block scales of the right shape
        kb.triton_block_gemm(q, s.float(), q, s, "mxfp4")
    with pytest.raises(TypeError, match="b_codes must be 2-D packed uint8"):
        kb.triton_block_gemm(q, s, q.to(torch.int16), s, "mxfp4")


def test_block_gemm_reads_column_major_codes():
    a, w = torch.randn(32, 64), torch.randn(32, 64)
    qa, qw = quantize_mxfp4(a), quantize_mxfp4(w)
    args = [t.to(DEV) for t in (qa.codes, qa.scales, qw.codes, qw.scales)]
    want = kb.triton_block_gemm(*args, "mxfp4", block_m=32, block_n=32).cpu()
    col_major = args[0].t().contiguous().t()  # the same values, unit row stride
    assert torch.equal(kb.triton_block_gemm(col_major, *args[1:], "mxfp4", block_m=32, block_n=32).cpu(), want)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_nan_block_is_nan_as_in_the_reference(fmt):
    # a NaN activation must reach the output (loss scaling and the non-finite guard look for it): the
    # quantizers write the format's NaN scale bitwise as the reference does, and the GeMM decodes it
    x, w = _inputs(24, 64), torch.randn(16, 64)
    x[1, 5], x[7, 40] = float("nan"), float("nan")
    quant, tquant = (quantize_mxfp4, kb.triton_quantize_mxfp4) if fmt == "mxfp4" else \
        (quantize_nvfp4, kb.triton_quantize_nvfp4)
    ref, got = quant(x), [t.cpu() for t in tquant(x.to(DEV))]
    assert torch.equal(got[1].view(torch.uint8), ref.scales.view(torch.uint8)) and torch.equal(got[0], ref.codes)
    qw = quant(w)
    factor = 1.0 if fmt == "mxfp4" else float(ref.global_scale * qw.global_scale)
    y = kb.triton_block_gemm(*[t.to(DEV) for t in (ref.codes, ref.scales, qw.codes, qw.scales)], fmt, factor,
                             block_m=32, block_n=32).cpu()
    y_ref = block_gemm_reference(ref, qw)
    assert torch.equal(y.isnan(), y_ref.isnan()) and y[[1, 7]].isnan().all() and y[[0, 2]].isfinite().all()


# --------------------------------------------------------------------------- FP4Linear on the Triton path
# The block recipes' FP4Linear with FP4LIGHTNING_BACKEND=triton (what CUDA tensors get) against the
# reference path: the same codes, scales and stochastic draws, so the two differ only in fp32
# accumulation order (and where OCC's residual joins: the reference folds R / s into A's fp32
# values, the Triton path adds R W_q^T after the kernel). Audit over seeds 0-999: worst 138.2 dB
# (y with OCC, seed 160); every other output bit-identical at these shapes.
LINEAR_PATHS_MIN_SQNR_DB = 100.0


def _block_layer(cfg, k=256, n=128):
    from torch import nn

    from fp4lightning import FP4Linear

    lin = nn.Linear(k, n)
    nn.init.normal_(lin.weight, std=k ** -0.5)
    return FP4Linear.from_linear(lin, cfg).to(DEV)


def _layer_run(layer, x, dy, backend, monkeypatch):
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", backend)
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone()


# two cases cover every path: MXFP4 with the RHT and stochastic rounding, and NVFP4 (16x16 weight
# tiles, its own SR and RHT defaults) with OCC and DGE on top
@pytest.mark.parametrize("preset, extra", [("mxfp4-rht-sr", {}),
                                           ("nvfp4", {"occ": True, "occ_quantile": "exact", "dge": True})],
                         ids=["mxfp4-rht-sr", "nvfp4-occ-dge"])
def test_fp4linear_block_triton_matches_reference(preset, extra, monkeypatch):
    from fp4lightning import FP4Config

    layer = _block_layer(FP4Config.from_preset(preset, **extra), k=128, n=64)
    x, dy = heavy_tailed(48, 128).to(DEV), torch.randn(48, 64, device=DEV)
    ref = _layer_run(layer, x, dy, "reference", monkeypatch)
    calls = []  # at these shapes the two paths can agree bit for bit: prove the kernel really ran
    kernel = kb.triton_block_gemm
    monkeypatch.setattr(kb, "triton_block_gemm", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    got = _layer_run(layer, x, dy, "triton", monkeypatch)
    assert len(calls) == 3, "fprop, dgrad and wgrad must each run the Triton block GeMM"
    for name, g, r in zip(("y", "dx", "dw"), got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        above(sqnr(g, r), LINEAR_PATHS_MIN_SQNR_DB, f"{name} SQNR dB, Triton vs reference path")


def test_fp4linear_block_triton_is_the_kernel_on_the_quantized_operands(monkeypatch):
    """Round-to-nearest NVFP4 (2-D weight tiles): each output is exactly the Triton block GeMM of the
    quantized operands, so the layer adds nothing of its own to the kernel's result."""
    from fp4lightning import FP4Config
    from fp4lightning.numerics.block_formats import quantize_block

    cfg = FP4Config.from_preset("nvfp4", stochastic_rounding=(), rht_wgrad=False)
    assert cfg.weight_block_2d
    layer = _block_layer(cfg, k=128, n=64)
    x, dy = heavy_tailed(48, 128).to(DEV), torch.randn(48, 64, device=DEV)
    y, dx, dw = _layer_run(layer, x, dy, "triton", monkeypatch)
    w = layer.weight.detach()

    def kernel(a, b, b_tiles=False):
        qa, qb = quantize_block(a, "nvfp4"), quantize_block(b, "nvfp4", block_2d=b_tiles)
        sb = qb.scales.repeat_interleave(16, 0)[: qb.shape[0]].contiguous() if b_tiles else qb.scales
        return kb.triton_block_gemm(qa.codes, qa.scales, qb.codes, sb, "nvfp4", qa.global_scale * qb.global_scale)

    assert torch.equal(y, kernel(x, w, b_tiles=True) + layer.bias.detach())
    assert torch.equal(dx, kernel(dy, w.t().contiguous(), b_tiles=True))
    assert torch.equal(dw, kernel(dy.t().contiguous(), x.t().contiguous()))
