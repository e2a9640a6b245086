"""Launches folded into the scaled_mm path's kernels (issue 47, item 2), bit for bit against the separate
launches they replace: under the Triton interpreter on CPU, compiled on a GPU.

* the compact residual's overflow (``where(overflow, nan, dW)``) inside the wgrad finish kernel;
* the refold writing wgrad's operand transposed (no ``_transpose_kernel``);
* the FP8 dY quantizers writing ``1 / scale`` (no ``torch.reciprocal`` before each backward GeMM), and
  the row of ones ``_scaled_mm`` takes as the unused scale kept between calls;
* the FP4 quantizers writing ``1 / scale`` too: the forward GeMM's epilogue takes them, and backward's
  dY quantizers multiply by the saved ones (no reciprocal launch in forward or backward);
* the column absmax of dY / s_a taken in dY's row pass (no ``_col_amax_kernel``), the bias gradient in
  its column pass (no ``aten.sum``), and their buffer zeroed by the column pass itself (no ``aten.zeros``);
* the layer's fp32 bias cast to bf16 by the weight's quantizer (no ``aten._to_copy`` in the forward).
"""
import pytest
import torch

from fp4lightning.kernels import gemm as kgemm
from fp4lightning.kernels import scaled_mm as sm
from fp4lightning.numerics.absmax import quantize_rows_reference

from ._numerics import needs_cpu_scaled_mm

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


@needs_cpu_scaled_mm(DEV)
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


def _edge_gradient(m, n, dtype):
    """dY with rows / columns of zeros, subnormals, huge and tiny values, inf and NaN: every branch
    of the scale (the amax floor, the reciprocal of a huge scale going subnormal, NaN scales)."""
    x = torch.randn(m, n, device=DEV) * torch.exp(4 * torch.randn(m, 1, device=DEV))
    x[0] = 0.0  # amax 0: the scale of the FP8_AMAX_EPS floor
    x[1] = 1e-40  # subnormal
    x[2, :3] = torch.tensor([3e38, -3e38, 1e-30])  # huge: a tiny scale
    x[3] = 1e-37  # tiny: a scale whose reciprocal is subnormal
    x[4, 5], x[5, 6] = float("nan"), float("inf")
    x[:, 7] = 0.0
    x[:, 9] = 2e-38
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize("n", [40, 300], ids=["one-pass", "two-pass"])  # 300 > the interpreter's one-pass rows
def test_fp8_quantizer_writes_the_reciprocal_of_its_scale(dtype, dim, n):
    from fp4lightning.kernels import fp4_triton as kt
    torch.manual_seed(n + dim)
    x = _edge_gradient(37, n, dtype)
    div = torch.rand(n if dim == 1 else 37, device=DEV) * 8 + 0.25
    div[1] = 1e-30  # a tiny divisor: its column's values grow by 1e30 (some to inf)
    q0, s0 = kt.triton_quantize_fp8(x, dim=dim, fmt="e5m2", divide_by=div, column_major=dim == 0)
    q, s, inv = kt.triton_quantize_fp8(x, dim=dim, fmt="e5m2", divide_by=div, column_major=dim == 0, inverse=True)
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(_bits(s), _bits(s0))
    assert torch.equal(_bits(inv), _bits(torch.reciprocal(s)))  # what the GeMM took before: IEEE, bit for bit
    assert torch.isnan(s).any() and (inv[torch.isfinite(inv)] != 0).all()
    # the amax floor (FP8_AMAX_EPS = 2^-110) gives the largest scale, 57344 * 2^110 < 2^126: its reciprocal,
    # the smallest, is still a normal number (so flushing subnormals could not change a bit here)
    assert inv[torch.isfinite(inv)].min() < 2.0 ** -125
    # many random scales, not only the edge rows
    r = torch.exp(20 * torch.randn(4096, 1, device=DEV)) * torch.randn(4096, 16, device=DEV)
    _, s2, inv2 = kt.triton_quantize_fp8(r, dim=1, fmt="e4m3", inverse=True)
    assert torch.equal(_bits(inv2), _bits(torch.reciprocal(s2)))


