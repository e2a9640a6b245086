"""NVFP4 / MXFP4 block quantizers, stochastic rounding and the RHT (fp4lightning.numerics.block_formats, .hadamard).

Two oracles: exact value tables worked out from the OCP Microscaling Formats spec v1.0
(section 6.3: shared exponent ``floor(log2(amax)) - emax_elem``, emax_elem = 2 for E2M1;
E8M0 bias 127, 0xFF = NaN) and the NVFP4 definition (E4M3 block scale ``amax/6``), which
always run; and torchao's own CPU implementation (``torchao.prototype.mx_formats``,
pinned test-only extra ``oracle``), compared bitwise, skipped when torchao is absent.
"""
import math
import warnings

import pytest
import torch

from fp4lightning.numerics.block_formats import (
    block_gemm_reference,
    dequantize_block,
    e8m0_to_float,
    fake_quantize_block,
    quantize_block,
    quantize_mxfp4,
    quantize_nvfp4,
    stochastic_round_e2m1,
)
from fp4lightning.numerics.constants import E2M1_VALUES, E8M0_NAN
from fp4lightning.numerics.hadamard import RHT_SIZE, apply_rht, hadamard_matrix, rht_matrix
from tests._numerics import above, below, close, heavy_tailed, sqnr

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    _TORCHAO = None
except Exception as e:  # noqa: BLE001 - any import failure means "no oracle here"
    _TORCHAO = f"torchao.prototype.mx_formats not importable ({type(e).__name__}); install the pinned oracle " \
               "extra: pip install --no-deps 'torchao==0.18.0'"
needs_torchao = pytest.mark.skipif(_TORCHAO is not None, reason=_TORCHAO or "")

# Measured quantize-dequantize SQNR on heavy_tailed(256, 512): NVFP4 ~19.9 dB, MXFP4 ~16.4 dB;
# thresholds a few dB under.
NVFP4_MIN_SQNR_DB = 17.0
MXFP4_MIN_SQNR_DB = 13.5
# SR mean over N draws: the standard error is <= 0.5 * grid gap / sqrt(N); 6 sigma.
SR_DRAWS = 4000
SR_MEAN_TOL_SIGMAS = 6.0
# fp32 GeMM with and without the RHT: relative Frobenius error measured ~1e-7.
RHT_GEMM_RTOL = 1e-5


def _codes(q):
    return torch.stack((q.codes & 0xF, q.codes >> 4), -1).reshape(q.codes.shape[0], -1)


def _block(values, size):
    x = torch.zeros(1, size)
    x[0, : len(values)] = torch.tensor(values)
    return x


# --------------------------------------------------------------------------- OCP MX tables
# (block values, expected E8M0 biased exponent, expected decoded block values)
MX_TABLE = [
    # amax 6 = 1.5 * 2**2: X = 2**(2-2) = 1, values exact
    ([6.0, -3.0, 0.5, 1.5], 127, [6.0, -3.0, 0.5, 1.5]),
    # amax 1: X = 2**-2, 1 -> 4, 0.3 -> 1.2 -> 1 (nearest), 0.125 -> 0.5
    ([1.0, 0.3, 0.125, -0.0625], 125, [1.0, 0.25, 0.125, -0.0]),
    # amax 7.9: X = 2**0 -> 7.9 saturates to 6 (the OCP "minimally supported" clamp)
    ([7.9, 5.0, 2.5, 0.25], 127, [6.0, 4.0, 2.0, 0.0]),
    # amax 0.3: floor(log2 0.3) = -2, X = 2**-4; 0.3 * 16 = 4.8 -> 4 -> 0.25; 0.1 * 16 = 1.6 -> 1.5
    ([0.3, -0.3, 0.1], 123, [0.25, -0.25, 0.09375]),
    # all-zero block: smallest exponent, all codes 0
    ([0.0], 0, [0.0]),
    # huge: amax 2**100 -> X = 2**98
    ([2.0 ** 100, 2.0 ** 99], 127 + 98, [2.0 ** 100, 2.0 ** 99]),
]


