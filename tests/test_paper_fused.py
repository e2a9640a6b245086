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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1) if t.dim() else t.reshape(1).view(torch.uint8)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_k", [None, 32], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("m", [41, 48])
def test_fold_kernel_writes_the_compact_residual(dtype, block_k, m):
    from fp4lightning.kernels import quantize as kq
    x = _outliers(m, 74, dtype)
    bounds = occ_bounds(x, 0.97, "exact")
    e4, s_fold, codes, s_a, dense = kt.triton_quantize_rows_folded(x, bounds, save=True, block_k=block_k)
    want = _compact_residual(dense, 0.97)  # what FP4Linear built from the dense residual (row-major slots)
    cap = want[0].numel()
    got = kt.triton_quantize_rows_folded(x, bounds, save=True, block_k=block_k, capacity=cap)
    for a, b in zip(got[:4], (e4, s_fold, codes, s_a)):  # the same operand, scales and codes
        assert torch.equal(_bits(a), _bits(b))
    idx, vals, overflow, count = got[4]
    n = int((dense != 0).sum())
    assert int(count) == n and not bool(overflow) and not bool(want[2]) and n > 0
    assert idx.dtype == want[0].dtype and vals.dtype == dtype
    order = idx[:n].long().argsort()
    assert torch.equal(idx[:n][order], want[0][:n]) and torch.equal(vals[:n][order].view(torch.uint8),
                                                                     want[1][:n].view(torch.uint8))
    assert not kq._FOLD_COUNTERS[(str(x.device), False)].any()  # the counters are zero again for the next launch
    # the refold's bytes from it, whatever the slot order, equal those from the row-major form
    ref = sm.triton_refold(codes, s_a, None, want[0], want[1], 74, transposed=True, fold_scale=s_fold)
    for perm in (torch.arange(n), torch.randperm(n)):
        i2, v2 = idx.clone(), vals.clone()
        i2[:n], v2[:n] = idx[:n][perm], vals[:n][perm]
        i2[n:], v2[n:] = 7, 1000.0  # unwritten slots: whatever they hold is never read
        out = sm.triton_refold(codes, s_a, None, i2, v2, 74, transposed=True, fold_scale=s_fold, count=count)
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def test_fold_kernel_compact_residual_overflow():
    from fp4lightning.kernels import quantize as kq
    x = _outliers(41, 74, torch.bfloat16)
    bounds = occ_bounds(x, 0.97, "exact")
    *_, dense = kt.triton_quantize_rows_folded(x, bounds, save=True)
    n = int((dense != 0).sum())
    idx, vals, overflow, count = kt.triton_quantize_rows_folded(x, bounds, save=True, capacity=5)[4]
    assert bool(overflow) and int(count) == n > 5
    flat = dense.reshape(-1)
    assert len(set(idx.tolist())) == 5 and torch.equal(flat[idx.long()].view(torch.uint8), vals.view(torch.uint8))
    assert not kq._FOLD_COUNTERS[(str(x.device), False)].any()
    with pytest.raises(ValueError, match="capacity"):
        kt.triton_quantize_rows_folded(x, bounds, save=True, capacity=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fold_kernel_rounds_fp32_bounds_as_the_cast_did(dtype):
    # fp32 bounds go in as they are and the kernel rounds them to x's dtype (no two cast launches):
    # the same bytes as bounds cast by torch first, ties to even, a bound past the dtype's range, a NaN bound
    x = _outliers(24, 64, dtype)
    fine = torch.finfo(dtype)
    lo = torch.tensor(-1.0 - fine.eps / 2)  # half-way between two values of the dtype: ties to even
    for b in (occ_bounds(x, 0.97, "exact") * (1 + 2 ** -12), torch.stack([lo, torch.tensor(1.0 + 3 * fine.eps / 2)]),
              torch.tensor([-1e6, 70000.0]), torch.tensor([float("nan"), 2.0])):
        b = b.float()
        got = kt.triton_quantize_rows_folded(x, b, save=True)
        want = kt.triton_quantize_rows_folded(x, b.to(dtype), save=True)
        for a, w in zip(got, want):
            if a.dtype == dtype:  # the residual: a NaN bound's NaN payload is the cast's (torch's CPU cast
                nan = torch.isnan(w)  # sets every bit), which nothing reads (its rows fold to NaN, refold to 0)
                assert torch.equal(torch.isnan(a), nan)
                a, w = a.masked_fill(nan, 0), w.masked_fill(nan, 0)
            assert torch.equal(_bits(a), _bits(w))


# --------------------------------------------------------------------------- OCC's quantiles in one launch
def _cuda_sort_bounds(x, alpha, method, sample_size):
    """occ_bounds as it runs on CUDA, emulated on any device: the sample, torch.sort as cub's radix sort
    orders fp32 keys (by their bits: -NaN first, +NaN last; -0.0 and +0.0 equal, kept in input order),
    then occ_bounds' interpolation (0-dim fp32 tensors times a Python float)."""
    from fp4lightning.numerics.occ import lattice_stride, quantile_positions
    flat = x.reshape(-1)
    if method == "sample" and flat.numel() > sample_size:
        flat = flat[(torch.arange(sample_size, device=x.device) * lattice_stride(flat.numel())) % flat.numel()]
    flat = flat.float()
    i = flat.view(torch.int32).long()
    key = i ^ ((i >> 31) & 0x7FFFFFFF)
    key[key == -1] = 0  # -0.0 ranks with +0.0
    srt = flat[torch.sort(key, stable=True).indices]
    out = []
    for lo_i, frac in quantile_positions(flat.numel(), (1.0 - alpha, alpha)):
        v = srt[lo_i]
        if frac > 0 and lo_i + 1 < flat.numel():
            v = v + (srt[lo_i + 1] - v) * frac
        out.append(v)
    return torch.stack(out)


def _quantile_inputs():
    g = torch.randn(300, 700, device=DEV)
    yield "normal", g.bfloat16(), True
    yield "heavy tails", (g * torch.exp(2 * torch.randn(300, 1, device=DEV))).bfloat16(), True
    ties = (torch.randint(-4, 5, (96, 512), device=DEV) / 2).bfloat16()
    ties[torch.rand(96, 512, device=DEV) < 0.5] = -0.0  # zeros of both signs at the order statistics
    yield "ties and signed zeros", ties, True
    yield "all equal", torch.full((80, 128), 0.75, device=DEV).bfloat16(), True
    special = torch.randn(256, 256, device=DEV)
    hot = torch.rand(256, 256, device=DEV)
    special[hot < 0.015] = float("nan")
    special[hot > 0.99] = -torch.tensor(float("nan"))  # NaN with the sign bit (x86's default NaN)
    special[(hot > 0.5) & (hot < 0.51)] = float("inf")
    special[(hot > 0.6) & (hot < 0.601)] = -float("inf")
    yield "NaN of both signs and infinities", special.bfloat16(), False


def _quantile_inputs_fp32():
    """fp32 activations (q, k, v, gate and up under bf16 autocast): values sharing their keys' high 16
    bits at the order statistics, signed zeros, subnormals, NaN payloads and infinities."""
    g = torch.randn(300, 700, device=DEV)
    yield "normal", g, True
    yield "heavy tails", g * torch.exp(2 * torch.randn(300, 1, device=DEV)), True
    near = 1.0 + torch.randint(0, 4, (200, 400), device=DEV) * 2.0 ** -20  # one high-bits bin, four low keys
    near[torch.rand(200, 400, device=DEV) < 0.5] *= -1
    yield "order statistics inside one high-bits bin", near, True
    ties = torch.randint(-4, 5, (96, 512), device=DEV) / 2
    ties[torch.rand(96, 512, device=DEV) < 0.5] = -0.0
    yield "ties and signed zeros", ties, True
    tiny = torch.randn(128, 256, device=DEV) * 1e-40  # subnormal
    tiny[torch.rand(128, 256, device=DEV) < 0.3] = 0.0
    yield "subnormals", tiny, True
    special = torch.randn(256, 256, device=DEV)
    hot = torch.rand(256, 256, device=DEV)
    special[hot < 0.015] = float("nan")
    special[hot > 0.99] = -torch.tensor(float("nan"))
    special.view(torch.int32)[(hot > 0.3) & (hot < 0.305)] = 0x7FC00123  # another payload
    special[(hot > 0.5) & (hot < 0.51)] = float("inf")
    special[(hot > 0.6) & (hot < 0.601)] = -float("inf")
    yield "NaN payloads of both signs and infinities", special, False


def _check_quantiles(inputs, alpha, method, sample_size, fp32=False):
    """The kernel's bounds are the CUDA sort's bits (and, for finite inputs, occ_bounds' on this device:
    CPU's partial sorts give the same order statistics); its histograms and counters are zero again."""
    from fp4lightning.kernels import quantile as kqt
    for name, x, finite in inputs:
        assert kqt.occ_quantiles_supported(x, alpha, method, sample_size), name
        got = kqt.triton_occ_quantiles(x, alpha, method, sample_size)
        want = _cuda_sort_bounds(x, alpha, method, sample_size)
        assert torch.equal(_bits(got), _bits(want)), (name, got, want)
        if finite:
            assert torch.equal(_bits(got), _bits(occ_bounds(x, alpha, method, sample_size))), name
        ws = kqt._WORKSPACE[(str(x.device), False) + (("fp32",) if fp32 else ())]
        assert not ws[:kqt.WS32_SEL if fp32 else None].any(), name  # zeroed again for the next launch


@pytest.mark.parametrize("alpha", [0.99, 0.97, 0.9])
@pytest.mark.parametrize("method,sample_size", [("sample", 65536), ("sample", 20000), ("exact", 65536)])
def test_triton_quantiles_are_the_cuda_sorts(alpha, method, sample_size):
    _check_quantiles(_quantile_inputs(), alpha, method, sample_size)


@pytest.mark.parametrize("method,sample_size,alpha", [("sample", 65536, 0.99), ("sample", 20000, 0.9),
                                                      ("exact", 65536, 0.97)])
def test_triton_quantiles_of_fp32_are_the_cuda_sorts(method, sample_size, alpha):
    _check_quantiles(_quantile_inputs_fp32(), alpha, method, sample_size, fp32=True)


def test_triton_quantiles_refuse_what_they_cannot_match():
    from fp4lightning.kernels import quantile as kqt
    x = torch.randn(64, 64, device=DEV).bfloat16()  # 4096 elements: CUDA sorts them by comparison
    assert not kqt.occ_quantiles_supported(x, 0.99, "sample", 65536)
    assert kqt.occ_quantiles_supported(x.float().repeat(2, 1), 0.99, "sample", 65536)  # fp32: two launches
    assert not kqt.occ_quantiles_supported(x.half().repeat(2, 1), 0.99, "sample", 65536)
    assert not kqt.occ_quantiles_supported(x.repeat(2, 1).t(), 0.99, "sample", 65536)  # not contiguous
    assert kqt.occ_quantiles_supported(x.repeat(2, 1), 0.99, "sample", 65536)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        kqt.triton_occ_quantiles(x, 0.99)
