"""The scaled_mm backend's capability probe (fp4lightning/ops/capability.py): which ``torch._scaled_mm``
calls a device takes, and where each GeMM goes when it refuses one.

* ``choose_gemm_route`` on the devices that exist (a pure function: any GPU can be fed to it here);
* the probe itself on CPU (torch runs row-wise ``_scaled_mm`` there), and that a wrong result counts
  as a refusal;
* a device that refuses a kind, simulated on CPU: at the probe's call for one kind, and at
  ``torch._scaled_mm`` itself as torch's CUTLASS row-wise kernels refuse an fp32 output. FP4Linear
  then trains instead of crashing, with one line saying so, and the rerouted GeMMs give the bf16
  output rounded, as that route promises.
"""
import warnings

import pytest
import torch

from fp4lightning import FP4Config, FP4Linear
from fp4lightning.ops import capability, gemm

from ._numerics import needs_cpu_scaled_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
KINDS = capability.SCALED_MM_KINDS
#: the message torch's CUTLASS row-wise kernels give an fp32 output (aten RowwiseScaledMM.cu)
CUTLASS_FP32 = "RuntimeError: Only bf16 high precision output types are supported for row-wise scaling."
NO_ROWWISE = "RuntimeError: Rowwise scaling is not currently supported on your device"
PROBE_LINE = "fp4lightning: torch._scaled_mm on"


@pytest.fixture
def fresh_probe(monkeypatch):
    """The scaled_mm backend on CPU with the probe's cache emptied before and after (a simulated
    device's answers must not outlive the test)."""
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", "scaled_mm")
    gemm.forget_scaled_mm_probe()
    yield
    gemm.forget_scaled_mm_probe()


# --------------------------------------------------------------------------- the choice (pure)
def test_every_kind_runs_as_asked_where_the_probe_passes():
    routes = capability.choose_gemm_route((9, 0), dict.fromkeys(KINDS))  # H100/H200 on cuBLASLt
    assert routes.backend == "scaled_mm" and not routes.refused
    assert routes.routes == {k: ("scaled_mm", k[1]) for k in KINDS}
    assert capability.describe("cuda:0", routes) is None


@pytest.mark.parametrize("cap", [(8, 9), (10, 0), (9, 0)])  # L4, B200, H100 on an older CUDA build
def test_cutlass_rowwise_bf16_only_routes_fp32_through_bf16_and_fp16_to_triton(cap):
    probe = {k: None if k[1] == BF16 else CUTLASS_FP32 for k in KINDS}
    routes = capability.choose_gemm_route(cap, probe)
    assert routes.backend == "scaled_mm"
    assert set(routes.refused) == {k for k in KINDS if k[1] != BF16}
    for kind, route in routes.routes.items():
        want = {BF16: ("scaled_mm", BF16), FP32: ("scaled_mm", BF16), FP16: ("triton", None)}[kind[1]]
        assert route == want, capability.kind_name(kind)
    line = capability.describe("cuda:0 (NVIDIA L4, sm_89)", routes)
    assert "\n" not in line and "refused 5 of the 8" in line and CUTLASS_FP32 in line
    assert "E4M3 x E4M3 -> float32, E5M2 x E4M3 -> float32 via a bfloat16 output then a cast" in line
    assert "-> float16 + bias" in line and "via the triton GeMM" in line


def test_refused_bf16_output_or_bias_goes_through_fp32():
    refuse = {(E4M3, BF16, True), (E5M2, BF16, False)}
    routes = capability.choose_gemm_route((9, 0), {k: "RuntimeError: no" if k in refuse else None for k in KINDS})
    assert routes.routes[(E4M3, BF16, True)] == ("scaled_mm", FP32)
    assert routes.routes[(E5M2, BF16, False)] == ("scaled_mm", FP32)
    assert routes.routes[(E4M3, BF16, False)] == ("scaled_mm", BF16)


@pytest.mark.parametrize("cap, probe", [
    ((12, 0), dict.fromkeys(KINDS, NO_ROWWISE)),  # RTX 5090: no row-wise kernel at all
    ((9, 0), dict.fromkeys(KINDS, NO_ROWWISE)),  # a torch built without the row-wise kernels
    ((9, 0), None),  # a torch without torch._scaled_mm
    ((8, 0), dict.fromkeys(KINDS)),  # A100: no FP8 tensor cores, whatever a probe said
])
def test_no_rowwise_gemm_means_the_triton_backend(cap, probe):
    routes = capability.choose_gemm_route(cap, probe)
    assert routes.backend == "triton"
    assert set(routes.routes.values()) == {("triton", None)}
    assert "FP4Linear uses the triton GeMMs there" in capability.describe("cuda:0", routes)
    assert capability.choose_gemm_route(cap, probe, triton_available=False).backend == "reference"


# --------------------------------------------------------------------------- the probe on CPU
@needs_cpu_scaled_mm()
def test_probe_runs_every_kind_on_cpu():
    assert capability.probe(torch.device("cpu")) == dict.fromkeys(KINDS)


