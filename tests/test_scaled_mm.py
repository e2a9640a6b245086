"""The scaled_mm backend (``FP4LIGHTNING_BACKEND=scaled_mm``, kernels/scaled_mm.py): FP4Linear's three
GeMMs on ``torch._scaled_mm`` against the reference path, on CPU (where torch runs ``_scaled_mm``
too, slowly) at small shapes.

* operands: the quantizers' codes and scales are the reference's bit for bit, and the E4M3 operand
  holds exactly the reference's E2M1 values;
* GeMMs: against the float64 product of the same operands, within one rounding to the output dtype
  plus the fp32 summation error bound (see ``_bound``); the layouts cuBLASLt needs on Hopper are
  enforced on CPU too (torch's CPU kernel would take any);
* FP4Linear end to end against the reference backend.
"""
import os

import pytest
import torch

from fp4lightning import FP4Config, FP4Linear
from fp4lightning.numerics import cpu_fused
from fp4lightning.ops import gemm
from fp4lightning.numerics.dge import dge_derivative
from fp4lightning.numerics.formats import decode_packed_fp4
from fp4lightning.kernels import gemm as kgemm
from fp4lightning.kernels import scaled_mm as sm
from fp4lightning.numerics.absmax import quantize_rows_reference

from ._numerics import above, below, cpu_scaled_mm_refusal, needs_cpu_scaled_mm, sqnr

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
#: the tests run the backend on DEV: a GPU's, else the CPU's row-wise _scaled_mm
pytestmark = needs_cpu_scaled_mm(DEV)

#: two GeMMs of the same operands, fp32 sums in another order: measured 135-143 dB on CPU; on Hopper
#: the FP8 tensor cores' reduced-precision accumulation, ~80 dB (GPU_FP8_GEMM_SQNR_DB in test_kernels)
SAME_OPERANDS_SQNR_DB = 74.0 if CUDA else 100.0
#: unit roundoff (half an ulp, relative) of each output dtype, and of fp32 (the accumulation)
U = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


@pytest.fixture
def scaled(monkeypatch):
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")