@pytest.mark.parametrize("values,biased,decoded", MX_TABLE)
def test_mxfp4_ocp_exact_table(values, biased, decoded):
    q = quantize_mxfp4(_block(values, 32))
    assert q.scales.dtype == torch.uint8 and q.scales.shape == (1, 1)
    assert int(q.scales[0, 0]) == biased
    want = torch.tensor(decoded + [0.0] * (32 - len(decoded)))
    got = q.dequantize()[0]
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (got, want)


def test_e2m1_code_points_and_e8m0_decoding():
    # every E2M1 bit pattern (OCP table: 0b0SEEM) decodes to its value, both signs
    q = quantize_mxfp4(torch.tensor([list(E2M1_VALUES) + [-v for v in E2M1_VALUES] + [0.0] * 16]))
    assert _codes(q)[0, :16].tolist() == list(range(8)) + [8 + i for i in range(8)]
    assert e8m0_to_float(torch.tensor([127, 128, 126, 254], dtype=torch.uint8)).tolist() == [1.0, 2.0, 0.5, 2.0 ** 127]
    assert math.isnan(e8m0_to_float(torch.tensor([E8M0_NAN], dtype=torch.uint8)).item())


def test_nan_block_decodes_to_nan_other_blocks_unharmed():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    for q in (quantize_mxfp4(x), quantize_nvfp4(x, global_scale=None)):
        d = q.dequantize()
        blk = q.block
        assert torch.isnan(d[0, :blk]).all()
        assert torch.isfinite(d[0, blk:]).all() and torch.isfinite(d[1]).all()


# (block amax, expected E4M3 block scale): single-level NVFP4, scale = e4m3(amax / 6)
NV_TABLE = [(6.0, 1.0), (3.0, 0.5), (12.0, 2.0), (6.0 * 448, 448.0), (1e6, 448.0), (1e-9, 2.0 ** -6), (6.6, 1.125)]


@pytest.mark.parametrize("amax,scale", NV_TABLE)
def test_nvfp4_block_scale_table(amax, scale):
    x = torch.zeros(1, 16)
    x[0, 0] = amax
    x[0, 1] = -amax / 2
    q = quantize_nvfp4(x, global_scale=None)
    assert q.scales.dtype == torch.float8_e4m3fn
    assert q.scales.float().item() == scale
    d = q.dequantize()[0]
    # the top element lands on the nearest grid point of amax/scale (saturating at 6)
    top = min(6.0, min(E2M1_VALUES, key=lambda v: abs(v - amax / scale)))
    assert d[0].item() == pytest.approx(top * scale, rel=0, abs=0)


def test_nvfp4_two_level_scale_keeps_small_blocks_in_e4m3_range():
    # one block near 1e4, one near 1e-4: single-level E4M3 scales clamp (to 448 and
    # 2**-6); the per-tensor fp32 scale brings both within range
    x = torch.cat([torch.randn(1, 16) * 1e4, torch.randn(1, 16) * 1e-1], 1)
    one, two = quantize_nvfp4(x, global_scale=None), quantize_nvfp4(x)
    assert two.global_scale is not None
    above(sqnr(two.dequantize(), x) - sqnr(one.dequantize(), x), 10.0, "two-level minus one-level SQNR, dB")


@pytest.mark.parametrize("fmt,min_db", [("nvfp4", NVFP4_MIN_SQNR_DB), ("mxfp4", MXFP4_MIN_SQNR_DB)])
def test_quantize_dequantize_sqnr(fmt, min_db):
    x = heavy_tailed(256, 512)
    above(sqnr(quantize_block(x, fmt).dequantize(), x), min_db, "SQNR dB")


def test_nvfp4_2d_blocks_serve_both_orientations():
    w = torch.randn(48, 80)
    q = quantize_nvfp4(w, block_2d=True)
    assert q.scales.shape == (3, 5)
    qt = quantize_nvfp4(w.t().contiguous(), block_2d=True)
    # one scale per 16x16 tile, so W^T's quantization is W's quantization transposed
    assert torch.equal(qt.scales.view(torch.uint8), q.scales.view(torch.uint8).t())
    assert torch.equal(qt.dequantize(), q.dequantize().t())