@needs_cpu_scaled_mm(DEV)
@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_backward_takes_the_quantizers_reciprocals(preset, monkeypatch):
    # the scaled_mm path with the Triton quantizers (interpreted on CPU): dY's FP8 quantizers write 1 / s
    # and both backward GeMMs take it; the gradients are those of the same path taking torch.reciprocal
    # of the scales (what it did before), bit for bit, on a dY with every edge case of the scales
    from fp4lightning import FP4Config, FP4Linear
    from fp4lightning.ops import gemm
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    monkeypatch.setattr(gemm, "triton_quantizers", lambda device: True)
    torch.manual_seed(0)
    lin = FP4Linear(96, 48, config=FP4Config.from_preset(preset, occ_quantile="exact")).to(DEV)
    x = torch.randn(40, 96, device=DEV).bfloat16()
    dy = _edge_gradient(40, 48, torch.bfloat16)
    dy[4, 5] = dy[5, 6] = 1.0  # finite gradients: compare values

    def run(use_inv):
        taken = []
        real = sm._row_scale
        monkeypatch.setattr(sm, "_row_scale", lambda s, inv=None: taken.append(inv is not None)
                            or real(s, inv if use_inv else None))
        xx = x.clone().requires_grad_(True)
        lin.zero_grad()
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            y = lin(xx)
        y.backward(dy)
        monkeypatch.setattr(sm, "_row_scale", real)
        # the forward's A and W scales, then dgrad's and wgrad's row scales, came with their reciprocals
        assert taken == [True] * 4
        return y.detach(), xx.grad, lin.weight.grad.clone()

    for t, r in zip(run(True), run(False)):
        assert torch.equal(t.view(torch.int16) if t.dtype == torch.bfloat16 else _bits(t),
                           r.view(torch.int16) if r.dtype == torch.bfloat16 else _bits(r))


def test_ones_row_is_kept_between_calls():
    a = sm._unit_cols(48, torch.empty(1, device=DEV))
    b = sm._unit_cols(16, torch.empty(1, device=DEV))
    assert a.shape == (1, 48) and b.shape == (1, 16) and a.is_contiguous() and b.is_contiguous()
    assert (a == 1).all() and (b == 1).all() and a.dtype == torch.float32
    assert a.data_ptr() == b.data_ptr()  # one buffer: no fill launch per GeMM
    big = sm._unit_cols(5000, torch.empty(1, device=DEV))
    assert big.shape == (1, 5000) and (big == 1).all()
    meta = sm._unit_cols(16, torch.empty(1, device="meta"))
    assert meta.is_meta and not sm._unit_cols(16, torch.empty(1, device=DEV)).is_meta


def _edge_rows(m, k, dtype):
    """Activations with rows of zeros, subnormals, huge and tiny values, NaN and inf (the FP4 scale's
    branches: the amax floor, NaN scales) and rows spread over many binades."""
    x = torch.randn(m, k, device=DEV) * torch.exp(6 * torch.randn(m, 1, device=DEV))
    x[0] = 0.0
    x[1] = 1e-40
    x[2, :2] = torch.tensor([3e38, -1e-30])
    x[3] = 1e-37
    x[4, 3], x[5, 1] = float("nan"), float("-inf")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_kh", [None, 16], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("e4m3", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp4_quantizer_writes_the_reciprocal_of_its_scale(dtype, block_kh, e4m3, per_tensor):
    from fp4lightning.kernels import fp4_triton as kt
    x = _edge_rows(37, 96, dtype)
    if per_tensor:
        x[4, 3] = x[5, 1] = 1.0  # one non-finite value poisons every row's scale
    plain = kt.triton_quantize_rows(x, per_tensor=per_tensor, block_kh=block_kh, e4m3=e4m3)
    *outs, inv = kt.triton_quantize_rows(x, per_tensor=per_tensor, block_kh=block_kh, e4m3=e4m3, inverse=True)
    assert len(outs) == len(plain)
    for got, want in zip(outs, plain):  # codes, scales and the E4M3 operand unchanged
        assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(inv), _bits(torch.reciprocal(outs[1])))  # what the GeMM took before, bit for bit
    if not per_tensor:
        assert torch.isnan(inv[4]) and torch.isnan(inv[5]) and torch.isfinite(inv[:4]).all()
    # many random scales over 2^+-60
    r = torch.exp(20 * torch.randn(4096, 1, device=DEV)) * torch.randn(4096, 32, device=DEV)
    _, s2, inv2 = kt.triton_quantize_rows(r, inverse=True)
    assert torch.equal(_bits(inv2), _bits(torch.reciprocal(s2)))


