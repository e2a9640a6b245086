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

    def _accumulate(self) -> int:
        return self.trainer.accumulate_grad_batches if self.trainer is not None else 1

    def _progress(self) -> int:
        """Micro-batches of the optimizer steps taken (skipped non-finite steps count, as they
        consume their data): the position a resumed or extended run continues from. Not
        Lightning's processed-batch counter, which restarts with Lightning's epoch (a finished
        run that is extended is in epoch 1) and includes an interrupted accumulation cycle."""
        return self.trainer.global_step * self._accumulate()

    def _restart_cycle(self, saved_accumulate: int | None = None) -> None:
        """On resume: rewind the trainer's batch counters to the start of the accumulation
        cycle a checkpoint interrupted, where the train loader restarts (docs/training.md,
        "Interrupting and resuming"). Lightning steps the optimizer when its micro-batch count
        reaches a multiple of the accumulation, so without this the resumed run would step on
        the cycle's remaining micro-batches alone. A Ctrl-C inside a micro-batch (fetched, not
        yet processed) is rewound too: Lightning resets only the epoch's counters then, and its
        run-wide ``total`` count, which schedules validation, would stay one micro-batch ahead.
        The rewound counters are those of a checkpoint saved right after the cycle before
        (Lightning's RESTARTED_ON_LAST stage). A validation the checkpoint interrupted runs again
        in full (:meth:`_restart_validation`).

        ``saved_accumulate`` is the accumulation the checkpoint counted its micro-batches in; a run
        resumed on another world size has another one, and its counters are converted to the same
        optimizer steps in its own micro-batches (docs/distributed.md, "Resuming on another world size")."""
        loop = self.trainer.fit_loop.epoch_loop
        self._restart_validation(loop.val_loop.batch_progress)
        saved, acc = saved_accumulate or self._accumulate(), self._accumulate()
        current = loop.batch_progress.current
        partial = current.processed % saved
        counters = (loop.batch_progress.total, loop.batch_progress.current)
        if not partial and current.ready == current.processed:
            # at a cycle boundary: Lightning's own restart logic applies, to the counts in this run's micro-batches
            for progress in counters:
                shift = (progress.processed // saved) * acc - progress.processed
                progress.ready, progress.started = progress.ready + shift, progress.started + shift
                progress.processed, progress.completed = progress.processed + shift, progress.completed + shift
            return
        for progress in counters:
            n = max(0, progress.processed - partial)
            n = n if saved == acc else n // saved * acc
            progress.ready = progress.started = progress.processed = progress.completed = n
        if partial:
            # the interrupted cycle's zero_grad is counted: uncount it, so it is counted once
            zero_grad = loop.automatic_optimization.optim_progress.optimizer.zero_grad
            for progress in (zero_grad.total, zero_grad.current):
                progress.ready = progress.started = progress.completed = max(0, progress.completed - 1)

    @staticmethod
    def _restart_validation(progress) -> None:
        """Mark a validation the checkpoint interrupted as interrupted inside its first batch, so
        that Lightning runs it again from the start. SIGTERM stops a validation between two of
        its batches, a state Lightning resumes as a finished validation (it never logged: the
        step had no validation loss), and a stop inside a batch resumes at that batch (its loss
        would be the mean over the remaining batches only)."""
        current = progress.current
        if not current.ready or (progress.is_last_batch and current.completed == current.ready):
            return  # none under way: not started since the last one finished
        for counts in (progress.total, current):
            counts.processed = counts.completed = counts.completed - current.completed
            counts.ready = counts.started = counts.completed + 1
        progress.is_last_batch = False

    def train_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        ds = WindowDataset(self.data.shards("train"), self.seq_len, self.seed, **self.data.id_check("train"))
        sampler = PositionSampler(self.train_batches * self.micro_batch_size, rank, world)
        return ResumableDataLoader(
            ds, batch_size=self.micro_batch_size, sampler=sampler, num_workers=self.num_workers,
            drop_last=True, progress_fn=self._progress, accumulate=self._accumulate(),
            on_restart=self._restart_cycle if self.trainer is not None else None,
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        rank, world = self._rank_world()
        n = self.val_batches * self.micro_batch_size * world
        ds = ValWindowDataset(self.data.shards("val"), self.seq_len, n, **self.data.id_check("val"))
        # each rank evaluates a disjoint slice; the torchmetrics states are summed across ranks
        return DataLoader(Subset(ds, range(rank, len(ds), world)), batch_size=self.micro_batch_size)
