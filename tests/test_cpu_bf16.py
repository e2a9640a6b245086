"""bf16 GeMMs emulated with fp32 kernels on CPUs without native bf16 matrix kernels (fp4lightning.numerics.cpu_bf16).

Each test forces the mode it needs through ``FP4LIGHTNING_CPU_BF16_GEMM``, so the emulation and torch's
own bf16 kernels are both exercised whatever the machine's CPU is.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4lightning import FP4Config, FP4Linear
from fp4lightning.numerics import cpu_bf16
from fp4lightning.nn.convert import convert_to_fp4
from fp4lightning.models.llama import Llama, llama_config

ENV = "FP4LIGHTNING_CPU_BF16_GEMM"
# A native bf16 kernel and the emulation round the same fp32 products; only the order of the fp32
# additions differs. Each output may therefore differ by one bf16 ulp (it lands on the other side of
# a rounding boundary) plus what reordering K fp32 additions can change, K * 2^-24 * sum |a_i b_i|
# (which matters where the sum nearly cancels). Measured (128 x 192 -> 320): 0.007% of
# Y and 0.012% of dX differ, by one ulp; over 200 seeds a few near-cancelling outputs by up to 3 ulp.
MAX_DIFFERING_FRACTION = 0.01


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -126)))
    return torch.exp2(e - 7)


def _assert_same_bf16_gemm(a: torch.Tensor, b: torch.Tensor, abs_sum: torch.Tensor | float, k: int, what: str) -> None:
    """``a`` and ``b``: one bf16 GeMM output from two kernels; ``abs_sum``: sum |a_i b_i| per output."""
    a, b = a.float(), b.float()
    assert a.shape == b.shape, what
    diff = (a - b).abs()
    tol = _bf16_ulp(torch.maximum(a.abs(), b.abs())) + k * 2.0 ** -24 * abs_sum
    assert bool((diff <= tol).all()), (what, (diff / tol).max().item())
    assert (diff != 0).float().mean().item() <= MAX_DIFFERING_FRACTION, what


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().bfloat16().double().abs()


def _linear_run(layer: nn.Linear, x: torch.Tensor, dy: torch.Tensor):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("shape", [(128, 192, 320), (37, 64, 48)])
def test_emulated_linear_matches_native_bf16_autocast(monkeypatch, shape):
    m, k, n = shape
    ref = nn.Linear(k, n)
    emu = nn.Linear(k, n)
    emu.load_state_dict(ref.state_dict())
    monkeypatch.setenv(ENV, "emulate")
    assert cpu_bf16.emulate_bf16_linears(emu) == 1
    assert type(emu) is cpu_bf16.EmulatedBF16Linear and list(emu.state_dict()) == list(ref.state_dict())
    x = torch.randn(m, k)
    dy = torch.randn(m, n).bfloat16()
    got = _linear_run(emu, x, dy)
    monkeypatch.setenv(ENV, "native")
    want = _linear_run(ref, x, dy)
    xa, wa, ba, ga = _bf(x), _bf(ref.weight), _bf(ref.bias), dy.double().abs()
    sums = {"y": ((xa @ wa.t()) + ba, k), "dx": (ga @ wa, n), "dw": (ga.t() @ xa, m), "db": (ga.sum(0), m)}
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want):
        assert g.dtype == w.dtype, name
        _assert_same_bf16_gemm(g, w, sums[name][0].float(), sums[name][1], name)
    # and against float64: the emulation is as accurate as the native kernel
    y64 = x.double() @ ref.weight.double().t() + ref.bias.double()
    err_emu = (got[0].double() - y64).norm()
    err_nat = (want[0].double() - y64).norm()
    assert err_emu <= 1.01 * err_nat, (err_emu.item(), err_nat.item())


def test_emulated_linear_outside_bf16_is_plain_linear(monkeypatch):
    monkeypatch.setenv(ENV, "emulate")
    ref = nn.Linear(16, 8)
    emu = nn.Linear(16, 8)
    emu.load_state_dict(ref.state_dict())
    cpu_bf16.emulate_bf16_linears(emu)
    x = torch.randn(4, 16)
    assert torch.equal(emu(x), ref(x))  # fp32, no autocast: nn.Linear's own forward


def test_mm_emulation_matches_native(monkeypatch):
    a = torch.randn(96, 200).bfloat16()
    b = torch.randn(200, 72).bfloat16()
    monkeypatch.setenv(ENV, "native")
    want = cpu_bf16.mm(a, b)
    monkeypatch.setenv(ENV, "emulate")
    got = cpu_bf16.mm(a, b)
    assert got.dtype == torch.bfloat16
    _assert_same_bf16_gemm(got, want, (a.double().abs() @ b.double().abs()).float(), 200, "mm")
    # and each mode is the computation it names, bit for bit
    assert torch.equal(got, (a.float() @ b.float()).bfloat16())
    monkeypatch.setenv(ENV, "native")
    assert torch.equal(cpu_bf16.mm(a, b), a @ b)
    f = torch.randn(8, 8)
    assert torch.equal(cpu_bf16.mm(f, f), f @ f)  # fp32 operands: untouched


def test_mode_parsing(monkeypatch):
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match=ENV):
        cpu_bf16.emulate_bf16_gemm("cpu")
    monkeypatch.setenv(ENV, "emulate")
    assert cpu_bf16.emulate_bf16_gemm("cpu") and not cpu_bf16.emulate_bf16_gemm("meta")
    monkeypatch.setenv(ENV, "native")
    assert not cpu_bf16.emulate_bf16_gemm("cpu")
    monkeypatch.setenv(ENV, "auto")
    assert cpu_bf16.emulate_bf16_gemm("cpu") == (not cpu_bf16._cpu_has_native_bf16_gemm())


def test_swap_only_plain_linears_and_fp4_conversion_still_applies(monkeypatch):
    monkeypatch.setenv(ENV, "emulate")
    model = Llama(llama_config("tiny", vocab_size=256))
    keys = list(model.state_dict())
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert cpu_bf16.emulate_bf16_linears(model) == n_linear
    assert list(model.state_dict()) == keys
    convert_to_fp4(model, FP4Config())
    # every decoder projection became FP4Linear, the head stays an (emulated) high-precision Linear
    assert isinstance(model.lm_head, cpu_bf16.EmulatedBF16Linear) and not isinstance(model.lm_head, FP4Linear)
    assert sum(isinstance(m, FP4Linear) for m in model.modules()) == n_linear - 1
    monkeypatch.setenv(ENV, "native")
    assert cpu_bf16.emulate_bf16_linears(nn.Sequential(nn.Linear(4, 4))) == 0


def test_fp4linear_gemms_emulated_match_native(monkeypatch):
    lin = nn.Linear(64, 96)
    x = torch.randn(48, 64)
    dy = torch.randn(48, 96).bfloat16()
    emulated = []  # bf16 GeMMs that FP4Linear's reference path sent to the fp32 kernels
    real = cpu_bf16.emulated_mm_f32
    monkeypatch.setattr(cpu_bf16, "emulated_mm_f32", lambda a, b: emulated.append(a.shape) or real(a, b))
    outs = {}
    for mode in ("native", "emulate"):
        monkeypatch.setenv(ENV, mode)
        layer = FP4Linear.from_linear(lin, FP4Config())
        outs[mode] = _linear_run(layer, x, dy)
        # none under native; fprop, dgrad and wgrad under emulate
        assert len(emulated) == (0 if mode == "native" else 3), (mode, emulated)
    # the GeMMs run on E2M1/E5M2 operands inside FP4Linear; bound the reordering term by the largest
    # output (every |a_i b_i| sum is within a few times it at these sizes)
    for name, g, w in zip(("y", "dx", "dw", "db"), outs["emulate"], outs["native"]):
        _assert_same_bf16_gemm(g, w, 4 * w.float().abs().max(), 96, name)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_recipe_baseline_module_emulates_only_under_bf16(monkeypatch, precision):
    import lightning.pytorch as L

    from fp4lightning.train.run import make_module
    from fp4lightning.train.recipe import load_recipe

    monkeypatch.setenv(ENV, "emulate")
    cfg = load_recipe(None, [f"trainer.precision={precision}", "model.vocab_size=256"])
    module = make_module(cfg)
    module.trainer = L.Trainer(accelerator="cpu", precision=precision, logger=False, enable_checkpointing=False,
                               enable_progress_bar=False, enable_model_summary=False)
    module.configure_model()
    want = cpu_bf16.EmulatedBF16Linear if precision == "bf16-mixed" else nn.Linear
    linears = [m for m in module.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is want for m in linears), {type(m).__name__ for m in linears}


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_fp4linear_emulated_gemms_are_the_bf16_gemm_bit_for_bit(monkeypatch, compiled):
    """Under emulation FP4Linear's GeMMs take fp32 operands and round the product in the epilogue
    (cpu_bf16.gemm_plan): Y and dA must be, bit for bit, the bf16 GeMMs of the bf16 operands
    (``emulated_mm``) followed by the same epilogues; dW within fp32 rounding of that. Compiled
    too: Inductor drops a ``.to(bf16).float()`` round trip unless told to keep casts."""
    from fp4lightning.numerics import cpu_fused
    from fp4lightning.ops import gemm
    from fp4lightning.numerics.formats import decode_packed_fp4
    from fp4lightning.numerics.occ import occ_bounds

    monkeypatch.setenv(ENV, "emulate")
    monkeypatch.setenv("FP4LIGHTNING_COMPILE", compiled)
    m, k, n = 96, 128, 80
    lin = nn.Linear(k, n)
    x = torch.randn(m, k) * (1 + 9 * (torch.rand(m, k) < 0.02))
    dy = torch.randn(m, n).bfloat16()
    layer = FP4Linear.from_linear(lin, FP4Config())
    y, dx, dw, _ = _linear_run(layer, x, dy)
    assert not cpu_fused._FAILED, cpu_fused._FAILED  # compiled where asked (CI has a C++ compiler)
    monkeypatch.setenv("FP4LIGHTNING_COMPILE", "0")  # the reference below runs eagerly
    cfg = layer.config
    bf = torch.bfloat16
    # the forward as bf16 GeMMs: OCC-folded activation values and weight values in bf16
    bounds = occ_bounds(x, cfg.occ_alpha, cfg.occ_quantile, cfg.occ_sample_size)
    a_codes, a_scale, a_vals, r = gemm.quantize_fp4_clamped(x, bounds, cfg.scale_mode, False, fold=True,
                                                            values_dtype=bf)
    w_codes, w_scale, w_vals = gemm.quantize_fp4(lin.weight.detach(), cfg.scale_mode, False, values_dtype=bf)
    y_ref = cpu_fused.gemm_epilogue(cpu_bf16.emulated_mm(a_vals, w_vals.t()), a_scale, w_scale, lin.bias.detach(), bf)
    assert torch.equal(y, y_ref)
    g1, s1 = gemm.quantize_fp8_divided(dy, w_scale, dim=1, fmt=cfg.grad_format, carrier=bf)
    dx_ref = cpu_fused.gemm_epilogue(cpu_bf16.emulated_mm(g1, decode_packed_fp4(w_codes, k, bf)), s1, None, None, bf)
    assert torch.equal(dx, dx_ref.float())
    g2, s2 = gemm.quantize_fp8_divided(dy, a_scale, dim=0, fmt=cfg.grad_format, carrier=bf)
    acc = cpu_bf16.emulated_mm(g2.t(), decode_packed_fp4(a_codes, k, bf))
    comp = (dy.double().t() @ r.double()).float()  # OCC's share dY^T R, in float64 then fp32
    dw_ref = cpu_fused.wgrad_epilogue(acc, s2, comp, lin.weight.detach(), w_scale, cfg.dge_k, cfg.dge_clamp,
                                      torch.float32)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-6 * dw_ref.abs().max().item())


def test_sparse_compensation_product_in_chunks_is_the_whole_product(monkeypatch):
    """OCC's weight-gradient share ``dY^T R``, taken in column chunks of dY (fp4lightning.nn.linear), equals
    the float64 product to fp32 rounding, and the unchunked fp32 sparse product bit for bit, also
    where the last chunk is short (it failed on an AVX-512 CPU when a narrow last chunk ran alone)."""
    from fp4lightning.nn import linear as fl

    m, k = 256, 64
    r = torch.randn(m, k) * (torch.rand(m, k) < 0.03)
    rt = fl._sparse_residual(r, transpose=True)
    dy = torch.randn(m, 200).bfloat16()
    assert torch.equal(fl._sparse_wgrad(rt, dy), torch.sparse.mm(rt, dy.float()).t())  # one chunk at this size
    monkeypatch.setattr(fl, "SPARSE_CHUNK_BYTES", 4 * m * 64)  # 64 columns a chunk
    for n in (128, 136, 200, 263, 320):  # 128 and 320 split evenly; 136, 200, 263 leave 8, 8, 7 columns
        dy = torch.randn(m, n).bfloat16()
        whole = torch.sparse.mm(rt, dy.float()).t()
        chunked = fl._sparse_wgrad(rt, dy)
        assert chunked.shape == (n, k) and chunked.is_contiguous()
        assert torch.equal(chunked, whole), n
    ref = dy.double().t() @ r.double()
    torch.testing.assert_close(chunked.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
