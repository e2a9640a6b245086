"""`paper` on the scaled_mm backend with fewer launches (issue 47, items 2-3), bit for bit against the
launches each fused output replaces: under the Triton interpreter on CPU, compiled on a GPU.

* the refold kernels find each row's ``2^-shift`` from the two scales themselves (no ``div``, ``log2``,
  ``round``, ``exp2`` before them);
* the fold kernel writes OCC's compact residual itself (indices, values, count: no dense residual and no
  ``nonzero_static`` pass), in any slot order, and the refold gives the same bytes from it.
"""
import pytest
import torch

from fp4lightning.kernels import fp4_triton as kt
from fp4lightning.kernels import scaled_mm as sm
from fp4lightning.nn.linear import _compact_residual
from fp4lightning.numerics.occ import occ_bounds
from fp4lightning.ops import gemm

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _outliers(m, k, dtype, scale=1.0):
    """Activations whose folded rows take every shift 0..8, with NaN / inf rows, a zero and a subnormal."""
    x = torch.randn(m, k, device=DEV)
    hot = torch.rand(m, k, device=DEV) < 0.03
    x[hot] *= torch.randint(2, 3000, (int(hot.sum()),), device=DEV).float()
    x[2, 9], x[7, 0], x[3, 3], x[4, 5] = float("nan"), float("-inf"), 0.0, 1e-42
    return (x * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("scale", [1.0, 1e34, 1e-30], ids=["unit", "huge", "tiny"])
def test_refold_finds_the_shift_from_the_two_scales(dtype, transposed, scale):
    # the folded scale s_a 2^-shift is about 448 / max|x|: a normal fp32 number even for the largest x
    x = _outliers(41, 74, dtype, scale)
    bounds = occ_bounds(x, 0.97, "exact")
    _, s_fold, codes, s_a, resid = kt.triton_quantize_rows_folded(x, bounds, save=True)
    comp = _compact_residual(resid, 0.97)
    # what refold_operand computed before the kernels (four launches)
    p = torch.exp2(torch.round(torch.log2(s_fold / s_a)))
    ok = torch.isfinite(p)
    assert torch.isnan(p[[2, 7]]).all() and len(set(p[ok].tolist())) >= 5
    want = sm.triton_refold(codes, s_a, p, comp[0], comp[1], 74, transposed=transposed)
    got = sm.triton_refold(codes, s_a, None, comp[0], comp[1], 74, transposed=transposed, fold_scale=s_fold)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # and the PyTorch form of the refold (the reference backend here), from the same scales
    ref = gemm.refold_operand(codes, s_a, s_fold, comp, tuple(x.shape))
    assert torch.equal(got.contiguous().view(torch.uint8), ref.view(torch.uint8))
    with pytest.raises(ValueError, match="either p"):
        sm.triton_refold(codes, s_a, p, comp[0], comp[1], 74, fold_scale=s_fold)
