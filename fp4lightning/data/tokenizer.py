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

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

__all__ = ["Tokenizer", "BOS_TOKEN", "EOS_TOKEN", "TOKENIZER_FILE", "bounded_pieces", "token_pieces",
           "MAX_PIECE_CHARS", "MAX_RUN_CHARS"]

#: longest text handed to the BPE trainer or encoder at once; longer texts are cut at whitespace (:func:`token_pieces`)
MAX_PIECE_CHARS = 1 << 16
#: longest pre-token (a "word" of the byte-level pre-tokenizer: a run of letters, of digits, of other
#: symbols or of whitespace) the trainer sees; a longer one reaches it as its first ``MAX_RUN_CHARS``
#: characters only, and the rest of it is not trained on. SentencePiece caps its pieces the same way
#: (``max_sentencepiece_length``). The trainer's memory grows with the length of every distinct
#: pre-token and its merge counting with the square of it, so without the cap one line of letters
#: costs memory in proportion to its length. BPE tokens never span pre-tokens, so the cap changes
#: nothing for text without such runs.
MAX_RUN_CHARS = 64
#: a run that may hold a pre-token longer than ``MAX_RUN_CHARS`` (a pre-token never mixes whitespace
#: and other characters, apart from one leading space)
_LONG_RUN = re.compile(r"\S{%d}|\s{%d}" % (MAX_RUN_CHARS, MAX_RUN_CHARS + 1))
_PROGRESS_CHARS = 10_000_000


# a whitespace character after a non-whitespace one: the byte-level pre-tokenizer (GPT-2's pattern)
# always starts a new pre-token there, whatever follows, and merges never cross pre-tokens. Python's
# \S is narrower than the pattern's (Python also counts \x1c-\x1f as whitespace), so a point found
# here is one there too.
_TOKEN_BOUNDARY = re.compile(r"(?<=\S)[ \t\n]")


def token_pieces(text: str, limit: int = MAX_PIECE_CHARS) -> Iterator[str]:
    """``text`` in pieces of at most ``limit`` characters, cut just before a whitespace character
    that follows a non-whitespace one, so the pieces' token ids, concatenated, are those of the
    whole text. A stretch of ``limit`` characters without such a point (no spaces at all) is cut
    at ``limit``; only there can the ids differ from encoding the text whole."""
    while len(text) > limit:
        cut = max((m.start() for m in _TOKEN_BOUNDARY.finditer(text, 1, limit + 1)), default=limit)
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


def bounded_pieces(texts: Iterable[str], progress: Callable[[str], None] | None = None) -> Iterator[str]:
    """``texts`` as pieces of at most ``MAX_PIECE_CHARS`` characters with no pre-token longer than
    ``MAX_RUN_CHARS``: a longer one is replaced by its first ``MAX_RUN_CHARS`` characters, a piece of its
    own (so no merge spans the cut). A long line without whitespace costs the trainer what its first
    characters do, not its length."""
    seen, next_report, t0 = 0, _PROGRESS_CHARS, time.perf_counter()
    for text in texts:
        for piece in token_pieces(text):
            yield from (_capped_pre_tokens(piece) if _LONG_RUN.search(piece) else (piece,))
        seen += len(text)
        if progress is not None and seen >= next_report:
            next_report = seen + _PROGRESS_CHARS
            progress(f"tokenizer training: read {seen / 1e6:.0f}M characters ({time.perf_counter() - t0:.0f}s)")
    if progress is not None:
        progress(f"tokenizer training: read {seen / 1e6:.1f}M characters in all ({time.perf_counter() - t0:.0f}s); "
                 "computing merges")


def _capped_pre_tokens(piece: str) -> Iterator[str]:
    """``piece`` cut around each pre-token longer than ``MAX_RUN_CHARS``, which becomes its first
    ``MAX_RUN_CHARS`` characters; the text between such pre-tokens is kept whole."""
    start = 0
    for _, (a, b) in _pre_tokenizer().pre_tokenize_str(piece):  # offsets in characters of ``piece``
        if b - a > MAX_RUN_CHARS:
            if a > start:
                yield piece[start:a]
            yield piece[a:a + MAX_RUN_CHARS]
            start = b
    if start < len(piece):
        yield piece[start:]


def _pre_tokenizer():
    """The byte-level pre-tokenizer (GPT-2's pattern) of every tokenizer trained here."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False)


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
    def train(cls, texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2,
              progress: Callable[[str], None] | None = None) -> "Tokenizer":
        """Train a byte-level BPE with ``vocab_size`` entries (special tokens included).

        The texts reach the trainer in bounded pieces (:func:`bounded_pieces`): one huge line costs
        time in proportion to its length, and a pre-token longer than ``MAX_RUN_CHARS`` (a line of
        letters without whitespace) only what its first ``MAX_RUN_CHARS`` characters cost;
        ``progress(message)`` is called every ~10 MB.
        """
        from tokenizers import Tokenizer as _Tok, decoders, models, pre_tokenizers, trainers

        tok = _Tok(models.BPE())
        tok.pre_tokenizer = _pre_tokenizer()
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[BOS_TOKEN, EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(bounded_pieces(texts, progress), trainer=trainer)
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
        try:
            self.backend.save(str(path))
        except Exception as e:  # the Rust side raises a bare Exception("No space left on device (os error 28)")
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from e

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
        # the _fast variant (tokenizers >= 0.20) skips the character offsets: same ids, ~1.8x faster
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        for enc in encode(texts, add_special_tokens=False):
            yield ([self.bos_id] if bos else []) + enc.ids + ([self.eos_id] if eos else [])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