def _bound(ref64: torch.Tensor, abs64: torch.Tensor, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """How far a GeMM of exact products may land from the float64 result ``ref64``: one rounding to
    ``out_dtype`` (u |y|), the fp32 sum of ``k`` products in any order (k u32 sum|products|, the
    textbook bound of recursive summation), and three fp32 roundings of the scales (the epilogue's
    reciprocals and multiplies; torch's CPU kernel scales the operands before the GeMM, also inside
    this bound). ``abs64`` is the product of the operands' absolute values with the same scales."""
    u32 = U[torch.float32]
    return U[out_dtype] * ref64.abs() + (k + 4) * u32 * abs64 * (1 + U[out_dtype]) + 1e-30


def _check(actual, ref64, abs64, k, out_dtype, what, extra=None):
    assert actual.dtype == out_dtype, (what, actual.dtype)
    if CUDA:  # Hopper's FP8 MMA adds each instruction's products in reduced precision (tests/test_kernels.py)
        above(sqnr(actual, ref64), 74.0 if out_dtype == torch.float32 else 40.0, what)
        return
    bound = _bound(ref64, abs64, k, out_dtype) + (0 if extra is None else extra)
    ratio = ((actual.double() - ref64).abs() / bound).max().item()
    below(ratio, 1.0 + 1e-9, what)


def _operands(m, k, n, dtype=torch.float32):
    x = torch.randn(m, k, device=DEV) * torch.exp(torch.randn(m, 1, device=DEV))
    w = torch.randn(n, k, device=DEV) * 0.05
    return x.to(dtype), w


# --------------------------------------------------------------------------- the backend
def test_backend_choice(monkeypatch):
    monkeypatch.delenv("FP4LIGHTNING_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert gemm.backend_for(cpu) == "reference"  # the CPU default does not change
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    if cpu_scaled_mm_refusal() is None:
        assert gemm.backend_for(cpu) == "scaled_mm"
    else:  # a torch whose CPU _scaled_mm scales per tensor only: asked for, refused in one line
        with pytest.raises(RuntimeError, match="FP4LIGHTNING_BACKEND=scaled_mm: .*set FP4LIGHTNING_BACKEND to "):
            gemm.backend_for(cpu)
    assert not gemm.triton_quantizers(cpu)  # on CPU the quantizers are the references
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "cublas")
    with pytest.raises(ValueError, match="'cublas' is not one of .*scaled_mm"):
        gemm.backend_for(cpu)


@gpu
def test_auto_backend_on_cuda_is_scaled_mm_where_fp8_tensor_cores(monkeypatch):
    monkeypatch.delenv("FP4LIGHTNING_BACKEND", raising=False)
    fp8 = torch.cuda.get_device_capability(DEV) >= (8, 9)
    assert gemm.backend_for(DEV) == ("scaled_mm" if fp8 else "triton")


# --------------------------------------------------------------------------- operands
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizers_write_the_reference_codes_and_an_exact_e4m3_operand(dtype, scaled, monkeypatch):
    x, _ = _operands(40, 96, 16, dtype)
    codes, scale, e4 = gemm.quantize_fp4(x, values_dtype=torch.bfloat16)
    rc, rs, rv = quantize_rows_reference(x, packed=True, return_values=True)
    assert torch.equal(codes, rc) and torch.equal(scale, rs)
    assert e4.dtype == torch.float8_e4m3fn and e4.shape == x.shape
    assert torch.equal(e4.float(), rv) and torch.equal(e4.float(), decode_packed_fp4(codes, 96))
    bounds = torch.tensor([-1.5, 2.0], device=DEV)
    c2, s2, e2, r2 = gemm.quantize_fp4_clamped(x, bounds)
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "reference")
    rc2, rs2, rv2, rr2 = gemm.quantize_fp4_clamped(x, bounds)
    assert torch.equal(c2, rc2) and torch.equal(s2, rs2) and torch.equal(r2, rr2)
    assert torch.equal(e2.float(), rv2)
    # dY: the same FP8 bits, returned as FP8 (no carrier: _scaled_mm reads it)
    dy = torch.randn(40, 48, device=DEV).to(dtype)
    div = torch.rand(48, device=DEV) + 0.5
    rq, rsc = gemm.quantize_fp8_divided(dy, div, dim=1, fmt="e5m2")
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    q, qs = gemm.quantize_fp8_divided(dy, div, dim=1, fmt="e5m2", carrier=torch.float32)
    assert q.dtype == torch.float8_e5m2 and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(qs, rsc)
    with pytest.raises(ValueError, match="folds OCC's compensation with quantize_fp4_folded"):
        gemm.quantize_fp4_clamped(x, bounds, fold=True)


