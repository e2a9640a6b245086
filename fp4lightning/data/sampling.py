"""Sampling token windows: deterministic per seed, resumable mid-epoch.

The training split is cut into non-overlapping windows of ``seq_len + 1`` tokens (shifted by
a per-epoch random offset) visited in a per-epoch pseudo-random order (a keyed Feistel
permutation: O(1) memory at any corpus size). The sample at global position ``p`` is a pure
function of ``(seed, p)`` (not of the run's length), so a run is deterministic for its seed,
and a resumed or extended run continues at the next unseen position: the DataLoader's
``state_dict`` holds the micro-batches of the optimizer steps taken (docs/training.md,
"Interrupting and resuming").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from fp4lightning.data.manifest import DataCorruptError

__all__ = ["feistel_permute", "WindowDataset", "ValWindowDataset", "PositionSampler", "ResumableDataLoader"]


def _mix64(x: int) -> int:
    # splitmix64 finaliser: a cheap, well-mixed 64-bit hash
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def feistel_permute(i: int, n: int, key: int, rounds: int = 4) -> int:
    """``i``-th element of a keyed pseudo-random permutation of ``range(n)``.

    A balanced Feistel network on the smallest even-bit-width domain >= n is a bijection;
    cycle-walking (re-encrypting values >= n) restricts it to ``range(n)`` (expected < 4 steps).
    """
    if not 0 <= i < n:
        raise IndexError(i)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix64(right ^ _mix64(key * 4 + r)) & mask)
        x = (left << half) | right
        if x < n:
            return x


def _check_ids(window: np.ndarray, vocab_size: int | None, names: list[str] | None, hint: str | None,
               shard: int, start: int) -> None:
    """Raise :class:`DataCorruptError` naming the shard file if ``window`` holds an id >= ``vocab_size``.

    Such an id means a shard was altered on disk; without this check it fails later, as an
    IndexError inside the embedding.
    """
    if vocab_size is not None and int(window.max()) >= vocab_size:
        name = names[shard] if names else f"shard {shard}"
        raise DataCorruptError(
            f"{name} holds token id {int(window.max())} at tokens {start}..{start + len(window) - 1}, outside the "
            f"tokenizer's {vocab_size} ids: the shard was altered on disk; rebuild with:\n"
            f"  {hint or 'fp4lightning data prepare ... --force'}")


class WindowDataset(Dataset):
    """Training windows: item ``p`` (a global sample position) -> ``(seq_len + 1,)`` int64 tokens.

    Epoch ``e = p // num_windows`` visits every window once, in an order and with a start
    offset (0..seq_len-1) keyed by ``(seed, e)``.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int, seed: int, vocab_size: int | None = None,
                 names: list[str] | None = None, hint: str | None = None):
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        # ids >= vocab_size mean a shard was altered on disk: fail naming it, not inside the embedding
        self.vocab_size, self.names, self.hint = vocab_size, names, hint
        # windows per shard such that offset + w * seq_len + 1 <= len for any offset < seq_len
        counts = [max(0, (len(s) - seq_len) // seq_len) for s in shards]
        self.num_windows = sum(counts)
        if self.num_windows == 0:
            raise ValueError(
                f"the training split ({sum(map(len, shards))} tokens) is too short for one window of "
                f"seq_len={seq_len}; lower data.seq_len or prepare more text"
            )
        self._starts = np.cumsum([0] + counts)

    def __len__(self) -> int:
        return self.num_windows

    def locate(self, p: int) -> tuple[int, int]:
        """(shard, start token) of the window at global sample position ``p``."""
        epoch, k = divmod(int(p), self.num_windows)
        key = _mix64(self.seed * 1_000_003 + epoch)
        w = feistel_permute(k, self.num_windows, key)
        shard = int(np.searchsorted(self._starts, w, side="right")) - 1
        return shard, key % self.seq_len + (w - int(self._starts[shard])) * self.seq_len

    def __getitem__(self, p: int) -> torch.Tensor:
        shard, start = self.locate(p)
        window = self.shards[shard][start : start + self.seq_len + 1]
        _check_ids(window, self.vocab_size, self.names, self.hint, shard, start)
        return torch.from_numpy(window.astype(np.int64))


class ValWindowDataset(Dataset):
    """Validation windows: the first ``max_windows`` non-overlapping windows, in order.

    ``vocab_size``, ``names`` and ``hint`` check the ids as :class:`WindowDataset` does.
    """

    def __init__(self, shards: list[np.ndarray], seq_len: int, max_windows: int | None = None,
                 vocab_size: int | None = None, names: list[str] | None = None, hint: str | None = None):
        self.vocab_size, self.names, self.hint = vocab_size, names, hint
        self.index = [(s, i * seq_len) for s, arr in enumerate(shards) for i in range((len(arr) - 1) // seq_len)]
        if max_windows is not None:
            self.index = self.index[:max_windows]
        if not self.index:
            raise ValueError(
                f"the validation split ({sum(map(len, shards))} tokens) is shorter than seq_len={seq_len}+1; "
                "prepare with a larger --val-fraction or lower data.seq_len"
            )
        self.shards, self.seq_len = shards, seq_len

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> torch.Tensor:
        s, start = self.index[i]
        window = self.shards[s][start : start + self.seq_len + 1]
        _check_ids(window, self.vocab_size, self.names, self.hint, s, start)
        return torch.from_numpy(window.astype(np.int64))


class PositionSampler(Sampler[int]):
    """Yields this rank's global sample positions ``j * world_size + rank`` for ``j`` in its range.

    ``len()`` is always the full per-rank length (Lightning counts the epoch's batches from
    it); after ``skip(n)`` the next iteration starts ``n`` samples in. The positions do not
    depend on the epoch Lightning sets: a run is one epoch, and a finished run that is extended
    (``--resume`` with a larger ``schedule.max_steps``) is in Lightning's epoch 1 but continues at
    the position after its last sample, as an uninterrupted run of the new length reads it.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1):
        self.num_samples, self.rank, self.world_size = num_samples, rank, world_size
        self.epoch, self._skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # kept for Lightning; the positions do not use it (see above)

    def skip(self, n: int) -> None:
        self._skip = n

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        start, self._skip = self._skip, 0
        for j in range(start, self.num_samples):
            yield j * self.world_size + self.rank


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning checkpoints: ``state_dict()`` records the micro-batches consumed.

    ``progress_fn`` counts them (the trainer's optimizer steps x ``accumulate``) rather than the
    iterator, because Lightning and the workers prefetch batches ahead of training, and counts
    only whole accumulation cycles: an interrupted cycle's partial gradient is not in the
    checkpoint, so a resumed run restarts that cycle from its first micro-batch
    (docs/training.md, "Interrupting and resuming"). The state also records the global sample
    position reached, ``samples_consumed`` (micro-batches x micro-batch size x world size), with
    the world size and accumulation it was counted under.

    ``load_state_dict`` continues at that global position: each rank skips
    ``samples_consumed / world_size`` of its positions, so a run resumed on another world size
    (with the same global batch, hence another accumulation) reads, at every optimizer step, the
    samples the uninterrupted run would have read at that step (docs/distributed.md, "Resuming on
    another world size"). A state without ``samples_consumed`` (written before it was recorded) is
    taken to be of the current world size. Micro-batches are rounded down to a whole cycle, for
    checkpoints that counted every processed micro-batch. It then calls
    ``on_restart(saved_accumulate)`` so the trainer's batch counters can be rewound to the same
    cycle start, in micro-batches of the current accumulation (``TokenDataModule._restart_cycle``).
    """

    def __init__(self, *args, progress_fn: Callable[[], int], accumulate: int = 1,
                 on_restart: Callable[[int], None] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._progress_fn, self._accumulate, self._on_restart = progress_fn, accumulate, on_restart

    def state_dict(self) -> dict:
        # "epoch" is informational: the positions do not depend on it (PositionSampler)
        n = int(self._progress_fn())
        world = self.sampler.world_size
        return {"batches_consumed": n, "epoch": self.sampler.epoch, "samples_consumed": n * self.batch_size * world,
                "world_size": world, "accumulate": self._accumulate}

    def load_state_dict(self, state: dict) -> None:
        saved_accumulate = int(state.get("accumulate", self._accumulate))
        n = int(state["batches_consumed"])
        n -= n % saved_accumulate
        samples = int(state.get("samples_consumed", n * self.batch_size * self.sampler.world_size))
        per_step = self.batch_size * self.sampler.world_size * self._accumulate  # the global batch
        if samples % per_step:
            raise ValueError(
                f"the checkpoint's data loader stopped at global sample {samples}, not a multiple of this run's global "
                f"batch ({per_step} samples): resume with the data.global_batch_size that wrote it")
        self.sampler.skip(samples // self.sampler.world_size)
        if self._on_restart is not None:
            self._on_restart(saved_accumulate)
