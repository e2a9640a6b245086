"""Triton block-FP4 kernels (kernels/block.py) against the PyTorch reference, under the interpreter.

Codes and scales bitwise; the GeMM against the reference block GeMM to fp32 rounding.
Shapes stay <= 128 (the interpreter runs ~0.4 s per 256^3 GeMM).
"""
import pytest
import torch

from fp4lightning.block_formats import block_gemm_reference, quantize_mxfp4, quantize_nvfp4
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
    q, s = kb.triton_quantize_mxfp4(torch.randn(4, 64, device=DEV))
    with pytest.raises(ValueError, match="shapes do not match"):
        kb.triton_block_gemm(q, s, q[:, :16], s, "mxfp4")
    with pytest.raises(ValueError, match="block_k=48 must be a multiple"):
        kb.triton_block_gemm(q, s, q, s, "mxfp4", block_k=48)
