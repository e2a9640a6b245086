"""Helpers shared by the data modules: progress lines and file hashes."""

from __future__ import annotations

import hashlib
from pathlib import Path


def _log(msg: str) -> None:
    print(f"[data] {msg}", flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
