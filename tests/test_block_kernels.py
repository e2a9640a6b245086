"""Triton block-FP4 kernels (kernels/block.py, kernels/block_quantize.py) against the PyTorch
reference, under the interpreter.

Codes and scales bitwise; the GeMM against the reference block GeMM to fp32 rounding. The block
layer's CUDA path as benchmarks/roofline.py traces it: launches and host syncs.
Shapes stay <= 128 (the interpreter runs ~0.4 s per 256^3 GeMM).
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from fp4lightning.numerics.block_formats import (BlockFP4, block_gemm_reference, quantize_block, quantize_mxfp4,
                                                 quantize_nvfp4, sr_seed, sr_seed_from_checksum)
from tests._numerics import above, heavy_tailed, sqnr

kb = pytest.importorskip("fp4lightning.kernels.block", reason="triton is not importable here")
from fp4lightning.kernels import block_quantize as kq  # noqa: E402 (triton is importable: kb was)

#: kernels run on CUDA tensors when there is a GPU (compiled), else on CPU under the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 accumulation order differs from the reference matmul's: ~1e-7 relative
GEMM_MIN_SQNR_DB = 100.0


def _inputs(m, k):
    x = heavy_tailed(m, k) * torch.exp(torch.randn(m, 1) * 2)
    x[0, :32] = 0  # an all-zero block
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_quantizer_bitwise(dtype):
    x = _inputs(24, 96).to(dtype)
    q, s = (t.cpu() for t in kb.triton_quantize_mxfp4(x.to(DEV)))
    ref = quantize_mxfp4(x)
    assert torch.equal(s, ref.scales) and torch.equal(q, ref.codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_quantizer_bitwise(dtype):
    x = _inputs(24, 64).to(dtype)
    q, s, g = (t.cpu() for t in kb.triton_quantize_nvfp4(x.to(DEV)))
    ref = quantize_nvfp4(x)
    assert torch.equal(g, ref.global_scale)
    assert torch.equal(s.view(torch.uint8), ref.scales.view(torch.uint8)) and torch.equal(q, ref.codes)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("k, block_k", [(64, 64), (96, 64), (96, 32)])  # one tile, a K tail, several tiles
def test_block_gemm_matches_reference(fmt, k, block_k):
    a, w = _inputs(40, k), torch.randn(24, k)  # 2-3 MXFP4 / 4-6 NVFP4 K blocks
    quant = quantize_mxfp4 if fmt == "mxfp4" else quantize_nvfp4
    qa, qw = quant(a), quant(w)
    factor = 1.0 if fmt == "mxfp4" else qa.global_scale * qw.global_scale
    dev = [t.to(DEV) for t in (qa.codes, qa.scales, qw.codes, qw.scales)]
    got = kb.triton_block_gemm(*dev, fmt, factor if isinstance(factor, float) else factor.to(DEV),
                               block_m=32, block_n=32, block_k=block_k).cpu()
    above(sqnr(got, block_gemm_reference(qa, qw).double()), GEMM_MIN_SQNR_DB, "SQNR dB")


def test_kernel_inputs_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        kb.triton_quantize_mxfp4(torch.randn(4, 48, device=DEV))
    with pytest.raises(ValueError, match="empty input"):
        kb.triton_quantize_nvfp4(torch.randn(0, 32, device=DEV))
    q, s = kb.triton_quantize_mxfp4(torch.randn(4, 64, device=DEV))
    with pytest.raises(ValueError, match="shapes do not match"):
        kb.triton_block_gemm(q, s, q[:, :16], s, "mxfp4")
    with pytest.raises(ValueError, match="block_k=16 must be a multiple of the mxfp4 block size 32"):
        kb.triton_block_gemm(q, s, q, s, "mxfp4", block_k=16)
    with pytest.raises(ValueError, match="powers of two >= 16, got block_k=48"):
        kb.triton_block_gemm(q, s, q, s, "nvfp4", block_k=48)
    # layouts and dtypes the kernel cannot read are refused or made readable, never misread
    with pytest.raises(TypeError, match="a_scales must be torch.uint8"):  # fp32 block scales of the right shape
        kb.triton_block_gemm(q, s.float(), q, s, "mxfp4")
    with pytest.raises(TypeError, match="b_codes must be 2-D packed uint8"):
        kb.triton_block_gemm(q, s, q.to(torch.int16), s, "mxfp4")


def test_block_gemm_reads_column_major_codes():
    a, w = torch.randn(32, 64), torch.randn(32, 64)
    qa, qw = quantize_mxfp4(a), quantize_mxfp4(w)
    args = [t.to(DEV) for t in (qa.codes, qa.scales, qw.codes, qw.scales)]
    want = kb.triton_block_gemm(*args, "mxfp4", block_m=32, block_n=32).cpu()
    col_major = args[0].t().contiguous().t()  # the same values, unit row stride
    assert torch.equal(kb.triton_block_gemm(col_major, *args[1:], "mxfp4", block_m=32, block_n=32).cpu(), want)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_nan_block_is_nan_as_in_the_reference(fmt):
    # a NaN activation must reach the output (loss scaling and the non-finite guard look for it): the
    # quantizers write the format's NaN scale bitwise as the reference does, and the GeMM decodes it
    x, w = _inputs(24, 64), torch.randn(16, 64)
    x[1, 5], x[7, 40] = float("nan"), float("nan")
    quant, tquant = (quantize_mxfp4, kb.triton_quantize_mxfp4) if fmt == "mxfp4" else \
        (quantize_nvfp4, kb.triton_quantize_nvfp4)
    ref, got = quant(x), [t.cpu() for t in tquant(x.to(DEV))]
    assert torch.equal(got[1].view(torch.uint8), ref.scales.view(torch.uint8)) and torch.equal(got[0], ref.codes)
    qw = quant(w)
    factor = 1.0 if fmt == "mxfp4" else float(ref.global_scale * qw.global_scale)
    y = kb.triton_block_gemm(*[t.to(DEV) for t in (ref.codes, ref.scales, qw.codes, qw.scales)], fmt, factor,
                             block_m=32, block_n=32).cpu()
    y_ref = block_gemm_reference(ref, qw)
    assert torch.equal(y.isnan(), y_ref.isnan()) and y[[1, 7]].isnan().all() and y[[0, 2]].isfinite().all()


# --------------------------------------------------------------------------- FP4Linear on the Triton path
# The block recipes' FP4Linear with FP4LIGHTNING_BACKEND=triton (what CUDA tensors get) against the
# reference path: the same codes, scales and stochastic draws, so the two differ only in fp32
# accumulation order (and where OCC's residual joins: the reference folds R / s into A's fp32
# values, the Triton path adds R W_q^T after the kernel). Audit over seeds 0-999: worst 138.2 dB
# (y with OCC, seed 160); every other output bit-identical at these shapes.
LINEAR_PATHS_MIN_SQNR_DB = 100.0


def _block_layer(cfg, k=256, n=128):
    from torch import nn

    from fp4lightning import FP4Linear

    lin = nn.Linear(k, n)
    nn.init.normal_(lin.weight, std=k ** -0.5)
    return FP4Linear.from_linear(lin, cfg).to(DEV)


def _layer_run(layer, x, dy, backend, monkeypatch):
    monkeypatch.setenv("FP4LIGHTNING_BACKEND", backend)
    x = x.detach().clone().requires_grad_()
    layer.weight.grad = layer.bias.grad = None
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone()


# three cases cover every path: MXFP4 with the RHT and stochastic rounding, NVFP4 (16x16 weight
# tiles, its own SR and RHT defaults) with OCC and DGE on top, and every operand stochastic with the
# seeds a GPU uses (derived on the device: inside the Triton quantizer, by torch ops on the reference path)
@pytest.mark.parametrize("preset, extra, device_seeds", [
    ("mxfp4-rht-sr", {}, False), ("nvfp4", {"occ": True, "occ_quantile": "exact", "dge": True}, False),
    ("nvfp4", {"stochastic_rounding": ("fprop.a", "fprop.w", "dgrad.g", "dgrad.w", "wgrad.g", "wgrad.a")}, True)],
    ids=["mxfp4-rht-sr", "nvfp4-occ-dge", "nvfp4-all-sr-device-seeds"])
def test_fp4linear_block_triton_matches_reference(preset, extra, device_seeds, monkeypatch):
    from fp4lightning import FP4Config
    from fp4lightning.nn import block_linear

    if device_seeds:
        monkeypatch.setattr(block_linear, "host_seeded", lambda device: False)
    layer = _block_layer(FP4Config.from_preset(preset, **extra), k=128, n=64)
    x, dy = heavy_tailed(48, 128).to(DEV), torch.randn(48, 64, device=DEV)
    ref = _layer_run(layer, x, dy, "reference", monkeypatch)
    calls = []  # at these shapes the two paths can agree bit for bit: prove the kernels really ran
    gemm, quant = kb.triton_block_gemm_fp4, kq.triton_quantize_block
    monkeypatch.setattr(kb, "triton_block_gemm_fp4", lambda *a, **kw: calls.append("gemm") or gemm(*a, **kw))
    monkeypatch.setattr(kq, "triton_quantize_block", lambda *a, **kw: calls.append("quant") or quant(*a, **kw))
    got = _layer_run(layer, x, dy, "triton", monkeypatch)
    assert calls.count("gemm") == 3, "fprop, dgrad and wgrad must each run the Triton block GeMM"
    assert calls.count("quant") == 6, "each GeMM operand must be quantized by the Triton quantizer"
    for name, g, r in zip(("y", "dx", "dw"), got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        above(sqnr(g, r), LINEAR_PATHS_MIN_SQNR_DB, f"{name} SQNR dB, Triton vs reference path")


def test_fp4linear_block_triton_is_the_kernel_on_the_quantized_operands(monkeypatch):
    """Round-to-nearest NVFP4 (2-D weight tiles): each output is exactly the Triton block GeMM of the
    quantized operands, so the layer adds nothing of its own to the kernel's result."""
    from fp4lightning import FP4Config
    from fp4lightning.numerics.block_formats import quantize_block

    cfg = FP4Config.from_preset("nvfp4", stochastic_rounding=(), rht_wgrad=False)
    assert cfg.weight_block_2d
    layer = _block_layer(cfg, k=128, n=64)
    x, dy = heavy_tailed(48, 128).to(DEV), torch.randn(48, 64, device=DEV)
    y, dx, dw = _layer_run(layer, x, dy, "triton", monkeypatch)
    w = layer.weight.detach()

    def kernel(a, b, b_tiles=False):
        qa, qb = quantize_block(a, "nvfp4"), quantize_block(b, "nvfp4", block_2d=b_tiles)
        sb = qb.scales.repeat_interleave(16, 0)[: qb.shape[0]].contiguous() if b_tiles else qb.scales
        return kb.triton_block_gemm(qa.codes, qa.scales, qb.codes, sb, "nvfp4", qa.global_scale * qb.global_scale)

    assert torch.equal(y, kernel(x, w, b_tiles=True) + layer.bias.detach())
    assert torch.equal(dx, kernel(dy, w.t().contiguous(), b_tiles=True))
    assert torch.equal(dw, kernel(dy.t().contiguous(), x.t().contiguous()))


