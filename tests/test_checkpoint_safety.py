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
from fp4lightning.train.resume import plan_start
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
    """The one line of stderr (from ``capsys``, or what it captured already) that a refused command printed."""
    captured = capsys if hasattr(capsys, "err") else capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
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


def _run_with_sharded_last(run4: Path, out: Path) -> Path:
    """A copy of ``run4`` whose only checkpoint is ``checkpoints/last.ckpt`` as a sharded folder recording
    ``trainer.strategy=fsdp`` (what an FSDP run saves)."""
    shutil.copytree(run4, out)
    ckpt_dir = out / "checkpoints"
    for p in ckpt_dir.iterdir():
        p.unlink()
    ckpt = torch.load(run4 / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"]["recipe"]["trainer"]["strategy"] = "fsdp"
    return _write_sharded(ckpt_dir / LAST_CKPT, ckpt)


def test_sharded_last_ckpt_passes_the_resume_checks(corpus, run4, tmp_path):
    """An FSDP run's checkpoints/last.ckpt folder is accepted by --resume (it was refused: no optimizer_states)."""
    folder = _run_with_sharded_last(run4, tmp_path / "run")
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path / "run", "schedule.max_steps=6", "trainer.strategy=fsdp"))
    ckpt_path, _ = plan_start(cfg, resume=True, overwrite=False)
    assert ckpt_path == str(folder)


def test_resume_refuses_a_sharded_last_ckpt_in_a_non_fsdp_recipe(corpus, run4, tmp_path, capsys):
    """A sharded folder at checkpoints/last.ckpt passed the resume checks of a non-FSDP recipe and then died in
    Lightning with an IsADirectoryError traceback, whose closing message suggested the same --resume."""
    out = tmp_path / "run"
    folder = _run_with_sharded_last(run4, out)
    capsys.readouterr()
    assert cli_main(["train", *tiny_overrides(corpus, out, "schedule.max_steps=6"), "--resume"]) == 2
    captured = capsys.readouterr()
    line = _one_line_error(captured, "fp4lightning train")
    assert f"cannot resume from {folder}: it is a sharded checkpoint folder" in line, line
    assert "trainer.strategy=fsdp" in line and f"init.from_checkpoint={folder}" in line, line
    # refused before training: no traceback, no closing message (stderr holds the one line)
    assert "IsADirectoryError" not in captured.out + captured.err


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


# ------------------------------------------------------------------ .metadata cannot change the process
_MD = "torch.distributed.checkpoint.metadata"
_PWNED = "fp4_pwned"  # the attribute the payloads try to set


def _rewrite_metadata(folder: Path, change=None, prefix: bytes = b"") -> None:
    """Rewrite ``folder/.metadata``: ``change(md)`` edits torch's Metadata (read with plain pickle: torch wrote it
    just above), and ``prefix``, protocol-2 pickle opcodes that leave nothing on the stack, runs before it."""
    with open(folder / ".metadata", "rb") as f:
        md = pickle.load(f)
    if change is not None:
        change(md)
    body = pickle.dumps(md, protocol=2)
    (folder / ".metadata").write_bytes(body[:2] + prefix + body[2:])


def _build_onto(module: str, name: str, call_args: tuple | None = None, onto_dict: bool = False) -> bytes:
    """Pickle opcodes that BUILD ``{_PWNED: True}`` onto ``module.name`` (onto ``module.name(*call_args)`` with
    ``call_args``), then drop it. BUILD with (None, attrs) calls setattr: how a class's attribute is set;
    ``onto_dict``: BUILD with attrs updates ``__dict__`` (a function's)."""
    ops = f"c{module}\n{name}\n".encode()
    if call_args is not None:
        ops += pickle.dumps(call_args, protocol=2)[2:-1] + pickle.REDUCE
    attrs = pickle.dumps({_PWNED: True}, protocol=2)[2:-1]
    return ops + (attrs if onto_dict else pickle.NONE + attrs + pickle.TUPLE2) + pickle.BUILD + pickle.POP


