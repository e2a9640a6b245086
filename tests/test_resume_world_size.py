"""Resuming on another world size (docs/distributed.md, "Resuming on another world size").

`fp4lightning train` on 4 gloo ranks (DDP with FP8 E4M3 gradient exchange, and FSDP2 with its sharded DCP
checkpoint folders, FP16 optimizer states and FP8 reduce-scatter) takes 3 steps, writing ``step=000002.ckpt``
mid-run and ``last.ckpt`` at its end. The mid-run checkpoint resumes on 2 ranks and the final one on 1 (each
to step 4; Lightning restores the two differently). Checked: the step count continues, the optimizer state the
resumed run starts from, gathered from every shard, equals the one the 4-rank run held at that step, validation
comes after the same steps, and the samples each rank reads follow the documented rule: micro-batch ``m`` of
optimizer step ``s`` on rank ``r`` of ``W`` (``A`` micro-batches of ``B`` samples per step) reads the samples
at global positions ``((s A + m) B + b) W + r``, ``b < B``, so step ``s`` reads positions ``[s G, (s + 1) G)``
for the global batch ``G = A B W`` whatever the world size: nothing is repeated or skipped.

Three process groups (4, 2 and 1 ranks, each running the DDP and the FSDP2 run one after the other) are
spawned once for the module; each test asserts on what its runs recorded.
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
SAVED_STEPS = 3  # of the 4-rank run; it writes step=000002.ckpt and last.ckpt (step 3)
MID = 2  # the mid-run checkpoint's step
END = 4  # the resumed runs' max_steps
#: world size -> (checkpoint it resumes from, its step)
RESUMES = {2: (f"step={MID:06d}.ckpt", MID), 1: ("last.ckpt", SAVED_STEPS)}
STRATEGIES = ("ddp", "fsdp")


#: the method of each run: FP8 E4M3 gradients in both; FSDP2 with the 7B / 13B recipes' FP16 optimizer states
METHOD = {"ddp": ("trainer.grad_comm=fp8-e4m3",), "fsdp": ("trainer.grad_comm=fp8-e4m3", "optimizer.states=fp16")}


def _overrides(corpus: str, out: str, strategy: str, world: int, steps: int) -> list[str]:
    from tests.test_train import tiny_overrides

    return tiny_overrides(corpus, out, f"trainer.devices={world}", f"trainer.strategy={strategy}", *METHOD[strategy],
                          f"data.micro_batch_size={MICRO}", f"data.global_batch_size={GLOBAL}",
                          f"schedule.max_steps={steps}", f"trainer.checkpoint_every_n_steps={MID}",
                          # Lightning schedules validation in micro-batches: due in the fit of the resumed runs only
                          f"trainer.val_every_n_steps={END}", "trainer.log_every_n_steps=1000", "trainer.loggers=csv")


def _sample_digest(row: torch.Tensor) -> str:
    return hashlib.sha1(row.to(torch.int64).numpy().tobytes()).hexdigest()[:16]


def _recorder(res: dict, rank: int, out_dir: str, tag: str):
    """A callback recording the steps the run starts and ends at and validates after, the digest of every sample
    each micro-batch reads, and the optimizer state (rank 0 writes it gathered to ``<tag>.<when>.pt``) at the
    start, after step ``MID`` and at the end."""
    import lightning as L

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            res["start_step"] = trainer.global_step
            _save_state(trainer, pl_module, rank, os.path.join(out_dir, f"{tag}.start.pt"))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            res["batches"].append([trainer.global_step, [_sample_digest(row) for row in batch]])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == MID and not res["mid_saved"]:  # the state step=000002.ckpt holds
                res["mid_saved"] = True
                _save_state(trainer, pl_module, rank, os.path.join(out_dir, f"{tag}.mid.pt"))

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


def _run_phase(rank: int, out_dir: str, corpus: str, runs: str, world: int, steps: int, ckpt: str | None) -> dict:
    """On every rank: the DDP run, then the FSDP2 run, of ``world`` ranks in ``runs/<strategy>``, resumed from
    its checkpoint ``ckpt`` (a name in its checkpoints folder) or fresh."""
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.train.run import train

    results = {}
    for strategy in STRATEGIES:
        res: dict = {"batches": [], "validated_at": [], "mid_saved": False}
        tag = f"{strategy}-w{world}"
        out = os.path.join(runs, strategy)
        resume = [f"ckpt_path={os.path.join(out, 'checkpoints', ckpt)}"] if ckpt else []
        cfg = load_recipe(None, [*_overrides(corpus, out, strategy, world, steps), *resume])
        try:
            train(cfg, callbacks=[_recorder(res, rank, out_dir, tag)])
        except Exception as e:  # recorded: the parent says which run failed and why
            res["error"] = f"{type(e).__name__}: {e}"
        results[strategy] = res
    return results


def _phase(tmp: Path, corpus: Path, runs: Path, world: int, steps: int, ckpt: str | None) -> list[dict]:
    from tests.test_fsdp import _spawn

    out = tmp / f"w{world}"
    out.mkdir()
    fn = functools.partial(_run_phase, corpus=str(corpus), runs=str(runs), world=world, steps=steps, ckpt=ckpt)
    return _spawn(fn, out, timeout_s=300, world=world)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 4-rank runs (3 steps), and copies of them resumed on 2 ranks (from step 2) and on 1 (from step 3)."""
    from tests.test_data import prepared_test_corpus

    corpus = prepared_test_corpus(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("world_size")
    saved = tmp / "runs-w4"
    out = {4: _phase(tmp, corpus, saved, 4, SAVED_STEPS, None)}
    for world, (ckpt, _) in RESUMES.items():
        shutil.copytree(saved, tmp / f"runs-w{world}")
        out[world] = _phase(tmp, corpus, tmp / f"runs-w{world}", world, END, ckpt)
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
    start = RESUMES[world][1]
    assert [r[strategy]["end_step"] for r in saved] == [SAVED_STEPS] * 4
    # the saved run read steps 0..2 by the rule, on 4 ranks, and validated once, at its end
    _check_batches(runs["corpus"], saved, strategy, 4, range(0, SAVED_STEPS))
    assert [r[strategy]["validated_at"] for r in saved] == [[SAVED_STEPS]] * 4
    # the resumed run starts at the checkpoint's step, ends at END, reads by the rule on its ranks the
    # positions [start G, END G), and validates after step END inside fit (its micro-batch counters converted)
    assert [(r[strategy]["start_step"], r[strategy]["end_step"]) for r in resumed] == [(start, END)] * world
    _check_batches(runs["corpus"], resumed, strategy, world, range(start, END))
    assert [r[strategy]["validated_at"] for r in resumed] == [[END]] * world
    # the optimizer state it starts from is the one the 4-rank run held at that step, every tensor equal
    saved_state = torch.load(runs["tmp"] / f"w4/{strategy}-w4.{'mid' if start == MID else 'end'}.pt", weights_only=True)
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
        return load_recipe(None, _overrides(str(runs["corpus"]), str(tmp_path / "out"), "ddp", world, END))

    note = describe_resume(cfg(2), str(saved))[0]  # then the lines on the longer schedule
    assert note.startswith("resume: 2 rank(s) continue the run of 4 (gradient accumulation 1 -> 2) at global "
                           "sample 24: step 4 reads samples 24..31, as on 4 rank(s)"), note
    assert not any("rank(s)" in line for line in describe_resume(cfg(4), str(saved)))
    ckpt = torch.load(saved, weights_only=True)
    (state,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["samples_consumed"] == SAVED_STEPS * GLOBAL and state["world_size"] == 4, state
    ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"] = [{"batches_consumed": SAVED_STEPS, "epoch": 0}]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    assert check_resumable(old, cfg(4)) == []
    with pytest.raises(ResumeMismatchError, match=r"trainer.devices x trainer.num_nodes = 4 in the checkpoint, 2 now "
                       r"\(its data loader predates recording the global sample position"):
        check_resumable(old, cfg(2))


def _loader(rank: int, world: int, accumulate: int, steps_done: int = 0, restarts: list | None = None):
    from fp4lightning.data.sampling import PositionSampler, ResumableDataLoader

    batches = 6 * accumulate  # per rank: 6 optimizer steps
    return ResumableDataLoader(list(range(10_000)), batch_size=MICRO, sampler=PositionSampler(batches * MICRO, rank, world),
                               drop_last=True, progress_fn=lambda: steps_done * accumulate, accumulate=accumulate,
                               on_restart=None if restarts is None else restarts.append)


def test_loader_continues_at_the_global_sample_position():
    """The loader alone (no processes): the state of a 4-rank loader after 3 steps, loaded on 2 ranks and on 1,
    starts every rank where the rule puts step 3; a position that is not a whole global batch of the new run is
    refused naming the key; a state without the position (an older checkpoint) is taken as the current world size's."""
    state = _loader(0, 4, 1, steps_done=3).state_dict()
    assert state == {"batches_consumed": 3, "epoch": 0, "samples_consumed": 3 * GLOBAL, "world_size": 4, "accumulate": 1}
    for world in (4, 2, 1):
        accumulate = GLOBAL // (MICRO * world)
        step3 = []
        for rank in range(world):
            restarts: list = []
            loader = _loader(rank, world, accumulate, restarts=restarts)
            loader.load_state_dict(state)
            assert restarts == [1]  # the checkpoint's accumulation, for the trainer's counters
            first = [b.tolist() for _, b in zip(range(accumulate), loader)]
            assert first == [[((3 * accumulate + m) * MICRO + b) * world + rank for b in range(MICRO)]
                             for m in range(accumulate)], (world, rank)
            step3 += sum(first, [])
        assert sorted(step3) == list(range(3 * GLOBAL, 4 * GLOBAL))
    with pytest.raises(ValueError, match="not a multiple of this run's global batch.*data.global_batch_size"):
        _loader(0, 2, 2).load_state_dict({**state, "samples_consumed": 3 * GLOBAL + MICRO})
    old = _loader(1, 2, 2)
    old.load_state_dict({"batches_consumed": 6, "epoch": 0})  # 3 steps of 2 micro-batches on 2 ranks
    assert next(iter(old)).tolist() == [3 * GLOBAL + 1, 3 * GLOBAL + 3]
