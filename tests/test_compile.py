"""``trainer.compile``: each decoder block under ``torch.compile`` (``fp4lightning.models.llama.compile_blocks``).

RMSNorm, RoPE, the code around SDPA, SwiGLU and the residual adds compile; every FP4Linear is one graph
break (``fp4_linear`` is ``torch.compiler.disable``-d) and runs as it does eagerly. On CPU with
``backend="aot_eager"``: dynamo's graphs and AOTAutograd's forward/backward split, without a C++ build.
The CPU path's own compiled passes inside the FP4 layers run eagerly here (``FP4LIGHTNING_COMPILE=0``), so
every graph dynamo makes is a block's.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from fp4lightning.models.llama import Llama, LlamaConfig, compile_blocks, rope_cos_sin
from fp4lightning.nn.convert import convert_to_fp4
from fp4lightning.nn.linear import FP4Linear
from fp4lightning.train.module import LlamaLightningModule
from fp4lightning.train.recipe import RecipeError, load_recipe
from fp4lightning.train.run import make_module, precision_setup

ROOT = Path(__file__).parents[1]
VOCAB, T = 256, 16
CFG = LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=64)
#: the graphs of one block: its 7 FP4 linears (q, k, v, o, gate, up, down) run in sequence, each one break
GRAPHS_PER_BLOCK = 7 + 1
# Gradients against the eager model, relative L2 per parameter. The loss is bitwise eager's. The residual
# stream's gradient is not: it sums three terms at each block input (the residual branch, and the two uses
# of x inside RMSNorm, whose x.float() is x itself in fp32), and the graph break between the RMSNorm (first
# graph) and the residual add (a later graph) groups that sum differently; fp32 addition does not associate.
# Compiling RMSNorm and the add in one graph gives eager's bits. Measured (3 seeds x 3 batches): the
# embedding's gradient (the residual stream's, unquantized) 5.8e-8 to 6.2e-8 relative, every other gradient
# bitwise (the FP4 layers read dY through the FP8 quantizer, which absorbs a last-bit difference short of a
# rounding edge).
GRAD_RTOL = 1e-6


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test compiles from nothing; one thread (these matrices are too small to split, and the
    intra-op threads of a busy machine's cores wait on each other)."""
    monkeypatch.setenv("FP4LIGHTNING_COMPILE", "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()
    torch.set_num_threads(threads)


def _fp4_model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return convert_to_fp4(Llama(CFG), "paper")


def _batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (2, T + 1), generator=g) for _ in range(n)]