# --------------------------------------------------------------------------- the three GeMMs
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [37, 64])  # 37: wgrad pads the tokens (its reduction) to 48
def test_gemms_within_one_rounding_of_the_float64_product(out_dtype, m, scaled):
    k, n = 96, 48
    x, w = _operands(m, k, n)
    a_p, a_s, a8 = gemm.quantize_fp4(x)
    w_p, w_s, w8 = gemm.quantize_fp4(w)
    aq, wq = a8.double(), w8.double()
    # forward, with and without bias
    c = 1 / (a_s.double()[:, None] * w_s.double()[None, :])
    ref, mag = (aq @ wq.t()) * c, (aq.abs() @ wq.abs().t()) * c
    _check(gemm.fp4_gemm(a_p, a_s, w_p, w_s, k, out_dtype), ref, mag, k, out_dtype, "forward")
    _check(gemm.fp4_gemm(a_p, a_s, w_p, w_s, k, out_dtype, a_values=a8, w_values=w8), ref, mag, k,
           out_dtype, "forward, the quantizers' E4M3 operands")
    bias = torch.randn(n, device=DEV)
    # a fused bias is rounded to the output dtype first (as nn.Linear's under autocast)
    _check(gemm.fp4_gemm(a_p, a_s, w_p, w_s, k, out_dtype, bias=bias), ref + bias.double(), mag, k, out_dtype,
           "forward + bias", extra=2 * U[out_dtype] * bias.double().abs())
    dy = torch.randn(m, n, device=DEV)
    for fmt in ("e5m2", "e4m3"):
        g1, s1 = gemm.quantize_fp8_divided(dy, w_s, dim=1, fmt=fmt)
        g = g1.double() / s1.double()[:, None]
        _check(gemm.fp4_dgrad(g1, s1, w_p, k, out_dtype), g @ wq, g.abs() @ wq.abs(), n, out_dtype,
               f"dgrad {fmt}")
        g2, s2 = gemm.quantize_fp8_divided(dy, a_s, dim=0, fmt=fmt)
        g = g2.double() / s2.double()[None, :]
        _check(gemm.fp4_wgrad(g2, s2, a_p, k, out_dtype), g.t() @ aq, g.abs().t() @ aq.abs(), m, out_dtype,
               f"wgrad {fmt}")
        # column-major dY (the Triton quantizer's layout) is read without a copy: same result
        assert torch.equal(gemm.fp4_wgrad(g2.t().contiguous().t(), s2, a_p, k, out_dtype),
                           gemm.fp4_wgrad(g2, s2, a_p, k, out_dtype))


def test_wgrad_epilogue_adds_the_addend_then_multiplies_by_the_dge_factor(scaled):
    m, k, n = 40, 64, 32
    x, w = _operands(m, k, n)
    a_p, a_s, _ = gemm.quantize_fp4(x)
    _, w_s, _ = gemm.quantize_fp4(w)
    g2, s2 = gemm.quantize_fp8_divided(torch.randn(m, n, device=DEV), a_s, dim=0)
    addend = torch.randn(n, k, device=DEV)
    plain = gemm.fp4_wgrad(g2, s2, a_p, k)
    full = gemm.fp4_wgrad(g2, s2, a_p, k, dge_weight=w, dge_weight_scale=w_s, addend=addend)
    ones = torch.ones(n, device=DEV)
    if CUDA:  # the Triton epilogue kernel: the Triton wgrad's DGE factor
        assert torch.equal(full, (plain + addend) * kgemm.triton_dge_factor(w, w_s))
    else:
        assert torch.equal(full, cpu_fused.wgrad_epilogue(plain, ones, addend, w, w_s, 5.0, 3.0, torch.float32))
    dge = dge_derivative(w.double() * w_s.double()[:, None])
    above(sqnr(full, (plain.double() + addend.double()) * dge), 120.0, "wgrad + addend, * DGE")


def test_wgrad_finish_kernel_matches_the_triton_dge_factor():
    # the GPU path's epilogue (kernels/scaled_mm.py) under the interpreter on CPU, or compiled
    n, k = 40, 200  # not multiples of the 32 x 128 tile
    w = torch.randn(n, k, device=DEV) * 0.05
    _, w_s = quantize_rows_reference(w)
    acc, addend = torch.randn(n, k, device=DEV), torch.randn(n, k, device=DEV)
    got = sm.triton_wgrad_finish(acc.clone(), addend.t().contiguous().t(), w, w_s)  # a strided addend
    assert torch.equal(got, (acc + addend) * kgemm.triton_dge_factor(w, w_s))
    assert torch.equal(sm.triton_wgrad_finish(acc.clone(), addend), acc + addend)
    with pytest.raises(ValueError, match="dge_weight_scale"):
        sm.triton_wgrad_finish(acc.clone(), dge_weight=w)


@needs_cpu_scaled_mm()
def test_hopper_layout_rules_are_enforced_on_cpu_too():
    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    b = torch.randn(48, 64).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(32, 1), torch.ones(1, 48)
    assert sm._scaled(a, b.t(), sa, sb, torch.float32).shape == (32, 48)
    with pytest.raises(ValueError, match="second column-major"):  # torch's CPU kernel would take it
        sm._scaled(a, b.t().contiguous(), sa, sb, torch.float32)
    with pytest.raises(ValueError, match="multiples of 16"):
        sm._scaled(a[:, :40], b[:, :40].t(), sa, sb, torch.float32)
    with pytest.raises(TypeError, match="second E4M3"):
        sm._scaled(a, b.to(torch.float8_e5m2).t(), sa, sb, torch.float32)


