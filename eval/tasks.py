"""Offline zero-shot tasks built from the held-out split of a prepared corpus.

The paper scores FP4 against BF16 with the lm-evaluation-harness on zero-shot accuracy
(PiQA, HellaSwag, ..., LAMBADA) and on perplexity (LAMBADA, WikiText, Pile-10k)
(arXiv 2501.17116, section 7). Those benchmarks live on the Hugging Face hub; these three
tasks have the same *shape* and need nothing but a prepared data directory, so an FP4 vs
BF16 comparison runs anywhere:

* ``fp4l_lastword`` (LAMBADA-style, ``loglikelihood``): a passage of 30-80 words that ends
  a sentence; the model must predict its last word. Metrics: ``acc`` (the word is the
  greedy continuation) and ``perplexity`` (of the word), as ``lambada_openai``.
* ``fp4l_cloze`` (HellaSwag-style, ``multiple_choice``): a few sentences of context and
  four candidate next sentences, the true one and three taken from other held-out
  documents. Metrics: ``acc`` and ``acc_norm`` (log-likelihood per byte).
* ``fp4l_ppl`` (WikiText-style, ``loglikelihood_rolling``): whole held-out documents.
  Metrics: ``word_perplexity``, ``byte_perplexity``, ``bits_per_byte``.

The text is the validation split written by ``fp4lightning data prepare``: documents are
stored as ``BOS tokens EOS`` and the tokenizer is a byte-level BPE, so they decode back to
the original held-out text exactly. Nothing here was seen in training.

Layout written by :func:`build_offline_tasks` into ``<data_dir>/eval_tasks/``: one JSONL
and one lm-eval YAML per task (``dataset_path: json`` with an ABSOLUTE ``data_files`` path,
because lm-eval resolves relative paths against the current directory), and
``manifest.json`` (item counts, the source data's arguments). Load them with
``lm_eval.tasks.TaskManager(include_path=<that dir>, include_defaults=False)``; the tag
``fp4l_offline`` selects all three.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fp4lightning.errors import UsageError

__all__ = [
    "OFFLINE_TASKS",
    "OFFLINE_TAG",
    "TASKS_SUBDIR",
    "build_offline_tasks",
    "offline_tasks_dir",
    "offline_tasks_ready",
    "heldout_documents",
]

TASKS_SUBDIR = "eval_tasks"
OFFLINE_TAG = "fp4l_offline"
OFFLINE_TASKS = ("fp4l_lastword", "fp4l_cloze", "fp4l_ppl")
MANIFEST = "manifest.json"
TASKS_FORMAT_VERSION = 1

# held-out text read per build: enough for ~1000 items of each task at any corpus size
MAX_HELDOUT_CHARS = 4_000_000
MAX_ITEMS = 1000  # per multiple-choice / last-word task
MAX_PPL_DOCS = 200
LASTWORD_MIN_WORDS, LASTWORD_MAX_WORDS = 30, 80
CLOZE_MIN_CONTEXT_WORDS, CLOZE_MAX_CONTEXT_WORDS = 15, 60
CLOZE_MIN_ENDING_WORDS, CLOZE_MAX_ENDING_WORDS = 5, 30
CLOZE_CHOICES = 4
_SCAN_TOKENS = 1 << 20  # validation tokens read per step while looking for documents
SEED = 20250129  # fixed: the tasks are a pure function of the held-out text

# A last word: letters (inner apostrophes/hyphens allowed), then sentence-final
# punctuation and optional closing quotes/brackets, which are cut from the passage.
_LAST_WORD = re.compile(r"([A-Za-z][A-Za-z'\-]*[A-Za-z])[.!?]+[\"')\]\u2019\u201d]*")
# a sentence ends at . ! or ?, optionally followed by one closing quote or bracket
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]\u2019\u201d])\s+")


def offline_tasks_dir(data_dir: str | Path) -> Path:
    """``<data_dir>/eval_tasks``: where :func:`build_offline_tasks` writes."""
    return Path(data_dir).resolve() / TASKS_SUBDIR


# ----------------------------------------------------------------------------- held-out text
def heldout_documents(data_dir: str | Path, max_chars: int = MAX_HELDOUT_CHARS) -> Iterator[str]:
    """Decoded documents of the validation split, in order, up to about ``max_chars`` characters.

    Streams the memory-mapped shards in chunks, so the cost is ~``max_chars`` of work
    however large the split is (a DCLM-sized split has shards of 2^28 tokens). A
    document can straddle two shards (the writer cuts shards by token count).
    """
    # imported here: fp4lightning.data loads huggingface_hub, which must come after fp4lightning.eval.run
    # (which imports this module) has set the Hugging Face offline switches
    from fp4lightning.data import PreparedData

    data = PreparedData(data_dir)
    tok = data.tokenizer
    seen = 0
    for ids in _document_ids(data.shards("val"), tok.bos_id):
        text = _decode_doc(tok, ids, tok.bos_id, tok.eos_id)
        if text:
            yield text
            seen += len(text)
            if seen >= max_chars:
                return


def _document_ids(shards: list[np.ndarray], bos: int) -> Iterator[np.ndarray]:
    """The token ids of each document (``BOS ... EOS``) of ``shards``, in order; a document can straddle
    two shards (the writer cuts shards by token count)."""
    carry: list[np.ndarray] = []  # pieces of the current, unfinished document
    for chunk in _chunks(shards):
        cuts = [0, *np.flatnonzero(chunk == bos).tolist(), len(chunk)]
        for a, b in zip(cuts[:-1], cuts[1:]):
            if a == b:
                continue
            if chunk[a] == bos and carry:  # a new document starts: emit the previous one
                yield np.concatenate(carry)
                carry = []
            carry.append(chunk[a:b])
    if carry:
        yield np.concatenate(carry)


def _chunks(shards: list[np.ndarray]) -> Iterator[np.ndarray]:
    """The memory-mapped shards read in pieces of ``_SCAN_TOKENS`` tokens."""
    for shard in shards:
        for lo in range(0, len(shard), _SCAN_TOKENS):
            yield np.asarray(shard[lo : lo + _SCAN_TOKENS])


def _decode_doc(tok, ids: np.ndarray, bos: int, eos: int) -> str:
    ids = ids.tolist()
    if ids and ids[0] == bos:
        ids = ids[1:]
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    return tok.decode(ids).strip()


# ----------------------------------------------------------------------------- task items
def _lastword_items(docs: list[str]) -> list[dict]:
    """LAMBADA-style passages (single line, words joined by one space) ending at a word."""
    items = []
    for doc in docs:
        words = doc.split()
        start = 0
        while start + LASTWORD_MIN_WORDS < len(words) and len(items) < MAX_ITEMS:
            end = None
            for i in range(start + LASTWORD_MIN_WORDS, min(len(words), start + LASTWORD_MAX_WORDS)):
                m = _LAST_WORD.fullmatch(words[i])
                if m and len(m.group(1)) >= 3:
                    end = i
                    break
            if end is None:
                start += LASTWORD_MAX_WORDS
                continue
            target = _LAST_WORD.fullmatch(words[end]).group(1)
            items.append({"text": " ".join(words[start:end] + [target]), "target": target})
            start = end + 1
    return items


def _sentences(doc: str) -> list[str]:
    out = []
    for para in re.split(r"\n\s*\n", doc):
        flat = " ".join(para.split())
        out.extend(s.strip() for s in _SENTENCE_END.split(flat) if s.strip())
    return out


def _cloze_items(docs: list[str]) -> list[dict]:
    """Context sentences + the true next sentence and three endings from other documents."""
    cands = []  # (doc index, context, ending)
    for d, doc in enumerate(docs):
        sents = _sentences(doc)
        i = 0
        while i < len(sents):
            ctx, n = [], 0
            while i < len(sents) and n < CLOZE_MIN_CONTEXT_WORDS:
                ctx.append(sents[i])
                n += len(sents[i].split())
                i += 1
            if i >= len(sents):
                break
            ending = sents[i]
            i += 1
            if n <= CLOZE_MAX_CONTEXT_WORDS and CLOZE_MIN_ENDING_WORDS <= len(ending.split()) <= CLOZE_MAX_ENDING_WORDS:
                cands.append((d, " ".join(ctx), ending))
    rng = random.Random(SEED)
    items = []
    for k, (d, ctx, gold) in enumerate(cands):
        if len(items) >= MAX_ITEMS:
            break
        # distractors from other documents when there are any, so the true ending is
        # told apart by its coherence with the context rather than by a coin flip
        pool = [e for (d2, _, e) in cands if d2 != d and e != gold] or [e for (_, _, e) in cands if e != gold]
        pool = sorted(set(pool))
        if len(pool) < CLOZE_CHOICES - 1:
            continue
        choices = rng.sample(pool, CLOZE_CHOICES - 1)
        label = rng.randrange(CLOZE_CHOICES)
        choices.insert(label, gold)
        items.append({"context": ctx, "choices": choices, "label": label})
    return items


def _ppl_items(docs: list[str]) -> list[dict]:
    return [{"text": doc} for doc in docs[:MAX_PPL_DOCS]]


# ----------------------------------------------------------------------------- YAML
def _task_configs(out_dir: Path) -> dict[str, dict]:
    def data(name: str) -> dict:
        return {"data_files": {"test": str(out_dir / f"{name}.jsonl")}}

    common = {"tag": [OFFLINE_TAG], "dataset_path": "json", "test_split": "test"}
    return {
        "fp4l_lastword": {
            **common,
            "task": "fp4l_lastword",
            "dataset_kwargs": data("fp4l_lastword"),
            "output_type": "loglikelihood",
            "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
            "doc_to_target": "{{' '+text.split(' ')[-1]}}",
            "metric_list": [
                {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            ],
            "metadata": {"version": TASKS_FORMAT_VERSION},
        },
        "fp4l_cloze": {
            **common,
            "task": "fp4l_cloze",
            "dataset_kwargs": data("fp4l_cloze"),
            "output_type": "multiple_choice",
            "doc_to_text": "{{context}}",
            "doc_to_choice": "choices",
            "doc_to_target": "{{label}}",
            "metric_list": [
                {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
            ],
            "metadata": {"version": TASKS_FORMAT_VERSION},
        },
        "fp4l_ppl": {
            **common,
            "task": "fp4l_ppl",
            "dataset_kwargs": data("fp4l_ppl"),
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
            "metric_list": [
                {"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False},
            ],
            "metadata": {"version": TASKS_FORMAT_VERSION},
        },
    }


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _source_key(data_dir: Path) -> dict:
    meta = json.loads((data_dir / "meta.json").read_text())
    return {"format_version": TASKS_FORMAT_VERSION, "data_args": meta.get("args"),
            "val_tokens": meta["splits"]["val"]["tokens"], "dir": str(offline_tasks_dir(data_dir))}


def offline_tasks_ready(data_dir: str | Path) -> bool:
    """True if ``<data_dir>/eval_tasks`` is complete and was built from this data, at this path."""
    data_dir = Path(data_dir).resolve()
    out = offline_tasks_dir(data_dir)
    manifest = out / MANIFEST
    if not manifest.is_file() or not (data_dir / "meta.json").is_file():
        return False
    try:
        m = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    if m.get("source") != _source_key(data_dir):
        return False
    return all((out / f"{t}.jsonl").is_file() and (out / f"{t}.yaml").is_file() for t in OFFLINE_TASKS)


def build_offline_tasks(data_dir: str | Path, force: bool = False, strict: bool = True) -> Path | None:
    """Write the offline tasks of a prepared data directory; returns ``<data_dir>/eval_tasks``.

    Idempotent (a complete, current ``eval_tasks`` folder is left alone unless ``force``);
    rebuilt when the data directory was re-prepared or moved, since the YAMLs hold
    absolute paths. Raises ``DataNotPreparedError`` if ``data_dir`` is not prepared and
    ``ValueError`` if its held-out split is too small to make every task; with
    ``strict=False`` (what ``data prepare`` uses) that case prints a warning and returns None.
    """
    import yaml

    data_dir = Path(data_dir).resolve()
    out = offline_tasks_dir(data_dir)
    if not force and offline_tasks_ready(data_dir):
        return out
    docs = list(heldout_documents(data_dir))
    items = {
        "fp4l_lastword": _lastword_items(docs),
        "fp4l_cloze": _cloze_items(docs),
        "fp4l_ppl": _ppl_items(docs),
    }
    empty = [name for name, its in items.items() if not its]
    if empty:
        chars = sum(map(len, docs))
        msg = (f"the held-out split of {data_dir} ({len(docs)} documents, {chars:,} characters) is too small "
               f"to build the offline task(s) {empty}; prepare the data with a larger --val-fraction")
        if strict:
            raise UsageError(msg)
        print(f"[eval] warning: {msg}", flush=True)
        return None
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # written last: its presence means complete
    for name, its in items.items():
        _write_atomic(out / f"{name}.jsonl", "".join(json.dumps(it, ensure_ascii=False) + "\n" for it in its))
    for name, cfg in _task_configs(out).items():
        header = f"# Built by fp4lightning.eval.tasks from the held-out split of {data_dir}; do not edit.\n"
        _write_atomic(out / f"{name}.yaml", header + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True))
    manifest = {
        "source": _source_key(data_dir),
        "tag": OFFLINE_TAG,
        "tasks": {name: len(its) for name, its in items.items()},
        "heldout_documents": len(docs),
        "heldout_characters": sum(map(len, docs)),
    }
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=2))
    counts = ", ".join(f"{n} {len(its)}" for n, its in items.items())
    print(f"[eval] offline tasks ({counts} items) written to {out}", flush=True)
    return out
