"""A run folder holds one live run (issue 46, item 5): `fp4lightning train --overwrite` (or `--resume`, or
a plain `train`) into the folder of a run that is still training is refused in one line naming that
run's process, and touches nothing; the lock goes when the run ends, however it ends (SIGKILL too);
ranks another process started never take it."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fp4lightning.cli import main as cli_main
from fp4lightning.errors import EXIT_USAGE
from fp4lightning.train.run_lock import LOCK_FILE, RunInUseError, run_lock
from tests.test_train import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]

#: a process that holds the lock of the folder argv[1] until it is killed (no torch: starts in a second)
_HOLDER = """
import sys, time
from fp4lightning.train.run_lock import run_lock
with run_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from tests.test_data import prepared_test_corpus

    return prepared_test_corpus(tmp_path_factory)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fp4lightning train: error:"), err[-3000:]
    return lines[0]


def _steps(metrics_csv: Path) -> list[int]:
    with open(metrics_csv) as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_overwrite_of_a_live_run_is_refused_and_the_run_goes_on(corpus, tmp_path, capsys):
    """A real `fp4lightning train` process, then a real second one with --overwrite into its folder while
    it trains: exit 2, one line naming the first's pid and command; --resume and a plain start (here in
    this process) likewise. The first run goes on, and its checkpoint and metrics.csv are its own alone."""
    out = tmp_path / "run"
    overrides = tiny_overrides(corpus, out, "schedule.max_steps=100000", "trainer.checkpoint_every_n_steps=2",
                               "trainer.val_every_n_steps=100000", "trainer.loggers=csv")
    env = {**os.environ, "FP4LIGHTNING_COMPILE": "0", "PYTHONPATH": str(ROOT)}
    first = subprocess.Popen([sys.executable, "-m", "fp4lightning.cli", "train", *overrides], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stdout:  # one line per step (log_every_n_steps=1)
            if line.startswith("step 4/"):
                break
        assert first.poll() is None and (out / "checkpoints" / "last.ckpt").is_file()
        second = subprocess.run([sys.executable, "-m", "fp4lightning.cli", "train", *overrides, "--overwrite"],
                                env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == EXIT_USAGE, second.stderr[-3000:]
        line = _one_error_line(second.stderr)
        assert str(out) in line and f"pid {first.pid}" in line and "fp4lightning train" in line, line
        assert "still going" in line and "choose another out_dir" in line, line
        for flags in (["--resume"], []):
            capsys.readouterr()
            assert cli_main(["train", *overrides, *flags]) == EXIT_USAGE
            assert f"pid {first.pid}" in _one_error_line(capsys.readouterr().err)
        assert first.poll() is None  # still training, its folder still its own
        for line in first.stdout:
            if line.startswith("step 8/"):
                break
        first.send_signal(signal.SIGTERM)  # stops after saving a checkpoint, as a scheduler's preemption
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143, err[-3000:]
    assert not (out / LOCK_FILE).exists()  # a run that ends lets go of its folder
    stopped = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
    versions = sorted(p.name for p in (out / "logs" / "csv").iterdir())
    assert versions == ["version_0"] and stopped >= 8
    assert _steps(out / "logs" / "csv" / "version_0" / "metrics.csv") == list(range(1, stopped + 1))


def test_the_lock_outlives_no_process(tmp_path, capsys):
    """A process holding the lock refuses others, naming its pid; killed with SIGKILL, its lock is free
    (the file it leaves names a process that no longer holds it); a normal end deletes the file."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _tree(out)
        with pytest.raises(RunInUseError, match=rf"pid {holder.pid}\b.*-c"):
            with run_lock(out):
                pass
        assert _tree(out) == before  # refused without changing the lock file
        holder.kill()
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert str(holder.pid) in (out / LOCK_FILE).read_text()  # stale: its process is gone
    with run_lock(out):
        assert str(os.getpid()) in (out / LOCK_FILE).read_text()
    assert not (out / LOCK_FILE).exists()
    # a folder the lock created and the run left empty goes too
    with run_lock(tmp_path / "never used"):
        pass
    assert not (tmp_path / "never used").exists()


def test_ranks_started_by_another_process_skip_the_lock(tmp_path, monkeypatch):
    """Lightning's launcher (and torchrun, SLURM) start ranks 1..N with their rank variables set: they
    must not wait for, nor be refused by, the lock their rank 0 holds."""
    out = tmp_path / "run"
    with run_lock(out):
        for var, value in (("LOCAL_RANK", "1"), ("RANK", "3"), ("NODE_RANK", "1")):
            with monkeypatch.context() as m:
                m.setenv(var, value)
                t0 = time.monotonic()
                with run_lock(out):
                    pass
                assert time.monotonic() - t0 < 1
        assert (out / LOCK_FILE).is_file()  # still rank 0's
    with pytest.raises(RunInUseError):  # a second hold of rank 0 (another open of the file) is refused
        with run_lock(out):
            with run_lock(out):
                pass


def test_a_finished_run_leaves_its_folder_unlocked(corpus, tmp_path):
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.train.run import train

    out = tmp_path / "run"
    train(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=2", "trainer.loggers=csv",
                                           "trainer.val_every_n_steps=100")))
    assert (out / "checkpoints" / "last.ckpt").is_file() and not (out / LOCK_FILE).exists()
    train(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=3", "trainer.loggers=csv",
                                           "trainer.val_every_n_steps=100")), resume=True)
