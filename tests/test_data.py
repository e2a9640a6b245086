"""Data pipeline: prepare real text (local files, JSONL, Parquet), shards, tokenizer, sampling."""
from __future__ import annotations

import ast
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from fp4lightning.data import (
    DataNotPreparedError,
    DataSourceError,
    PreparedData,
    PositionSampler,
    TokenDataModule,
    WindowDataset,
    feistel_permute,
    prepare,
)
from fp4lightning.data.tokenizer import Tokenizer

# Real English text that ships with every Python: the standard library's docstrings and
# the interpreter's licence (no download at test time).
STDLIB_MODULES = (
    "argparse", "json/__init__", "pathlib", "functools", "textwrap", "string", "datetime",
    "decimal", "fractions", "statistics", "random", "heapq", "bisect", "logging/__init__",
    "doctest", "inspect", "typing", "dataclasses", "enum", "contextlib", "subprocess",
    "threading", "tarfile", "zipfile", "csv", "configparser", "difflib", "pprint", "shutil",
    "tempfile", "calendar", "pickle", "copy", "gettext", "locale", "optparse", "pydoc",
    "ast", "traceback", "warnings", "unittest/case", "email/message", "http/client", "urllib/parse",
)
TEST_VOCAB = 512
#: RSS that `data prepare` of a 5 MB one-line record may add to its imports (torch, lightning: ~500 MB).
#: Measured on the 2-core build machine: ~100 MB; ~1,140 MB when the record was encoded in one piece.
PREPARE_5MB_LINE_MAX_GROWTH_MB = 300


def stdlib_docs(module: str) -> str:
    path = Path(os.__file__).parent / f"{module}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))
    return "\n\n".join(d for d in map(ast.get_docstring, nodes) if d)


def write_text_corpus(root: Path) -> Path:
    """~430 KB of real English prose as .txt files (one per stdlib module) plus LICENSE.txt."""
    root.mkdir(parents=True, exist_ok=True)
    for m in STDLIB_MODULES:
        (root / f"{m.replace('/', '_')}.txt").write_text(stdlib_docs(m), encoding="utf-8")
    licence = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"
    if licence.is_file():
        (root / "LICENSE.txt").write_text(licence.read_text(encoding="utf-8"), encoding="utf-8")
    return root


def prepared_test_corpus(tmp_path_factory) -> Path:
    """Prepare the stdlib-docs corpus once per test session (prepare() is idempotent)."""
    base = tmp_path_factory.getbasetemp()
    src = base / "stdlib_text"
    if not src.exists():
        write_text_corpus(src)
    return prepare(str(src), base / "stdlib_prepared", vocab_size=TEST_VOCAB, val_fraction=0.05)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


def test_prepare_local_text(corpus, tmp_path_factory, capsys):
    data = PreparedData(corpus)
    meta = data.meta
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == TEST_VOCAB
    assert data.num_tokens("train") > 50_000 and data.num_tokens("val") > 1_000
    # the split is held out: val documents' tokens are not in train
    assert 0.01 < data.num_tokens("val") / (data.num_tokens("train") + data.num_tokens("val")) < 0.15
    tok = data.tokenizer
    for split in ("train", "val"):
        arr = np.concatenate(data.shards(split))
        assert arr.max() < tok.vocab_size
        # every document is BOS ... EOS
        assert arr[0] == tok.bos_id and arr[-1] == tok.eos_id
        assert (arr == tok.bos_id).sum() == (arr == tok.eos_id).sum()
    # decoding the shards gives back the real text
    text = tok.decode(np.concatenate(data.shards("train"))[:2000].tolist())
    assert " the " in text
    # idempotent: a second call reports up to date and rewrites nothing
    mtime = (corpus / "meta.json").stat().st_mtime_ns
    capsys.readouterr()
    prepare(str(tmp_path_factory.getbasetemp() / "stdlib_text"), corpus, vocab_size=TEST_VOCAB, val_fraction=0.05)
    assert "up to date" in capsys.readouterr().out
    assert (corpus / "meta.json").stat().st_mtime_ns == mtime