# --------------------------------------------------------------------------- quantizers of every layout
# kernels/block_quantize.py: the block layer's quantizer on CUDA. Bit for bit the reference's codes, block
# scales, global scale and stochastic draws (the same seed), whatever the input's strides and K.
QUANT_CASES = [("nvfp4", False), ("nvfp4", True), ("mxfp4", False)]


def _wide_range(m, k, dtype, huge=False):
    """Fresh random values over ~25 binades per row, an all-zero block, an fp32 subnormal, a tiny row."""
    x = heavy_tailed(m, k) * torch.exp(torch.randn(m, 1) * 3)
    x[0, :32] = 0
    x[1, 3] = 1e-40
    x[3] *= 1e-30
    if huge:
        x[2, 5] = 3e38
    return x.to(dtype)


def _host(q: BlockFP4) -> BlockFP4:
    g = None if q.global_scale is None else q.global_scale.cpu()
    return BlockFP4(q.codes.cpu(), q.scales.cpu(), g, q.fmt, q.block_2d, q.shape, q.post_scale)


def _assert_same(got: BlockFP4, ref: BlockFP4, nan_blocks_exact: bool = True):
    got = _host(got)
    assert (got.fmt, got.block_2d, got.shape, got.post_scale) == (ref.fmt, ref.block_2d, ref.shape, ref.post_scale)
    assert torch.equal(got.scales.view(torch.uint8), ref.scales.view(torch.uint8)), "block scales"
    assert (got.global_scale is None) == (ref.global_scale is None)
    if ref.global_scale is not None:
        assert torch.equal(got.global_scale, ref.global_scale), "global scale"
    codes, want = got.codes, ref.codes
    if not nan_blocks_exact:  # a GPU's NaN has one sign: the code's sign bit in a NaN-scaled block may differ
        keep = ref.block_scales_fp32().isnan().logical_not()
        keep = keep.repeat_interleave(ref.block // 2, 1)
        keep = keep.repeat_interleave(ref.block, 0)[: ref.shape[0]] if ref.block_2d else keep
        codes, want = codes[keep], want[keep]
    assert torch.equal(codes, want), "codes"


def _to_dev(t):
    return None if t is None else t.to(DEV)


def _seed():
    """A fresh stochastic-rounding seed, as the layer draws it on CPU."""
    return sr_seed(torch.Generator().manual_seed(int(torch.randint(1 << 62, ()))), torch.device("cpu"))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt, block_2d", QUANT_CASES)
def test_block_quantizer_bitwise_any_layout(fmt, block_2d, rounding):
    seed = _seed() if rounding == "stochastic" else None
    # (dtype, M, K, read transposed, a value near the fp32 maximum): K a multiple of the block and not,
    # row- and column-major, bf16 and fp32
    for dtype, m, k, transposed, huge in ((torch.float32, 37, 80, False, False), (torch.bfloat16, 24, 64, True, False),
                                          (torch.float32, 40, 33, True, True)):
        x = _wide_range(m, k, dtype, huge)
        src = x.t().contiguous().t() if transposed else x  # the same values, column-major
        got = kq.triton_quantize_block(src.to(DEV), fmt, rounding, block_2d, seed=_to_dev(seed))
        _assert_same(got, quantize_block(x, fmt, rounding, block_2d=block_2d, seed=seed))


@pytest.mark.parametrize("fmt, block_2d", QUANT_CASES)
def test_block_quantizer_nan_and_inf_as_the_reference(fmt, block_2d):
    """NaN blocks get the format's NaN scale; an inf makes NVFP4's global scale inf (its block's scale
    inf / inf = NaN, every other block's values 0); NaN anywhere makes the global scale 1; all zeros too."""
    pos_nan, neg_nan = float("nan"), torch.tensor(float("-inf")) + float("inf")  # the second: the sign bit set
    cases = {"nan": [(1, 5, pos_nan), (20, 40, pos_nan)], "-nan": [(1, 5, -pos_nan), (3, 3, neg_nan)],
             "inf": [(2, 7, float("inf"))], "-inf, nan": [(30, 60, float("-inf")), (9, 9, pos_nan)], "zeros": []}
    for i, (name, cells) in enumerate(cases.items()):
        x = torch.randn(40, 64) * (0 if name == "zeros" else 1)
        for r, c, v in cells:
            x[r, c] = v
        xd = x.to((torch.float32, torch.bfloat16)[i % 2])
        for rounding in ("nearest", "stochastic"):
            seed = _seed() if rounding == "stochastic" else None
            got = kq.triton_quantize_block(xd.to(DEV), fmt, rounding, block_2d, seed=_to_dev(seed))
            _assert_same(got, quantize_block(xd, fmt, rounding, block_2d=block_2d, seed=seed), DEV == "cpu")


@pytest.mark.parametrize("fmt, block_2d", QUANT_CASES)
def test_device_derived_seed_is_sr_seed_from_checksum(fmt, block_2d):
    """``seed_base=``: the kernel derives the seed from the stats pass' checksum on the device, the bits of
    block_formats.sr_seed_from_checksum; the stats of the transposed tensor (dgrad's W^T reusing the
    forward's) and any number of programs give the same result."""
    x = _wide_range(40, 64, torch.bfloat16)
    base = int(torch.randint(1 << 62, ()))
    checksum = x.view(torch.int16).to(torch.int64).sum()
    ref = quantize_block(x, fmt, "stochastic", block_2d=block_2d, seed=sr_seed_from_checksum(base, checksum))
    xd = x.to(DEV)
    _assert_same(kq.triton_quantize_block(xd, fmt, "stochastic", block_2d, seed_base=base), ref)
    _assert_same(kq.triton_quantize_block(xd, fmt, "stochastic", block_2d, seed_base=base, programs=1), ref)
    stats = kq.triton_block_stats(xd.t(), programs=3)
    _assert_same(kq.triton_quantize_block(xd, fmt, "stochastic", block_2d, seed_base=base, stats=stats), ref)
    with pytest.raises(ValueError, match="exactly one of seed= and seed_base="):
        kq.triton_quantize_block(xd, fmt, "stochastic", block_2d)


@pytest.mark.parametrize("fmt, block_2d, sr", [("nvfp4", True, False), ("mxfp4", False, True)])
def test_block_gemm_fp4_is_the_kernel_with_its_factor(fmt, block_2d, sr):
    """triton_block_gemm_fp4 (tile scales read in place, the factor in the epilogue) == ops.gemm.block_gemm's
    way: per-row scales, then ``y * factor`` in torch, bit for bit."""
    a, w = _wide_range(40, 96, torch.float32), torch.randn(24, 96)
    rounding = "stochastic" if sr else "nearest"
    qa = quantize_block(a, fmt, rounding, seed=_seed() if sr else None)
    qw = quantize_block(w, fmt, rounding, block_2d=block_2d, seed=_seed() if sr else None)
    sw = qw.scales.repeat_interleave(16, 0)[:24].contiguous() if block_2d else qw.scales
    fa, fw = (q.post_scale if q.global_scale is None else q.global_scale * q.post_scale for q in (qa, qw))
    f = fa * fw
    dev = [t.to(DEV) for t in (qa.codes, qa.scales, qw.codes, sw)]
    want = kb.triton_block_gemm(*dev, fmt, f.to(DEV) if isinstance(f, torch.Tensor) else f, block_m=32, block_n=32)
    got = kb.triton_block_gemm_fp4(*(_on_dev(q) for q in (qa, qw)), block_m=32, block_n=32)
    assert torch.equal(got, want)


def _on_dev(q: BlockFP4) -> BlockFP4:
    g = None if q.global_scale is None else q.global_scale.to(DEV)
    return BlockFP4(q.codes.to(DEV), q.scales.to(DEV), g, q.fmt, q.block_2d, q.shape, q.post_scale)


# --------------------------------------------------------------------------- launches of the CUDA path
def _roofline():
    """benchmarks/roofline.py, loaded once by path (as tests/test_roofline.py and test_fused_launches.py do)."""
    if "roofline" not in sys.modules:
        spec = importlib.util.spec_from_file_location("roofline", Path(__file__).resolve().parents[1] / "benchmarks"
                                                      / "roofline.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["roofline"] = mod  # dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["roofline"]


#: CUDA kernel launches of one forward + backward of a block FP4Linear (bias, bf16 autocast, weight quantized
#: in it), as benchmarks/roofline.py traces the CUDA path: measured 23 / 14 / 22 (the eager PyTorch quantizers
#: made 382 + 2 host syncs / 295 / 404 + 4 host syncs)
BLOCK_LAUNCH_BUDGET = {"nvfp4": 24, "mxfp4": 15, "mxfp4-rht-sr": 23}


@pytest.mark.parametrize("preset", list(BLOCK_LAUNCH_BUDGET))
def test_block_layer_cuda_path_launches_and_never_waits_for_the_host(preset):
    launches = _roofline().trace_layer(preset, 256, 256, 512)
    rf = _roofline()
    assert rf.count_host_syncs(launches) == 0, [x.name for x in launches if x.kind == "sync"]
    assert rf.count_launches(launches) <= BLOCK_LAUNCH_BUDGET[preset], rf.launch_table(launches)
    kernels = [x.name for x in launches if x.name.startswith("triton.")]
    assert kernels.count("triton._block_gemm_kernel") == 3 and kernels.count("triton._block_quant_kernel") == 6
