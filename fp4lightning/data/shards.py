"""Reading a prepared data folder: its tokenizer, manifest and memory-mapped token shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fp4lightning.data.manifest import (DataCorruptError, entry_outside, prepare_command, require_prepared,
                                        shard_problems)
from fp4lightning.data.tokenizer import Tokenizer

__all__ = ["PreparedData"]


class PreparedData:
    """A prepared data directory: ``tokenizer``, ``meta`` and memory-mapped ``shards(split)``.

    A missing directory raises :class:`DataNotPreparedError` showing ``prepare_hint`` (the
    command that prepares it; default: the builtin corpus).
    """

    def __init__(self, data_dir: str | Path, prepare_hint: str | None = None, verify: bool = False):
        self.dir = Path(data_dir)
        hint = prepare_hint or prepare_command("builtin", self.dir)
        meta_path = require_prepared(self.dir, hint)
        try:
            self.meta = json.loads(meta_path.read_text())
            self.meta["splits"]["train"]["shards"], self.meta["dtype"], self.meta["tokenizer"]
            outside = entry_outside(self.dir, self.meta)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataCorruptError(f"{meta_path} is damaged ({type(e).__name__}: {e}); rebuild with:\n"
                                   f"  {hint} --force") from e
        if outside is not None:
            raise DataCorruptError(f"{meta_path}: {outside}; a prepared folder keeps its files inside it, so "
                                   f"training reads nothing else: prepare it again with: {hint} --force")
        # sizes always (cheap); checksums on request (fp4lightning train --verify-data)
        problems = shard_problems(self.dir, self.meta, checksums=verify)
        if problems:
            raise DataCorruptError(f"prepared data in {self.dir} is damaged: {problems[0]}"
                                   f"{f' (and {len(problems) - 1} more)' if len(problems) > 1 else ''}; "
                                   f"rebuild with:\n  {hint} --force")
        self.hint = hint
        tok_path = self.dir / self.meta["tokenizer"]
        try:
            self.tokenizer = Tokenizer.from_file(tok_path)
        except Exception as e:  # the tokenizers library raises a bare Exception ("expected value at line 1 ...")
            raise DataCorruptError(f"{tok_path} is damaged ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                                   f"rebuild with:\n  {hint} --force") from e
        self._dtype = np.dtype(self.meta["dtype"])

    def shard_files(self, split: str) -> list[Path]:
        return [self.dir / s["file"] for s in self.meta["splits"][split]["shards"] if s["tokens"] > 0]

    def shards(self, split: str) -> list[np.ndarray]:
        return [
            np.memmap(self.dir / s["file"], dtype=self._dtype, mode="r", shape=(s["tokens"],))
            for s in self.meta["splits"][split]["shards"]
            if s["tokens"] > 0
        ]

    def id_check(self, split: str) -> dict:
        """Keyword arguments of ``WindowDataset`` / ``ValWindowDataset`` that check every window's ids
        against the tokenizer and name the shard and the rebuild command on a bad one."""
        return {"vocab_size": self.tokenizer.vocab_size, "names": [str(p) for p in self.shard_files(split)],
                "hint": f"{self.hint} --force"}

    def num_tokens(self, split: str) -> int:
        return self.meta["splits"][split]["tokens"]
