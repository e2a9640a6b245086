"""The progress lines of ``fp4lightning data prepare`` (its sources, tokenizer training and shard writer)."""

from __future__ import annotations

__all__ = ["progress"]


def progress(msg: str) -> None:
    """Print ``[data] msg`` at once (``prepare`` runs for minutes; its lines must not wait in a buffer)."""
    print(f"[data] {msg}", flush=True)
