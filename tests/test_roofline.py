"""The roofline model of the CUDA path (benchmarks/roofline.py) and the launch budget of issue 47.

The trace runs FP4Linear's CUDA path (the ``scaled_mm`` backend) on meta tensors: nothing is allocated
or computed, so the 7B shapes themselves trace in well under a second, on any machine.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("roofline", ROOT / "benchmarks" / "roofline.py")
roofline = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("roofline", roofline)  # dataclasses look their module up
_spec.loader.exec_module(roofline)

#: one 7B layer: 8192 tokens, 4096 -> 4096, with a bias (issue 47 counted FP4Linear's default)
M, K, N = 8192, 4096, 4096

#: issue 47, item 2: forward + backward of one FP4Linear, weight quantized in it, at most this many launches
LAUNCH_BUDGET = {"w4a4-direct": 12, "paper": 16}
#: ... and at most these bytes outside the GeMMs, per element of A (M x K, bf16), W (N x K, fp32) and
#: dY (M x N, bf16), 10% over what the issue's kernel set moves:
#:   A: read once by its quantizer (2 B), which writes the packed codes (0.5 B) and the forward's E4M3
#:      operand (1 B); wgrad's operand written transposed from the codes (0.5 B read, 1 B written): 5 B.
#:      `paper` adds the compact OCC residual, written by the fold kernel and read by the refold
#:      (2 x 6 B per slot, slots 1.5 x 2% of A): 0.5 B with the sample quantile.
#:   W: read once (4 B), codes and both E4M3 layouts written in the same pass (2.5 B): 6.5 B.
#:      `paper` adds the wgrad finish (DGE): dW read and written (8 B), W read (4 B): 18.5 B.
#:   dY: the row pass (2 B read, 1 B FP8 written; the column amax and the bias gradient ride in it) and
#:      the column pass (2 B, 1 B): 6 B.
NON_GEMM_BYTES_PER_ELEMENT = {"w4a4-direct": (5.0, 6.5, 6.0), "paper": (5.5, 18.5, 6.0)}
BUDGET_MARGIN = 1.10

#: what the code traces to today at (M, K, N) (launches, bytes outside the GeMMs): a change that adds
#: launches or traffic fails `test_launches_do_not_grow`; lower these when the kernels are reduced
CURRENT = {"w4a4-direct": (9, 487_464_960), "paper": (13, 752_706_378)}


def _bytes_budget(preset: str) -> float:
    a, w, g = NON_GEMM_BYTES_PER_ELEMENT[preset]
    return BUDGET_MARGIN * (a * M * K + w * N * K + g * M * N)


@pytest.fixture(scope="module")
def traces():
    return {p: roofline.trace_layer(p, M, K, N) for p in ("bf16", "w4a4-direct", "paper")}


def test_json_schema():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "roofline.py"), "--json"], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert list(out) == ["shapes"]
    assert list(out["shapes"]) == ["4096x4096", "4096x11008", "11008x4096"]
    for shape, row in out["shapes"].items():
        assert list(row) == ["bf16", "w4a4-direct", "paper", "torchao-float8"], shape
        for preset, entry in row.items():
            assert isinstance(entry["launches"], int) and entry["launches"] >= 4, (shape, preset)
            assert isinstance(entry["pred_ms"], float) and entry["pred_ms"] > 0, (shape, preset)
            assert entry["gemms"] == 3, (shape, preset)
            assert entry["x_bf16"] == pytest.approx(entry["pred_ms"] / row["bf16"]["pred_ms"], abs=2e-3)


def test_bf16_linear_is_three_gemms(traces):
    launches = traces["bf16"]
    gemms = [x for x in launches if x.kind == "gemm"]
    assert [x.name for x in gemms] == ["aten.mm"] * 3 or [x.name for x in gemms] == ["aten.addmm", "aten.mm", "aten.mm"]
    assert all(x.flops == 2 * M * K * N and x.rate == roofline.BF16_RATE for x in gemms)
    assert roofline.count_host_syncs(launches) == 0
    # autocast's casts of W and b to bf16, autograd's casts of their gradients to fp32, the bias gradient
    assert roofline.count_launches(launches) == 8
    assert roofline.count_launches(roofline.trace_layer("bf16", M, K, N, bias=False)) == 5


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_trace_takes_the_cuda_path(traces, preset):
    launches = traces[preset]
    gemms = [x for x in launches if x.kind == "gemm"]
    assert [x.name for x in gemms] == ["aten._scaled_mm"] * 3  # no reference GeMM, no Triton GeMM fallback
    assert all(x.rate == roofline.FP8_RATE and x.flops == 2 * M * K * N for x in gemms)
    assert any(x.name.startswith("triton.") for x in launches)  # the CUDA quantizers


def test_host_sync_is_detected():
    # the "no host sync" checks below can fail: a value read on the host is one
    with roofline.modelled_h200() as rec, rec:
        x = torch.empty(64, device="cuda")
        x.sum().item()
        torch.nonzero(x)
    assert roofline.count_host_syncs(rec.launches) == 2


def test_launch_budget(traces):
    failures = []
    for preset, budget in LAUNCH_BUDGET.items():
        launches = traces[preset]
        n, syncs, moved = (roofline.count_launches(launches), roofline.count_host_syncs(launches),
                           roofline.non_gemm_bytes(launches))
        if n > budget or syncs or moved > _bytes_budget(preset):
            failures.append(f"{preset}: {n} launches (budget {budget}), {syncs} host syncs, {moved / 1e6:.0f} MB "
                            f"outside the GeMMs (budget {_bytes_budget(preset) / 1e6:.0f} MB)")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_launches_do_not_grow(traces, preset):
    launches = traces[preset]
    n_max, bytes_max = CURRENT[preset]
    assert roofline.count_launches(launches) <= n_max, roofline.launch_table(launches)
    assert roofline.count_host_syncs(launches) == 0, roofline.launch_table(launches)
    assert roofline.non_gemm_bytes(launches) <= 1.01 * bytes_max, roofline.launch_table(launches)


def test_trace_leaves_the_process_as_it_was(monkeypatch):
    from fp4lightning.config import FP4Config
    from fp4lightning.nn.linear import FP4Linear
    from fp4lightning.numerics import occ
    from fp4lightning.ops import gemm

    monkeypatch.delenv("FP4LIGHTNING_BACKEND", raising=False)
    torch.manual_seed(0)
    layer = FP4Linear(256, 128, config=FP4Config.from_preset("paper"))
    x = torch.randn(512, 256)  # OCC samples its quantile above 65,536 elements
    before = layer(x).detach()
    cuda = torch.cuda.is_available()
    roofline.trace_layer("paper", 512, 256, 128)
    assert "device" not in torch.Tensor.__dict__ and "is_cuda" not in torch.Tensor.__dict__
    assert torch.cuda.is_available() == cuda
    assert "FP4LIGHTNING_BACKEND" not in os.environ
    assert gemm.backend_for(torch.device("cpu")) == "reference"
    assert not any(t.is_meta for t in getattr(occ, "_SAMPLE_INDEX", {}).values())
    assert torch.equal(layer(x).detach(), before)


#: issue 47, item 3: predicted time against bf16 nn.Linear's, at every 7B shape
PREDICTED_RATIO_TARGET = {"w4a4-direct": 0.65, "paper": 0.80}


@pytest.fixture(scope="module")
def modelled():
    return roofline.model()["shapes"]


@pytest.mark.parametrize("shape", ["4096x4096", "4096x11008", "11008x4096"])
def test_predicted_ratios_beat_torchao_float8(modelled, shape):
    row = modelled[shape]
    assert row["paper"]["x_bf16"] <= PREDICTED_RATIO_TARGET["paper"], row
    for preset in PREDICTED_RATIO_TARGET:
        assert row[preset]["x_bf16"] < row["torchao-float8"]["x_bf16"], (preset, row)


@pytest.mark.parametrize("shape", [
    pytest.param("4096x4096", marks=pytest.mark.xfail(strict=True, reason="w4a4-direct is predicted at 0.68x, "
                 "and no implementation of its numerics on the vendor's FP8 GeMMs goes below 0.655x in this model "
                 "(test_w4a4_direct_floor)")),
    "4096x11008", "11008x4096"])
def test_w4a4_direct_predicted_ratio(modelled, shape):
    assert modelled[shape]["w4a4-direct"]["x_bf16"] <= PREDICTED_RATIO_TARGET["w4a4-direct"], modelled[shape]


@pytest.mark.parametrize("shape", [(4096, 4096), (4096, 11008), (11008, 4096)])
def test_w4a4_direct_floor_bounds_the_trace(shape):
    k, n = shape
    floor, traced = roofline.w4a4_direct_floor(M, k, n), roofline.trace_layer("w4a4-direct", M, k, n)
    assert [x for x in floor if x.kind == "gemm"] == [x for x in traced if x.kind == "gemm"]
    assert roofline.count_launches(floor) == 6 <= roofline.count_launches(traced)
    assert roofline.non_gemm_bytes(floor) <= roofline.non_gemm_bytes(traced)
    assert roofline.predicted_s(floor) <= roofline.predicted_s(traced)
    # what must move outside the GeMMs, per element: A 2 B read + 2 x 1 B written, W 4 + 2 x 1, dY 2 x (2 + 1)
    assert roofline.non_gemm_bytes(floor) == pytest.approx(4 * M * k + 6 * n * k + 6 * M * n, rel=1e-3)


def test_w4a4_direct_floor():
    """Issue 47's <= 0.65x for w4a4-direct at 4096 x 4096 lies below the floor of its numerics in this
    model: even 3 non-GeMM launches moving only what must move leave 0.655x (docs/perf.md)."""
    base = roofline.predicted_s(roofline.trace_layer("bf16", M, K, N))
    floor = roofline.predicted_s(roofline.w4a4_direct_floor(M, K, N)) / base
    assert PREDICTED_RATIO_TARGET["w4a4-direct"] < floor == pytest.approx(0.655, abs=1e-3)
    # the three GeMMs and three more launches are 0.558x; the 436 MB that must move outside them add 0.096x
    gemms = sum(x.time_s for x in roofline.w4a4_direct_floor(M, K, N) if x.kind == "gemm")
    assert (gemms + 3 * roofline.LAUNCH_S) / base == pytest.approx(0.5583, abs=1e-3)


def test_memory_counts_a_buffer_until_its_last_view_dies():
    with roofline.modelled_h200() as rec, rec:
        base = torch.empty(1000, dtype=torch.uint8, device="cuda")
        view = base.view(torch.float8_e4m3fn)[:500]
        del base
        assert rec.memory.now == 1000  # the view holds the buffer
        other = torch.empty(24, dtype=torch.float32, device="cuda")
        assert rec.memory.peak == 1096 and rec.memory.peak_at == "forward: aten.empty"
        del view
        assert rec.memory.now == 96
        del other
        assert rec.memory.now == 0 and rec.memory.peak == 1096


def test_layer_memory_bf16_holds_its_input_and_bf16_weight():
    mem = roofline.layer_memory("bf16", M, K, N, bias=False)
    assert mem["held_mb"] == pytest.approx((2 * M * K + 2 * N * K) / 1e6, abs=0.01)
    # the output, dx, and dW in bf16 then fp32 (autocast's weight freed with the graph)
    assert mem["peak_mb"] == pytest.approx((2 * M * N + 2 * M * K + 6 * N * K) / 1e6, abs=0.01)


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_layer_memory_fp4_backward_peak(preset):
    """FP4Linear's backward holds one FP8 copy of dY at a time: the dgrad operand is freed before the
    wgrad operand is made. Its peak is then the output, dx, dW in fp32, dY's wgrad operand (1 B), A's
    wgrad operand (1 B), what the forward saved, and the scales."""
    bf16 = roofline.layer_memory("bf16", M, K, N)
    mem = roofline.layer_memory(preset, M, K, N)
    assert mem["held_mb"] < bf16["held_mb"] / 3
    peak = 2 * M * N + 2 * M * K + 4 * N * K + M * N + M * K
    assert mem["peak_mb"] <= peak / 1e6 + mem["held_mb"] + 1.0, mem


@pytest.mark.parametrize("preset", ["w4a4-direct", "paper"])
def test_launch_budget_fp32_input(preset):
    """Under bf16 autocast the LLaMA models' q, k, v, gate and up projections get an fp32 input (the
    residual stream and the RMSNorm are fp32): the launch budget holds for it too (`paper`: OCC's
    quantiles in two launches, not a sort and a dozen small ops)."""
    launches = roofline.trace_layer(preset, M, K, N, input_dtype=torch.float32)
    assert roofline.count_host_syncs(launches) == 0
    assert roofline.count_launches(launches) <= LAUNCH_BUDGET[preset], roofline.launch_table(launches)
    assert not any(x.name == "aten.sort" for x in launches), roofline.launch_table(launches)
    # the bf16 input's launches, and for fp32 the cast of dx back to the input's dtype (as nn.Linear's)
    assert roofline.count_launches(launches) == CURRENT[preset][0] + (2 if preset == "paper" else 1)


def test_llama_linears_get_fp32_and_bf16_inputs_under_autocast():
    from fp4lightning.models.config import LLAMA_CONFIGS
    from fp4lightning.models.llama import Llama

    model, seen = Llama(LLAMA_CONFIGS["tiny"]), {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers.0."):
            mod.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name.split(".")[-1], args[0].dtype)
                                          and None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 100, (1, 16)))
    assert {k for k, v in seen.items() if v == torch.float32} == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert {k for k, v in seen.items() if v == torch.bfloat16} == {"o_proj", "down_proj"}
