"""Pretraining data: corpus sources, tokenised memory-mapped shards, a resumable DataModule.

The paper pretrains on DCLM with sequences of 2048 tokens (arXiv 2501.17116, section 7);
this package prepares any text source the same way and streams fixed-length windows.
One module per job:

* :mod:`~fp4lightning.data.sources` - the corpus sources (``builtin``, a local file or folder,
  ``hf:NAME[:CONFIG]``), the built-in corpus's pinned download included;
* :mod:`~fp4lightning.data.build` - :func:`prepare`: tokenizer + train/val token shards, built
  beside the folder and swapped in, under a lock, idempotent;
* :mod:`~fp4lightning.data.manifest` - the prepared folder's format (``meta.json``, checksums,
  the errors that name the prepare command);
* :mod:`~fp4lightning.data.shards` - :class:`PreparedData`: reading it back, memory-mapped;
* :mod:`~fp4lightning.data.sampling` - windows, the Feistel-permuted resumable sampler and loader;
* :mod:`~fp4lightning.data.datamodule` - :class:`TokenDataModule`.

``fp4lightning data prepare`` (the command line, :mod:`fp4lightning.cli`) also builds the
offline evaluation tasks from the held-out split (:mod:`fp4lightning.eval.tasks`).
"""

# Every name is imported on first use: the command line checks a recipe's data (``meta.json``,
# :func:`~fp4lightning.data.manifest.require_prepared`) before torch, which the DataModule and the
# samplers import, and ``data prepare`` runs without it.
_LAZY = {
    **dict.fromkeys(("SHARD_TOKENS", "prepare"), "build"),
    "TokenDataModule": "datamodule",
    **dict.fromkeys(("FORMAT_VERSION", "META_FILE", "MIN_VOCAB", "DataCorruptError", "DataNotPreparedError",
                     "data_fingerprint", "default_data_dir", "prepare_command", "require_prepared",
                     "shard_problems"), "manifest"),
    **dict.fromkeys(("PositionSampler", "ResumableDataLoader", "ValWindowDataset", "WindowDataset",
                     "feistel_permute"), "sampling"),
    "PreparedData": "shards",
    **dict.fromkeys(("BUILTIN_PACKAGES", "BadRecords", "DataSourceError", "fetch_builtin", "iter_documents"),
                    "sources"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BUILTIN_PACKAGES",
    "DataNotPreparedError",
    "DataSourceError",
    "DataCorruptError",
    "PreparedData",
    "TokenDataModule",
    "prepare",
    "prepare_command",
    "require_prepared",
    "default_data_dir",
    "shard_problems",
    "data_fingerprint",
    "iter_documents",
    "fetch_builtin",
    "BadRecords",
    "WindowDataset",
    "ValWindowDataset",
    "PositionSampler",
    "ResumableDataLoader",
    "feistel_permute",
    "META_FILE",
    "MIN_VOCAB",
    "FORMAT_VERSION",
    "SHARD_TOKENS",
]
