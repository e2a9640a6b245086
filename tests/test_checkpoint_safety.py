"""Loading a checkpoint never runs code from it; resume takes the newest checkpoint; checkpoints follow the umask.

A sharded checkpoint folder (what ``trainer.strategy=fsdp`` saves: torch.distributed.checkpoint
shards, their pickled ``.metadata`` and Lightning's ``meta.pt``) is as much user input as a ``.ckpt``
file: a payload hidden in any of its three parts must be refused with one line at every entry point
(eval, export-hf, train --resume, init.from_checkpoint), and must not run. The checkpoints come
from a real short run of the tiny test model; the sharded folders are written the way Lightning's
ModelParallelStrategy writes them.
"""
from __future__ import annotations

import os
import pickle
import shutil
import stat
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch

from fp4lightning.train.checkpoint import (LAST_CKPT, AtomicCheckpointIO, CheckpointError, load_checkpoint,
                                           read_checkpoint)
from fp4lightning.cli import main as cli_main
from fp4lightning.train.run import build, train
from fp4lightning.train.recipe import load_recipe
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


class _KeepLast(L.Callback):
    """Copies ``last.ckpt`` as it was after the step-2 save (to rebuild the state of a save killed later)."""

    def __init__(self, ckpt_dir: Path, copy_to: Path):
        self.ckpt_dir, self.copy_to = ckpt_dir, copy_to

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2:
            shutil.copy2(self.ckpt_dir / LAST_CKPT, self.copy_to)


@pytest.fixture(scope="module")
def run4(corpus, tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4), written under umask 022; plus ``last-step2.ckpt``,
    last.ckpt as it was at step 2."""
    out = tmp_path_factory.mktemp("run4")
    old = os.umask(0o022)
    try:
        train(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=4",
                                               "trainer.checkpoint_every_n_steps=2", "trainer.val_every_n_steps=2")),
              callbacks=[_KeepLast(out / "checkpoints", out / "last-step2.ckpt")])
    finally:
        os.umask(old)
    return out


class _Payload:
    """Unpickling this runs code (touches a marker file): what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _write_sharded(folder: Path, ckpt: dict, extra_entry=None) -> Path:
    """``ckpt`` as a sharded checkpoint folder, laid out as Lightning's ModelParallelStrategy saves one:
    state dict and optimizer states through torch.distributed.checkpoint, the rest in ``meta.pt``."""
    from lightning.fabric.strategies.fsdp import _distributed_checkpoint_save

    ckpt = dict(ckpt)
    state = {"state_dict": ckpt.pop("state_dict"),
             **{f"optimizer_{i}": o for i, o in enumerate(ckpt.pop("optimizer_states", []))}}
    if extra_entry is not None:
        state["extra"] = extra_entry
    folder.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized, assuming ... a single process"
        _distributed_checkpoint_save(state, folder)
    torch.save(ckpt, folder / "meta.pt")
    return folder


def _malicious_sharded(folder: Path, source: Path, marker: Path, where: str) -> Path:
    """A sharded checkpoint of ``source`` with a payload in ``where``: ``.metadata``, ``meta.pt`` or a
    non-tensor ``entry`` of the shards."""
    ckpt = torch.load(source, map_location="cpu", weights_only=True)
    if where == "meta.pt":
        ckpt["evil"] = _Payload(marker)
    _write_sharded(folder, ckpt, _Payload(marker) if where == "entry" else None)
    if where == ".metadata":
        with open(folder / ".metadata", "rb") as f:
            md = pickle.load(f)  # written just above by torch: trusted
        md.planner_data["evil"] = _Payload(marker)
        with open(folder / ".metadata", "wb") as f:
            pickle.dump(md, f)
    assert not marker.exists()
    return folder


def _one_line_error(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"{prog}: error:") and "Traceback" not in err[0], err
    return err[0]


# ------------------------------------------------------------------ genuine sharded folders still load
def test_sharded_checkpoint_loads(run4, tmp_path):
    source = run4 / "checkpoints" / LAST_CKPT
    folder = _write_sharded(tmp_path / "sharded.ckpt", torch.load(source, map_location="cpu", weights_only=True))
    ckpt, path = read_checkpoint(folder)
    assert path == folder and ckpt["global_step"] == 4
    want = load_checkpoint(source).model.state_dict()
    got = load_checkpoint(folder).model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # the optimizer's non-tensor entries (param_groups) come back too
    assert ckpt["optimizer_states"][0]["param_groups"][0]["lr"] > 0