@needs_cpu_scaled_mm()
def test_a_wrong_result_is_a_refusal(monkeypatch):
    real = capability.probe_call

    def off_by_one(a, b, scale_a, scale_b, out_dtype, bias, fast_accum):
        y = real(a, b, scale_a, scale_b, out_dtype, bias, fast_accum)
        return y + 1 if out_dtype == FP16 else y

    monkeypatch.setattr(capability, "probe_call", off_by_one)
    results = capability.probe(torch.device("cpu"))
    assert {k for k, why in results.items() if why} == {k for k in KINDS if k[1] == FP16}
    assert set(filter(None, results.values())) == {"wrong result"}


# --------------------------------------------------------------------------- a refusing device, simulated
def _layer(preset: str, k: int = 64, n: int = 48) -> tuple[FP4Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    x = torch.randn(40, k) * torch.exp(torch.randn(40, 1))
    return FP4Linear.from_linear(lin, FP4Config.from_preset(preset)), x, torch.randn(40, n)


def _fwd_bwd(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = layer(x)  # fp32, no autocast: every GeMM asks _scaled_mm for an fp32 output
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _probe_lines(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith(PROBE_LINE)]


@needs_cpu_scaled_mm()
def test_probe_level_refusal_routes_that_kind_with_one_line(fresh_probe, monkeypatch):
    real = capability.probe_call

    def refuse_e5m2_fp32(a, b, scale_a, scale_b, out_dtype, bias, fast_accum):
        if a.dtype == E5M2 and out_dtype == FP32:
            raise RuntimeError(CUTLASS_FP32.removeprefix("RuntimeError: "))
        return real(a, b, scale_a, scale_b, out_dtype, bias, fast_accum)

    monkeypatch.setattr(capability, "probe_call", refuse_e5m2_fp32)
    cpu = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gemm.backend_for(cpu) == "scaled_mm"
        routes = gemm.scaled_mm_routes(cpu)
        gemm.scaled_mm_routes(cpu)  # cached: probed once, said once
    assert routes.refused == {(E5M2, FP32, False): CUTLASS_FP32}
    assert routes.routes[(E5M2, FP32, False)] == ("scaled_mm", BF16)
    assert routes.routes[(E4M3, FP32, False)] == ("scaled_mm", FP32)
    lines = _probe_lines(caught)
    assert len(lines) == 1 and "E5M2 x E4M3 -> float32 via a bfloat16 output then a cast" in lines[0]


def _refusing_scaled_mm(real, refuse):
    """``torch._scaled_mm`` of a device that raises, as torch does, for the calls ``refuse`` names."""
    def call(a, b, *args, out_dtype=None, **kwargs):
        if refuse(a.dtype, out_dtype):
            raise RuntimeError(CUTLASS_FP32.removeprefix("RuntimeError: "))
        return real(a, b, *args, out_dtype=out_dtype, **kwargs)
    return call


@needs_cpu_scaled_mm()
@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_device_refusing_fp32_outputs_trains_through_bf16(preset, fresh_probe, monkeypatch):
    layer, x, dy = _layer(preset)
    direct = _fwd_bwd(layer, x, dy)  # this CPU takes every kind
    gemm.forget_scaled_mm_probe()
    monkeypatch.setattr(torch, "_scaled_mm", _refusing_scaled_mm(torch._scaled_mm, lambda a, out: out == FP32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        routed = [_fwd_bwd(layer, x, dy) for _ in range(2)]  # before the probe: RuntimeError mid-step
    lines = _probe_lines(caught)
    assert len(lines) == 1, lines  # one line, once per device
    assert "refused 2 of the 8" in lines[0] and CUTLASS_FP32 in lines[0]
    y, dx, dw, db = routed[-1]
    for a, b in zip(routed[0], routed[1]):
        assert torch.equal(a, b)
    # forward and dgrad: _scaled_mm's bf16 output of the same operands, then the fp32 bias
    assert torch.equal(y, (direct[0] - layer.bias.detach()).bfloat16().float() + layer.bias.detach())
    assert torch.equal(dx, direct[1].bfloat16().float())
    # wgrad: the GeMM rounded to bf16 before the DGE factor (exact property: one bf16 rounding)
    bound = 2.0 ** -8 * direct[2].abs() * (1 + 1e-6) + 1e-30
    assert ((dw - direct[2]).abs() <= bound).all()
    assert torch.equal(db, direct[3])


def test_device_with_no_rowwise_gemm_refuses_an_explicit_scaled_mm(fresh_probe, monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _refusing_scaled_mm(torch._scaled_mm, lambda a, out: True))
    cpu = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert "runs no row-wise scaled FP8 GeMM" in gemm.scaled_mm_unavailable(cpu)
        with pytest.raises(RuntimeError, match="FP4LIGHTNING_BACKEND=scaled_mm: .*set FP4LIGHTNING_BACKEND to triton"):
            gemm.backend_for(cpu)
    assert len(_probe_lines(caught)) == 1
