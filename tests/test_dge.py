"""Differentiable Gradient Estimator (docs/method.md section 4)."""
import pytest
import torch

from fp4lightning.numerics.dge import dge_derivative, dge_smooth
from fp4lightning.numerics.constants import E2M1_VALUES

from ._numerics import above, below, close


def _analytic_f64(x: torch.Tensor, k: float, clamp: float) -> torch.Tensor:
    """Independent float64 transcription of the paper's formula, interval by interval."""
    out = torch.zeros_like(x, dtype=torch.float64)
    a = x.double().abs().clamp(max=6.0)  # saturated to the quantizer's range first
    for lo, hi, delta in ((0.0, 2.0, 0.5), (2.0, 4.0, 1.0), (4.0, 6.0, 2.0)):
        sel = (a >= lo) & ((a < hi) if hi < 6 else (a <= hi))
        u = a[sel] - (lo + torch.floor((a[sel] - lo) / delta) * delta)
        out[sel] = ((1 / k) * (2 * u / delta - 1).abs().pow(1 / k - 1)).clamp(max=clamp)
    return out


@pytest.mark.parametrize("k,clamp", [(5.0, 3.0), (3.0, 3.0), (10.0, 2.0)])
def test_matches_analytic_formula(k, clamp):
    x = (torch.rand(50000) * 14 - 7).to(torch.float64)
    got = dge_derivative(x, k, clamp)
    want = _analytic_f64(x, k, clamp)
    close(got, want, rtol=2e-5, atol=1e-6, what="f' against the float64 formula")


def test_grid_points_and_clamp_and_range():
    grid = torch.tensor([s * v for v in E2M1_VALUES[1:] for s in (1, -1)])
    assert torch.allclose(dge_derivative(grid), torch.full_like(grid, 0.2))
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    assert torch.equal(dge_derivative(mids), torch.full_like(mids, 3.0))
    x = torch.randn(10000) * 4
    d = dge_derivative(x, clamp=2.5)
    assert d.max() <= 2.5 and d.min() >= 0
    # beyond +/-6 the magnitude saturates to the grid point 6: derivative 1/k, never 0
    assert torch.all(dge_derivative(torch.tensor([6.01, -7.0, 100.0])) == torch.tensor(0.2))


def test_matches_finite_differences_of_the_smooth_function():
    x = (torch.rand(4000, dtype=torch.float64) * 11.8 - 5.9)
    fprime = dge_derivative(x, k=5.0, clamp=1e9).double()
    # stay away from the singular mid-points where f' is unbounded
    ok = fprime < 2.0
    h = 1e-6
    fd = (dge_smooth(x + h).double() - dge_smooth(x - h).double()) / (2 * h)
    # dge_smooth runs in fp32: finite differences carry ~1e-7/h relative noise
    close(fd[ok], fprime[ok], rtol=0.05, atol=0.05, what="finite differences")


def test_smooth_function_hits_grid_and_mean_derivative():
    grid = torch.tensor(E2M1_VALUES)
    assert torch.allclose(dge_smooth(grid), grid)
    # Unclamped, f' integrates to delta over each interval (mean 1). The clamp at c cuts
    # the integrable spike: mean = c * t_c + 1 - t_c^(1/k) with t_c = (c k)^(k/(1-k)),
    # about 0.594 for k=5, c=3: DGE as published shrinks weight gradients by ~40%.
    k, c = 5.0, 3.0
    t_c = (c * k) ** (k / (1 - k))
    want = c * t_c + 1 - t_c ** (1 / k)
    u = (torch.arange(400000, dtype=torch.float64) + 0.5) / 400000 * 2.0  # uniform on [0, 2)
    below(abs(dge_derivative(u, k, c).double().mean().item() - want), 0.005, "mean f' error")


def test_bad_parameters():
    with pytest.raises(ValueError, match="k must be"):
        dge_derivative(torch.zeros(3), k=1.0)
    with pytest.raises(ValueError, match="clamp"):
        dge_derivative(torch.zeros(3), clamp=0)


def test_row_maximum_gets_one_over_k_not_zero():
    """The issue's reproduction: W * s_w of a row's largest weight lands an ulp above 6 in fp32;
    its derivative must be 1/k (a grid point), so dW = STE value / k there."""
    from fp4lightning import FP4Config
    from fp4lightning.nn.linear import fp4_linear

    grads = {}
    for dge in (True, False):
        w = torch.nn.Parameter(torch.full((16, 16), 0.01))
        w.data[:, 0] = 0.37
        cfg = FP4Config.from_preset("paper", dge=dge)
        fp4_linear(torch.ones(4, 16), w, None, cfg).sum().backward()
        grads[dge] = w.grad
    ste = grads[False][:, 0]
    assert torch.all(ste != 0)
    assert torch.equal(grads[True][:, 0], ste * torch.tensor(1.0 / 5.0))


@pytest.mark.parametrize("scale_mode", ["float", "pow2"])
def test_no_finite_weight_gets_zero_derivative(scale_mode):
    from fp4lightning.numerics.absmax import quantize_rows_reference

    w = torch.randn(256, 512) * torch.rand(256, 1)
    _, s_w = quantize_rows_reference(w, scale_mode)
    d = dge_derivative(w * s_w[:, None])
    above(d.min(), 0.0, "smallest f'")
    rows = torch.arange(w.shape[0])
    top = w.abs().argmax(1)
    if scale_mode == "float":
        # the row maximum sits on the grid point 6, give or take an fp32 ulp of W * s_w:
        # at or above 6 the derivative is exactly 1/k, an ulp below it differs by ~1e-7
        xs = (w * s_w[:, None])[rows, top].abs()
        row_max = d[rows, top]
        assert torch.equal(row_max[xs >= 6], torch.full_like(row_max[xs >= 6], 1.0 / 5.0))
        above((xs >= 6).sum(), 0, "rows whose maximum lands at or above 6")  # the bug's case occurs
        close(row_max, torch.full_like(row_max, 1.0 / 5.0), rtol=1e-6, atol=0, what="f' at row maxima")


def test_nonfinite_inputs_get_zero():
    d = dge_derivative(torch.tensor([float("nan"), float("inf"), -float("inf"), 6.0, 6.5]))
    assert d.tolist()[:3] == [0.0, 0.0, 0.0]
    assert torch.equal(d[3:], torch.full((2,), 1.0 / 5.0))


def test_derivative_equals_the_interval_formula_bit_for_bit():
    """dge_derivative computes the offset in the interval as u - floor(u), u = a / delta (exact for
    a power-of-two delta); it must give the bits of the direct (a - left) / delta formula."""
    from fp4lightning.numerics.dge import _interval

    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    edges = torch.cat([grid, grid + 0.25, grid - 0.25, torch.tensor([2.0, 4.0, 6.0])])
    x = torch.cat([torch.randn(200000) * 3, torch.rand(100000) * 13 - 6.5, edges,
                   torch.nextafter(edges, torch.full_like(edges, 10.0)),
                   torch.nextafter(edges, torch.full_like(edges, -10.0))])
    x = torch.cat([x, -x])
    for k, clamp in ((5.0, 3.0), (3.0, 2.0)):
        a = x.abs().clamp(max=6.0)
        left, delta = _interval(a)
        t = (2.0 * (a - left) / delta - 1.0).abs()
        want = ((1.0 / k) * t.pow(1.0 / k - 1.0)).clamp(max=clamp)
        assert torch.equal(dge_derivative(x, k, clamp), want)
