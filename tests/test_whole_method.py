"""The paper's whole method from a recipe: ``optimizer.states`` (AdamW's moments in reduced precision) and
``trainer.grad_comm`` (the data-parallel gradient format, and on one device its rounding,
fp4lightning.distributed.grad_comm_sim) reach the optimizer, the strategy and the checkpoints; ``--resume`` keeps them;
one device rounds its gradients as a two-process exchange does; FSDP2 shards reduced-precision states."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from fp4lightning.distributed.comm import CommState, hook_for_format
from fp4lightning.distributed.grad_comm_sim import GradCommSimulation, round_trip_
from fp4lightning.lightning.optim import LowPrecisionAdamW
from fp4lightning.train.recipe import GRAD_COMM, OPTIMIZER_STATES, WIRE_FORMAT, load_recipe

ROOT = Path(__file__).parents[1]
RECIPES = ROOT / "recipes"

pytestmark = [pytest.mark.usefixtures("one_thread"),  # see conftest.py
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*")]  # Lightning's, on every fit


# ----------------------------------------------------------------------------- recipes and wiring
def test_schema_defaults_keep_the_old_training():
    """No key set: torch's AdamW, no gradient rounding on one device, Lightning's own strategy string."""
    from fp4lightning.train.callbacks import grad_comm_simulation
    from fp4lightning.train.run import make_module, make_strategy

    cfg = load_recipe(None, ["trainer.accelerator=cpu"])
    assert (cfg.optimizer.states, cfg.trainer.grad_comm) == ("fp32", "fp32")
    assert grad_comm_simulation(cfg) == [] and make_strategy(cfg) == "auto"
    module = make_module(cfg)
    module.configure_model()
    assert type(module.configure_optimizers()["optimizer"]) is torch.optim.AdamW
    for name in ("tiny", "small"):  # their results in docs/results.md were trained so
        cfg = load_recipe(RECIPES / f"{name}.yaml")
        assert (cfg.optimizer.states, cfg.trainer.grad_comm) == ("fp32", "fp32"), name


@pytest.mark.parametrize("name", ["llama2-1.3b", "llama2-7b", "llama2-13b"])
def test_paper_recipes_use_the_whole_method(name):
    """FP16 states (the paper's text) and FP8 E4M3 gradients, through DDP's hook or FSDP's reduce-scatter."""
    from fp4lightning.train.run import make_module, make_strategy
    from fp4lightning.lightning.strategy import FP4DDPStrategy, FP4FSDPStrategy

    cfg = load_recipe(RECIPES / f"{name}.yaml")
    assert (cfg.optimizer.states, cfg.trainer.grad_comm) == ("fp16", "fp8-e4m3")
    strategy = make_strategy(cfg)
    assert isinstance(strategy, FP4FSDPStrategy if cfg.trainer.strategy == "fsdp" else FP4DDPStrategy)
    assert strategy.grad_format == "e4m3"
    cfg = load_recipe(RECIPES / f"{name}.yaml", ["model.name=tiny", "data.seq_len=256"])  # small enough to build
    module = make_module(cfg)
    module.configure_model()
    opt = module.configure_optimizers()["optimizer"]
    assert isinstance(opt, LowPrecisionAdamW)
    assert {(g["exp_avg_format"], g["exp_avg_sq_format"]) for g in opt.param_groups} == {("fp16", "fp16")}


@pytest.mark.parametrize("comm,precision,expect", [
    ("fp8-e5m2", "fp4", ("FP4DDPStrategy", "e5m2")),
    ("fp32", "fp4", ("FP4DDPStrategy", "fp32")),  # an FP4 run no longer sends FP8 unless the recipe says so
    ("bf16", "bf16-mixed", ("FP4DDPStrategy", "bf16")),
    ("fp32", "bf16-mixed", ("str", "ddp")),  # Lightning's DDP, as before
])
def test_grad_comm_picks_the_ddp_wire_format(comm, precision, expect):
    from fp4lightning.train.callbacks import grad_comm_simulation
    from fp4lightning.train.run import make_strategy

    cfg = load_recipe(None, ["trainer.devices=2", "trainer.strategy=ddp", "data.micro_batch_size=8",
                             f"trainer.grad_comm={comm}", f"trainer.precision={precision}"])
    s = make_strategy(cfg)
    assert (type(s).__name__, s if isinstance(s, str) else s.grad_format) == expect
    assert grad_comm_simulation(cfg) == []  # two devices: the hook rounds


def test_wire_formats_are_comms():
    from fp4lightning.distributed.comm import WIRE_FORMATS

    assert set(WIRE_FORMAT.values()) == set(WIRE_FORMATS) and tuple(WIRE_FORMAT) == GRAD_COMM
    assert GradCommSimulation(WIRE_FORMAT["fp8-e4m3"]).fmt == "e4m3"


@pytest.mark.parametrize("states,formats", [("fp16", ("fp16", "fp16")), ("fp8-fp16", ("fp8", "fp16"))])
def test_optimizer_states_build_low_precision_adamw(states, formats):
    from fp4lightning.train.run import make_module

    assert states in OPTIMIZER_STATES
    for precision in ("fp4", "bf16-mixed"):  # the module builds it: every precision and strategy gets it
        module = make_module(load_recipe(None, [f"optimizer.states={states}", f"trainer.precision={precision}"]))
        module.configure_model()
        opt = module.configure_optimizers()["optimizer"]
        assert isinstance(opt, LowPrecisionAdamW)
        assert [(g["exp_avg_format"], g["exp_avg_sq_format"]) for g in opt.param_groups] == [formats] * 2
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # as torch's AdamW groups


# ----------------------------------------------------------------------------- one device = the exchange
@pytest.mark.parametrize("fmt,scheme", [("e4m3", "async_all_gather"), ("e4m3", "reduce_scatter"),
                                        ("e5m2", "async_all_gather"), ("e5m2", "reduce_scatter"),
                                        ("bf16", "auto")])
def test_round_trip_is_the_hooks_result_at_one_rank(world_of_one, fmt, scheme):
    """A real DDP model whose buckets hold several tensors of odd sizes: what the communication hook
    hands back at one rank is ``round_trip_`` of each gradient, bit for bit (same scales, same codes)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 65), nn.ReLU(), nn.Linear(65, 7))  # 2,209 + 462 + 7 ... elements
    ddp = nn.parallel.DistributedDataParallel(model)
    state = CommState(fmt, scheme=scheme)
    ddp.register_comm_hook(state, hook_for_format(fmt, scheme, world_size=1))
    x, y = torch.randn(8, 33) * 1e3, torch.randint(0, 7, (8,))  # large: FP8's range is used
    with ddp.no_sync():
        nn.functional.cross_entropy(ddp(x), y).backward()
    want = [round_trip_(p.grad.detach().clone(), fmt) for p in model.parameters()]
    raw = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(ddp(x), y).backward()
    assert state.buckets >= 1
    for p, w, r in zip(model.parameters(), want, raw):
        assert torch.equal(p.grad, w)
    assert any(not torch.equal(w, r) for w, r in zip(want, raw))  # the round trip does round


def test_round_trip_keeps_nonfinite_and_zero_gradients():
    g = torch.tensor([1.0, float("nan"), 3.0])
    assert torch.equal(round_trip_(g.clone(), "e4m3").isnan(), g.isnan())
    assert torch.equal(round_trip_(torch.zeros(5), "e4m3"), torch.zeros(5))
    t = torch.randn(6, 4).t()  # not contiguous: written back
    want = round_trip_(t.contiguous(), "e5m2")
    assert torch.equal(round_trip_(t, "e5m2"), want) and torch.equal(t, want)
    with pytest.raises(ValueError, match="e4m3"):
        round_trip_(g, "fp8")


#: one model, the roles: ``ddp`` trains one SGD step over 2 gloo processes (the script; Lightning starts
#: rank 1) with FP4DDPStrategy(grad_format=FMT), every rank on the same batch (no distributed sampler);
#: ``ddp-split`` the same with each rank on its half of the batch (rank r the samples r, r + 2, ...);
#: ``sim`` / ``plain`` train it on one device on the whole batch (in the test's process) with / without
#: the simulation; ``half0`` / ``half1`` on one device on one rank's half, unrounded.
#: Each writes its first update (ROLE.json) and the gradient the optimizer stepped with (ROLE.grad.json).
ONE_STEP = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {root!r})
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from fp4lightning.distributed.grad_comm_sim import GradCommSimulation
    from fp4lightning.lightning.strategy import FP4DDPStrategy


    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            # SGD: the update is -lr x the gradient, so the step shows the synchronised gradient itself
            return torch.optim.SGD(self.parameters(), lr=0.5)


    class Grads(L.Callback):  # after the simulation's callback: the gradient the optimizer steps with
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads = [p.grad.detach().clone() for p in pl_module.parameters()]


    def run(out, role, fmt):
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        if role.startswith("half") or role == "ddp-split":  # Lightning starts rank 1 with LOCAL_RANK=1
            k = int(role[-1]) if role.startswith("half") else int(os.environ.get("LOCAL_RANK", 0))
            x, y = x[k::2], y[k::2]
        data = DataLoader(TensorDataset(x, y), batch_size=len(x))
        model = M()
        before = [p.detach().clone() for p in model.parameters()]
        ddp = role.startswith("ddp")
        grads = Grads()
        trainer = L.Trainer(accelerator="cpu", devices=2 if ddp else 1, max_steps=1, logger=False,
                            strategy=FP4DDPStrategy(grad_format=fmt) if ddp else "auto",
                            callbacks=[GradCommSimulation(fmt)] * (role == "sim") + [grads],
                            use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(model, data)
        if trainer.is_global_zero:
            update = [(p.detach() - b).tolist() for p, b in zip(model.parameters(), before)]
            json.dump(update, open(os.path.join(out, role + ".json"), "w"))
            json.dump([t.tolist() for t in grads.grads], open(os.path.join(out, role + ".grad.json"), "w"))


    if __name__ == "__main__":
        torch.set_num_threads(1)
        run(*sys.argv[1:])
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_env() -> dict:
    leaked = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR"}
    env = {k: v for k, v in os.environ.items() if k not in leaked and not k.startswith(("PL_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    return env


def _one_step_roles(tmp_path: Path, ddp_role: str, one_device_roles: tuple[str, ...]) -> None:
    """ONE_STEP's ``ddp_role`` over 2 gloo processes, then each one-device role in this process (the same
    module and data); each writes its ROLE.json and ROLE.grad.json into ``tmp_path``."""
    script = tmp_path / "one_step.py"
    script.write_text(ONE_STEP.format(root=str(ROOT)))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), ddp_role, "e4m3"], env=_ddp_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    here: dict = {}
    exec(compile(script.read_text(), str(script), "exec"), here)
    for role in one_device_roles:
        here["run"](str(tmp_path), role, "e4m3")


def _e4m3_error_bound(g: torch.Tensor) -> torch.Tensor:
    """Per element, the most the exchange's E4M3 round trip of ``g`` (one power-of-two scale for the tensor)
    can move it: half a step, 2^-4 of the value for normals, 2^-10 / scale in the subnormal range."""
    from fp4lightning.distributed.fp8_codec import pow2_scales, tensor_amax

    scale = pow2_scales(tensor_amax(g.reshape(-1)).view(1), 448.0)[0]
    return torch.maximum(g.abs() * 2.0**-4, torch.full_like(g, 2.0**-10) / scale)


@pytest.mark.slow
def test_one_device_simulation_against_ddp_with_different_data_per_rank(tmp_path):
    """What the one-device simulation models and what it does not, with each rank on its own half of the batch
    (real DDP: 2 gloo processes, FP8 E4M3 on the wire).

    The 2-rank exchange returns the mean of the two ranks' rounded gradients, (Q(g0) + Q(g1)) / 2, with g0, g1
    the gradients of the halves (each rank its own power-of-two scale): checked to fp32 rounding. The
    one-device simulation rounds the mean gradient once, Q((g0 + g1) / 2): another rounding of the same
    scheme, not the same bits. Both stay within the exchange's error bound of the exact mean gradient (half
    an E4M3 step per element, per rank for DDP); the two differ from each other by about as much as each
    differs from the exact gradient (the relative norms are printed)."""
    _one_step_roles(tmp_path, "ddp-split", ("sim", "plain", "half0", "half1"))
    grads = {r: [torch.tensor(t) for t in json.loads((tmp_path / f"{r}.grad.json").read_text())]
             for r in ("ddp-split", "sim", "plain", "half0", "half1")}
    diff = {"ddp-sim": 0.0, "sim-exact": 0.0, "ddp-exact": 0.0}
    norm = 0.0
    for ddp, sim, exact, g0, g1 in zip(*(grads[r] for r in ("ddp-split", "sim", "plain", "half0", "half1"))):
        per_rank = (round_trip_(g0.clone(), "e4m3") + round_trip_(g1.clone(), "e4m3")) / 2
        torch.testing.assert_close(ddp, per_rank, rtol=1e-6, atol=1e-9)  # what DDP computes
        torch.testing.assert_close((g0 + g1) / 2, exact, rtol=1e-5, atol=1e-8)  # the halves make the batch
        assert bool(((sim - exact).abs() <= _e4m3_error_bound(exact) * 1.0001 + 1e-9).all())
        bound = (_e4m3_error_bound(g0) + _e4m3_error_bound(g1)) / 2
        assert bool(((ddp - exact).abs() <= bound * 1.0001 + 1e-6 * exact.abs() + 1e-9).all())
        diff["ddp-sim"] += float((ddp - sim).pow(2).sum())
        diff["sim-exact"] += float((sim - exact).pow(2).sum())
        diff["ddp-exact"] += float((ddp - exact).pow(2).sum())
        norm += float(exact.pow(2).sum())
    rel = {k: (v / norm) ** 0.5 for k, v in diff.items()}
    print("relative gradient differences (norm):", {k: f"{100 * v:.2f}%" for k, v in rel.items()})
    assert rel["ddp-sim"] > 0  # not the same bits: the simulation rounds the mean, DDP each rank's part
    assert rel["ddp-sim"] <= rel["sim-exact"] + rel["ddp-exact"] + 1e-9


@pytest.mark.slow
def test_one_device_rounds_as_the_two_process_exchange(tmp_path):
    """The first update of a 2-process gloo run (FP4DDPStrategy, FP8 E4M3 on the wire) and of a one-device
    run with GradCommSimulation, both on the same batch: equal bit for bit.

    Tolerance zero, argued: with identical data every rank holds the same gradient g, so the exchange
    (async all-gather at W = 2: each rank's own power-of-two scale, E4M3 codes, decoded, summed in rank
    order, halved) returns (Q(g) + Q(g)) / 2 = Q(g) exactly: no sum order is left to differ, and Q is
    comm.py's encoder and decoder on both sides. Without the simulation the one-device update differs
    (the test can fail). With different data per rank the two runs round at different places (the mean
    of the rounded halves against the rounded mean): the same error bound, half an E4M3 step per element."""
    _one_step_roles(tmp_path, "ddp", ("sim", "plain"))
    ddp, sim, plain = (json.loads((tmp_path / f"{r}.json").read_text()) for r in ("ddp", "sim", "plain"))
    assert ddp == sim
    assert ddp != plain


# ----------------------------------------------------------------------------- pretraining and --resume
@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """2 steps of the test LLaMA with E4M3 first moments and FP8 E4M3 gradient rounding on one device."""
    import lightning as L

    from fp4lightning.train.run import train
    from tests.test_data import prepared_test_corpus
    from tests.test_train import tiny_overrides

    class Grads(L.Callback):  # added after the recipe's callbacks: sees what the optimizer will use
        grads: list = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()
                               if p.grad is not None})
            self.optimizer = optimizer

    corpus = prepared_test_corpus(tmp_path_factory)
    out = tmp_path_factory.mktemp("whole")
    overrides = tiny_overrides(corpus, out, "schedule.max_steps=2", "trainer.val_every_n_steps=2",
                               "optimizer.states=fp8-fp16", "trainer.grad_comm=fp8-e4m3")
    rec = Grads()
    result = train(load_recipe(None, overrides), callbacks=[rec])
    return result, rec, overrides, corpus


@pytest.mark.slow
def test_recipe_run_trains_with_the_whole_method(whole_run):
    result, rec, _, _ = whole_run
    assert len(rec.grads) == 2
    for grads in rec.grads:
        for name, g in grads.items():  # every gradient on its tensor's E4M3 grid (one scale per tensor)
            assert torch.equal(round_trip_(g.clone(), "e4m3"), g), name
    opt = rec.optimizer.optimizer if hasattr(rec.optimizer, "optimizer") else rec.optimizer
    assert isinstance(opt, LowPrecisionAdamW)
    ckpt = torch.load(result.checkpoint, weights_only=True)
    state = next(iter(ckpt["optimizer_states"][0]["state"].values()))
    assert state["exp_avg_q"].dtype == torch.float8_e4m3fn and state["exp_avg_sq_q"].dtype == torch.float16
    recipe = ckpt["hyper_parameters"]["recipe"]
    assert (recipe["optimizer"]["states"], recipe["trainer"]["grad_comm"]) == ("fp8-fp16", "fp8-e4m3")


@pytest.mark.slow
@pytest.mark.parametrize("change,key", [("optimizer.states=fp32", "optimizer.states"),
                                        ("optimizer.states=fp16", "optimizer.states"),
                                        ("trainer.grad_comm=fp8-e5m2", "trainer.grad_comm")])
def test_resume_refuses_a_changed_method_key(whole_run, change, key):
    from fp4lightning.train.resume import ResumeMismatchError
    from fp4lightning.train.run import build

    _, _, overrides, _ = whole_run
    with pytest.raises(ResumeMismatchError, match=rf"{key} = '[\w-]+' in the checkpoint, '[\w-]+' now.*"
                                                  rf"Resume with the settings that wrote it \({key}="):
        build(load_recipe(None, [*overrides, change]), resume=True)


@pytest.mark.slow
def test_checkpoint_from_before_the_keys_resumes_with_a_note(whole_run, tmp_path, capsys):
    """The keys removed from a checkpoint's recorded recipe (as one written before them): it trained with
    fp32 states and, on one device, fp32 gradients; a recipe saying so resumes with a note, one that
    changes them is refused naming the inferred key."""
    from fp4lightning.train.resume import ResumeMismatchError, check_resumable, recorded_method_keys

    result, _, overrides, _ = whole_run
    ckpt = torch.load(result.checkpoint, weights_only=True)
    del ckpt["hyper_parameters"]["recipe"]["optimizer"]["states"]
    del ckpt["hyper_parameters"]["recipe"]["trainer"]["grad_comm"]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    base = [o for o in overrides if not o.startswith(("optimizer.states", "trainer.grad_comm"))]
    check_resumable(old, load_recipe(None, base))
    err = capsys.readouterr().err
    assert "does not record optimizer.states, trainer.grad_comm" in err and "optimizer.states=fp32" in err
    with pytest.raises(ResumeMismatchError, match=r"optimizer.states = 'fp32' in the checkpoint \(not recorded"):
        check_resumable(old, load_recipe(None, overrides))
    # several devices, FP4, DDP: fp4lightning.Trainer sent FP8 E4M3 before the key existed
    legacy = {"trainer": {"precision": "fp4", "devices": 2, "num_nodes": 1, "strategy": "ddp"}}
    assert recorded_method_keys(legacy) == ({"optimizer.states": "fp32", "trainer.grad_comm": "fp8-e4m3"},
                                            ["optimizer.states", "trainer.grad_comm"])
    legacy["trainer"]["strategy"] = "fsdp"
    assert recorded_method_keys(legacy)[0]["trainer.grad_comm"] == "fp32"


# ----------------------------------------------------------------------------- FSDP2: sharded states
def _fsdp_states(rank, out_dir):
    """LowPrecisionAdamW on FSDP2-sharded parameters (DTensors) against the unsharded model, same batch on
    both ranks: FP16 states give the same parameters and states bit for bit (the per-tensor scale is the
    amax over both shards); they survive torch's distributed optimizer state dict (what Lightning's FSDP
    checkpoints use); FP8 first moments get the unsharded scale."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from fp4lightning.distributed.fsdp import fully_shard_fp4
    from tests.test_fsdp import _full, _loss, _model

    res = {}
    data = torch.randint(0, 256, (3, 2, 17), generator=torch.Generator().manual_seed(3))
    for states in ("fp16", "fp8-fp16"):
        m_fmt = "fp8" if states == "fp8-fp16" else "fp16"
        base = _model("fp4-no-dge", 0)
        ref = copy.deepcopy(base)
        sharded = fully_shard_fp4(copy.deepcopy(base), fp4_all_gather=False)
        opts = [LowPrecisionAdamW(m.parameters(), lr=1e-2, exp_avg_format=m_fmt) for m in (ref, sharded)]
        steps = 1 if states == "fp8-fp16" else len(data)  # FP8: stochastic rounding draws per shard
        for batch in data[:steps]:
            for m, opt in zip((ref, sharded), opts):
                _loss(m, batch).backward()
                opt.step()
                opt.zero_grad()
        sp = [_full(p) for p in sharded.parameters()]
        st = [opts[1].state[p] for p in sharded.parameters()]
        rt = [opts[0].state[p] for p in ref.parameters()]
        r = {"params_equal": all(torch.equal(a, b) for a, b in zip(sp, ref.parameters())),
             "m_scales_equal": all(torch.equal(a["exp_avg_scale"], b["exp_avg_scale"]) for a, b in zip(st, rt)),
             "v_equal": all(torch.equal(_full(a["exp_avg_sq_q"]), b["exp_avg_sq_q"]) for a, b in zip(st, rt)),
             "m_dtype": str(st[0]["exp_avg_q"].dtype), "sharded": type(st[0]["exp_avg_q"]).__name__}
        if states == "fp16":
            osd = get_optimizer_state_dict(sharded, opts[1])
            again = LowPrecisionAdamW(sharded.parameters(), lr=1e-2, exp_avg_format=m_fmt)
            set_optimizer_state_dict(sharded, again, osd)
            r["state_dict_round_trip"] = all(
                torch.equal(_full(again.state[p][k]), _full(opts[1].state[p][k]))
                for p in sharded.parameters() for k in ("exp_avg_q", "exp_avg_sq_q", "exp_avg_scale"))
        res[states] = r
    return res


