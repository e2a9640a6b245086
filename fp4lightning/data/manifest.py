"""The prepared data folder's format: its manifest (``meta.json``), checksums and errors.

``<data_dir>`` holds ``tokenizer.json``, the token shards ``train-00000.bin``, ... /
``val-00000.bin`` (flat token ids, uint16 when the vocabulary fits, else uint32) and
``meta.json``, written last: its presence means "prepared"; it records the inputs (so a second
``prepare`` with the same arguments does nothing) and every shard's size and sha256.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


from fp4lightning.console import program
from fp4lightning.errors import InputNotFoundError

__all__ = ["META_FILE", "MIN_VOCAB", "FORMAT_VERSION", "DataNotPreparedError", "DataCorruptError",
           "default_data_dir", "prepare_command", "require_prepared", "entry_outside", "shard_problems", "data_fingerprint",
           "file_sha256"]

META_FILE = "meta.json"
MIN_VOCAB = 258  # the 256 byte tokens of byte-level BPE + BOS + EOS
FORMAT_VERSION = 2  # 2: per-shard sha256 in meta.json


class DataNotPreparedError(InputNotFoundError):
    """The data directory has no prepared shards; the message names the prepare command."""



class DataCorruptError(DataNotPreparedError):
    """A prepared shard is missing, truncated or altered; the message names it and the rebuild command."""



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
    cmd = f"{program()} data prepare --source {source} --out {out_dir}"
    for flag, value, default in (("--vocab-size", vocab_size, None), ("--val-fraction", val_fraction, 0.02),
                                 ("--max-tokens", max_tokens, None), ("--text-key", text_key, "text")):
        if value is not None and value != default:
            cmd += f" {flag} {value}"
    return cmd


def require_prepared(data_dir: str | Path, hint: str | None = None) -> Path:
    """``data_dir/meta.json``; :class:`DataNotPreparedError` in one line naming ``hint`` (the command
    that prepares the folder; default: the builtin corpus) where it is missing. Needs no torch: the
    command line checks the recipe's data with it before importing torch and Lightning."""
    meta = Path(data_dir) / META_FILE
    if not meta.is_file():
        raise DataNotPreparedError(f"no prepared data in {data_dir} ({META_FILE} missing); prepare it with: "
                                   f"{hint or prepare_command('builtin', data_dir)}")
    return meta



def file_sha256(path: Path) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB blocks (shards are hundreds of MiB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry_outside(out_dir: str | Path, meta: dict) -> str | None:
    """The first file entry of ``meta`` (the tokenizer, a shard) that leaves ``out_dir``, as
    ``"<key> = <value> ..."`` saying how: an absolute path, a path through ``..``, or a symlink that
    resolves outside the folder. None where every file stays inside: a prepared folder is self-contained,
    so a manifest from elsewhere cannot make training read (or ``prepare`` hash) other files."""
    root = Path(out_dir).resolve()
    entries = [("tokenizer", meta["tokenizer"])] + [
        (f"splits.{name}.shards[{i}].file", shard["file"])
        for name, split in meta["splits"].items() for i, shard in enumerate(split["shards"])]
    for key, value in entries:
        if not isinstance(value, str) or not value:
            return f"{key} = {value!r} is not a file name"
        if Path(value).is_absolute() or ".." in Path(value).parts:
            return f"{key} = {value!r} leaves the data folder"
        real = (root / value).resolve()
        if not real.is_relative_to(root):
            return f"{key} = {value!r} is a link to {real}, outside the data folder"
    return None


def shard_problems(out_dir: Path, meta: dict, checksums: bool = False) -> list[str]:
    """What is wrong with the prepared files of ``meta`` (empty: intact).

    A file entry leaving the folder (:func:`entry_outside`) is the one problem reported, and nothing
    outside is touched. Sizes are always compared with the manifest; ``checksums`` also re-hashes every
    shard (and the tokenizer) against the sha256 recorded at prepare time.
    """
    outside = entry_outside(out_dir, meta)
    if outside is not None:
        return [f"{Path(out_dir) / META_FILE}: {outside}"]
    problems = []
    import numpy as np  # here: the CLI's input checks import this module before any heavy package

    itemsize = np.dtype(meta["dtype"]).itemsize
    tok = out_dir / meta["tokenizer"]
    if not tok.is_file():
        problems.append(f"{tok} is missing")
    elif checksums and meta.get("tokenizer_sha256") and file_sha256(tok) != meta["tokenizer_sha256"]:
        problems.append(f"{tok} does not match its sha256 in {META_FILE}")
    for split in meta["splits"].values():
        for shard in split["shards"]:
            problem = _shard_problem(out_dir / shard["file"], shard, itemsize, checksums)
            if problem is not None:
                problems.append(problem)
    return problems


def _shard_problem(path: Path, shard: dict, itemsize: int, checksums: bool) -> str | None:
    """What is wrong with one shard file against its manifest entry ``shard`` (None: intact)."""
    if not path.is_file():
        return f"shard {path} is missing"
    if path.stat().st_size != shard["tokens"] * itemsize:
        return (f"shard {path} has {path.stat().st_size} bytes, {META_FILE} records "
                f"{shard['tokens'] * itemsize} (truncated or replaced)")
    if checksums and shard.get("sha256") and file_sha256(path) != shard["sha256"]:
        return f"shard {path} does not match its sha256 in {META_FILE} (altered on disk)"
    if checksums and not shard.get("sha256"):
        return f"shard {path} has no sha256 in {META_FILE} (prepared by an older version)"
    return None


def data_fingerprint(data_dir: str | Path) -> str | None:
    """sha256 of what ``prepare`` recorded in ``<data_dir>/meta.json`` about the tokens (the
    tokenizer's and every shard's sha256 and token count): equal for a copied or moved folder,
    different once it is prepared again. None where there is no readable ``meta.json``. Checkpoints
    keep it (``--resume`` compares the corpus by content) and so do ``compare`` summaries."""
    try:
        meta = json.loads((Path(data_dir) / META_FILE).read_text())
        what = {"tokenizer_sha256": meta["tokenizer_sha256"], "dtype": meta["dtype"],
                "splits": {name: [(s["file"], s["tokens"], s["sha256"]) for s in split["shards"]]
                           for name, split in sorted(meta["splits"].items())}}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