def test_sizes_that_do_not_fit_fall_back(scaled, monkeypatch):
    # K = 40 is no multiple of 16 (FP4Linear refuses it; the GeMMs themselves fall back)
    m, k, n = 24, 40, 32
    x, w = _operands(m, k, n)
    a_p, a_s, a8 = gemm.quantize_fp4(x)
    w_p, w_s, w8 = gemm.quantize_fp4(w)
    g1, s1 = gemm.quantize_fp8_divided(torch.randn(m, n, device=DEV), w_s, dim=1)
    got = (gemm.fp4_gemm(a_p, a_s, w_p, w_s, k, torch.bfloat16, a_values=a8, w_values=w8),
           gemm.fp4_dgrad(g1, s1, w_p, k))
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "triton" if CUDA else "reference")  # the Triton GeMMs on a GPU
    want = (gemm.fp4_gemm(a_p, a_s, w_p, w_s, k, torch.bfloat16), gemm.fp4_dgrad(g1, s1, w_p, k))
    assert all(torch.equal(g, r) for g, r in zip(got, want))


# --------------------------------------------------------------------------- FP4Linear
def _run(lin, x, dy, backend, monkeypatch, autocast=False):
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", backend)
    xx = x.clone().requires_grad_(True)
    lin.zero_grad()
    with torch.autocast(DEV.type, dtype=torch.bfloat16, enabled=autocast):
        y = lin(xx)
    y.backward(dy.to(y.dtype))
    return y.detach(), xx.grad, lin.weight.grad.clone(), lin.bias.grad.clone()


@pytest.mark.parametrize("preset", ["w4a4-direct", "fp4-no-occ"])
def test_fp4linear_matches_the_reference(preset, monkeypatch):
    lin = FP4Linear(96, 48, config=FP4Config.from_preset(preset)).to(DEV)
    x, dy = torch.randn(3, 13, 96, device=DEV), torch.randn(3, 13, 48, device=DEV)
    ref = _run(lin, x, dy, "reference", monkeypatch)
    got = _run(lin, x, dy, "scaled_mm", monkeypatch)
    # fp32: the same operands and exact products; fp32 sums in another order, the DGE factor the same
    for name, t, r in zip(("y", "dx", "dw", "db"), got, ref):
        above(sqnr(t, r), SAME_OPERANDS_SQNR_DB, name)
    # under bf16 autocast the outputs are rounded to bf16 once (the reference rounds the GeMM's
    # product, then the scaled result): no further from the fp32 result than the reference's own
    ref_bf = _run(lin, x, dy, "reference", monkeypatch, autocast=True)
    got_bf = _run(lin, x, dy, "scaled_mm", monkeypatch, autocast=True)
    for name, t, r, r32 in zip(("y", "dx", "dw"), got_bf, ref_bf, ref):
        assert t.dtype == r.dtype, name
        above(sqnr(t, r32), sqnr(r, r32) - 3.0, f"{name} (bf16) against fp32")


def test_fp4linear_nan_row_and_saved_bytes(monkeypatch):
    from fp4lightning.experiments.occ_fidelity import saved_tensor_bytes
    lin = FP4Linear(64, 32, config=FP4Config.from_preset("w4a4-direct")).to(DEV)
    x = torch.randn(20, 64, device=DEV)
    x[3, 5] = float("nan")
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    y = lin(x)
    assert torch.isnan(y[3]).all() and torch.isfinite(y[torch.arange(20) != 3]).all()
    # backward keeps the packed FP4 activation (half a byte per element), not the E4M3 operand
    xs = torch.randn(32, 64, device=DEV).requires_grad_(True)
    got, triton_quantizers = saved_tensor_bytes(lin, lambda: lin(xs)), gemm.triton_quantizers(DEV)
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "reference")
    ref = saved_tensor_bytes(lin, lambda: lin(xs))
    # the Triton quantizers (GPU) also keep 1 / scale of the activation rows and the weight rows, in
    # fp32: 4 (M + N) bytes, seen on an H200 (2560 against 2304), where the E4M3 operand would be M K
    assert got - ref == (4 * (xs.shape[0] + lin.out_features) if triton_quantizers else 0)