@pytest.mark.slow
def test_fsdp_shards_reduced_precision_states(tmp_path):
    from tests.test_fsdp import _spawn

    r0, r1 = _spawn(_fsdp_states, tmp_path)
    for r in (r0, r1):
        assert r["fp16"]["params_equal"] and r["fp16"]["v_equal"] and r["fp16"]["m_scales_equal"], r
        assert r["fp16"]["state_dict_round_trip"] and r["fp16"]["sharded"] == "DTensor", r
        assert r["fp8-fp16"]["m_scales_equal"] and r["fp8-fp16"]["m_dtype"] == "torch.float8_e4m3fn", r
    assert r0 == r1


def _fsdp_recipe_run(rank, out_dir, corpus):
    """`fp4lightning train` with trainer.strategy=fsdp on one device, FP16 states and FP8 E4M3 gradients (the
    7B / 13B recipes' method): trains, writes its sharded checkpoint and resumes from it."""
    import lightning as L

    from fp4lightning.train.run import train
    from tests.test_train import tiny_overrides

    res = {"on_grid": [], "optimizer": None}

    class Seen(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            opt = getattr(optimizer, "optimizer", optimizer)
            res["optimizer"] = type(opt).__name__
            res["on_grid"].append(all(
                torch.equal(round_trip_(p.grad.to_local().clone(), "e4m3"), p.grad.to_local())
                for p in pl_module.parameters() if p.grad is not None))

    overrides = tiny_overrides(corpus, os.path.join(out_dir, "run"), "trainer.strategy=fsdp",
                               "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2",
                               "optimizer.states=fp16", "trainer.grad_comm=fp8-e4m3")
    first = train(load_recipe(None, [*overrides, "schedule.max_steps=2"]), callbacks=[Seen()])
    again = train(load_recipe(None, [*overrides, "schedule.max_steps=3"]), resume=True, callbacks=[Seen()])
    res.update(first_loss=first.val_loss, resumed_loss=again.val_loss)
    return res


@pytest.mark.slow
def test_fsdp_recipe_trains_and_resumes_with_the_whole_method(tmp_path, tmp_path_factory):
    import functools
    import math

    from tests.test_data import prepared_test_corpus
    from tests.test_fsdp import _spawn

    corpus = prepared_test_corpus(tmp_path_factory)
    (r,) = _spawn(functools.partial(_fsdp_recipe_run, corpus=str(corpus)), tmp_path, world=1)
    # steps 1-2, then step 3 resumed from the sharded checkpoint (a restart would take 3 more)
    assert r["optimizer"] == "LowPrecisionAdamW" and r["on_grid"] == [True] * 3, r
    assert math.isfinite(r["first_loss"]) and math.isfinite(r["resumed_loss"]), r