def _admitted_targets() -> dict:
    """What a .metadata pickle may name (torch writes these there), with an enum member it can reach by a call."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    return {"PurePosixPath": pathlib.PurePosixPath, "PosixPath": pathlib.PosixPath, "Metadata": metadata.Metadata,
            "TensorProperties": metadata.TensorProperties, "_StorageInfo": filesystem._StorageInfo,
            "_get_layout": torch.serialization._get_layout, "_MEM_FORMAT_ENCODING": metadata._MEM_FORMAT_ENCODING,
            "TORCH_CONTIGUOUS_FORMAT": metadata._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT}


#: name -> the payload that sets an attribute on it
_BUILD_PAYLOADS = {
    "PurePosixPath": ("pathlib", "PurePosixPath", None, False),
    "Metadata": (_MD, "Metadata", None, False),
    "_StorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo", None, False),
    "_get_layout": ("torch.serialization", "_get_layout", None, True),  # the function whose .cache maps layouts
    "TORCH_CONTIGUOUS_FORMAT": (_MD, "_MEM_FORMAT_ENCODING", (0,), False),  # an enum member: one per process
}


@pytest.fixture
def admitted_state():
    """Every admitted class's and function's attributes before the test; after it, the payload's attribute is
    removed wherever it was set (a failing test must not leave it for the next one)."""
    targets = _admitted_targets()
    before = {k: dict(vars(t)) for k, t in targets.items()}
    yield targets, before
    for t in targets.values():
        if _PWNED in vars(t):
            delattr(t, _PWNED)


def _assert_unchanged(admitted_state) -> None:
    targets, before = admitted_state
    changed = [k for k, t in targets.items() if dict(vars(t)) != before[k]]
    assert not changed, f"the checkpoint changed attributes of {changed}"


def _build_payload_folder(run4: Path, tmp_path: Path, target: str) -> Path:
    folder = _write_sharded(tmp_path / "evil.ckpt", torch.load(run4 / "checkpoints" / LAST_CKPT, map_location="cpu",
                                                               weights_only=True))
    _rewrite_metadata(folder, prefix=_build_onto(*_BUILD_PAYLOADS[target]))
    return folder


@pytest.mark.parametrize("target", list(_BUILD_PAYLOADS))
def test_metadata_cannot_set_attributes_of_what_it_names(run4, tmp_path, admitted_state, target):
    """BUILD onto a class, a function or a shared object would change it for the rest of the process
    (PurePosixPath.__truediv__ set this way broke path handling); the checkpoint otherwise loads."""
    folder = _build_payload_folder(run4, tmp_path, target)
    with pytest.raises(CheckpointError) as e:
        read_checkpoint(folder)
    msg = str(e.value)
    assert "\n" not in msg and str(folder / ".metadata") in msg and "it sets attributes of" in msg, msg
    _assert_unchanged(admitted_state)


@pytest.mark.parametrize("command", ["eval", "export-hf", "init.from_checkpoint"])
def test_entry_points_refuse_a_metadata_that_sets_class_attributes(corpus, run4, tmp_path, capsys, admitted_state,
                                                                   command):
    folder = _build_payload_folder(run4, tmp_path, "PurePosixPath")
    argv = {"eval": ["eval", str(folder), "--out", str(tmp_path / "eval")],
            "export-hf": ["export-hf", str(folder), str(tmp_path / "hf")],
            "init.from_checkpoint": ["train", *tiny_overrides(corpus, tmp_path / "run"),
                                     f"init.from_checkpoint={folder}"]}[command]
    capsys.readouterr()
    assert cli_main(argv) == 2
    line = _one_line_error(capsys, f"fp4lightning {argv[0]}")
    assert str(folder / ".metadata") in line and "it sets attributes of pathlib.PurePosixPath" in line, line
    _assert_unchanged(admitted_state)


# ------------------------------------------------------------------ what a load allocates is bounded by the files
def _max_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _refused_cheaply(folder: Path, *expected: str) -> str:
    """Load ``folder``; assert it is refused in one line holding ``expected``, in well under the time and memory
    the bad case took (1 GB and more; a list index of 100,000,000 ran out of 22 GB here). The address space is
    capped meanwhile, so a regression fails with MemoryError instead of taking the machine's memory."""
    import resource
    import time

    vm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
              if line.startswith("VmSize:")) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    rss, t0 = _max_rss_mb(), time.perf_counter()
    cap = vm + (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(folder)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    took, grew = time.perf_counter() - t0, _max_rss_mb() - rss
    msg = str(e.value)
    assert "\n" not in msg and all(x in msg for x in expected), msg
    assert took < 5 and grew < 200, (took, grew)
    return msg


def _sharded_copy(run4: Path, tmp_path: Path) -> Path:
    return _write_sharded(tmp_path / "ckpt" / "big.ckpt",
                          torch.load(run4 / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True))


def _bytes_entry(md) -> tuple:
    """(MetadataIndex, _StorageInfo) of a non-tensor entry (what loading reads whole into memory)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return next((k, v) for k, v in md.storage_data.items()
                if isinstance(md.state_dict_metadata[k.fqn], BytesStorageMetadata))


def test_a_huge_list_index_in_a_key_path_is_refused_before_the_list_is_built(run4, tmp_path):
    """A 41 KB .metadata whose key path held list index 100,000,000 built a list that long (1.3 GB, ~50 s)."""
    folder = _sharded_copy(run4, tmp_path)

    def huge_index(md):
        key = next(k for k, path in md.planner_data.items() if any(type(p) is int for p in path))
        md.planner_data[key] = tuple(100_000_000 if type(p) is int else p for p in md.planner_data[key])

    _rewrite_metadata(folder, huge_index)
    _refused_cheaply(folder, str(folder / ".metadata"), "list index 100000000")


GIB = 1 << 30


@pytest.mark.parametrize("how", ["symlink", "dotdot", "absolute"])
def test_a_shard_outside_the_folder_is_refused_unread(run4, tmp_path, how):
    """A shard symlinked to a 1 GiB sparse file (and its entry's length set to match) was read whole (1.6 GB)."""
    folder = _sharded_copy(run4, tmp_path)
    outside = folder.parent / "outside.distcp"  # what ../outside.distcp names
    shard = folder / "__0_0.distcp"
    with open(outside, "wb") as f:
        f.write(shard.read_bytes())
        f.truncate(GIB)  # sparse: no disk used

    def point_outside(md):
        index, info = _bytes_entry(md)
        info.length = GIB - info.offset
        if how != "symlink":
            rel = "../outside.distcp" if how == "dotdot" else str(outside)
            for other in md.storage_data.values():
                other.relative_path = rel

    _rewrite_metadata(folder, point_outside)
    if how == "symlink":
        shard.unlink()
        shard.symlink_to(outside)
    msg = _refused_cheaply(folder, str(folder / ".metadata"))
    assert ("outside the checkpoint folder" if how == "symlink" else "which leaves the checkpoint folder") in msg, msg


def test_an_entry_over_a_sparse_stretch_of_a_shard_is_refused_unread(run4, tmp_path):
    """An entry whose recorded range covers 1 GiB of zeros (a sparse file inside the folder) is not read."""
    folder = _sharded_copy(run4, tmp_path)
    shard = folder / "__0_0.distcp"
    end = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(GIB)

    def over_the_hole(md):
        _, info = _bytes_entry(md)
        info.offset, info.length = end, GIB - end

    _rewrite_metadata(folder, over_the_hole)
    _refused_cheaply(folder, str(folder / ".metadata"), "is not a torch.save file")


# ------------------------------------------------------------------ refusals in our words, never torch's advice
class _SystemPayload:
    """Unpickling this runs a shell command (pickled as posix.system, a module torch blocks by name)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("where", ["meta.pt", "entry", ".ckpt"])
def test_a_pickled_system_call_is_named_without_torchs_advice(run4, tmp_path, capsys, where):
    """torch's refusal of a blocked module says 'Re-running torch.load with weights_only set to False will likely
    succeed'; the one line embedded it."""
    marker = tmp_path / "payload_ran"
    ckpt = torch.load(run4 / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)
    if where == ".ckpt":
        ckpt["evil"] = _SystemPayload(marker)
        path = tmp_path / "evil.ckpt"
        torch.save(ckpt, path)
    else:
        if where == "meta.pt":
            ckpt["evil"] = _SystemPayload(marker)
        path = _write_sharded(tmp_path / "evil.ckpt", ckpt, _SystemPayload(marker) if where == "entry" else None)
    capsys.readouterr()
    assert cli_main(["eval", str(path), "--out", str(tmp_path / "eval")]) == 2
    line = _one_line_error(capsys, "fp4lightning eval")
    assert "it holds a pickled posix.system, code that loading would run" in line, line
    assert "weights_only" not in line and "Re-running" not in line, line
    assert not marker.exists()


def _torchscript(path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))


def _with_pickle(path: Path, data_pkl: bytes) -> None:
    """A torch.save zip whose data.pkl is ``data_pkl``."""
    import io
    import zipfile

    plain = io.BytesIO()
    torch.save({"a": 1}, plain)
    with zipfile.ZipFile(io.BytesIO(plain.getvalue())) as src, zipfile.ZipFile(path, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, data_pkl if name.endswith("data.pkl") else src.read(name))


@pytest.mark.parametrize("kind, expected", [
    ("torchscript", "it is a TorchScript archive (a compiled model), not a training checkpoint"),
    ("opcode", "its pickle uses opcode 105"),
    ("builtin", "it holds a pickled builtins.eval, code that loading would run"),
])
def test_other_refusals_of_the_safe_loader_are_worded_ours(tmp_path, kind, expected):
    path = tmp_path / "x.ckpt"
    if kind == "torchscript":
        _torchscript(path)
    else:
        _with_pickle(path, b"(itorch\nSize\n." if kind == "opcode" else b"\x80\x02cbuiltins\neval\nX\x01\x00\x00\x001\x85R.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.load's "looks like a TorchScript archive"
        with pytest.raises(CheckpointError) as e:
            read_checkpoint(path)
    msg = str(e.value)
    assert expected in msg and "weights_only" not in msg and "\n" not in msg, msg


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


def test_weights_that_do_not_fit_the_stored_config_are_refused_in_one_line(run4, tmp_path, capsys):
    ckpt = torch.load(run4 / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)
    key = next(k for k in ckpt["state_dict"] if k.endswith("mlp.down_proj.weight"))
    ckpt["state_dict"][key] = ckpt["state_dict"][key][:, :-1].clone()
    del ckpt["state_dict"][next(k for k in ckpt["state_dict"] if k.endswith("input_layernorm.weight"))]
    bad = tmp_path / "edited.ckpt"
    torch.save(ckpt, bad)
    with pytest.raises(CheckpointError, match=r"do not match the stored model config \(missing: .*; shape: .*down_proj"):
        load_checkpoint(bad)
    capsys.readouterr()
    assert cli_main(["export-hf", str(bad), str(tmp_path / "hf")]) == 2
    line = _one_line_error(capsys, "fp4lightning export-hf")
    assert str(bad) in line and "down_proj" in line
    assert not (tmp_path / "hf").exists()
