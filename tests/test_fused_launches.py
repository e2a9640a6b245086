"""Launches folded into the scaled_mm path's kernels (issue 47, item 2), bit for bit against the separate
launches they replace: under the Triton interpreter on CPU, compiled on a GPU.

* the compact residual's overflow (``where(overflow, nan, dW)``) inside the wgrad finish kernel;
* the refold writing wgrad's operand transposed (no ``_transpose_kernel``).
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


@pytest.mark.parametrize("m", [41, 48], ids=["M%16!=0", "M%16==0"])
def test_refold_writes_the_wgrad_operand_transposed_bit_for_bit(m, monkeypatch):
    from fp4lightning.nn.linear import _compact_residual
    from fp4lightning.numerics.occ import occ_bounds
    from fp4lightning.kernels import fp4_triton as kt
    from fp4lightning.kernels import fp8_gemm
    x = torch.randn(m, 74, device=DEV)
    hot = torch.rand(m, 74, device=DEV) < 0.03
    x[hot] *= torch.randint(2, 3000, (int(hot.sum()),), device=DEV).float()  # every fold shift 0-8
    x[2, 9], x[7, 0], x[3, 3], x[4, 5] = float("nan"), float("-inf"), 0.0, 1e-42  # NaN rows, a zero, a subnormal
    x = x.to(torch.bfloat16)
    bounds = occ_bounds(x, 0.97, "exact")
    _, s_fold, codes, s_a, resid = kt.triton_quantize_rows_folded(x, bounds, save=True)
    comp = _compact_residual(resid, 0.97)
    p = torch.exp2(torch.round(torch.log2(s_fold / s_a)))
    rows = sm.triton_refold(codes, s_a, p, comp[0], comp[1], 74)
    cols = sm.triton_refold(codes, s_a, p, comp[0], comp[1], 74, transposed=True)
    assert cols.shape == (m, 74) and cols.stride(0) == 1 and cols.stride(1) % 16 == 0
    assert torch.equal(cols.view(torch.uint8), rows.view(torch.uint8))
    # wgrad's operand from it: the bytes the transpose kernel made from the row-major form, zeros past M
    want = fp8_gemm.triton_transpose_fp8(rows)
    want = want if m % 16 == 0 else sm._pad_cols(want)
    got = sm.fp8_cols(cols)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if m % 16 == 0:  # read in place: no copy
        assert got.data_ptr() == cols.data_ptr()