def test_sharded_last_ckpt_passes_the_resume_checks(corpus, run4, tmp_path):
    """An FSDP run's checkpoints/last.ckpt folder is accepted by --resume (it was refused: no optimizer_states)."""
    out = shutil.copytree(run4, tmp_path / "run")
    ckpt_dir = out / "checkpoints"
    for p in ckpt_dir.iterdir():
        p.unlink()
    _write_sharded(ckpt_dir / LAST_CKPT, torch.load(run4 / "checkpoints" / LAST_CKPT, map_location="cpu",
                                                    weights_only=True))
    _, _, _, ckpt_path = build(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=6")), resume=True)
    assert ckpt_path == str(ckpt_dir / LAST_CKPT)


# ------------------------------------------------------------------ payloads are refused, never run
@pytest.mark.parametrize("where", [".metadata", "meta.pt", "entry"])
def test_payload_in_any_part_of_a_sharded_folder_is_refused(run4, tmp_path, monkeypatch, where):
    marker = tmp_path / "payload_ran"
    folder = _malicious_sharded(tmp_path / "evil.ckpt", run4 / "checkpoints" / LAST_CKPT, marker, where)
    # even with torch's escape hatch set, nothing is unpickled unsafely
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(folder)
    msg = str(e.value)
    assert "\n" not in msg and "it holds a pickled" in msg, msg
    assert str(folder / where) in msg if where != "entry" else f"{folder} (entry extra)" in msg, msg
    assert not marker.exists()


def _evil_metadata_folder(run4: Path, tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "payload_ran"
    return _malicious_sharded(tmp_path / "evil.ckpt", run4 / "checkpoints" / LAST_CKPT, marker, ".metadata"), marker


def test_eval_refuses_a_malicious_sharded_folder(run4, tmp_path, capsys):
    folder, marker = _evil_metadata_folder(run4, tmp_path)
    capsys.readouterr()
    assert cli_main(["eval", str(folder), "--out", str(tmp_path / "eval")]) == 2
    assert str(folder / ".metadata") in _one_line_error(capsys, "fp4lightning eval")
    assert not marker.exists()


def test_export_hf_refuses_a_malicious_sharded_folder(run4, tmp_path, capsys):
    folder, marker = _evil_metadata_folder(run4, tmp_path)
    capsys.readouterr()
    assert cli_main(["export-hf", str(folder), str(tmp_path / "hf")]) == 2
    assert str(folder / ".metadata") in _one_line_error(capsys, "fp4lightning export-hf")
    assert not marker.exists() and not (tmp_path / "hf" / "config.json").exists()


def test_resume_refuses_a_malicious_last_ckpt_folder(corpus, run4, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    folder, marker = _evil_metadata_folder(run4, tmp_path)
    shutil.move(folder, out / "checkpoints" / LAST_CKPT)
    capsys.readouterr()
    assert cli_main(["train", *tiny_overrides(corpus, out, "schedule.max_steps=6"), "--resume"]) == 2
    assert str(out / "checkpoints" / LAST_CKPT / ".metadata") in _one_line_error(capsys, "fp4lightning train")
    assert not marker.exists()


def test_init_from_checkpoint_refuses_a_malicious_sharded_folder(corpus, run4, tmp_path, capsys):
    folder, marker = _evil_metadata_folder(run4, tmp_path)
    capsys.readouterr()
    rc = cli_main(["train", *tiny_overrides(corpus, tmp_path / "run"), f"init.from_checkpoint={folder}"])
    assert rc == 2
    assert str(folder / ".metadata") in _one_line_error(capsys, "fp4lightning train")
    assert not marker.exists()


# ------------------------------------------------------------------ resume takes the newest step inside
class _Steps(L.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(trainer.global_step)


def test_resume_takes_a_numbered_checkpoint_newer_than_last(corpus, run4, tmp_path, capsys):
    """A kill between the numbered save and the last.ckpt save leaves last.ckpt a save behind."""
    out = shutil.copytree(run4, tmp_path / "run")
    ckpt_dir = out / "checkpoints"
    shutil.copy2(out / "last-step2.ckpt", ckpt_dir / LAST_CKPT)
    numbered = ckpt_dir / "step=000004.ckpt"
    assert read_checkpoint(ckpt_dir / LAST_CKPT)[0]["global_step"] == 2 and numbered.exists()
    steps = _Steps()
    capsys.readouterr()
    train(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=6", "trainer.checkpoint_every_n_steps=2",
                                           "trainer.val_every_n_steps=2")), resume=True, callbacks=[steps])
    assert f"resuming from {numbered}" in capsys.readouterr().out
    assert steps.steps == [5, 6]
    assert read_checkpoint(ckpt_dir / LAST_CKPT)[0]["global_step"] == 6


def test_resume_skips_a_corrupt_newer_checkpoint_with_a_note(corpus, run4, tmp_path, capsys):
    out = shutil.copytree(run4, tmp_path / "run")
    ckpt_dir = out / "checkpoints"
    shutil.copy2(out / "last-step2.ckpt", ckpt_dir / LAST_CKPT)
    numbered = ckpt_dir / "step=000004.ckpt"
    numbered.write_bytes(numbered.read_bytes()[:2000])  # torn by a crash
    capsys.readouterr()
    _, _, _, ckpt_path = build(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=6")), resume=True)
    assert ckpt_path == str(ckpt_dir / LAST_CKPT)
    err = capsys.readouterr().err
    assert numbered.name in err and "corrupt" in err and f"resuming from {ckpt_dir / LAST_CKPT} instead" in err


# ------------------------------------------------------------------ checkpoints follow the umask
def test_run_checkpoints_follow_the_umask(run4):
    files = [run4 / "checkpoints" / LAST_CKPT, *(run4 / "checkpoints").glob("step=*.ckpt")]
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, (f, oct(f.stat().st_mode))


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_atomic_writer_uses_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "x.ckpt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.ckpt").stat().st_mode) == 0o666 & ~umask
