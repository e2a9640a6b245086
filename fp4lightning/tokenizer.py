"""Byte-level BPE tokenizer trained on the corpus with Hugging Face ``tokenizers``.

Part of the data pipeline for the paper's pretraining runs (arXiv 2501.17116, section 7);
the paper used LLaMA-2's tokenizer, which cannot be fetched offline, so each prepared
corpus trains its own byte-level BPE (every byte is in the base alphabet, so any text
encodes without unknown tokens and decodes back exactly).

Two special tokens, ``<|bos|>`` (id 0) and ``<|eos|>`` (id 1), mark document boundaries.
The tokenizer is one JSON file: ``<data_dir>/tokenizer.json`` beside the shards, copied
to ``<run_dir>/tokenizer.json`` by training and embedded in every checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["Tokenizer", "BOS_TOKEN", "EOS_TOKEN", "TOKENIZER_FILE"]

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    """Thin wrapper around a ``tokenizers.Tokenizer`` with BOS/EOS ids.

    ``encode(text, bos=True, eos=False) -> list[int]``, ``decode(ids) -> str``,
    ``bos_id``, ``eos_id``, ``vocab_size``; ``Tokenizer.from_file(path)`` /
    ``Tokenizer.from_str(json)`` / ``save(path)`` / ``to_str()``.
    """

    bos_token = BOS_TOKEN
    eos_token = EOS_TOKEN

    def __init__(self, backend):
        self.backend = backend  # tokenizers.Tokenizer
        self.bos_id = backend.token_to_id(BOS_TOKEN)
        self.eos_id = backend.token_to_id(EOS_TOKEN)
        if self.bos_id is None or self.eos_id is None:
            raise ValueError(f"tokenizer lacks the special tokens {BOS_TOKEN!r} / {EOS_TOKEN!r}")

    # ----------------------------------------------------------------- construction
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> "Tokenizer":
        """Train a byte-level BPE with ``vocab_size`` entries (special tokens included)."""
        from tokenizers import Tokenizer as _Tok, decoders, models, pre_tokenizers, trainers

        tok = _Tok(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[BOS_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} not found")
        return cls(_Tok.from_file(str(path)))

    @classmethod
    def from_str(cls, json_str: str) -> "Tokenizer":
        from tokenizers import Tokenizer as _Tok

        return cls(_Tok.from_str(json_str))

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    def to_str(self) -> str:
        return self.backend.to_str()

    # ----------------------------------------------------------------- use
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally wrapped in BOS/EOS."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str], bos: bool = True, eos: bool = True) -> Iterator[list[int]]:
        """Encode many documents in parallel (the Rust side uses all cores)."""
        for enc in self.backend.encode_batch(texts, add_special_tokens=False):
            yield ([self.bos_id] if bos else []) + enc.ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
