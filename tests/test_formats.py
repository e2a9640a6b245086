"""E2M1 rounding, encoding and packing against exact value tables (docs/method.md section 1)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4lightning.numerics.constants import E2M1_VALUES
from fp4lightning.numerics.formats import (
    cast_to_fp8,
    decode_e2m1,
    decode_packed_fp4,
    encode_e2m1,
    pack_fp4,
    round_to_e2m1,
    unpack_fp4,
)

# (input, round-half-to-even E2M1 value): every grid point, every tie, saturation.
EXACT_TABLE = [
    (0.0, 0.0), (0.1, 0.0), (0.25, 0.0), (0.26, 0.5), (0.5, 0.5), (0.74, 0.5), (0.75, 1.0),
    (1.0, 1.0), (1.25, 1.0), (1.26, 1.5), (1.5, 1.5), (1.75, 2.0), (2.0, 2.0), (2.49, 2.0),
    (2.5, 2.0), (2.51, 3.0), (3.0, 3.0), (3.5, 4.0), (4.0, 4.0), (4.99, 4.0), (5.0, 4.0),
    (5.01, 6.0), (6.0, 6.0), (6.5, 6.0), (1e9, 6.0), (math.inf, 6.0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_round_exact_table_both_signs(dtype):
    xs = torch.tensor([x for x, _ in EXACT_TABLE], dtype=torch.float64)
    want = torch.tensor([y for _, y in EXACT_TABLE], dtype=torch.float64)
    if dtype == torch.bfloat16:  # keep only inputs bf16 represents exactly
        keep = xs.to(dtype).double() == xs
        xs, want = xs[keep], want[keep]
    for sign in (1.0, -1.0):
        got = round_to_e2m1((sign * xs).to(dtype))
        assert got.dtype == dtype
        assert torch.equal(got.double(), sign * want), (sign * xs, got)


def test_negative_zero_and_nan():
    got = round_to_e2m1(torch.tensor([-0.0, -0.1, float("nan")]))
    assert torch.signbit(got[0]) and torch.signbit(got[1]) and got[0] == 0 and got[1] == 0
    assert torch.isnan(got[2])
    codes = encode_e2m1(torch.tensor([-0.0, 0.0, -0.2]))
    assert codes.tolist() == [8, 0, 8]
    with pytest.raises(ValueError, match="NaN"):
        encode_e2m1(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError):
        round_to_e2m1(torch.tensor([1, 2]))


def test_encode_decode_all_codes():
    values = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])
    codes = encode_e2m1(values)
    assert codes.tolist() == list(range(16))
    assert torch.equal(decode_e2m1(codes), values)
    # every code value is exact in FP8 E4M3 and bf16
    assert torch.equal(values.to(torch.float8_e4m3fn).float(), values)
    assert torch.equal(values.to(torch.bfloat16).float(), values)


@pytest.mark.parametrize("k", [1, 2, 7, 16, 33])
def test_pack_unpack_round_trip(k):
    codes = torch.randint(0, 16, (5, k), dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (5, (k + 1) // 2) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed, k), codes)
    # layout: element 2j in the low nibble
    assert int(packed[0, 0]) & 0xF == int(codes[0, 0])


def test_unpack_rejects_wrong_length():
    with pytest.raises(ValueError, match="k=5"):
        unpack_fp4(torch.zeros(2, 4, dtype=torch.uint8), 5)


def test_cast_to_fp8_saturates():
    x = torch.tensor([1e6, -1e6, 1.0, float("nan")])
    assert cast_to_fp8(x, "e4m3").float()[:3].tolist() == [448.0, -448.0, 1.0]
    assert cast_to_fp8(x, "e5m2").float()[:2].tolist() == [57344.0, -57344.0]
    assert torch.isnan(cast_to_fp8(x, "e5m2").float()[3])
    with pytest.raises(ValueError, match="e4m3"):
        cast_to_fp8(x, "e3m4")


finite = st.floats(min_value=-20, max_value=20, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(a=finite, b=finite)
def test_rounding_monotonic(a, b):
    lo, hi = min(a, b), max(a, b)
    r = round_to_e2m1(torch.tensor([lo, hi]))
    assert r[0] <= r[1]


@settings(max_examples=200, deadline=None)
@given(a=finite)
def test_rounding_odd_symmetric_and_idempotent(a):
    x = torch.tensor([a, -a])
    r = round_to_e2m1(x)
    assert r[0] == -r[1]
    assert torch.equal(round_to_e2m1(r), r)
    assert float(r[0]) in E2M1_VALUES or -float(r[0]) in E2M1_VALUES


def test_round_is_nearest_on_random_values():
    """Brute force: the chosen grid value is a nearest one (ties aside) for fresh inputs."""
    x = torch.randn(20000) * 3
    grid = torch.tensor(sorted({s * v for v in E2M1_VALUES for s in (1, -1)}))
    r = round_to_e2m1(x)
    best = (x[:, None] - grid[None, :]).abs().min(dim=1).values
    assert torch.equal((x - r).abs(), best)


@pytest.mark.parametrize("k", [1, 6, 33])
def test_decode_packed_equals_unpack_then_decode(k):
    codes = torch.randint(0, 16, (4, k), dtype=torch.uint8)
    codes[0, : min(k, 16)] = torch.arange(min(k, 16), dtype=torch.uint8)  # every code, -0 included
    packed = pack_fp4(codes)
    # 2- and 4-byte dtypes gather each byte's pair as one word, float64 as a row of two
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        got, want = decode_packed_fp4(packed, k, dtype), decode_e2m1(unpack_fp4(packed, k), dtype)
        assert got.dtype == dtype and got.shape == (4, k)
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))  # bits, sign of zero too


def test_float64_rounds_in_its_own_precision():
    """A float64 input just past a tie must not be cast to fp32 first (double rounding)."""
    eps = 1e-12
    xs = torch.tensor([2.5 + eps, 2.5 - eps, 0.25 + eps, 5.0 + eps, 1.75 - eps, 3.5 - eps], dtype=torch.float64)
    want = torch.tensor([3.0, 2.0, 0.5, 6.0, 1.5, 3.0], dtype=torch.float64)
    assert torch.equal(round_to_e2m1(xs), want)
    assert torch.equal(round_to_e2m1(-xs), -want)


def test_round_bitwise_equal_to_exact_table_on_every_bf16_pattern():
    """Every finite bf16 bit pattern: rounding equals the nearest grid value, ties to even mantissa."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    a = x.double().abs().clamp(max=6.0)
    dist = (a[:, None] - grid[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    cand = dist == best  # one or two nearest; on a tie take the even code index (even mantissa)
    idx = torch.where(cand.sum(1) > 1, (cand.int().argmax(1) + 1) // 2 * 2, cand.int().argmax(1))
    want = torch.copysign(grid[idx], x.double())
    got = round_to_e2m1(x)
    assert torch.equal(got.double(), want)
    assert torch.equal(torch.signbit(got), torch.signbit(x))
    codes = encode_e2m1(x)
    assert torch.equal(codes & 7, idx.to(torch.uint8))


def test_arithmetic_e5m2_rounding_equals_torch_cast_bitwise():
    """formats.round_to_e5m2 (the fused CPU path's FP8 rounding) against torch's E5M2 cast, on
    random fp32 bit patterns of every exponent, ties, subnormals and signed zeros."""
    from fp4lightning.numerics.constants import F8E5M2_MAX
    from fp4lightning.numerics.formats import round_to_e5m2

    bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x)].clamp(-F8E5M2_MAX, F8E5M2_MAX)
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e5m2).float()
    grid = grid[torch.isfinite(grid)]
    g = grid.sort().values
    ties = (g[:-1] + g[1:]) / 2  # every mid-point between neighbouring E5M2 values
    x = torch.cat([x, grid, ties, torch.tensor([0.0, -0.0, 2.0**-17, -(2.0**-17), 2.0**-14])])
    want = x.to(torch.float8_e5m2).float().view(torch.int32)
    assert torch.equal(round_to_e5m2(x).view(torch.int32), want)
    compiled = torch.compile(round_to_e5m2, dynamic=True, fullgraph=True)  # as the fused FP8 cast runs it
    assert torch.equal(compiled(x).view(torch.int32), want)