def test_bf16_dy_runs_the_backward_gemms_of_the_reference(monkeypatch):
    # grad_format='bf16': _scaled_mm takes no bf16 operand, so dgrad and wgrad fall back (on CPU
    # to the reference: the same bits; the forward runs on _scaled_mm)
    lin = FP4Linear(64, 32, config=FP4Config.from_preset("fp4-no-occ", grad_format="bf16")).to(DEV)
    x, dy = torch.randn(24, 64, device=DEV), torch.randn(24, 32, device=DEV)
    _, dx_r, dw_r, _ = _run(lin, x, dy, "reference", monkeypatch)
    _, dx_s, dw_s, _ = _run(lin, x, dy, "scaled_mm", monkeypatch)
    if not CUDA:
        assert torch.equal(dx_s, dx_r) and torch.equal(dw_s, dw_r)
    else:  # the Triton GeMMs on a GPU
        above(sqnr(dx_s, dx_r), 100.0, "dx")
        above(sqnr(dw_s, dw_r), 100.0, "dw")


# --------------------------------------------------------------------------- `paper`: OCC folded in E4M3
def _outliers(m, k, dtype=torch.float32):
    x = torch.randn(m, k, device=DEV)
    hot = torch.rand(m, k, device=DEV) < 0.03
    x[hot] *= torch.randint(2, 3000, (int(hot.sum()),), device=DEV).float()  # every fold shift 0-8
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refold_rebuilds_the_folded_operand_bit_for_bit(dtype, scaled):
    from fp4lightning.nn.linear import _compact_residual
    from fp4lightning.numerics.occ import occ_bounds
    x = _outliers(48, 96, dtype)
    x[5, 7], x[9, 1] = float("nan"), float("inf")  # rows folded to NaN: zeros and a NaN scale
    bounds = occ_bounds(x, 0.97, "exact")
    e4, s_fold = gemm.quantize_fp4_folded(x, bounds)
    codes, s_a, _, r = gemm.quantize_fp4_clamped(x, bounds)
    resid = _compact_residual(r, 0.97)
    assert not resid[2]
    got = gemm.refold_operand(codes, s_a, s_fold, resid, tuple(x.shape))
    assert torch.equal(got.view(torch.uint8), e4.view(torch.uint8))
    assert torch.isnan(s_fold[[5, 9]]).all() and (got.float()[[5, 9]] == 0).all()
    assert len(set((s_fold / s_a)[torch.isfinite(s_fold)].tolist())) > 3  # several shifts exercised


@pytest.mark.parametrize("grad_format", ["e5m2", "bf16"])
def test_paper_on_scaled_mm_is_the_e4m3_fold(grad_format, monkeypatch):
    # `paper` on the scaled_mm backend computes OCC's compensation folded into the E4M3 operand: the
    # numerics of FP4Config(occ_fold_e4m3=True) on the reference path (same operand bits; fp32 sums)
    lin = FP4Linear(96, 48, config=FP4Config.from_preset("paper", occ_quantile="exact", grad_format=grad_format))
    lin = lin.to(DEV)
    x, dy = _outliers(40, 96).reshape(2, 20, 96), torch.randn(2, 20, 48, device=DEV)
    got = _run(lin, x, dy, "scaled_mm", monkeypatch)
    lin.config = FP4Config.from_preset("paper", occ_quantile="exact", grad_format=grad_format, occ_fold_e4m3=True)
    ref = _run(lin, x, dy, "reference", monkeypatch)
    for name, t, r in zip(("y", "dx", "dw", "db"), got, ref):
        above(sqnr(t, r), SAME_OPERANDS_SQNR_DB, name)
    lin.config = FP4Config.from_preset("paper", occ_quantile="exact", grad_format=grad_format)
    exact = _run(lin, x, dy, "reference", monkeypatch)  # the exact compensation: close, not equal
    above(sqnr(got[0], exact[0]), 20.0, "y against the exact compensation")


