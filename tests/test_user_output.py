"""What a user sees: a recipe mistake reported before torch is imported, a training run on a
terminal free of messages nobody can act on, a note before the CPU kernels compile, and no
offline-switch warning when no hub task is asked for."""
from __future__ import annotations

import fcntl
import logging
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# runs the CLI in a fresh interpreter, then reports its exit status and the heavy modules loaded
_VALIDATION_PROBE = """
import sys
from fp4lightning.cli import main
rc = main({argv!r})
heavy = sorted(m for m in ("torch", "lightning", "numpy") if m in sys.modules)
print(f"RC={{rc}} HEAVY={{','.join(heavy)}}")
"""


@pytest.mark.parametrize("kind", ["override", "recipe-file", "data-prepare"])
def test_recipe_mistake_is_reported_before_torch_is_imported(kind, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optimizer:\n  lrr: 1\n")
    argv = {"override": ["train", str(ROOT / "recipes" / "tiny.yaml"), "optimizer.lrr=1"],
            "recipe-file": ["train", str(bad)],
            "data-prepare": ["data", "prepare", "--recipe", str(bad), "--out", str(tmp_path / "data")]}[kind]
    proc = subprocess.run([sys.executable, "-c", _VALIDATION_PROBE.format(argv=argv)], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert proc.stdout.strip().splitlines()[-1] == "RC=2 HEAVY=", (proc.stdout, proc.stderr)
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith(f"fp4lightning {argv[0]}: error: unknown recipe key `optimizer.lrr`"), proc.stderr
    assert not (tmp_path / "data").exists()


def _run_on_terminal(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as stdin, stdout and stderr; (exit status, everything it wrote)."""
    master, slave = pty.openpty()
    # 40 rows x 120 columns: tqdm draws nothing in a terminal of size 0 x 0
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True)
    os.close(slave)
    out, deadline = [], time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{cmd[:4]} ran over {timeout} s; output so far:\n{b''.join(out).decode()}")
            if select.select([master], [], [], 1.0)[0]:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # EIO: every copy of the terminal is closed, the command has exited
                    break
                if not data:
                    break
                out.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(out).decode(errors="replace")


#: what every run printed although no user can act on it (issue 37)
NOISE = ("`weights_only` was not set", "is not supported by the model summary", "Total FLOPs", "Epoch 0/-2",
         "torch_dtype", "offline switches")


def test_training_on_a_terminal_prints_no_noise(tmp_path_factory, tmp_path):
    from tests.test_data import prepared_test_corpus
    from tests.test_train import tiny_overrides

    corpus = prepared_test_corpus(tmp_path_factory)
    # 3 steps, checkpoints every 2: the final one is saved after fit, and validated again
    overrides = tiny_overrides(corpus, tmp_path / "run", "schedule.max_steps=3", "trainer.val_every_n_steps=2",
                               "trainer.checkpoint_every_n_steps=2", "trainer.loggers=csv")
    rc, out = _run_on_terminal([sys.executable, "-m", "fp4lightning.cli", "train", *overrides], timeout=300)
    assert rc == 0, out
    assert "finished after 3 steps" in out and (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert "Epoch 0" in out and "3/3" in out, out  # the terminal's progress bar was drawn
    assert [s for s in NOISE if s in out] == [], out


@pytest.mark.parametrize("compile_mode", ["auto", "0"])
def test_fp4_precision_says_before_the_first_step_that_it_compiles(compile_mode, monkeypatch, caplog):
    import torch

    from fp4lightning.lightning.precision import FP4Precision
    from fp4lightning.numerics import compile_progress

    monkeypatch.setenv("FP4LIGHTNING_COMPILE", compile_mode)
    monkeypatch.setattr(compile_progress._PROGRESS, "said", False)  # said once per process: as in a fresh one
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    plugin = FP4Precision()
    plugin.convert_module(model)
    with caplog.at_level(logging.INFO):
        plugin.connect(model, [], [])
        plugin.connect(model, [], [])  # Trainer.validate after fit connects again: said once
    said = [r for r in caplog.messages if "compiling the CPU kernels (first step only" in r]
    assert len(said) == (1 if compile_mode == "auto" else 0), caplog.messages


def test_no_offline_switch_warning_without_hub_tasks(monkeypatch, capsys):
    import huggingface_hub  # noqa: F401 - imported before the switches are set, as in `compare`

    from fp4lightning.eval.run import prepare_hf_environment

    # nothing listens on port 9 (discard): a hub that refuses at once
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for need_hub, warned in ((False, False), (True, True)):
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
        assert prepare_hf_environment(need_hub, probe_timeout=2.0) is False
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
        assert ("offline switches" in capsys.readouterr().err) == warned