def test_pow2_floor_is_exact_floor_of_log2():
    """``pow2_floor`` against math.frexp (exact), fp32 and fp64, across the normal range and at
    values one ulp either side of powers of two, where a float log2 can round the wrong way."""
    from fp4lightning.numerics.formats import pow2_floor

    for dtype in (torch.float32, torch.float64):
        tiny, big = torch.finfo(dtype).tiny, torch.finfo(dtype).max
        x = torch.exp2(torch.empty(2000, dtype=torch.float64).uniform_(math.log2(tiny), math.log2(big) - 1)).to(dtype)
        p2 = torch.exp2(torch.arange(-100, 100, dtype=dtype))
        x = torch.cat([x, p2, torch.nextafter(p2, torch.zeros_like(p2)), torch.nextafter(p2, p2 * 4)])
        expected = torch.tensor([math.ldexp(1.0, math.frexp(v)[1] - 1) for v in x.tolist()], dtype=dtype)
        assert torch.equal(pow2_floor(x), expected)
    with pytest.raises(TypeError, match="fp32 or fp64"):
        pow2_floor(torch.ones(2, dtype=torch.float16))


def test_saturating_cast_matches_cast_to_fp8_and_saturates_fp16():
    from fp4lightning.numerics.formats import saturating_cast_

    x = torch.randn(512) * 1e5
    x[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for fmt, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        out = saturating_cast_(x.clone(), torch.empty(512, dtype=dtype))
        assert torch.equal(out.view(torch.uint8), cast_to_fp8(x, fmt).view(torch.uint8))
    half = saturating_cast_(x.clone(), torch.empty(512, dtype=torch.float16))
    assert torch.isfinite(half[1:]).all() and half[1].item() == 65504.0 and half[2].item() == -65504.0
