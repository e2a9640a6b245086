"""Every ```python snippet of README.md and docs/*.md runs as written, or says why it cannot.

A snippet that cannot run here (it needs GPUs, a multi-node launch, or is not a program) carries
``<!-- snippet: skip (REASON) -->`` on the line before its fence; the reason is required. Every other
snippet runs, on CPU, in one child process (torch and Lightning are imported once), each in a fresh
namespace, in a working folder that holds what the docs' examples assume:

* ``model``, ``datamodule``, ``optimizer``, ``loader``, ``loss_fn``: "your" model and data, a small
  LightningModule whose ``training_step`` asks the Trainer to stop after its first step (a
  ``max_steps=10_000`` in a snippet then trains one step), with 32-wide random batches;
* ``runs/tiny``: a 2-step FP4 run of a 0.1M-parameter model on the tests' prepared corpus
  (``tests/test_data.py::prepared_test_corpus``), with ``fp8-fp16`` optimizer states, and
  ``fp4.ckpt``, its ``last.ckpt``.

The compiled CPU passes run eagerly (``FP4LIGHTNING_COMPILE=0``, the same numerics) so that the whole
check stays under a minute.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```", re.S | re.M)
SKIP = re.compile(r"^ *<!-- snippet: skip \((?P<reason>.*\S.*)\) -->$")
#: seconds for the child that runs every snippet (about 25 s on the 2-core build machine)
BUDGET_S = 240

#: what the snippets may assume exists, defined afresh for each (no other name: a snippet imports what it uses)
PRELUDE = '''
import torch as _torch
import lightning.pytorch as _pl


class _YourModel(_pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = _torch.nn.Sequential(_torch.nn.Linear(32, 64), _torch.nn.ReLU(), _torch.nn.Linear(64, 32))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.trainer.should_stop = True  # one step is enough to show that the snippet trains
        return _torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return _torch.optim.AdamW(self.parameters(), lr=1e-3)


class _YourData(_pl.LightningDataModule):
    def train_dataloader(self):
        return loader


loader = _torch.utils.data.DataLoader(
    _torch.utils.data.TensorDataset(_torch.randn(8, 32), _torch.randn(8, 32)), batch_size=4)
model, datamodule, loss_fn = _YourModel(), _YourData(), _torch.nn.functional.mse_loss
optimizer = _torch.optim.AdamW(model.parameters(), lr=1e-3)
'''

#: the child: train runs/tiny, then run every snippet, one JSON line of results
RUNNER = '''
import json, os, sys, traceback
from fp4lightning.train.recipe import load_recipe
from fp4lightning.train.run import train

snippets, overrides, prelude = json.load(open(sys.argv[1]))
train(load_recipe(None, overrides))
os.symlink(os.path.join("runs", "tiny", "checkpoints", "last.ckpt"), "fp4.ckpt")
failed = {}
for where, code in snippets:
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(prelude, "<prelude>", "exec"), namespace)
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        failed[where] = traceback.format_exc(limit=-3)
print("RESULT " + json.dumps(failed))
'''


def snippets() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(the snippets to run as (file:line, code), the skipped ones as (file:line, reason))."""
    run, skipped = [], []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            where = f"{doc.relative_to(ROOT)}:{line}"
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if "snippet:" in before:
                skip = SKIP.match(before)
                assert skip, f"{where}: write `<!-- snippet: skip (REASON) -->`, with a reason, got {before!r}"
                skipped.append((where, skip["reason"]))
            else:
                run.append((where, textwrap.dedent(m["code"])))
    return run, skipped


def test_every_python_snippet_runs_or_says_why_not(tmp_path, tmp_path_factory):
    run, skipped = snippets()
    assert len(run) >= 8 and skipped, (run, skipped)  # the parser found the docs' snippets
    corpus = prepared_test_corpus(tmp_path_factory)
    overrides = tiny_overrides(corpus, Path("runs") / "tiny", "schedule.max_steps=2", "trainer.val_every_n_steps=2",
                               "trainer.checkpoint_every_n_steps=2", "trainer.loggers=csv",
                               "optimizer.states=fp8-fp16")
    spec = tmp_path / "snippets.json"
    spec.write_text(json.dumps([run, overrides, PRELUDE]))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "FP4LIGHTNING_COMPILE": "0", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=BUDGET_S)
    assert proc.returncode == 0 and "RESULT " in proc.stdout, proc.stderr[-4000:]
    failed = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
    assert not failed, "snippets that fail as written:\n" + "\n".join(f"--- {k}\n{v}" for k, v in failed.items())