@pytest.mark.parametrize("dim", [1, 0])
@pytest.mark.parametrize("n", [40, 300], ids=["one-pass", "two-pass"])
def test_fp8_quantizer_takes_the_given_reciprocals(dim, n):
    # multiply_by = the FP4 quantizer's 1 / s: the same bits as divide_by = s (which took torch.reciprocal)
    from fp4lightning.kernels import fp4_triton as kt
    x = _edge_gradient(37, n, torch.bfloat16)
    div = torch.exp(8 * torch.randn(n if dim == 1 else 37, device=DEV))
    div[1] = 1e-30
    want = kt.triton_quantize_fp8(x, dim=dim, divide_by=div, column_major=dim == 0, inverse=True)
    got = kt.triton_quantize_fp8(x, dim=dim, multiply_by=torch.reciprocal(div), column_major=dim == 0, inverse=True)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() and torch.equal(_bits(g), _bits(w))
    with pytest.raises(ValueError, match="not both"):
        kt.triton_quantize_fp8(x, dim=dim, divide_by=div, multiply_by=div)


def _roofline():
    import importlib.util
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "roofline.py"
    if "roofline" not in sys.modules:
        spec = importlib.util.spec_from_file_location("roofline", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["roofline"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["roofline"]


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_no_reciprocal_launches_on_the_cuda_path(preset):
    # the CUDA path's forward + backward as benchmarks/roofline.py traces it: the scales' reciprocals come
    # from the quantizers (`paper`'s folded scale: one reciprocal in the forward, kept for backward)
    launches = _roofline().trace_layer(preset, 256, 128, 64)
    recips = [x.phase for x in launches if x.name == "aten.reciprocal"]
    assert recips == ([] if preset == "w4a4-direct" else ["forward"]), recips


def _dy_pair(m, n, dtype):
    """dY with the edge rows and columns, and the two multiplier vectors of FP4Linear's backward."""
    x = _edge_gradient(m, n, dtype)
    x[8, 10] = float("-inf")
    w_inv = torch.reciprocal(torch.exp(4 * torch.randn(n, device=DEV)))
    a_inv = torch.reciprocal(torch.exp(4 * torch.randn(m, device=DEV)))
    a_inv[11] = 1e30  # a row whose products overflow to inf in the column pass only
    return x, w_inv, a_inv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n", [(200, 48), (37, 16), (40, 300)], ids=["4-iterations", "1-iteration", "two-pass"])
def test_row_pass_takes_the_column_absmax_bit_for_bit(dtype, m, n):
    # what the column pass quantizes with the row pass's column absmax is what it quantized with its own
    # absmax kernel; the row pass's own outputs do not change; the scratch buffer is zero again after
    from fp4lightning.kernels import fp4_triton as kt
    from fp4lightning.kernels import quantize as kq
    x, w_inv, a_inv = _dy_pair(m, n, dtype)
    rows0 = kt.triton_quantize_fp8(x, 1, multiply_by=w_inv, inverse=True)
    cols0 = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, inverse=True, column_major=True)
    *rows, handle = kt.triton_quantize_fp8(x, 1, multiply_by=w_inv, inverse=True, column_amax_of=a_inv)
    assert handle is not None  # one-pass rows: one atomic per column a program; two-pass: a row block
    cols = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, inverse=True, column_major=True, column_amax=handle)
    for got, want in zip(rows + list(cols), list(rows0) + list(cols0)):
        assert got.shape == want.shape and got.stride() == want.stride() and torch.equal(_bits(got), _bits(want))
    assert torch.isnan(cols[1]).any() and torch.isfinite(cols[1]).any()  # the edge columns' NaN scales
    assert all(int(ent[0].count_nonzero()) == 0 for ent in kq._SCRATCH.values() if not ent[0].is_meta)


