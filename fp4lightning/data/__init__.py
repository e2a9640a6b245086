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

from fp4lightning.data.build import SHARD_TOKENS, prepare
from fp4lightning.data.datamodule import TokenDataModule
from fp4lightning.data.manifest import (
    FORMAT_VERSION,
    META_FILE,
    MIN_VOCAB,
    DataCorruptError,
    DataNotPreparedError,
    data_fingerprint,
    default_data_dir,
    prepare_command,
    shard_problems,
)
from fp4lightning.data.sampling import (
    PositionSampler,
    ResumableDataLoader,
    ValWindowDataset,
    WindowDataset,
    feistel_permute,
)
from fp4lightning.data.shards import PreparedData
from fp4lightning.data.sources import BUILTIN_PACKAGES, BadRecords, DataSourceError, fetch_builtin, iter_documents

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
