"""LowPrecisionAdamW's foreach path against its per-parameter loop: bitwise the same on CPU.

Both paths run the same elementwise ops with the same constants (torch's foreach ops on CPU apply
the per-tensor op to each tensor), and each FP8 moment draws its stochastic-rounding noise from the
same ``(seed, step, index)`` generator, so parameters, master copies, moment codes and scales must
agree bit for bit, not merely closely.
"""
import copy
import itertools

import pytest
import torch
from torch import nn

from fp4lightning.lightning.optim import LowPrecisionAdamW

FORMATS = [("fp8", "fp16"), ("fp16", "fp16"), ("fp32", "fp32")]
SHAPES = [(7, 5), (16,), (3, 4, 2), (), (33,)]
STEPS = 4
STATE_KEYS = ("exp_avg_q", "exp_avg_scale", "exp_avg_sq_q", "exp_avg_sq_scale", "master")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(_bits(a), _bits(b)), f"{what}: bits differ (max |diff| {(a.float() - b.float()).abs().max()})"


def _make_params(gen: torch.Generator, shapes=SHAPES, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(gen: torch.Generator, params, steps=STEPS, missing=()) -> list[list]:
    """``steps`` lists of gradients (fresh draws, scaled differently per step); ``missing`` holds the
    ``(step, parameter number)`` pairs that get no gradient."""
    out = []
    for t in range(steps):
        scale = 10.0 ** (t - 2)
        out.append([None if (t, i) in missing else (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)
                    for i, p in enumerate(params)])
    return out


def _run(params, groups_of, grads, foreach: bool, **kwargs):
    """Train copies of ``params`` on ``grads``; returns (params, optimizer)."""
    params = copy.deepcopy(params)
    opt = LowPrecisionAdamW(groups_of(params), foreach=foreach, **kwargs)
    if foreach:  # every plain, non-empty parameter must take the foreach path
        opt._update_one = _loop_only_for_empty_or_sharded(opt._update_one)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    return params, opt


def _loop_only_for_empty_or_sharded(update_one):
    def checked(p, group, index):
        assert p.numel() == 0 or hasattr(p, "device_mesh"), f"parameter {index} took the loop path"
        checked.indices.append(index)
        return update_one(p, group, index)
    checked.indices = []
    return checked


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _assert_same(run_a, run_b) -> None:
    (pa, oa), (pb, ob) = run_a, run_b
    for i, (a, b) in enumerate(zip(pa, pb)):
        _assert_bitwise(_full(a), _full(b), f"param {i}")
        sa, sb = oa.state.get(a, {}), ob.state.get(b, {})
        assert sa.keys() == sb.keys(), f"param {i}: state keys {sorted(sa)} vs {sorted(sb)}"
        assert sa.get("step") == sb.get("step"), f"param {i}: step {sa.get('step')} vs {sb.get('step')}"
        for key in STATE_KEYS:
            if key in sa:
                _assert_bitwise(_full(sa[key]), _full(sb[key]), f"param {i} {key}")


def _one_group(params):
    return params


# (moment formats, parameter dtype, master weights, stochastic rounding); the master copy exists only
# for bf16/fp16 parameters and stochastic rounding only for an FP8 first moment
CASES = [(f, d, m, s) for f, d, m, s in itertools.product(FORMATS, (torch.float32, torch.bfloat16),
                                                           (True, False), (True, False))
         if (d == torch.bfloat16 or m) and (f[0] == "fp8" or s)]


def _case_id(case) -> str:
    (m_fmt, v_fmt), dtype, master, stochastic = case
    return "-".join([f"{m_fmt}/{v_fmt}", str(dtype).removeprefix("torch."), "master" if master else "nomaster",
                     "sr" if stochastic else "nearest"])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_foreach_matches_loop_bitwise(case):
    formats, dtype, master, stochastic = case
    _check_foreach_matches_loop(formats, dtype, master, stochastic)


def _check_foreach_matches_loop(formats, dtype, master, stochastic):
    gen = torch.Generator().manual_seed(1234)
    params = _make_params(gen, dtype=dtype)
    grads = _grads(gen, params)
    kwargs = dict(lr=3e-2, weight_decay=0.1, exp_avg_format=formats[0], exp_avg_sq_format=formats[1],
                  master_weights=master, stochastic_rounding=stochastic, seed=7)
    loop = _run(params, _one_group, grads, foreach=False, **kwargs)
    fe = _run(params, _one_group, grads, foreach=True, **kwargs)
    _assert_same(loop, fe)
    if dtype == torch.bfloat16:
        assert ("master" in fe[1].state[fe[0][0]]) == master
    # the run must move the parameters, else equality would prove little
    assert not torch.equal(fe[0][0], params[0])


def _two_groups(params):
    return [{"params": params[:3], "lr": 2e-2, "exp_avg_format": "fp8", "exp_avg_sq_format": "fp16"},
            {"params": params[3:], "lr": 5e-3, "weight_decay": 0.0, "betas": (0.8, 0.95),
             "exp_avg_format": "fp16", "exp_avg_sq_format": "fp32"}]


def test_two_groups_late_gradients_and_mixed_dtypes():
    """Groups with their own lr, betas, weight decay and formats; fp32 and bf16 parameters in one
    group; a parameter without a gradient at step 1 (its step counter then lags the others') and one
    that misses step 3."""
    gen = torch.Generator().manual_seed(99)
    params = (_make_params(gen, shapes=[(6, 4), (5,), (2, 3)])
              + _make_params(gen, shapes=[(9,), (4, 4), (3,), (2, 5)]))
    params[1].data = params[1].data.bfloat16()
    params[4].data = params[4].data.bfloat16()
    params[6].data = params[6].data.double()
    grads = _grads(gen, params, steps=5, missing={(0, 2), (0, 5), (1, 5), (2, 0)})
    loop = _run(params, _two_groups, grads, foreach=False, weight_decay=0.05)
    fe = _run(params, _two_groups, grads, foreach=True, weight_decay=0.05)
    _assert_same(loop, fe)
    steps = [fe[1].state[p]["step"] for p in fe[0]]
    assert steps == [4, 5, 4, 5, 5, 3, 5]


def test_chunked_lists_match_loop(monkeypatch):
    """Lists cut at a small element budget (and a parameter over it alone) give the same bits."""
    monkeypatch.setattr("fp4lightning.lightning.optim._FOREACH_CHUNK_NUMEL", 40)
    gen = torch.Generator().manual_seed(5)
    params = _make_params(gen, shapes=[(10,), (20,), (15,), (64,), (3,), (30,)])
    grads = _grads(gen, params, steps=3)
    _assert_same(_run(params, _one_group, grads, foreach=False), _run(params, _one_group, grads, foreach=True))


def test_empty_parameter_and_non_finite_gradients():
    """An empty parameter takes the loop (no amax to take); a NaN and an inf in the gradients reach the
    moments and parameters the same way on both paths."""
    gen = torch.Generator().manual_seed(3)
    params = _make_params(gen, shapes=[(0,), (8,), (5,), (4, 2)])
    grads = _grads(gen, params, steps=3)
    grads[1][1][3] = float("nan")
    grads[2][2][0] = float("inf")
    loop = _run(params, _one_group, grads, foreach=False)
    fe = _run(params, _one_group, grads, foreach=True)
    _assert_same(loop, fe)
    assert fe[1]._update_one.indices == [0, 0, 0]
    assert torch.isnan(fe[0][1]).any()


def test_state_dict_from_foreach_resumes_in_loop_bit_exactly():
    gen = torch.Generator().manual_seed(11)
    params = _make_params(gen, shapes=[(6, 3), (7,), (2, 2)])
    params[1].data = params[1].data.bfloat16()
    grads = _grads(gen, params, steps=5, missing={(0, 2)})
    whole = _run(params, _one_group, grads, foreach=True, weight_decay=0.1, seed=3)
    first, opt = _run(params, _one_group, grads[:2], foreach=True, weight_decay=0.1, seed=3)
    saved = copy.deepcopy(opt.state_dict())
    resumed_params = copy.deepcopy(first)
    resumed = LowPrecisionAdamW(resumed_params, foreach=False, weight_decay=0.1, seed=3)
    resumed.load_state_dict(saved)
    for step_grads in grads[2:]:
        for p, g in zip(resumed_params, step_grads):
            p.grad = None if g is None else g.clone()
        resumed.step()
    _assert_same(whole, (resumed_params, resumed))
    assert "foreach" not in saved["param_groups"][0]


def test_default_is_the_loop_on_cpu():
    gen = torch.Generator().manual_seed(0)
    params = _make_params(gen, shapes=[(4,)])
    opt = LowPrecisionAdamW(params)
    assert opt.foreach is None

    def boom(*args):
        raise AssertionError("the foreach path ran for CPU parameters with foreach=None")
    opt._update_many = boom
    params[0].grad = torch.ones(4)
    opt.step()
    assert opt.state[params[0]]["step"] == 1


def test_sharded_parameters_take_the_loop(world_of_one):
    """With foreach=True a DTensor parameter is updated per parameter (its amax all-reduced over the
    shards) next to plain ones on the foreach path; the result is the loop's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(21)
    params = _make_params(gen, shapes=[(8, 3), (5,)])
    params.insert(1, nn.Parameter(distribute_tensor(torch.randn(6, 2, generator=gen), mesh, [Shard(0)])))
    grads = _grads(gen, params, steps=3)
    for step_grads in grads:
        step_grads[1] = distribute_tensor(step_grads[1], mesh, [Shard(0)])
    loop = _run(params, _one_group, grads, foreach=False)
    fe = _run(params, _one_group, grads, foreach=True)
    _assert_same(loop, fe)
    params_fe, opt_fe = fe
    assert opt_fe._update_one.indices == [1, 1, 1]  # the DTensor, once per step; the others on foreach
    for key in ("exp_avg_q", "exp_avg_sq_q"):
        assert hasattr(opt_fe.state[params_fe[1]][key], "device_mesh")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the default picks foreach for CUDA parameters")
def test_default_is_foreach_on_cuda():
    """CUDA parameters take the foreach path by default. CUDA's foreach kernels need not round every op
    as its per-op kernels do (a division by a host scalar, say), so the check against the loop is a
    bound here, not bitwise: after 3 steps of lr 1e-3 the parameters agree within one lr."""
    gen = torch.Generator().manual_seed(8)
    params = [nn.Parameter(p.data.cuda()) for p in _make_params(gen, shapes=[(64, 32), (32,), (128,)])]
    grads = [[g.cuda() for g in step] for step in _grads(gen, params, steps=3)]
    loop_params, _ = _run(params, _one_group, grads, foreach=False, lr=1e-3)
    fe_params = copy.deepcopy(params)
    opt = LowPrecisionAdamW(fe_params, lr=1e-3)
    opt._update_one = _loop_only_for_empty_or_sharded(opt._update_one)
    for step_grads in grads:
        for p, g in zip(fe_params, step_grads):
            p.grad = g.clone()
        opt.step()
    for a, b in zip(loop_params, fe_params):
        assert (a - b).abs().max().item() <= 1e-3


def test_foreach_step_reads_nothing_back_from_the_device():
    """No ``.item()``-like read and no upload of a Python number inside a foreach step: on a GPU either
    would stall the host once per step (tests/test_step_sync.py holds the whole step to one read)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(4)
    params = _make_params(gen, shapes=[(8, 4), (6,)])
    params[1].data = params[1].data.bfloat16()
    opt = LowPrecisionAdamW(params, foreach=True, weight_decay=0.1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
    names = {e.key for e in prof.key_averages()}
    assert "aten::_foreach_lerp_" in names
    assert not names & {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::lift_fresh"}