def test_column_absmax_guards_and_recovery():
    from fp4lightning.kernels import fp4_triton as kt
    x, w_inv, a_inv = _dy_pair(40, 48, torch.bfloat16)
    want = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, column_major=True)
    # a row pass whose column pass never ran (an error between them): the next user zeroes the buffer first
    kt.triton_quantize_fp8(x * 1e6, 1, multiply_by=w_inv, column_amax_of=a_inv)
    *_, handle = kt.triton_quantize_fp8(x, 1, multiply_by=w_inv, column_amax_of=a_inv)
    got = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, column_major=True, column_amax=handle)
    assert all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want))
    # a handle taken with other multipliers, or overwritten by a later row pass, is refused
    *_, handle = kt.triton_quantize_fp8(x, 1, multiply_by=w_inv, column_amax_of=a_inv)
    with pytest.raises(ValueError, match="other row multipliers"):
        kt.triton_quantize_fp8(x, 0, multiply_by=a_inv.clone(), column_major=True, column_amax=handle)
    kt.triton_quantize_fp8(x, 1, multiply_by=w_inv, column_amax_of=a_inv)
    with pytest.raises(RuntimeError, match="overwritten"):
        kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, column_major=True, column_amax=handle)
    with pytest.raises(ValueError, match="row pass"):
        kt.triton_quantize_fp8(x, 1, bias_grad=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_pass_takes_the_bias_gradient(dtype, monkeypatch):
    from fp4lightning.kernels import fp4_triton as kt
    from fp4lightning.kernels import quantize as kq
    monkeypatch.setattr(kq, "BIAS_SUM_ELEMENTS", 32)  # two tiles' partial sums at a time: 3 tiles, 2 steps
    m, n = 600, 48
    _, _, a_inv = _dy_pair(m, n, dtype)
    # (1) sums that are exact in fp32 in any order (integers times 2^-8): torch's sum bit for bit, with a
    # NaN column, an inf column and a column holding +inf and -inf (NaN)
    x = (torch.randint(-300, 300, (m, n), device=DEV).float() * 2.0 ** -8).to(dtype)
    x[5, 1], x[6, 2], x[7, 3], x[8, 3] = float("nan"), float("inf"), float("inf"), float("-inf")
    want = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, inverse=True, column_major=True)
    *got, bias = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, inverse=True, column_major=True, bias_grad=True)
    assert all(torch.equal(_bits(g), _bits(w)) for g, w in zip(got, want))  # the quantized dY unchanged
    assert torch.equal(_bits(bias), _bits(x.sum(0, dtype=torch.float32)))
    # (2) any values: within the error bound of fp32 sums in any order of the float64 sum, and the same
    # bits on every run (a fixed order, no atomics)
    x = (torch.randn(m, n, device=DEV) * torch.exp(3 * torch.randn(m, 1, device=DEV))).to(dtype)
    bias = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, column_major=True, bias_grad=True)[-1]
    again = kt.triton_quantize_fp8(x, 0, multiply_by=a_inv, column_major=True, bias_grad=True)[-1]
    assert torch.equal(_bits(bias), _bits(again))
    exact = x.double().sum(0)
    assert ((bias.double() - exact).abs() <= m * 2.0 ** -24 * x.double().abs().sum(0)).all()