def test_padding_non_multiple_k():
    x = torch.randn(5, 40)
    for fmt in ("nvfp4", "mxfp4"):
        q = quantize_block(x, fmt)
        assert q.dequantize().shape == (5, 40)
        ref = quantize_block(torch.nn.functional.pad(x, (0, 64 - 40)), fmt).dequantize()[:, :40]
        assert torch.equal(q.dequantize(), ref)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_mxfp4(torch.randn(2, 2, 32))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_nvfp4(torch.ones(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown block format"):
        quantize_block(torch.randn(2, 32), "fp3")
    with pytest.raises(ValueError, match="rounding"):
        quantize_mxfp4(torch.randn(2, 32), rounding="up")
    with pytest.raises(ValueError, match="NVFP4"):
        quantize_block(torch.randn(32, 32), "mxfp4", block_2d=True)


# --------------------------------------------------------------------------- torchao oracle
@needs_torchao
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_bitwise_vs_torchao(dtype):
    x = (heavy_tailed(64, 256) * torch.exp(torch.randn(64, 1) * 4)).to(dtype)
    x[0, :32] = 0
    x[3, 40] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32)
    q = quantize_mxfp4(x)
    assert torch.equal(scale.view(torch.uint8), q.scales)
    # codes of a NaN block are meaningless (its scale is NaN); compare the rest bitwise
    theirs, ours = data.view(torch.uint8).clone(), q.codes.clone()
    theirs[3, 16:32] = ours[3, 16:32] = 0
    assert torch.equal(theirs, ours)


@needs_torchao
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("two_level", [False, True])
def test_nvfp4_bitwise_vs_torchao(dtype, two_level):
    x = (heavy_tailed(64, 256) * torch.exp(torch.randn(64, 1) * 3)).to(dtype)
    x[1, :16] = 0
    pts = per_tensor_amax_to_scale(x.float().abs().max()) if two_level else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts)
        t_deq = t.dequantize(torch.float32)
    q = quantize_nvfp4(x, global_scale=True if two_level else None)
    assert torch.equal(t.scale.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(t.qdata.view(torch.uint8), q.codes)
    assert torch.equal(t_deq, q.dequantize())


# --------------------------------------------------------------------------- stochastic rounding
def test_sr_never_leaves_the_two_neighbours_and_keeps_grid_points():
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(20000) * 12 - 6).float()
    y = stochastic_round_e2m1(x, g)
    grid = torch.tensor(E2M1_VALUES)
    a = x.abs()
    lo = grid[(torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)]
    hi = grid[torch.bucketize(a, grid, right=False).clamp(0, 7)]
    assert ((y.abs() == lo) | (y.abs() == hi)).all()
    assert torch.equal(torch.signbit(y[y != 0]), torch.signbit(x[y != 0]))
    on_grid = torch.cat([grid, -grid])
    assert torch.equal(stochastic_round_e2m1(on_grid, g), on_grid)


def test_sr_is_unbiased():
    x = torch.rand(64) * 12 - 6
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    draws = stochastic_round_e2m1(x.expand(SR_DRAWS, -1).contiguous(), g)
    tol = SR_MEAN_TOL_SIGMAS * 1.0 / math.sqrt(SR_DRAWS)  # 0.5 * max gap (2) / sqrt(N)
    below((draws.mean(0) - x).abs().max(), tol, "worst SR mean error")
    # round-to-nearest is biased on the same inputs (sanity: the test can fail)
    from fp4lightning.numerics.formats import round_to_e2m1
    above((round_to_e2m1(x) - x).abs().max(), tol, "worst round-to-nearest error")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_block_sr_unbiased_and_reproducible(fmt):
    x = torch.randn(8, 64)
    x[:, 0] = 3.0 * x.abs().max()  # a block max that MXFP4's floor scale puts near 8
    seed = torch.randint(0, 2 ** 31, ()).item()
    q1 = quantize_block(x, fmt, "stochastic", torch.Generator().manual_seed(seed))
    q2 = quantize_block(x, fmt, "stochastic", torch.Generator().manual_seed(seed))
    assert torch.equal(q1.codes, q2.codes)
    g = torch.Generator().manual_seed(seed + 1)
    mean = sum(quantize_block(x, fmt, "stochastic", g).dequantize() for _ in range(400)) / 400
    # MXFP4 SR pre-scales by 3/4 so nothing saturates: unbiased everywhere
    rtn = quantize_block(x, fmt)
    dec = rtn.element_scales()[:, :64] * (rtn.global_scale if rtn.global_scale is not None else 1.0)
    step = dec * 2.0
    # NVFP4: a block scale rounded down to E4M3 can push its max a little past 6, which
    # saturates (a known, bounded bias); judge the unsaturated elements there
    ok = (x.abs() / dec <= 6.0) if fmt == "nvfp4" else torch.ones_like(x, dtype=torch.bool)
    rel = ((mean - x).abs() / step)[ok].max().item()
    below(rel, SR_MEAN_TOL_SIGMAS * 0.5 / math.sqrt(400) * (4 / 3), "worst SR mean error / grid step")