def test_paper_on_scaled_mm_keeps_the_saved_bytes_budget(monkeypatch):
    # backward keeps the packed codes and the compact residual, not the 1-byte folded operand
    from fp4lightning.experiments.occ_fidelity import saved_tensor_bytes
    base = torch.nn.Linear(256, 512).to(DEV)
    x = _outliers(512, 256, torch.bfloat16).requires_grad_(True)

    def saved(mod):
        def run():
            with torch.autocast(DEV.type, dtype=torch.bfloat16):
                mod(x)
        return saved_tensor_bytes(mod, run)

    bf16 = saved(base)
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    paper = saved(FP4Linear.from_linear(base, FP4Config()))
    fold = saved(FP4Linear.from_linear(base, FP4Config(occ_fold_e4m3=True)))
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "reference")
    kept_operand = saved(FP4Linear.from_linear(base, FP4Config(occ_fold_e4m3=True)))  # 1 B per element
    assert paper == fold and paper < kept_operand
    below(paper / bf16, 0.35, "saved bytes, paper on scaled_mm / bf16 nn.Linear")


def test_paper_on_scaled_mm_compact_residual_overflow_is_a_nan_weight_gradient(monkeypatch):
    from fp4lightning.nn import linear
    monkeypatch.setattr(linear, "OCC_CAPACITY_MARGIN", 0.05)
    monkeypatch.setattr(linear, "OCC_CAPACITY_SLACK", 0)
    lin = FP4Linear(64, 32, config=FP4Config(occ_quantile="exact")).to(DEV)
    _, dx, dw, _ = _run(lin, _outliers(32, 64), torch.randn(32, 32, device=DEV), "scaled_mm", monkeypatch)
    assert torch.isnan(dw).all() and torch.isfinite(dx).all()