def test_tokenizer_roundtrip(corpus):
    tok = Tokenizer.from_file(corpus / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    text = stdlib_docs("textwrap")[:3000] + "\nnon-ASCII: naïve café — ünïcödé ✓"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text  # byte-level: exact round trip, no unknown tokens
    # BPE compresses real English: fewer tokens than bytes
    assert len(ids) < 0.6 * len(text.encode())
    assert Tokenizer.from_str(tok.to_str()).encode(text) == tok.encode(text)


@pytest.mark.slow
def test_prepare_jsonl_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [stdlib_docs(m) for m in STDLIB_MODULES[:12]]
    paras = [p for d in docs for p in d.split("\n\n") if len(p) > 40]
    (tmp_path / "src").mkdir()
    with open(tmp_path / "src" / "a.jsonl", "w") as f:
        for p in paras[: len(paras) // 2]:
            f.write(json.dumps({"content": p}) + "\n")
    pq.write_table(pa.table({"content": paras[len(paras) // 2:]}), tmp_path / "src" / "b.parquet")
    out = prepare(str(tmp_path / "src"), tmp_path / "out", vocab_size=300, val_fraction=0.1, text_key="content")
    data = PreparedData(out)
    n_docs = data.meta["documents"]
    assert n_docs == len(paras)
    total = data.num_tokens("train") + data.num_tokens("val")
    arr = np.concatenate(data.shards("train") + data.shards("val"))
    assert len(arr) == total and (arr == data.tokenizer.bos_id).sum() == n_docs

    # a JSONL line without the field is an error naming the file, line and option
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(DataSourceError, match=r"x\.jsonl:2.*--text-key"):
        prepare(str(tmp_path / "bad"), tmp_path / "bad_out", vocab_size=300)


def test_missing_data_dir_names_prepare_command(tmp_path):
    with pytest.raises(DataNotPreparedError) as e:
        TokenDataModule(tmp_path / "nothing_here", seq_len=32, micro_batch_size=2, train_batches=4)
    msg = str(e.value)
    assert f"fp4lightning data prepare --source builtin --out {tmp_path / 'nothing_here'}" in msg


def test_unknown_source_is_clear(tmp_path):
    with pytest.raises(DataSourceError, match="neither 'builtin', 'hf:NAME' nor an existing path"):
        prepare(str(tmp_path / "does_not_exist"), tmp_path / "out")


def test_hf_source_offline_names_dataset(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataSourceError, match=r"(?s)mlfoundations/dclm-baseline-1\.0.*hub"):
        prepare("hf:mlfoundations/dclm-baseline-1.0", tmp_path / "dclm", max_tokens=1000)
    assert not (tmp_path / "dclm").exists()  # nothing half-written


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000, 12345])
def test_feistel_is_a_permutation(n):
    key = int(torch.randint(0, 2**31, ()).item())
    perm = [feistel_permute(i, n, key) for i in range(n)]
    assert sorted(perm) == list(range(n))
    if n >= 64:  # actually shuffled
        assert sum(p == i for i, p in enumerate(perm)) < n // 8


def test_sampling_deterministic_epochs_and_ranks(corpus):
    data = PreparedData(corpus)
    ds = WindowDataset(data.shards("train"), seq_len=32, seed=7)
    n = len(ds)
    # one epoch visits every window exactly once: starts are offset + k * seq_len, all distinct
    starts = [ds.locate(p) for p in range(n)]
    offset = starts[0][1] % 32
    assert sorted(starts) == [(0, offset + k * 32) for k in range(n)]
    assert starts != sorted(starts)  # shuffled
    flat = np.concatenate(data.shards("train"))
    assert ds[0].shape == (33,) and ds[0].dtype == torch.int64
    # same seed, same samples; other seed or epoch, other order
    ds2 = WindowDataset(data.shards("train"), seq_len=32, seed=7)
    assert all(torch.equal(ds[p], ds2[p]) for p in range(0, 3 * n, 97))
    assert not torch.equal(torch.stack([ds[p] for p in range(8)]), torch.stack([ds[n + p] for p in range(8)]))
    assert not torch.equal(ds[0], WindowDataset(data.shards("train"), 32, seed=8)[0])
    # windows are real slices of the shard
    w = ds[3].numpy()
    hits = np.flatnonzero(flat[:-33] == w[0])
    assert any((flat[h:h + 33] == w).all() for h in hits)
    # two ranks partition the positions; skip() resumes mid-epoch
    r0, r1 = PositionSampler(10, 0, 2), PositionSampler(10, 1, 2)
    assert sorted(list(r0) + list(r1)) == list(range(20))
    r0.skip(4)
    assert list(r0) == [8, 10, 12, 14, 16, 18] and len(r0) == 10
    assert list(r0)[:2] == [0, 2]  # the skip applies to the next iteration only


def test_val_ids_out_of_vocab_name_the_shard(corpus, tmp_path):
    # a validation shard altered on disk fails naming the file and the rebuild, as the training
    # shards do (WindowDataset), rather than as an IndexError inside the embedding mid-training
    import shutil

    from fp4lightning.data import DataCorruptError

    data = shutil.copytree(corpus, tmp_path / "data")
    shard = np.memmap(data / "val-00000.bin", dtype=np.uint16, mode="r+")
    shard[::100] = 60000
    shard.flush()
    del shard
    dm = TokenDataModule(data, seq_len=32, micro_batch_size=4, train_batches=4, val_batches=2)
    with pytest.raises(DataCorruptError, match=r"(?s)val-00000\.bin holds token id 60000.*data prepare .*--force"):
        next(iter(dm.val_dataloader()))


class BatchRecorder(L.Callback):
    """Every training micro-batch and its loss, by batch index in the run; optionally sends this
    process SIGTERM after micro-batch ``stop_after`` (Lightning saves a checkpoint, then exits)."""

    def __init__(self, stop_after: int | None = None):
        self.batches: dict[int, torch.Tensor] = {}
        self.losses: dict[int, float] = {}
        self.stop_after = stop_after

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches[batch_idx] = batch.detach().clone()
        self.losses[batch_idx] = outputs["loss"].item()
        if batch_idx == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)


def _positions(ds: WindowDataset, batches: list[torch.Tensor], micro_batch_size: int) -> list[int]:
    """The sample position of every row of ``batches`` (searched among the first few hundred)."""
    first = [ds[p] for p in range(40 * micro_batch_size)]
    return [next((p for p, w in enumerate(first) if torch.equal(w, row)), -1) for b in batches for row in b]


def _run(cfg, resume: bool = False, stop_after: int | None = None) -> BatchRecorder:
    from fp4lightning.train.run import train

    rec = BatchRecorder(stop_after)
    if stop_after is None:
        train(cfg, resume=resume, callbacks=[rec])
    else:
        with pytest.raises(SystemExit):  # SIGTERM: checkpoint saved, exit status 143
            train(cfg, resume=resume, callbacks=[rec])
    return rec


def test_extending_a_finished_run_reads_the_next_unseen_samples(corpus, tmp_path):
    # docs/training.md, "Resuming with a changed schedule": a finished 4-step run extended to 6,
    # then to 8 steps, reads exactly what an uninterrupted 8-step run reads (positions 0, 1, 2, ...:
    # a sample's position does not depend on the run's length)
    from fp4lightning.train.recipe import load_recipe
    from tests.test_train import tiny_overrides

    runs = []
    for steps in (4, 6, 8):
        cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, f"schedule.max_steps={steps}"))
        runs.append(_run(cfg, resume=steps > 4))
    ds = WindowDataset(PreparedData(corpus).shards("train"), 64, cfg.seed)
    read = [_positions(ds, [r.batches[i] for i in sorted(r.batches)], 4) for r in runs]
    assert read == [list(range(0, 16)), list(range(16, 24)), list(range(24, 32))]


def test_interrupt_mid_accumulation_restarts_the_cycle(corpus, tmp_path):
    # SIGTERM after micro-batch 4 of 8 (the first of step 3's two): the partial gradient is lost,
    # so the resumed run redoes step 3 from its first micro-batch (docs/training.md,
    # "Interrupting and resuming") and ends bitwise where an uninterrupted run ends
    from fp4lightning.train.checkpoint import LAST_CKPT
    from fp4lightning.train.recipe import load_recipe
    from tests.test_train import tiny_overrides

    extra = ("data.global_batch_size=8", "schedule.max_steps=4", "trainer.checkpoint_every_n_steps=100")
    full = _run(load_recipe(None, tiny_overrides(corpus, tmp_path / "full", *extra)))
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path / "cut", *extra))
    first = _run(cfg, stop_after=4)
    second = _run(cfg, resume=True)
    assert sorted(full.batches) == list(range(8)) and sorted(first.batches) == list(range(5))
    assert sorted(second.batches) == list(range(4, 8))  # micro-batch 4 again, then 5..7
    for i in range(8):
        assert torch.equal((second if i >= 4 else first).batches[i], full.batches[i]), i
        assert (second if i >= 4 else first).losses[i] == full.losses[i], i
    a, b = (torch.load(d / "checkpoints" / LAST_CKPT, map_location="cpu", weights_only=True)
            for d in (tmp_path / "full", tmp_path / "cut"))
    assert a["global_step"] == b["global_step"] == 4
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    for i, state in a["optimizer_states"][0]["state"].items():
        for k, v in state.items():
            assert torch.equal(v, b["optimizer_states"][0]["state"][i][k]), (i, k)
    batches = a["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert b["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"] == batches


# ------------------------------------------------------------------ bounded memory, early split check, full disk
def _run_prepare_cli(args: list[str]) -> tuple[int, str, str, int, int]:
    """``fp4lightning data prepare ARGS`` in a subprocess: (exit status, stdout, stderr, peak RSS in MB,
    RSS in MB once the modules it uses are imported). ``os.wait4`` gives the peak of this one child
    (``RUSAGE_CHILDREN`` would be the largest child this test process ever waited for)."""
    import subprocess
    import tempfile

    child = ("import resource, sys\n"
             "import fp4lightning.data, fp4lightning.eval.tasks\n"
             "print('imported:', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
             "from fp4lightning.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", child, "data", "prepare", *args], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read()
        imported = int(stdout.split("imported: ", 1)[1].split()[0])
        return proc.returncode, stdout, err.read(), usage.ru_maxrss // 1024, imported // 1024


def _prose_line(chars: int) -> str:
    """``chars`` characters of real prose on one line (the stdlib docs, whitespace collapsed, repeated)."""
    prose = " ".join(" ".join(stdlib_docs(m).split()) for m in STDLIB_MODULES)
    return (prose + " ") * (chars // (len(prose) + 1)) + prose[: chars % (len(prose) + 1)]


def test_token_pieces_encode_like_the_whole_text(corpus):
    # pieces are cut only where the byte-level pre-tokenizer never joins two characters, so encoding
    # a long text piece by piece (bounded memory) gives exactly the ids of encoding it whole
    from fp4lightning.data.tokenizer import token_pieces

    tok = PreparedData(corpus).tokenizer
    text = "\n\n".join(stdlib_docs(m) for m in STDLIB_MODULES[:6]) + "\n  tabs\tand\u00a0nbsp\u3000ideographic  end  "
    pieces = list(token_pieces(text, 500))
    assert len(pieces) > 50 and max(map(len, pieces)) <= 500 and "".join(pieces) == text
    assert [i for p in pieces for i in tok.encode(p, bos=False)] == tok.encode(text, bos=False)


@pytest.mark.slow
def test_prepare_a_5mb_line_in_bounded_memory(tmp_path):
    # one 5 MB JSONL record (a document that cannot be cut) held ~1.1 GB while it was encoded in one
    # piece; the short records after it give the validation split. The file's name puts the long
    # record in the training split (documents are held out by a hash of their name).
    with open(tmp_path / "line.jsonl", "w") as f:
        f.write(json.dumps({"text": _prose_line(5_000_000)}) + "\n")
        for m in STDLIB_MODULES:
            f.write(json.dumps({"text": stdlib_docs(m)[:2000]}) + "\n")
    rc, out, err, peak_mb, imported_mb = _run_prepare_cli(
        ["--source", str(tmp_path / "line.jsonl"), "--out", str(tmp_path / "out"), "--vocab-size", "300",
         "--val-fraction", "0.2"])
    assert rc == 0, err[-2000:]
    data = PreparedData(tmp_path / "out")
    assert 0 < data.num_tokens("val") < 100_000 and data.num_tokens("train") > 1_000_000
    assert peak_mb - imported_mb < PREPARE_5MB_LINE_MAX_GROWTH_MB, (peak_mb, imported_mb)


def _name_in_split(val: bool, val_fraction: float) -> str:
    from fp4lightning.data.build import _is_val

    return next(n for n in (f"doc{i}.txt" for i in range(1000)) if _is_val(n, val_fraction) == val)


@pytest.mark.parametrize("held_out", [False, True])
def test_prepare_refuses_an_empty_split_before_training_the_tokenizer(tmp_path, capsys, held_out):
    # one document lands in one split only: refused while the text is read, before the merges
    val_fraction = 0.3
    name = _name_in_split(held_out, val_fraction)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / name).write_text(stdlib_docs("argparse")[:5000])
    with pytest.raises(DataSourceError) as e:
        prepare(str(tmp_path / "src"), tmp_path / "out", vocab_size=300, val_fraction=val_fraction)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "src") in msg and "--val-fraction" in msg and "0.3" in msg
    assert ("training" if held_out else "validation") in msg
    assert "computing merges" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def mount_tmpfs(path: Path, size: str = "2m") -> None:
    """Mount a tmpfs of ``size`` at the new folder ``path``: a small full disk (skips without root)."""
    import subprocess

    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a full disk is simulated with a small tmpfs mount, which needs root (CI runs as root)")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to simulate a full disk: {proc.stderr.strip()}")