# --------------------------------------------------------------------------- RHT
def test_hadamard_is_orthogonal():
    h = hadamard_matrix(RHT_SIZE)
    assert torch.equal(h @ h.t(), RHT_SIZE * torch.eye(RHT_SIZE, dtype=torch.float64))
    q = rht_matrix(seed=torch.randint(0, 1000, ()).item(), dtype=torch.float64)
    close(q @ q.t(), torch.eye(RHT_SIZE, dtype=torch.float64), rtol=1e-5, atol=1e-15, what="Q Q^T")
    assert not torch.equal(rht_matrix(1).abs(), rht_matrix(2)) or not torch.equal(rht_matrix(1), rht_matrix(2))
    assert torch.equal(rht_matrix(7), rht_matrix(7))


def test_rht_leaves_the_wgrad_product_unchanged():
    m, n, k = 100, 48, 64  # m not a multiple of 16: zero-padding must not change the product
    g, a = torch.randn(m, n), heavy_tailed(m, k)
    q = rht_matrix(3)
    gt, at = apply_rht(g, q, 0), apply_rht(a, q, 0)
    assert gt.shape == (112, n)
    ref = (g.double().t() @ a.double())
    got = gt.t() @ at
    below((got.double() - ref).norm() / ref.norm(), RHT_GEMM_RTOL, "relative error")


def test_rht_spreads_a_spike_over_its_block():
    # the mechanism behind the RHT (a block's outlier no longer sets its scale alone):
    # a one-hot spike becomes 16 entries of equal magnitude spike / 4
    x = torch.zeros(32, 3)
    x[5, 0], x[20, 1] = 8.0, -2.0
    y = apply_rht(x, rht_matrix(torch.randint(0, 1000, ()).item()), 0)
    assert torch.allclose(y[:16, 0].abs(), torch.full((16,), 2.0))
    assert torch.allclose(y[16:, 1].abs(), torch.full((16,), 0.5))
    assert torch.equal(y[16:, 0], torch.zeros(16)) and torch.equal(y[:, 2], torch.zeros(32))


# --------------------------------------------------------------------------- GeMM
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_block_gemm_matches_dequantized_float64_product(fmt, out_dtype):
    a, w = heavy_tailed(64, 96), torch.randn(32, 96)
    qa, qw = quantize_block(a, fmt), quantize_block(w, fmt)
    ref = dequantize_block(qa, torch.float64) @ dequantize_block(qw, torch.float64).t()
    got = block_gemm_reference(qa, qw, out_dtype)
    assert got.dtype == out_dtype
    above(sqnr(got, ref), 60 if out_dtype == torch.float32 else 35, "SQNR dB")


