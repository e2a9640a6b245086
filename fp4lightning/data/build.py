"""``prepare``: tokenise a corpus into token shards, atomically and idempotently.

A byte-level BPE (:mod:`fp4lightning.data.tokenizer`) is trained on the training split, then every
document is written as ``BOS tokens EOS`` into the train or validation shards; each document goes
to the validation split by a hash of its name, so the split is deterministic, spread over the
whole corpus, and decidable while streaming. The folder is built beside ``out_dir`` and swapped
in when complete, under a lock (one ``prepare`` per folder at a time); ``meta.json``
(:mod:`fp4lightning.data.manifest`) is written last.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fp4lightning.data.manifest import (
    FORMAT_VERSION,
    META_FILE,
    MIN_VOCAB,
    default_data_dir,
    file_sha256,
    shard_problems,
)
from fp4lightning.data.progress import progress
from fp4lightning.errors import check_writable_dir
from fp4lightning.data.sources import BUILTIN_PACKAGES, DATA_SUFFIXES, BadRecords, DataSourceError, iter_documents
from fp4lightning.data.tokenizer import TOKENIZER_FILE, Tokenizer, token_pieces

__all__ = ["prepare", "SHARD_TOKENS"]

SHARD_TOKENS = 1 << 28  # 268M tokens: 512 MiB per uint16 shard
#: characters per call of the tokenizer's encoder: its encodings hold ~200 bytes per character
#: until their ids are written, so this bounds prepare's memory whatever the documents' sizes
ENCODE_CHARS = 1 << 18


def _is_val(doc_name: str, val_fraction: float) -> bool:
    return zlib.crc32(doc_name.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


def _no_space(e: BaseException) -> bool:
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def _disk_full_error(out_dir: Path, written: int) -> DataSourceError:
    """The one-line error of a ``prepare`` stopped by a full disk (``written``: bytes of new data by then)."""
    def size(n: int) -> str:
        return next((f"{n / 10**e:.1f} {unit}" for e, unit in ((9, "GB"), (6, "MB"), (3, "KB")) if n >= 10**e),
                    f"{n} bytes")

    probe = out_dir.resolve()
    while not probe.exists():
        probe = probe.parent
    reached = f"the new data had reached {size(written)}; " if written else ""
    free = size(shutil.disk_usage(probe).free)
    kept = (f"the previous data in {out_dir} is unchanged" if (out_dir / META_FILE).is_file()
            else "the partial data was removed")
    return DataSourceError(f"no space left on device while writing {out_dir} ({reached}{free} free there now): "
                           f"free space on that disk or choose another --out; {kept}")


# ----------------------------------------------------------------------------- prepare
class _ShardWriter:
    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
        self.files: list[dict] = []
        self._f = None
        self._n = 0
        self.total = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.files):05d}.bin"
        self._f = open(self.out_dir / (name + ".tmp"), "wb")
        self._hash = hashlib.sha256()
        self.files.append({"file": name, "tokens": 0})
        self._n = 0

    def write(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._f is None or self._n >= self.shard_tokens:
                self.close()
                self._open()
            take = ids[: self.shard_tokens - self._n]
            data = take.astype(self.dtype).tobytes()
            self._f.write(data)
            self._hash.update(data)
            self._n += len(take)
            self.total += len(take)
            self.files[-1]["tokens"] = self._n
            ids = ids[len(take):]

    def abort(self) -> None:
        """Close the open shard after a failed write, quietly: a buffered writer that still holds
        bytes a full disk refused would otherwise report it again when garbage-collected."""
        if self._f is not None:
            with contextlib.suppress(OSError):
                self._f.close()
            self._f = None

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            name = self.files[-1]["file"]
            self.files[-1]["sha256"] = self._hash.hexdigest()
            os.replace(self.out_dir / (name + ".tmp"), self.out_dir / name)
            self._f = None



class _FolderLock:
    """An exclusive lock on ``out_dir`` (a sibling ``.<name>.lock`` file): one ``prepare`` at a time.

    A second ``prepare`` into the same folder waits for the first, then finds the data up to date.
    The holder deletes the file before it lets go, so a finished ``prepare`` leaves none behind; a
    waiter that then holds the lock of a deleted file opens the path again (whoever locks the file
    that is at the path holds the lock).
    """

    def __init__(self, out_dir: Path):
        self.path = out_dir.parent / f".{out_dir.name}.lock"
        self._f = None

    def __enter__(self) -> "_FolderLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while not self._lock_current_file():
            pass
        self._f.seek(0)
        self._f.truncate()
        self._f.write(str(os.getpid()))
        self._f.flush()
        return self

    def _lock_current_file(self) -> bool:
        """Open and lock the file at ``self.path``; False (unlocked, closed) if it was deleted meanwhile."""
        import fcntl

        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "?"
            progress(f"another `data prepare` (pid {holder}) is writing {self.path.parent / self.path.name[1:-5]}; "
                     "waiting for it to finish")
            fcntl.flock(self._f, fcntl.LOCK_EX)
        try:
            current = os.stat(self.path).st_ino == os.fstat(self._f.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if not current:
            self._f.close()
        return current

    def __exit__(self, *exc) -> None:
        import fcntl

        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # still held: a waiter finds the file gone and opens the path again
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


def _recover_and_clean(out_dir: Path) -> None:
    """Under the lock: undo a swap cut short by a crash, and remove a killed run's build folders."""
    olds = sorted(out_dir.parent.glob(f".{out_dir.name}.old-*"))
    if not out_dir.exists():
        for old in olds:
            if (old / META_FILE).is_file():
                os.rename(old, out_dir)  # the previous complete data, put back
                progress(f"restored {out_dir} from an interrupted update")
                break
    for leftover in [*out_dir.parent.glob(f".{out_dir.name}.old-*"), *out_dir.parent.glob(f".{out_dir.name}.build-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _swap_in(build: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the complete ``build`` folder: two renames, the old data deleted last."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(build, out_dir)
    shutil.rmtree(old, ignore_errors=True)


@dataclass
class _Job:
    """The arguments of one :func:`prepare` call, checked."""

    source: str
    out_dir: Path
    cache_dir: Path
    vocab_size: int
    val_fraction: float
    max_tokens: int | None
    tokenizer_train_chars: int
    text_key: str
    force: bool
    shard_tokens: int
    on_bad_record: str
    #: what meta.json records of the call: a second ``prepare`` with the same ``args`` does nothing
    args: dict = field(init=False)

    def __post_init__(self) -> None:
        self.args = {
            "format_version": FORMAT_VERSION,
            "source": self.source if not Path(self.source).exists() else str(Path(self.source).resolve()),
            "vocab_size": self.vocab_size,
            "val_fraction": self.val_fraction,
            "max_tokens": self.max_tokens,
            "tokenizer_train_chars": self.tokenizer_train_chars,
            "text_key": self.text_key,
            "on_bad_record": self.on_bad_record,
        }

    def documents(self, bad: BadRecords | None = None) -> Iterator[tuple[str, str]]:
        return iter_documents(self.source, self.cache_dir, self.text_key, bad)


def prepare(
    source: str = "builtin",
    out_dir: str | Path | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.02,
    max_tokens: int | None = None,
    tokenizer_train_chars: int = 200_000_000,
    text_key: str = "text",
    cache_dir: str | Path | None = None,
    force: bool = False,
    shard_tokens: int = SHARD_TOKENS,
    on_bad_record: str = "error",
    then: Callable[[Path], object] | None = None,
) -> Path:
    """Tokenise ``source`` into ``out_dir`` (see the module docstring); returns ``out_dir``.

    Idempotent: if ``out_dir/meta.json`` records the same arguments, nothing is redone.
    ``max_tokens`` caps the tokens written (needed for ``hf:`` corpora such as DCLM);
    the tokenizer trains on the first ``tokenizer_train_chars`` characters. ``then(out_dir)`` runs
    while the folder is still locked (what ``data prepare`` writes into the prepared folder besides
    the data: the offline eval tasks), so a concurrent ``prepare`` cannot swap the folder under it.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_data_dir(source)
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / "downloads"
    _check_arguments(vocab_size, val_fraction, max_tokens, on_bad_record)
    job = _Job(source, out_dir, cache_dir, vocab_size, val_fraction, max_tokens, tokenizer_train_chars, text_key,
               force, shard_tokens, on_bad_record)
    check_writable_dir(out_dir, "--out", DataSourceError)
    try:
        with _FolderLock(out_dir):
            _prepare_locked(job)
            if then is not None:
                then(out_dir)
    except OSError as e:  # the lock file or the build folder could not be written
        if _no_space(e):
            raise _disk_full_error(out_dir, 0) from e
        raise
    return out_dir


def _check_arguments(vocab_size: int, val_fraction: float, max_tokens: int | None, on_bad_record: str) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise DataSourceError(f"--val-fraction must be in (0, 1) (both splits need text), got {val_fraction}")
    if not MIN_VOCAB <= vocab_size <= 1 << 31:
        raise DataSourceError(f"--vocab-size must be at least {MIN_VOCAB} (256 byte tokens + BOS + EOS), "
                              f"got {vocab_size}")
    if max_tokens is not None and max_tokens < 1:
        raise DataSourceError(f"--max-tokens must be a positive number of tokens (omit it for the whole source), "
                              f"got {max_tokens}")
    BadRecords(on_bad_record)  # validates the policy


def _prepare_locked(job: _Job) -> None:
    _recover_and_clean(job.out_dir)
    if not job.force and _up_to_date(job):
        return
    # reach the source before building: downloads, hub access and paths fail here
    next(job.documents(), None)
    # build beside the folder and swap it in only when complete: a failure or a kill leaves the
    # previous data as it was
    build = job.out_dir.parent / f".{job.out_dir.name}.build-{os.getpid()}"
    build.mkdir(parents=True)
    try:
        _build(job, build)
    except BaseException as e:
        written = sum(p.stat().st_size for p in build.iterdir()) if _no_space(e) else 0
        shutil.rmtree(build, ignore_errors=True)
        if _no_space(e):
            raise _disk_full_error(job.out_dir, written) from e
        raise
    _swap_in(build, job.out_dir)


def _up_to_date(job: _Job) -> bool:
    """True (and says so) when ``job.out_dir`` holds intact data prepared with the same arguments."""
    meta_path = job.out_dir / META_FILE
    if not meta_path.is_file():
        return False
    meta = json.loads(meta_path.read_text())
    problems = shard_problems(job.out_dir, meta, checksums=True) if meta.get("args") == job.args else None
    if problems == []:
        progress(f"{job.out_dir} is up to date ({meta['splits']['train']['tokens']:,} train / "
                 f"{meta['splits']['val']['tokens']:,} val tokens, checksums verified); nothing to do "
                 "(--force redoes it)")
        return True
    if problems:
        progress(f"{job.out_dir} is damaged ({problems[0]}"
                 f"{f' and {len(problems) - 1} more' if len(problems) > 1 else ''}); preparing again")
    else:
        progress(f"{job.out_dir} was prepared with different arguments; preparing again")
    return False


def _build(job: _Job, out_dir: Path) -> None:
    """Tokenizer, shards and meta.json of ``job.source`` into the (new, empty) folder ``out_dir``."""
    t0 = time.perf_counter()
    tok = _train_tokenizer(job, out_dir, t0)
    writers, n_docs, n_chars = _write_shards(job, tok, out_dir)
    if writers["val"].total == 0 or writers["train"].total == 0:
        raise DataSourceError(
            f"{job.source}: {n_docs} documents gave {writers['train'].total} train / {writers['val'].total} val "
            "tokens; both splits need text (add more documents or raise --val-fraction)"
        )
    meta = {
        "args": job.args,
        "dtype": writers["train"].dtype.name,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": file_sha256(out_dir / TOKENIZER_FILE),
        "documents": n_docs,
        "characters": n_chars,
        "splits": {s: {"tokens": w.total, "shards": w.files} for s, w in writers.items()},
        "builtin_packages": [p.__dict__ for p in BUILTIN_PACKAGES] if job.source == "builtin" else None,
    }
    meta_path = out_dir / META_FILE
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, meta_path)  # meta.json last: its presence means the shards are complete
    progress(f"done in {time.perf_counter() - t0:.1f}s: {n_docs:,} documents, {n_chars / 1e6:.1f}M characters -> "
             f"{writers['train'].total:,} train / {writers['val'].total:,} val tokens "
             f"({n_chars / max(1, writers['train'].total + writers['val'].total):.2f} chars/token)")


# 1) the tokenizer, trained on the training split's documents only

def _train_tokenizer(job: _Job, out_dir: Path, t0: float) -> Tokenizer:
    progress(f"training a byte-level BPE tokenizer (vocab {job.vocab_size}) on {job.source}")
    tok = Tokenizer.train(_training_texts(job), vocab_size=job.vocab_size, progress=progress)
    tok.save(out_dir / TOKENIZER_FILE)
    progress(f"tokenizer: {tok} saved to {out_dir / TOKENIZER_FILE} ({time.perf_counter() - t0:.1f}s)")
    return tok


def _training_texts(job: _Job) -> Iterator[str]:
    """The training split's texts, up to ``job.tokenizer_train_chars`` characters.

    Both splits are counted while the text is read, so a source that leaves one of them empty is
    refused here, before the merges are computed."""
    seen, docs = 0, {False: 0, True: 0}  # documents by held_out
    for name, text in job.documents(BadRecords(job.on_bad_record)):
        held_out = _is_val(name, job.val_fraction)
        docs[held_out] += 1
        if seen >= job.tokenizer_train_chars:  # enough to train on: read on only to find a held-out document
            if docs[True]:
                return
        elif not held_out:
            yield text
            seen += len(text)
    if not docs[True] and not docs[False]:
        raise DataSourceError(f"{job.source}: no documents found (a folder is read for files ending in "
                              f"{', '.join(sorted(DATA_SUFFIXES))})")
    if not docs[True] or not docs[False]:
        empty, change = ("validation", "raise") if not docs[True] else ("training", "lower")
        raise DataSourceError(
            f"{job.source}: none of its {sum(docs.values())} documents is in the {empty} split "
            f"(--val-fraction {job.val_fraction} holds out documents by a hash of their name); "
            f"{change} --val-fraction or add documents (a text file is one document per ~8 KB between blank lines)")


# 2) every document into the train / val shards, ENCODE_CHARS of text per encoder call

def _write_shards(job: _Job, tok: Tokenizer, out_dir: Path) -> tuple[dict[str, _ShardWriter], int, int]:
    """Tokenise every document into the train / val shards of ``out_dir``, each as ``BOS tokens EOS``;
    returns the closed shard writers by split, the number of documents and of characters."""
    dtype = np.dtype(np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)
    writers = {s: _ShardWriter(out_dir, s, dtype, job.shard_tokens) for s in ("train", "val")}
    batch = _EncodeBatch(tok)
    n_docs, n_chars, last = 0, 0, time.perf_counter()
    bad = BadRecords(job.on_bad_record)
    try:
        for name, text in job.documents(bad):
            batch.add(writers["val" if _is_val(name, job.val_fraction) else "train"], text)
            n_docs += 1
            n_chars += len(text)
            if time.perf_counter() - last > 2.0:
                last = time.perf_counter()
                progress(f"tokenised {n_docs:,} documents, {n_chars / 1e6:.1f}M characters, "
                         f"{writers['train'].total + writers['val'].total:,} tokens")
            if job.max_tokens is not None and writers["train"].total + writers["val"].total >= job.max_tokens:
                progress(f"reached max_tokens={job.max_tokens:,}")
                break
        batch.flush()
        for w in writers.values():
            w.close()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    bad.summary()
    return writers, n_docs, n_chars


class _EncodeBatch:
    """Pieces of documents waiting for one call of the tokenizer's encoder (about ``ENCODE_CHARS``
    characters), each with the shard writer it goes to."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.pending: list[tuple[_ShardWriter, str, bool, bool]] = []  # (writer, piece, first of its document, last)
        self.chars = 0

    def add(self, writer: _ShardWriter, text: str) -> None:
        """Queue one document for ``writer``; a long one in pieces cut where the ids do not change (token_pieces)."""
        pieces = list(token_pieces(text)) or [""]
        for k, piece in enumerate(pieces):
            self.pending.append((writer, piece, k == 0, k == len(pieces) - 1))
            self.chars += len(piece)
            if self.chars >= ENCODE_CHARS:
                self.flush()

    def flush(self) -> None:
        """Encode the queued pieces in one call and write their ids (BOS before a document, EOS after it)."""
        tok = self.tok
        encoded = tok.encode_batch([p for _, p, _, _ in self.pending], bos=False, eos=False)
        for (w, _, first, end), ids in zip(self.pending, encoded):
            w.write(np.asarray(([tok.bos_id] if first else []) + ids + ([tok.eos_id] if end else []), dtype=np.int64))
        self.pending.clear()
        self.chars = 0