def test_prepare_on_a_full_disk_keeps_the_old_data(corpus, tmp_path_factory, tmp_path, capsys):
    import gc
    import shutil
    import subprocess

    from fp4lightning.cli import main

    disk = tmp_path / "disk"
    mount_tmpfs(disk, "2m")
    try:
        old = shutil.copytree(corpus, disk / "data")
        before = {p.name: p.read_bytes() for p in old.iterdir() if p.is_file()}
        # fill the disk up to 100 KB: room for the new tokenizer, not for the new shards
        free = shutil.disk_usage(disk).free
        (disk / "filler").write_bytes(b"\0" * (free - 100 * 1024))
        src = tmp_path_factory.getbasetemp() / "stdlib_text"
        capsys.readouterr()
        rc = main(["data", "prepare", "--source", str(src), "--out", str(old), "--vocab-size", str(TEST_VOCAB),
                   "--val-fraction", "0.05", "--force"])
        gc.collect()  # a shard file left open would report its unwritten bytes here
        err = capsys.readouterr().err
        assert rc == 2, err[-3000:]
        lines = err.strip().splitlines()
        assert len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"fp4lightning data: error: no space left on device while writing {old} (")
        assert "--out" in lines[0] and "unchanged" in lines[0]
        assert {p.name: p.read_bytes() for p in old.iterdir() if p.is_file()} == before
        assert sorted(p.name for p in disk.iterdir()) == ["data", "filler"]  # no build folder or lock file left
        PreparedData(old, verify=True)
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)  # lazy: even if a file there is still open
