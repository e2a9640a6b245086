"""Resuming on another world size (docs/distributed.md, "Resuming on another world size").

A run of `fp4lightning train` on 4 gloo ranks (DDP, and FSDP2 with its sharded DCP checkpoint folder) writes a
checkpoint after 2 optimizer steps; the same checkpoint resumes on 2 ranks and on 1 for one more step. Checked:
the step count continues (2 -> 3), the optimizer states the resumed run starts from equal the saved ones
(gathered from every shard), and the samples each rank reads follow the documented rule: micro-batch ``m`` of
optimizer step ``s`` on rank ``r`` of ``W`` (``A`` micro-batches of ``B`` samples per step) reads the samples at
global positions ``((s A + m) B + b) W + r``, ``b < B``, so step ``s`` reads positions ``[s G, (s + 1) G)`` for
the global batch ``G = A B W`` whatever the world size: nothing is repeated or skipped.

Three process groups (4, 2 and 1 ranks, each running the DDP and the FSDP2 run one after the other) are
spawned once for the module; each test asserts on what its run recorded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

MICRO, GLOBAL = 2, 8  # accumulation 1 on 4 ranks, 2 on 2, 4 on 1
SAVED_STEPS = 2
STRATEGIES = ("ddp", "fsdp")


#: the method of each run: FP8 E4M3 gradients in both; FSDP2 with the 7B / 13B recipes' FP16 optimizer states
METHOD = {"ddp": ("trainer.grad_comm=fp8-e4m3",), "fsdp": ("trainer.grad_comm=fp8-e4m3", "optimizer.states=fp16")}


def _overrides(corpus: str, out: str, strategy: str, world: int, steps: int) -> list[str]:
    from tests.test_train import tiny_overrides

    return tiny_overrides(corpus, out, f"trainer.devices={world}", f"trainer.strategy={strategy}", *METHOD[strategy],
                          f"data.micro_batch_size={MICRO}", f"data.global_batch_size={GLOBAL}",
                          f"schedule.max_steps={steps}", f"trainer.checkpoint_every_n_steps={SAVED_STEPS}",
                          f"trainer.val_every_n_steps={SAVED_STEPS + 1}", "trainer.log_every_n_steps=1000",
                          "trainer.loggers=csv")


def _sample_digest(row: torch.Tensor) -> str:
    return hashlib.sha1(row.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def _recorder(res: dict, rank: int, out_dir: str, tag: str):
    """A callback recording the step the run starts at, the optimizer state it starts from (rank 0 writes the
    gathered state to ``<tag>.opt.pt``) and the digest of every sample each micro-batch reads."""
    import lightning as L

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            res["start_step"] = trainer.global_step
            _save_state(trainer, pl_module, rank, os.path.join(out_dir, f"{tag}.start.pt"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            res["batches"].append([trainer.global_step, [_sample_digest(row) for row in batch]])

        def on_validation_end(self, trainer, pl_module):
            res["validated_at"].append(trainer.global_step)

        def on_train_end(self, trainer, pl_module):
            res["end_step"] = trainer.global_step
            _save_state(trainer, pl_module, rank, os.path.join(out_dir, f"{tag}.end.pt"))

    return Record()


def _save_state(trainer, pl_module, rank: int, path: str) -> None:
    """The whole optimizer state keyed by parameter name (gathered from the shards: a collective), written by
    rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opt = trainer.optimizers[0]
    opt = getattr(opt, "optimizer", opt)
    state = get_optimizer_state_dict(pl_module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, path)


def _run_phase(rank: int, out_dir: str, corpus: str, runs: str, world: int, steps: int, resume: bool) -> dict:
    """On every rank: the DDP run, then the FSDP2 run, of ``world`` ranks in ``runs/<strategy>``."""
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.train.run import train

    results = {}
    for strategy in STRATEGIES:
        res: dict = {"batches": [], "validated_at": []}
        tag = f"{strategy}-w{world}"
        cfg = load_recipe(None, _overrides(corpus, os.path.join(runs, strategy), strategy, world, steps))
        try:
            train(cfg, resume=resume, callbacks=[_recorder(res, rank, out_dir, tag)])
        except Exception as e:  # recorded: the parent says which run failed and why
            res["error"] = f"{type(e).__name__}: {e}"
        results[strategy] = res
    return results


