"""The LightningDataModule over a prepared data folder (the paper's setting: arXiv 2501.17116, section 7)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader, Subset

from fp4lightning.data.sampling import PositionSampler, ResumableDataLoader, ValWindowDataset, WindowDataset
from fp4lightning.data.shards import PreparedData

__all__ = ["TokenDataModule"]


class TokenDataModule(L.LightningDataModule):
    """Fixed-length next-token windows ``(B, seq_len + 1)`` from a prepared data directory.

    ``train_batches`` is the number of micro-batches each rank trains on (max_steps x
    gradient accumulation): the train loader is exactly that long, one epoch per run.
    Raises :class:`DataNotPreparedError` (naming the prepare command, ``prepare_hint``) if
    ``data_dir`` is not prepared.
    """

    def __init__(
        self,
        data_dir: str | Path,
        seq_len: int,
        micro_batch_size: int,
        train_batches: int,
        val_batches: int = 8,
        seed: int = 1234,
        num_workers: int = 0,
        prepare_hint: str | None = None,
        verify: bool = False,
    ):
        super().__init__()
        self.data = PreparedData(data_dir, prepare_hint, verify=verify)
        self.tokenizer = self.data.tokenizer
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.train_batches, self.val_batches = train_batches, val_batches
        self.seed, self.num_workers = seed, num_workers

    def _rank_world(self) -> tuple[int, int]:
        t = self.trainer
        return (t.global_rank, t.world_size) if t is not None else (0, 1)

    def _progress(self) -> int:
        return self.trainer.fit_loop.epoch_loop.batch_progress.current.processed

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        ds = WindowDataset(self.data.shards("train"), self.seq_len, self.seed, vocab_size=self.tokenizer.vocab_size,
                           names=[str(p) for p in self.data.shard_files("train")], hint=f"{self.data.hint} --force")
        sampler = PositionSampler(self.train_batches * self.micro_batch_size, rank, world)
        return ResumableDataLoader(
            ds, batch_size=self.micro_batch_size, sampler=sampler, num_workers=self.num_workers,
            drop_last=True, progress_fn=self._progress, persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        n = self.val_batches * self.micro_batch_size * world
        ds = ValWindowDataset(self.data.shards("val"), self.seq_len, n)
        # each rank evaluates a disjoint slice; the torchmetrics states are summed across ranks
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=self.micro_batch_size)