# --------------------------------------------------------------------------- the Triton quantizers it runs on a GPU
# (under the interpreter on CPU; compiled for sm_90a by kernels/compile_check.py)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [None, 16], ids=["one-pass", "two-pass"])
def test_triton_quantizer_writes_codes_and_e4m3_operand_in_one_pass(dtype, block):
    from fp4lightning.kernels import fp4_triton as kt
    from fp4lightning.numerics.occ import occ_clamp
    x, _ = _operands(37, 96, 16, dtype)
    x[4, 3] = float("nan")
    codes, scale, e4 = kt.triton_quantize_rows(x, block_kh=block, e4m3=True)
    rc, rs, rv = quantize_rows_reference(x, packed=True, return_values=True)
    assert torch.equal(codes, rc) and torch.equal(scale.nan_to_num(), rs.nan_to_num()) and scale[4].isnan()
    assert e4.dtype == torch.float8_e4m3fn and e4.stride(0) % 16 == 0 and torch.equal(e4.float(), rv)
    bounds = torch.tensor([-1.0, 1.5], device=DEV)
    c2, s2, r2, e2 = kt.triton_quantize_rows_clamped(x, bounds, block_kh=block, e4m3=True)
    xc, rr = occ_clamp(x, bounds)
    rc2, _, rv2 = quantize_rows_reference(xc, packed=True, return_values=True)
    assert torch.equal(c2, rc2) and torch.equal(e2.float(), rv2)
    assert torch.equal(r2.nan_to_num(), rr.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_k", [None, 32], ids=["one-pass", "two-pass"])
def test_triton_fold_quantizer_also_writes_what_backward_refolds_from(dtype, block_k, monkeypatch):
    from fp4lightning.kernels import fp4_triton as kt
    from fp4lightning.nn.linear import _compact_residual
    from fp4lightning.numerics.occ import occ_bounds
    x = _outliers(41, 74, dtype)
    x[2, 9], x[7, 0] = float("nan"), float("-inf")
    bounds = occ_bounds(x, 0.97, "exact")
    e4, s_fold, codes, s_a, resid = kt.triton_quantize_rows_folded(x, bounds, block_k=block_k, save=True)
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "reference")
    re4, rs_fold = gemm.quantize_fp4_folded(x, bounds)
    rcodes, rs_a, _, rresid = gemm.quantize_fp4_clamped(x, bounds)

    def same(a, b):
        return torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a.nan_to_num(),
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b.nan_to_num())

    assert same(e4, re4) and same(s_fold, rs_fold) and same(codes, rcodes) and same(s_a, rs_a)
    assert same(resid, rresid) and torch.equal(resid.isnan(), rresid.isnan())
    # the backward's rebuild kernels (codes, then the compact residual's outliers) give the same bytes
    from fp4lightning.kernels import scaled_mm as ksm
    comp = _compact_residual(resid, 0.97)
    p = torch.exp2(torch.round(torch.log2(s_fold / s_a)))
    got = ksm.triton_refold(codes, s_a, p, comp[0], comp[1], 74)
    assert got.stride(0) % 16 == 0 and same(got, re4)


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_fp4linear_scaled_mm_with_the_triton_quantizers(preset, monkeypatch):
    # the GPU's scaled_mm path (Triton quantizers writing the E4M3 operands, the fold's one pass
    # and backward's rebuild kernels) against its CPU form (the reference quantizers): the
    # quantizers' bits are identical, so the layer's results are too
    lin = FP4Linear(96, 48, config=FP4Config.from_preset(preset, occ_quantile="exact")).to(DEV)
    x, dy = _outliers(40, 96, torch.bfloat16), torch.randn(40, 48, device=DEV)
    want = _run(lin, x, dy, "scaled_mm", monkeypatch, autocast=True)
    monkeypatch.setattr(gemm, "triton_quantizers", lambda device: True)
    got = _run(lin, x, dy, "scaled_mm", monkeypatch, autocast=True)
    for name, t, r in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(t, r), name


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_scaled_mm_path_has_no_host_sync(preset, monkeypatch):
    # the GPU path (Triton quantizers, the fold's one pass, the compact residual, the refold) never
    # makes the host wait for the device; on CPU the same calls run, recorded by the same mode
    from .test_kernels import _HostSyncRecorder
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    monkeypatch.setattr(gemm, "triton_quantizers", lambda device: True)
    lin = FP4Linear(96, 48, config=FP4Config.from_preset(preset)).to(DEV)
    x = _outliers(37, 96, torch.bfloat16).requires_grad_(True)
    rec = _HostSyncRecorder()
    with rec:
        lin(x).backward(torch.randn(37, 48, device=DEV).bfloat16())
    assert rec.calls == [], sorted(set(rec.calls))
    assert torch.isfinite(lin.weight.grad).all() and torch.isfinite(x.grad).all()


@gpu
@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_fp4linear_scaled_mm_at_a_realistic_size(preset, monkeypatch):
    # compiled quantizers and cuBLAS/CUTLASS's FP8 GeMM against the same math on the reference path
    # (for `paper` the E4M3 fold, FP4Config.occ_fold_e4m3) at 2048 tokens, 1024 -> 2816 features
    lin = FP4Linear(1024, 2816, config=FP4Config.from_preset(preset, occ_quantile="exact")).to(DEV)
    x, dy = _outliers(2048, 1024), torch.randn(2048, 2816, device=DEV)
    got = _run(lin, x, dy, "scaled_mm", monkeypatch)
    if preset == "paper":
        lin.config = FP4Config.from_preset(preset, occ_quantile="exact", occ_fold_e4m3=True)
    ref = _run(lin, x, dy, "reference", monkeypatch)
    for name, t, r in zip(("y", "dx", "dw", "db"), got, ref):
        above(sqnr(t, r), SAME_OPERANDS_SQNR_DB, name)