def _step(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward (bf16 autocast, as FP4Precision runs it) and backward; the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: _full(p.grad) for n, p in model.named_parameters()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def _assert_matches_eager(got, ref) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    worst = {n: _rel(grads[n], ref_grads[n]) for n in grads}
    assert max(worst.values()) <= GRAD_RTOL, {n: r for n, r in worst.items() if r}


def _break_reasons() -> list[str]:
    return list(counters["graph_break"])


# ----------------------------------------------------------------------------- structure
def test_a_block_breaks_only_at_its_fp4_layers():
    model = _fp4_model()
    block = model.layers[0]
    assert sum(isinstance(m, FP4Linear) for m in block.modules()) == GRAPHS_PER_BLOCK - 1
    x = torch.randn(2, T, CFG.dim)
    cos, sin = rope_cos_sin(T, CFG.head_dim, CFG.rope_theta, x.device)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch._dynamo.explain(block)(x, cos, sin)
    assert (out.graph_count, out.graph_break_count) == (GRAPHS_PER_BLOCK, GRAPHS_PER_BLOCK - 1)
    for r in out.break_reasons:
        assert "torch.compiler.disable" in r.reason and "fp4_linear" in r.reason, r.reason
        assert any(f.name == "forward" and f.filename.endswith("linear.py") for f in r.user_stack), r.user_stack
    # the same block in high precision is one graph: nothing else in it breaks
    torch._dynamo.reset()
    plain = Llama(CFG).layers[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch._dynamo.explain(plain)(x, cos, sin)
    assert (out.graph_count, out.graph_break_count) == (1, 0)


def test_compiled_fp4_model_matches_eager_and_compiles_once():
    eager = _fp4_model()
    model = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    assert compile_blocks(model, backend=counter) is model
    for i, batch in enumerate(_batches(3)):
        _assert_matches_eager(_step(model, batch), _step(eager, batch))
        # both blocks run the same 8 graphs (parameters are graph inputs); steps 2 and 3 (same shapes)
        # compile nothing more (a recompile would hand the backend a graph again)
        assert counter.frame_count == GRAPHS_PER_BLOCK, (i, counter.frame_count)
    reasons = _break_reasons()
    assert reasons and all("fp4_linear" in r for r in reasons), reasons


def test_fsdp_activation_checkpointing_wraps_the_compiled_blocks(world_of_one):
    """fully_shard_fp4 (one rank: no FP4 all-gather, but its activation checkpointing) after compile_blocks:
    the checkpoint wraps each compiled forward, so the blocks do compile. The other order would trace the
    checkpoint, whose body may not break, and run every block eagerly: compile_blocks refuses it."""
    from fp4lightning.distributed.fsdp import fully_shard_fp4

    eager = fully_shard_fp4(_fp4_model(), activation_checkpointing=True)
    model = _fp4_model()
    counter = CompileCounterWithBackend("aot_eager")
    fully_shard_fp4(compile_blocks(model, backend=counter), activation_checkpointing=True)
    for batch in _batches(2):
        _assert_matches_eager(_step(model, batch), _step(eager, batch))
    assert counter.frame_count == GRAPHS_PER_BLOCK  # the checkpoint's recompute in backward compiles nothing
    assert all("fp4_linear" in r for r in _break_reasons())
    with pytest.raises(ValueError, match=r"layers\.0 already wraps its forward.*compile the blocks before sharding"):
        compile_blocks(eager)


# ----------------------------------------------------------------------------- the recipe key
def test_recipe_key_trainer_compile():
    assert load_recipe().trainer.compile is False
    assert load_recipe(None, ["trainer.compile=true"]).trainer.compile is True
    assert load_recipe(None, ["trainer.compile=true", "trainer.strategy=fsdp", "trainer.accelerator=cpu"]).trainer.compile
    with pytest.raises(RecipeError, match=r"`trainer\.compile`.*expects bool"):
        load_recipe(None, ["trainer.compile=maybe"])
    with pytest.raises(RecipeError, match=r"`trainer\.compile`.*expects bool"):
        load_recipe(None, ["trainer.compile=1"])
    shipped = {p.stem: load_recipe(p).trainer.compile for p in sorted((ROOT / "recipes").glob("*.yaml"))}
    assert shipped == {"llama2-1.3b": True, "llama2-7b": True, "llama2-13b": True, "small": False, "tiny": False}


def test_module_compiles_the_blocks_the_plugin_converted(monkeypatch):
    """trainer.compile=true: configure_model compiles each block; the FP4Precision plugin converts the layers
    after that hook, and the compile (lazy) sees FP4Linear: 8 graphs, as in the unit test above."""
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(LlamaLightningModule, "compile_backend", counter)
    model_keys = [f"model.{k}={getattr(CFG, k)}" for k in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim")]
    cfg = load_recipe(None, ["trainer.compile=true", "trainer.accelerator=cpu", *model_keys])
    precision = precision_setup(cfg)
    module = make_module(cfg, precision)
    assert module.compiles_blocks
    module.configure_model()
    (plugin,) = precision.plugins
    plugin.convert_module(module.model)
    batch = _batches(1)[0]
    with plugin.forward_context():
        module._loss(batch).backward()
    assert counter.frame_count == GRAPHS_PER_BLOCK
    # without the key (and for a checkpoint's recipe written before it existed) the blocks stay eager
    assert not make_module(load_recipe()).compiles_blocks
    assert not LlamaLightningModule(model=dataclasses.asdict(CFG), recipe={"trainer": {}}).compiles_blocks
    assert LlamaLightningModule(model=dataclasses.asdict(CFG), compile=True).compiles_blocks


# ----------------------------------------------------------------------------- the step benchmark
def _bench_train():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "benchmarks" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_step_benchmark_compiles_the_blocks_of_every_row():
    """``--compile``: every row's blocks compiled as trainer.compile compiles them (bf16-mixed included, so
    the rows stay comparable); the FP4 row timed here, compiled at its first warm-up step only."""
    bench = _bench_train()
    cfg = load_recipe(ROOT / "recipes" / "tiny.yaml", ["model.n_layers=2", "model.vocab_size=256"])
    dev = torch.device("cpu")
    counter = CompileCounterWithBackend("aot_eager")
    bf16 = bench.Row("bf16-mixed", cfg, dev, 1, T, compile_backend=counter)
    assert bf16.compiled == "blocks" and all("forward" in vars(b) for b in bf16.model.layers)
    bf16.free()
    row = bench.Row("fp4", cfg, dev, 1, T, compile_backend=counter)
    row.x, row.source = bench._batch(cfg, VOCAB, 1, T, dev)
    for _ in range(bench.WARMUP + 1):
        row.times.append(row.step())
    assert counter.frame_count == GRAPHS_PER_BLOCK
    out = bench._measure(row, 1.0, None)
    assert out["compiled"] == "blocks" and out["split_ms"] is None and out["attention_op"] == "n/a (compiled)"
    assert out["tokens_per_s"] > 0 and counter.frame_count == GRAPHS_PER_BLOCK
    row.free()


# ----------------------------------------------------------------------------- a Lightning run
@pytest.mark.slow
def test_a_short_training_run_compiles_the_blocks(tmp_path_factory, tmp_path, monkeypatch):
    """``fp4lightning train`` with trainer.compile=true: 2 FP4 steps and a validation on the test corpus."""
    from fp4lightning.train.run import train
    from tests.test_data import prepared_test_corpus
    from tests.test_train import LossRecorder, tiny_overrides

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(LlamaLightningModule, "compile_backend", counter)
    corpus = prepared_test_corpus(tmp_path_factory)
    steps = ["schedule.max_steps=2", "trainer.val_every_n_steps=2", "trainer.checkpoint_every_n_steps=2"]
    runs = {}
    for compiled in ("true", "false"):
        rec = LossRecorder()
        result = train(load_recipe(None, tiny_overrides(corpus, tmp_path / compiled, *steps, f"trainer.compile={compiled}")),
                       callbacks=[rec])
        runs[compiled] = (rec.losses, result.val_loss, counter.frame_count)
    (losses, val_loss, graphs), (ref_losses, ref_val_loss, graphs_after) = runs["true"], runs["false"]
    # the training step's 8 graphs, and the same 8 again for validation (no_grad: new guards); the eager
    # run compiles nothing
    assert graphs == graphs_after == 2 * GRAPHS_PER_BLOCK
    assert sorted(losses) == sorted(ref_losses) == [1, 2]
    assert losses[1] == ref_losses[1]  # the same forward on the same weights
    # step 2 and validation follow weights one AdamW step apart by the gradients' last bits (GRAD_RTOL)
    assert losses[2] == pytest.approx(ref_losses[2], rel=1e-5) and val_loss == pytest.approx(ref_val_loss, rel=1e-5)


# ----------------------------------------------------------------------------- the memory budget
def test_compile_memory_budget_reaches_the_partitioner_and_keeps_the_numbers(monkeypatch):
    """trainer.compile_memory_budget: torch's activation_memory_budget is the recipe's while each block
    compiles (the backend sees it), and only then; the step computes what the eager model computes."""
    import torch._functorch.config as functorch_config

    seen = []

    def backend(gm, example_inputs):
        seen.append(functorch_config.activation_memory_budget)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    default = functorch_config.activation_memory_budget
    eager = _fp4_model()
    compiled = compile_blocks(copy.deepcopy(eager), backend=backend, memory_budget=0.5)
    batch = _batches(1)[0]
    _assert_matches_eager(_step(compiled, batch), _step(eager, batch))
    assert seen and set(seen) == {0.5} and functorch_config.activation_memory_budget == default
    # the recipe key: checked, carried to compile_blocks by the Lightning module
    with pytest.raises(RecipeError, match=r"`trainer\.compile_memory_budget` must be in \[0, 1\]"):
        load_recipe(None, ["trainer.compile_memory_budget=1.5"])
    assert load_recipe().trainer.compile_memory_budget is None
    got = {}
    monkeypatch.setattr("fp4lightning.train.module.compile_blocks",
                        lambda model, backend, memory_budget: got.setdefault("budget", memory_budget))
    model_keys = [f"model.{k}={getattr(CFG, k)}" for k in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim")]
    cfg = load_recipe(None, ["trainer.compile=true", "trainer.compile_memory_budget=0.25", "trainer.accelerator=cpu",
                             *model_keys])
    make_module(cfg, precision_setup(cfg)).configure_model()
    assert got == {"budget": 0.25}
