"""Launches folded into the scaled_mm path's kernels (issue 47, item 2), bit for bit against the separate
launches they replace: under the Triton interpreter on CPU, compiled on a GPU.

* the compact residual's overflow (``where(overflow, nan, dW)``) inside the wgrad finish kernel.
"""
import pytest
import torch

from fp4lightning.kernels import gemm as kgemm
from fp4lightning.kernels import scaled_mm as sm
from fp4lightning.numerics.absmax import quantize_rows_reference

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


@pytest.mark.parametrize("flag", [False, True])
@pytest.mark.parametrize("parts", ["addend+dge", "dge", "flag only"])
def test_wgrad_finish_makes_the_overflow_nan_in_the_same_pass(flag, parts):
    n, k = 40, 200  # not multiples of the 32 x 128 tile
    w = torch.randn(n, k, device=DEV) * 0.05
    _, w_s = quantize_rows_reference(w)
    acc, addend = torch.randn(n, k, device=DEV), torch.randn(n, k, device=DEV)
    acc[0, :4] = torch.tensor([0.0, -0.0, 1e-42, float("inf")])  # zeros, a subnormal, inf pass through
    kw = {"addend+dge": dict(addend=addend, dge_weight=w, dge_weight_scale=w_s),
          "dge": dict(dge_weight=w, dge_weight_scale=w_s), "flag only": {}}[parts]
    nan_if = torch.tensor(flag, device=DEV)
    got = sm.triton_wgrad_finish(acc.clone(), nan_if=nan_if, **kw)
    # what the separate launches gave: the finish kernel (or nothing), then torch.where
    want = sm.triton_wgrad_finish(acc.clone(), **kw) if kw else acc.clone()
    want = torch.where(nan_if, torch.full((), float("nan"), device=DEV), want)
    assert torch.equal(_bits(got), _bits(want))
    assert torch.isnan(got).all() == flag
    if parts == "addend+dge" and not flag:
        assert torch.equal(got, (acc + addend) * kgemm.triton_dge_factor(w, w_s))
    with pytest.raises(ValueError, match="nan_if"):
        sm.triton_wgrad_finish(acc.clone(), nan_if=torch.zeros(2, dtype=torch.bool, device=DEV))


@pytest.mark.parametrize("flag", [False, True])
def test_scaled_wgrad_nan_if_on_cpu_is_the_where(flag):
    # the CPU form of the same path (cpu_fused epilogue, then torch.where) gives the same bits
    g = (torch.randn(32, 16, device=DEV) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(16, device=DEV) + 0.5
    a8t = (torch.randn(48, 32, device=DEV)).to(torch.float8_e4m3fn)
    nan_if = torch.tensor(flag, device=DEV)
    plain = sm.scaled_fp4_wgrad(g, s, a8t)
    got = sm.scaled_fp4_wgrad(g, s, a8t, nan_if=nan_if)
    want = torch.where(nan_if, torch.full((), float("nan"), device=DEV), plain)
    assert torch.equal(_bits(got), _bits(want)) and torch.isnan(got).all() == flag