@needs_cpu_scaled_mm(DEV)
@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_fp4linear_with_the_bias_gradient_in_the_column_pass(preset, monkeypatch):
    # the GPU's backward (the Triton quantizers, the bias gradient from dY's column pass) against the same
    # path with torch's sum: dY's gradients bit for bit, the bias gradient within fp32 reordering of it
    from fp4lightning import FP4Config, FP4Linear
    from fp4lightning.nn import linear as linear_mod
    from fp4lightning.ops import gemm
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    monkeypatch.setattr(gemm, "triton_quantizers", lambda device: True)
    torch.manual_seed(0)
    lin = FP4Linear(96, 48, config=FP4Config.from_preset(preset, occ_quantile="exact")).to(DEV)
    x = torch.randn(40, 96, device=DEV).bfloat16()
    dy = torch.randn(40, 48, device=DEV).bfloat16()

    def run(fused):
        monkeypatch.setattr(linear_mod, "_bias_in_column_pass", lambda dy: fused)
        xx = x.clone().requires_grad_(True)
        lin.zero_grad()
        with torch.autocast(DEV.type, dtype=torch.bfloat16):
            y = lin(xx)
        y.backward(dy)
        return xx.grad, lin.weight.grad.clone(), lin.bias.grad.clone()

    (dx, dw, db), (dx0, dw0, db0) = run(True), run(False)
    assert torch.equal(dx.view(torch.int16), dx0.view(torch.int16)) and torch.equal(_bits(dw), _bits(dw0))
    assert db.dtype == db0.dtype == torch.float32
    assert ((db.double() - db0.double()).abs() <= 40 * 2.0 ** -23 * dy.double().abs().sum(0)).all()


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_no_column_absmax_zeros_or_sum_launches_on_the_cuda_path(preset):
    # dY's column absmax, its buffer's zeroing and the bias gradient ride in the two dY passes
    launches = _roofline().trace_layer(preset, 256, 128, 64)
    names = [x.name for x in launches if x.phase == "backward"]
    assert not {"aten.zeros", "triton._col_amax_kernel", "aten.sum"} & set(names), names
    assert names.count("triton._quantize_fp8_rows_kernel") == names.count("triton._quantize_fp8_cols_kernel") == 1


@pytest.mark.parametrize("block_kh", [None, 16], ids=["one-pass", "two-pass"])
def test_weight_quantizer_casts_the_bias_bit_for_bit(block_kh):
    from fp4lightning.kernels import fp4_triton as kt
    w = torch.randn(64, 96, device=DEV) * 0.05
    b = torch.randn(64, device=DEV) * torch.exp(8 * torch.randn(64, device=DEV))
    one = torch.tensor(1.0)
    ties = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 2.0 ** -130 * 3]  # halfway: to even; a subnormal
    b[:12] = torch.tensor(ties + [3.4e38, -3.4e38, 0.0, -0.0, float("inf"), float("-inf"), float("nan"),
                                  float(torch.nextafter(one, 2 * one))], device=DEV)
    plain = kt.triton_quantize_rows(w, block_kh=block_kh, e4m3=True, inverse=True)
    *outs, b16 = kt.triton_quantize_rows(w, block_kh=block_kh, e4m3=True, inverse=True, bias_bf16=b)
    assert all(torch.equal(_bits(g), _bits(p)) for g, p in zip(outs, plain))
    want = b.to(torch.bfloat16)
    assert b16.dtype == torch.bfloat16 and torch.equal(torch.isnan(b16), torch.isnan(want))
    fin = ~torch.isnan(want)
    assert torch.equal(b16[fin].view(torch.int16), want[fin].view(torch.int16))  # ties to even, inf, -0.0
    with pytest.raises(ValueError, match="bias"):
        kt.triton_quantize_rows(w, bias_bf16=b[:10])


def test_no_bias_cast_launch_in_the_forward():
    # the roofline trace's forward: the two quantizers and the GeMM, no cast of the fp32 bias
    launches = _roofline().trace_layer("w4a4-direct", 256, 128, 64)
    names = [x.name for x in launches if x.phase == "forward"]
    assert names == ["triton._quantize_fp4_kernel", "triton._quantize_fp4_kernel", "aten._scaled_mm"], names