def _phase(tmp: Path, corpus: Path, runs: Path, world: int, steps: int, resume: bool) -> list[dict]:
    from tests.test_fsdp import _spawn

    out = tmp / f"w{world}"
    out.mkdir()
    fn = functools.partial(_run_phase, corpus=str(corpus), runs=str(runs), world=world, steps=steps, resume=resume)
    return _spawn(fn, out, timeout_s=300, world=world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 4-rank runs (2 steps, checkpoint at step 2), and a copy of them resumed on 2 ranks and on 1 (3 steps)."""
    from tests.test_data import prepared_test_corpus

    corpus = prepared_test_corpus(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("world_size")
    saved = tmp / "runs-w4"
    out = {4: _phase(tmp, corpus, saved, 4, SAVED_STEPS, resume=False)}
    for world in (2, 1):
        shutil.copytree(saved, tmp / f"runs-w{world}")
        out[world] = _phase(tmp, corpus, tmp / f"runs-w{world}", world, SAVED_STEPS + 1, resume=True)
    return {"tmp": tmp, "corpus": corpus, "ranks": out}


def _expected_digests(corpus: Path, step: int, micro: int, rank: int, world: int, accumulate: int) -> list[str]:
    """The digests of the samples of micro-batch ``micro`` of optimizer step ``step`` on ``rank`` by the rule."""
    from fp4lightning.data.sampling import WindowDataset
    from fp4lightning.data.shards import PreparedData

    ds = WindowDataset(PreparedData(corpus).shards("train"), 64, 1234)
    first = (step * accumulate + micro) * MICRO
    return [_sample_digest(ds[(first + b) * world + rank]) for b in range(MICRO)]


def _check_batches(corpus: Path, ranks: list[dict], strategy: str, world: int, steps: range) -> None:
    accumulate = GLOBAL // (MICRO * world)
    for rank, r in enumerate(ranks):
        got = r[strategy]["batches"]
        want = [[s, _expected_digests(corpus, s, m, rank, world, accumulate)] for s in steps for m in range(accumulate)]
        assert got == want, f"{strategy} on {world} ranks, rank {rank}: samples differ from the documented rule"


def _check_resumed(runs: dict, strategy: str, world: int) -> None:
    saved, resumed = runs["ranks"][4], runs["ranks"][world]
    for r in (*saved, *resumed):
        assert "error" not in r[strategy], r[strategy].get("error")
    assert [r[strategy]["end_step"] for r in saved] == [SAVED_STEPS] * 4
    # the saved run read steps 0 and 1 by the rule, on 4 ranks
    _check_batches(runs["corpus"], saved, strategy, 4, range(0, SAVED_STEPS))
    # the resumed run starts at step 2, takes step 3, and reads positions [2 G, 3 G) by the rule on its ranks
    assert [(r[strategy]["start_step"], r[strategy]["end_step"]) for r in resumed] == [(SAVED_STEPS, SAVED_STEPS + 1)] * world
    _check_batches(runs["corpus"], resumed, strategy, world, range(SAVED_STEPS, SAVED_STEPS + 1))
    # validation every 3 steps, which Lightning schedules in micro-batches: the saved run validates once at
    # its end (step 2, fp4lightning's closing validation), the resumed one inside fit after step 3
    assert [r[strategy]["validated_at"] for r in saved] == [[SAVED_STEPS]] * 4
    assert [r[strategy]["validated_at"] for r in resumed] == [[SAVED_STEPS + 1]] * world
    # the optimizer state it starts from is the saved one, every tensor equal
    saved_state = torch.load(runs["tmp"] / f"w4/{strategy}-w4.end.pt", weights_only=True)
    start_state = torch.load(runs["tmp"] / f"w{world}/{strategy}-w{world}.start.pt", weights_only=True)
    _assert_states_equal(saved_state, start_state)


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys() and a["state"], (sorted(a["state"])[:3], sorted(b["state"])[:3])
    for name, sa in a["state"].items():
        sb = b["state"][name]
        assert sa.keys() == sb.keys(), name
        for k, v in sa.items():
            w = sb[k]
            if isinstance(v, torch.Tensor):
                assert isinstance(w, torch.Tensor) and v.dtype == w.dtype and torch.equal(v, w), (name, k)
            else:
                assert v == w, (name, k)
    strip = [{k: v for k, v in g.items() if k != "params"} for g in a["param_groups"]]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in b["param_groups"]]


@pytest.mark.parametrize("world", [2, 1])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_on_fewer_ranks(runs, strategy, world):
    _check_resumed(runs, strategy, world)


def test_resume_note_and_checkpoints_without_the_position(runs, tmp_path):
    """The resumed run says where it continues; a checkpoint whose data loader did not record its global
    sample position (written before it did) still resumes on its own world size only, and the refusal says why."""
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.train.resume import ResumeMismatchError, check_resumable, describe_resume

    saved = runs["tmp"] / "runs-w4" / "ddp" / "checkpoints" / "last.ckpt"

    def cfg(world):
        return load_recipe(None, _overrides(str(runs["corpus"]), str(tmp_path / "out"), "ddp", world, SAVED_STEPS + 1))

    note = describe_resume(cfg(2), str(saved))[0]  # then the lines on the longer schedule
    assert note.startswith("resume: 2 rank(s) continue the run of 4 (gradient accumulation 1 -> 2) at global "
                           f"sample {SAVED_STEPS * GLOBAL}: step 3 reads samples 16..23, as on 4 rank(s)"), note
    assert not any("rank(s)" in line for line in describe_resume(cfg(4), str(saved)))
    ckpt = torch.load(saved, weights_only=True)
    (state,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["samples_consumed"] == SAVED_STEPS * GLOBAL and state["world_size"] == 4, state
    ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"batches_consumed": 2, "epoch": 0}]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    assert check_resumable(old, cfg(4)) == []
    with pytest.raises(ResumeMismatchError, match=r"trainer.devices x trainer.num_nodes = 4 in the checkpoint, 2 now "
                       r"\(its data loader predates recording the global sample position"):
        check_resumable(old, cfg(2))