# two of the six (format, 2-D, rounding) graphs: each compile costs ~20-50 s of CI time
@pytest.mark.parametrize("fmt, block_2d, rounding", [("nvfp4", True, "stochastic"), ("mxfp4", False, "nearest")])
def test_fake_quantize_block_compiled_is_bitwise_equal_to_eager(monkeypatch, fmt, block_2d, rounding):
    """torch.compile fuses the block quantizer on CPU; values, factor and scales must not change a bit."""
    from fp4lightning.numerics import cpu_fused

    x = heavy_tailed(70, 100) * torch.exp(torch.randn(70, 1) * 3)  # K and M not multiples of the block
    x[3, :40] = 0
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("FP4LIGHTNING_COMPILE", mode)
        gen = torch.Generator().manual_seed(7)
        out[mode] = fake_quantize_block(x, fmt, rounding, gen, block_2d=block_2d, dtype=torch.bfloat16)
    assert not cpu_fused._FAILED, cpu_fused._FAILED
    for a, b in zip(out["0"], out["1"]):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    # and the same values as the packed quantizer with the same generator (same stochastic draws;
    # only the order of the two scale multiplications differs: <= 1 ulp, a wrong draw is a grid step)
    q = quantize_block(x, fmt, rounding, torch.Generator().manual_seed(7), block_2d=block_2d)
    v, factor, _ = out["1"]
    close(v.float() * factor, q.dequantize(), rtol=2.0**-22, atol=0.0, what="values x factor")


def test_hash_uniform_is_uniform_independent_and_reproducible():
    """The counter-based uniforms behind stochastic rounding (block_formats.hash_uniform): moments,
    a 64-bin histogram, neighbour and cross-seed correlation; same seed, same draws."""
    from fp4lightning.numerics.block_formats import hash_uniform, sr_seed

    n = 1 << 20
    s1 = sr_seed(torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item()), torch.device("cpu"))
    s2 = sr_seed(torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item()), torch.device("cpu"))
    u, v = hash_uniform(n, s1, torch.device("cpu")), hash_uniform(n, s2, torch.device("cpu"))
    assert torch.equal(u, hash_uniform(n, s1, torch.device("cpu")))
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    assert torch.equal(u * 2**24, (u * 2**24).round())  # 24-bit grid
    sd = (1 / 12) ** 0.5 / n ** 0.5  # standard error of a mean of n uniforms
    below(abs(u.mean().item() - 0.5), 6 * sd, "mean - 1/2")
    below(abs(u.var().item() - 1 / 12), 6 * 0.0745 / n ** 0.5, "variance - 1/12")  # sd(var) ~ 0.0745/sqrt(n)
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
    below(chi2, 63 + 6 * (2 * 63) ** 0.5, "chi-square, 63 degrees of freedom")
    c = u - 0.5
    for what, other in (("neighbour", torch.roll(c, 1)), ("other seed", v - 0.5)):
        corr = (c * other).mean().item() / (1 / 12)
        below(abs(corr), 6 / n ** 0.5, f"correlation with {what}")


def test_sr_seed_from_checksum_is_its_formula_and_spreads_seeds():
    """The device-side seed (block_formats.sr_seed_from_checksum, what a GPU's backward uses instead of a
    host generator): the documented integer formula, in Python integers; in [0, 2^32); one checksum step or
    one base step gives an unrelated seed; any int64 checksum (negative, wrapping) works."""
    from fp4lightning.numerics.block_formats import sr_seed_from_checksum

    def lowbias32(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    m63 = (1 << 63) - 1
    bases = [0, 1, int(torch.randint(1 << 62, ())), m63]
    sums = [0, -1, int(torch.randint(-(1 << 40), 1 << 40, ())), (1 << 63) - 1, -(1 << 63)]
    seeds = set()
    for base in bases:
        for c in sums:
            s = (base + c) & m63
            want = lowbias32((s & 0xFFFFFFFF) ^ lowbias32((s >> 32) ^ 0x9E3779B1))
            got = sr_seed_from_checksum(base, torch.tensor(c, dtype=torch.int64))
            assert got.dtype == torch.int64 and got.dim() == 0 and int(got) == want and 0 <= want < 2**32
            seeds.add(want)
    assert len(seeds) == len({(b + c) & m63 for b in bases for c in sums})  # distinct seeds mod 2^63, distinct
    # neighbouring checksums: about half of the 32 bits differ
    a, b = (int(sr_seed_from_checksum(7, torch.tensor(c))) for c in (1000, 1001))
    assert 6 <= bin(a ^ b).count("1") <= 26
