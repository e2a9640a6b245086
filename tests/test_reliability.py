"""Nothing lost, nothing silent: non-finite steps, atomic checkpoints, resume fallbacks, exit codes.

Every test drives the real Trainer / CLI on CPU with the tiny test model (tests/test_train.py).
Faults are injected the way they happen: a NaN put into a gradient, into dY, into an
activation or into the embedding output by hooks on the real model; a process killed with
SIGKILL while it writes a checkpoint; an ENOSPC raised by the write path of the real
checkpoint writer.
"""
from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from fp4lightning.train.checkpoint import LAST_CKPT, AtomicCheckpointIO, CheckpointError, read_checkpoint
from fp4lightning.cli import main as cli_main
from fp4lightning.lightning.nonfinite import NonFiniteError
from fp4lightning.train.recipe import load_recipe
from fp4lightning.cli import EXIT_NONFINITE
from fp4lightning.train.run import build, train
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
STAGES = ("gradient", "dY", "activation", "embedding")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


class Injector(L.Callback):
    """Puts an inf/NaN into one stage of a step: ``plan`` maps optimizer step -> stage.

    ``from_step``: poison every step from there on (stage ``gradient``); ``rank``: only on that rank.
    Records every step's parameters and optimizer state (the tiny model is ~0.1M parameters).
    """

    def __init__(self, plan: dict[int, str] | None = None, from_step: int | None = None, rank: int | None = None):
        self.plan, self.from_step, self.rank = dict(plan or {}), from_step, rank
        self.params: dict[int, list[torch.Tensor]] = {}
        self.opt: dict[int, list[torch.Tensor]] = {}

    def _stage(self, trainer) -> str | None:
        if self.rank is not None and trainer.global_rank != self.rank:
            return None
        step = trainer.global_step + 1  # the step being computed
        if self.from_step is not None and step >= self.from_step:
            return "gradient"
        return self.plan.get(step)

    def on_train_start(self, trainer, pl_module):
        model = pl_module.model
        self.params[0] = [p.detach().clone() for p in model.parameters()]

        def poison_output(stage):
            def hook(module, args, out):
                if self._stage(trainer) == stage:
                    out = out.clone()
                    out.view(-1)[0] = float("nan")
                return out
            return hook

        def poison_dy(module, grad_output):
            if self._stage(trainer) == "dY":
                g = grad_output[0].clone()
                g.view(-1)[0] = float("inf")
                return (g,)
            return None

        model.embed_tokens.register_forward_hook(poison_output("embedding"))
        model.layers[0].register_forward_hook(poison_output("activation"))
        model.layers[-1].mlp.down_proj.register_full_backward_pre_hook(poison_dy)

    def on_after_backward(self, trainer, pl_module):
        if self._stage(trainer) == "gradient":
            p = next(p for p in pl_module.model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.params[step] = [p.detach().clone() for p in pl_module.model.parameters()]
        state = trainer.optimizers[0].state
        self.opt[step] = [v.detach().clone() for s in state.values() for v in s.values() if torch.is_tensor(v)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _all_finite(ckpt_path: Path) -> bool:
    ckpt, _ = read_checkpoint(ckpt_path)
    return all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def _logged_skips(out: Path) -> list[float]:
    rows = []
    for path in (out / "logs" / "csv").glob("version_*/metrics.csv"):
        with open(path, newline="") as f:
            rows += [float(r["train/nonfinite_skips"]) for r in csv.DictReader(f) if r.get("train/nonfinite_skips")]
    return rows


def _fit_with_trainer(corpus: Path, out: Path, precision: str, callbacks: list, max_steps: int):
    """fp4lightning.Trainer(precision=...) with the same module, data and checkpointing as the CLI."""
    from fp4lightning.lightning.trainer import Trainer

    cfg = load_recipe(None, tiny_overrides(corpus, out, f"schedule.max_steps={max_steps}"))
    _, module, dm, _ = build(cfg)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)
    trainer = Trainer(precision=precision, accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      limit_val_batches=0, plugins=[AtomicCheckpointIO()], callbacks=[ckpt, *callbacks])
    trainer.fit(module, datamodule=dm)
    return trainer


# ------------------------------------------------------------------ 1. non-finite steps
PLAN = {2: "gradient", 3: "dY", 5: "activation", 6: "embedding"}


@pytest.mark.parametrize("precision", ["fp4", "fp4-bf16", "fp4-fp16", "bf16-mixed"])
def test_nonfinite_step_is_skipped_at_every_stage(corpus, tmp_path, precision, one_thread):
    inj = Injector(PLAN)
    if precision in ("fp4", "bf16-mixed"):  # recipe precisions, through fp4lightning.train.run
        cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, "schedule.max_steps=7",
                                               f"trainer.precision={precision}"))
        result = train(cfg, callbacks=[inj])
        assert not result.interrupted
        assert _logged_skips(tmp_path)[-1] == len(PLAN)
        plugin_counter = None
    else:
        trainer = _fit_with_trainer(corpus, tmp_path, precision, [inj], max_steps=7)
        plugin_counter = trainer.precision_plugin.nonfinite
        assert plugin_counter.total == len(PLAN) and plugin_counter.consecutive == 0
    for step in range(1, 8):
        if step in PLAN:  # skipped: weights and optimizer state exactly as before
            assert _same(inj.params[step], inj.params[step - 1]), (precision, PLAN[step])
            assert _same(inj.opt[step], inj.opt[step - 1]), (precision, PLAN[step])
        else:
            assert not _same(inj.params[step], inj.params[step - 1]), (precision, step)
    assert all(torch.isfinite(p).all() for p in inj.params[7])
    assert _all_finite(tmp_path / "checkpoints" / LAST_CKPT)


def test_persistent_nonfinite_stops_naming_step_and_checkpoint(corpus, tmp_path, capsys, one_thread):
    # a good checkpoint at step 2, then every step from 4 on is poisoned: stop after 3 skips, at step 6
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, "schedule.max_steps=20",
                                           "trainer.checkpoint_every_n_steps=2", "trainer.max_nonfinite_skips=3"))
    with pytest.raises(NonFiniteError, match=r"3 optimizer steps in a row.*step 6") as e:
        train(cfg, callbacks=[Injector(from_step=4)])
    assert e.value.step == 6
    err = capsys.readouterr().err
    # the banner names the step the error names
    assert "training stopped at step 6;" in err and "latest checkpoint" in err and "--resume" in err
    assert "finished after" not in err
    ckpts = list((tmp_path / "checkpoints").glob("*.ckpt"))
    assert ckpts and all(_all_finite(p) for p in ckpts)
    assert read_checkpoint(tmp_path / "checkpoints" / LAST_CKPT)[0]["global_step"] <= 6


class _PoisonWeights(L.Callback):
    """After optimizer step ``at``, a NaN in one weight: every later step diverges."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            with torch.no_grad():
                pl_module.model.norm.weight.view(-1)[0] = float("nan")  # used by every token


def test_diverged_message_wins_over_the_checkpoint_refusal(corpus, tmp_path, capsys, caplog, one_thread):
    """Weights gone NaN (what trainer.precision=16-true did at step 1): the run stops with the "diverged"
    message and its advice; the save-on-exception checkpoint it then refuses is a secondary line, not the
    error that replaces it."""
    cfg = load_recipe(None, tiny_overrides(corpus, tmp_path, "schedule.max_steps=6"))
    with pytest.raises(NonFiniteError, match=r"weights are non-finite at step 3.*The run has diverged: lower "
                                             r"optimizer\.lr") as e:
        train(cfg, callbacks=[_PoisonWeights(at=2)])
    assert "refusing" not in str(e.value)
    err = capsys.readouterr().err
    assert err.count("note: no checkpoint written at step 2: weight model.norm.weight holds inf/NaN") == 1, err[-2000:]
    assert "training stopped at step 3;" in err
    assert not list((tmp_path / "checkpoints").glob("*.ckpt"))  # nothing NaN on disk
    # and Lightning's "..., saved checkpoint to <file>" line is dropped: no such file was written
    assert "was raised with message" not in caplog.text + err, caplog.text


def test_nonfinite_weights_are_never_checkpointed(tmp_path):
    io = AtomicCheckpointIO()
    good = {"state_dict": {"w": torch.ones(3)}, "global_step": 1}
    io.save_checkpoint(good, tmp_path / "last.ckpt")
    bad = {"state_dict": {"w": torch.tensor([1.0, float("nan"), 2.0])}, "global_step": 2}
    with pytest.raises(NonFiniteError, match=r"last.ckpt: weight w holds inf/NaN"):
        io.save_checkpoint(bad, tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1


DDP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    sys.path.insert(0, {root!r})
    from fp4lightning.lightning.nonfinite import NonFiniteError
    from fp4lightning.train.recipe import load_recipe
    from fp4lightning.cli import EXIT_NONFINITE
    from fp4lightning.train.run import train
    from tests.test_reliability import Injector
    from tests.test_train import tiny_overrides

    corpus, out = sys.argv[1], sys.argv[2]
    cfg = load_recipe(None, tiny_overrides(corpus, out, "trainer.devices=2", "trainer.strategy=ddp",
                                           "data.global_batch_size=8", "schedule.max_steps=20",
                                           "trainer.checkpoint_every_n_steps=2", "trainer.max_nonfinite_skips=3"))
    # rank 1 alone: a NaN in a gradient after synchronisation at step 2, then every step from 4 on
    inj = Injector({{2: "gradient", 3: "embedding"}}, from_step=5, rank=1)
    import lightning as L

    class LoggedLoss(L.Callback):  # what each rank logs as train/loss (synced: the global-batch mean)
        losses = {{}}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if "train/loss" in trainer.callback_metrics:
                self.losses[trainer.global_step] = float(trainer.callback_metrics["train/loss"])

    code = 0
    try:
        train(cfg, callbacks=[inj, LoggedLoss()])
    except NonFiniteError as e:
        code = EXIT_NONFINITE
        msg = str(e)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    digest = {{s: float(sum(p.double().sum() * (i + 1) for i, p in enumerate(ps))) for s, ps in inj.params.items()}}
    Path = __import__("pathlib").Path
    Path(out, f"rank{{rank}}.json").write_text(json.dumps({{"digest": digest, "msg": msg if code else "",
                                                          "losses": LoggedLoss.losses}}))
    sys.exit(code)
""")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_ranks_skip_and_stop_together(corpus, tmp_path):
    script = tmp_path / "ddp_nonfinite.py"
    script.write_text(DDP_SCRIPT.format(root=str(ROOT)))
    # an explicit free port: Lightning's own pick races with other processes opening ports
    # a clean launch: no rank/world variables an earlier in-process test may have left behind
    # (with them set, Lightning takes the run as launched by torchrun and never starts rank 1)
    leaked = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR"}
    env = {k: v for k, v in os.environ.items() if k not in leaked and not k.startswith(("PL_", "TORCHELASTIC"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "run")], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == EXIT_NONFINITE, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["digest"] == r1["digest"]  # identical weights on both ranks at every step
    # train/loss is the global batch's (synced), not each rank's own half: the ranks log the same value
    assert r0["losses"] and r0["losses"] == r1["losses"], (r0["losses"], r1["losses"])
    d = r0["digest"]
    assert d["2"] == d["1"] and d["3"] == d["2"] and d["4"] != d["3"]  # steps 2 and 3 skipped on both ranks
    for r in (r0, r1):
        assert "3 optimizer steps in a row" in r["msg"] and "step 7" in r["msg"]
    ckpts = list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))
    assert ckpts and all(_all_finite(p) for p in ckpts)


# ------------------------------------------------------------------ 2. atomic checkpoints
def _writer(target: Path, io_name: str, tmpdir: Path, ready_fd: int) -> None:
    """Child process: rewrite ``target`` in a loop; version k holds k in every element (~16 MB)."""
    import tempfile

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    torch.set_num_threads(1)
    os.environ["TMPDIR"] = str(tmpdir)
    tempfile.tempdir = None  # re-read TMPDIR
    io = AtomicCheckpointIO() if io_name == "atomic" else TorchCheckpointIO()
    w = torch.empty(4_000_000)
    k = 0
    while True:
        k += 1
        io.save_checkpoint({"state_dict": {"w": w.fill_(float(k))}, "global_step": k}, target)
        if k == 1:
            os.write(ready_fd, b"1")


def _kill_during_saves(tmp_path: Path, io_name: str, moments: int = 4) -> list[str]:
    """SIGKILL a process that rewrites last.ckpt in a loop, at several moments of a save, with
    TMPDIR on another filesystem (/dev/shm, tmpfs) than the checkpoint. Returns what went wrong."""
    tmpdir = Path("/dev/shm") / f"fp4l-test-{os.getpid()}-{io_name}"
    tmpdir.mkdir(exist_ok=True)
    ckpt_dir = tmp_path / f"ck-{io_name}"
    ckpt_dir.mkdir()
    target = ckpt_dir / LAST_CKPT
    problems = []
    try:
        for moment in range(moments):
            r, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                try:
                    os.close(r)
                    _writer(target, io_name, tmpdir, wfd)
                finally:
                    os._exit(1)
            os.close(wfd)
            try:
                os.read(r, 1)  # one complete save
                deadline = time.monotonic() + 30
                # moment 0: as soon as the next save's temporary file appears; later: once it holds bytes
                while time.monotonic() < deadline:
                    tmps = list(ckpt_dir.glob(".*.tmp")) + list(tmpdir.iterdir())
                    sizes = []
                    for p in tmps:
                        with contextlib.suppress(OSError):
                            sizes.append(p.stat().st_size)
                    if sizes and (moment == 0 or max(sizes) > moment * 3_000_000):
                        break
                    if io_name != "atomic" and moment and 0 < target.stat().st_size < 16_000_000:
                        break  # Lightning's writer: the target itself is being rewritten in place
                os.kill(pid, signal.SIGKILL)
            finally:
                os.waitpid(pid, 0)
                os.close(r)
            try:
                ckpt = torch.load(target, map_location="cpu", weights_only=True)
                if not (ckpt["state_dict"]["w"] == ckpt["global_step"]).all():
                    problems.append(f"moment {moment}: mixed versions")
            except Exception as e:  # noqa: BLE001 - any failure to load is what we look for
                problems.append(f"moment {moment}: {type(e).__name__}")
            left = list(tmpdir.iterdir())
            if left:
                problems.append(f"moment {moment}: {len(left)} orphan(s) in TMPDIR")
                for p in left:
                    p.unlink()
    finally:
        for p in tmpdir.iterdir():
            p.unlink()
        tmpdir.rmdir()
    return problems


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or os.stat("/dev/shm").st_dev == os.stat("/tmp").st_dev,
                    reason="needs /dev/shm on another filesystem than /tmp")
def test_kill_during_save_keeps_a_loadable_checkpoint(tmp_path, one_thread):
    assert _kill_during_saves(tmp_path, "atomic") == []
    # the orphaned temporary file (in the checkpoint folder, never in TMPDIR) goes at the next run
    from fp4lightning.train.checkpoint import remove_stale_temporaries

    remove_stale_temporaries(tmp_path / "ck-atomic")
    assert [p.name for p in (tmp_path / "ck-atomic").iterdir()] == [LAST_CKPT]


class _DiskFull(AtomicCheckpointIO):
    """The real writer; the disk fills up after the first MB of the checkpoint."""

    @staticmethod
    def _write(checkpoint, f):
        import errno

        class Limited:
            def __init__(self):
                self.n = 0

            def write(self, b):
                self.n += len(b)
                if self.n > 1 << 20:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return f.write(b)

            def flush(self):
                f.flush()

        torch.save(checkpoint, Limited())


def test_full_disk_save_leaves_previous_checkpoint(tmp_path):
    target = tmp_path / LAST_CKPT
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(8)}, "global_step": 1}, target)
    before = target.read_bytes()
    with pytest.raises(CheckpointError, match=r"last.ckpt \(the disk is full\); the previous last.ckpt"):
        _DiskFull().save_checkpoint({"state_dict": {"w": torch.randn(1_000_000)}, "global_step": 2}, target)
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [LAST_CKPT]


def _can_mount_tmpfs(where: Path) -> bool:
    where.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def test_full_disk_save_on_a_real_small_filesystem(tmp_path):
    mnt = tmp_path / "small"
    if os.geteuid() != 0 or not _can_mount_tmpfs(mnt):
        pytest.skip("mounting a 2 MB tmpfs needs root")
    try:
        target = mnt / LAST_CKPT
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(8)}, "global_step": 1}, target)
        before = target.read_bytes()
        with pytest.raises(CheckpointError, match="the disk is full"):
            AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.randn(1_000_000)}}, target)
        assert target.read_bytes() == before and [p.name for p in mnt.iterdir()] == [LAST_CKPT]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ------------------------------------------------------------------ resume: fall back, refuse with one line
@pytest.fixture(scope="module")
def run4(corpus, tmp_path_factory):
    """A finished 4-step run with checkpoints at steps 2 and 4 (step=000004.ckpt and last.ckpt kept)."""
    out = tmp_path_factory.mktemp("run4")
    train(load_recipe(None, tiny_overrides(corpus, out, "schedule.max_steps=4", "trainer.checkpoint_every_n_steps=2")))
    return out


def _copy_run(run4: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(run4, dst)
    return dst


def test_resume_falls_back_to_newest_loadable_checkpoint(corpus, run4, tmp_path, capsys, one_thread):
    out = _copy_run(run4, tmp_path / "run")
    last = out / "checkpoints" / LAST_CKPT
    last.write_bytes(last.read_bytes()[:1000])  # truncated, as after a crash of a non-atomic writer
    (numbered,) = (out / "checkpoints").glob("step=*.ckpt")
    overrides = tiny_overrides(corpus, out, "schedule.max_steps=6", "trainer.checkpoint_every_n_steps=2")
    capsys.readouterr()
    assert cli_main(["train", *overrides, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "last.ckpt" in err and "corrupt" in err and f"resuming from {numbered} instead" in err
    assert read_checkpoint(last)[0]["global_step"] == 6
    # last.ckpt missing: --resume finds the numbered checkpoint
    last.unlink()
    numbered = max((out / "checkpoints").glob("step=*.ckpt"))
    step = read_checkpoint(numbered)[0]["global_step"]
    overrides = tiny_overrides(corpus, out, "schedule.max_steps=8", "trainer.checkpoint_every_n_steps=2")
    assert cli_main(["train", *overrides, "--resume"]) == 0
    assert f"resuming from {numbered}" in capsys.readouterr().out
    assert read_checkpoint(last)[0]["global_step"] == 8 and step < 8


class _Payload:
    """Unpickling this runs code (touches a marker file): what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_resume_from_bad_checkpoints_is_one_line(corpus, run4, tmp_path, capsys, monkeypatch):
    good = (run4 / "checkpoints" / LAST_CKPT).read_bytes()
    marker = tmp_path / "payload_ran"
    other = dict(torch.load(run4 / "checkpoints" / LAST_CKPT, weights_only=True))
    other["hyper_parameters"] = {**other["hyper_parameters"],
                                 "model": {**other["hyper_parameters"]["model"], "dim": 128}}
    plain = {k: v for k, v in other.items() if k != "hyper_parameters"}
    bad = {
        "truncated": good[: len(good) // 2],
        "random": os.urandom(4096),
        "empty": b"",
        "different_size": other,
        "plain_lightning": plain,
        "list": [1, 2, 3],
        "malicious": {"state_dict": {}, "x": _Payload(marker)},
    }
    expect = {"truncated": "corrupt", "random": "corrupt", "empty": "corrupt", "malicious": "corrupt",
              "different_size": "different model", "plain_lightning": "not an fp4lightning",
              "list": "not an fp4lightning"}
    # even with torch's escape hatch set, nothing is unpickled unsafely
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    for name, content in bad.items():
        path = tmp_path / f"{name}.ckpt"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        capsys.readouterr()
        rc = cli_main(["train", *tiny_overrides(corpus, tmp_path / "out"), f"ckpt_path={path}"])
        err = capsys.readouterr().err.strip()
        assert rc == 2, name
        assert err.startswith("fp4lightning train: error:") and f"{name}.ckpt" in err and expect[name] in err, err
        assert "Traceback" not in err
    assert not marker.exists()


def test_sigterm_exits_143_after_saving(corpus, tmp_path):
    """The console script under SIGTERM: checkpoint written, exit status 143 (not 0), resumable."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "fp4lightning.cli", "train",
           *tiny_overrides(corpus, out, "schedule.max_steps=100000", "trainer.checkpoint_every_n_steps=100000")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:  # one line per step (log_every_n_steps=1)
            if line.startswith("step 3/"):
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "--resume" in err and "finished after" not in err
    assert read_checkpoint(out / "checkpoints" / LAST_CKPT)[0]["global_step"] >= 3


# ------------------------------------------------------------------ 3-6, 10. prepared data
def _small_source(root: Path, modules=("argparse", "json/__init__", "pathlib", "textwrap", "string", "random",
                                       "heapq", "difflib")) -> Path:
    from tests.test_data import stdlib_docs

    root.mkdir(parents=True, exist_ok=True)
    for m in modules:
        (root / f"{m.replace('/', '_')}.txt").write_text(stdlib_docs(m), encoding="utf-8")
    return root


def _prepare_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fp4lightning.cli", "data", "prepare", "--source", str(src), "--out", str(out),
            "--vocab-size", "300", "--val-fraction", "0.2", *extra]


def _consistent(out: Path) -> None:
    from fp4lightning.data import META_FILE, PreparedData, shard_problems

    meta = json.loads((out / META_FILE).read_text())
    assert shard_problems(out, meta, checksums=True) == []
    data = PreparedData(out, verify=True)
    # the shards were written by this tokenizer: they decode to the source's text
    text = data.tokenizer.decode(data.shards("train")[0][:300].tolist())
    assert len(text) > 200 and (" the " in text or " of " in text)


def test_two_concurrent_prepares_into_one_folder(tmp_path):
    from fp4lightning.data.build import _FolderLock

    a = _small_source(tmp_path / "a", ("argparse", "textwrap", "string"))
    b = _small_source(tmp_path / "b", ("decimal", "fractions", "statistics"))
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # hold the folder's lock (as a third prepare would) until both have started and wait for it
    with _FolderLock(out):
        procs = [subprocess.Popen(_prepare_cmd(src, out, "--val-fraction", "0.5"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env) for src in (a, b)]
        firsts = [p.stdout.readline() for p in procs]
    outs = [first + p.communicate(timeout=240)[0] for first, p in zip(firsts, procs)]
    assert [p.returncode for p in procs] == [0, 0], [o[-1500:] for o in outs]
    assert all("waiting for it to finish" in first for first in firsts), firsts
    _consistent(out)  # manifest, tokenizer and shards all from one source
    meta = json.loads((out / "meta.json").read_text())
    assert meta["args"]["source"] in (str(a), str(b))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []  # lock file removed too


def test_offline_tasks_are_written_while_the_folder_is_locked(tmp_path, monkeypatch):
    """`data prepare` writes the eval tasks into the prepared folder; a second prepare that swaps the
    folder in meanwhile made the first one's os.replace fail (seen in CI as exit 1 of one of two
    concurrent prepares): the tasks must be written before the folder's lock is let go."""
    import fcntl

    import fp4lightning.eval.tasks as tasks

    src, out = _small_source(tmp_path / "src"), tmp_path / "out"
    real, seen = tasks.build_offline_tasks, []

    def checked(folder, *a, **kw):
        with open(tmp_path / ".out.lock", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("unlocked")
            except BlockingIOError:
                seen.append("locked")
        return real(folder, *a, **kw)

    monkeypatch.setattr(tasks, "build_offline_tasks", checked)
    assert cli_main(["data", "prepare", "--source", str(src), "--out", str(out), "--vocab-size", "300",
                     "--val-fraction", "0.5"]) == 0
    assert seen == ["locked"]
    assert (out / "eval_tasks").is_dir()


def test_failed_reprepare_keeps_the_previous_data(tmp_path):
    from fp4lightning.data import DataSourceError, prepare

    src = _small_source(tmp_path / "src")
    out = prepare(str(src), tmp_path / "out", vocab_size=300, val_fraction=0.2)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    bad = tmp_path / "bad"
    bad.mkdir()
    good_lines = [json.dumps({"text": (src / f).read_text()}) for f in sorted(os.listdir(src))]
    (bad / "x.jsonl").write_text("\n".join(good_lines + ['{"body": "no text field"}']) + "\n")
    with pytest.raises(DataSourceError, match=r"x\.jsonl:\d+"):
        prepare(str(bad), out, vocab_size=300, val_fraction=0.2)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert not list(tmp_path.glob(".out.build-*")) and not list(tmp_path.glob(".out.old-*"))


def _corrupt_in_vocabulary(shard: Path, vocab: int) -> None:
    import numpy as np

    n = shard.stat().st_size // 2
    np.random.default_rng().integers(2, vocab, n, dtype=np.uint16).tofile(shard)


def test_in_vocabulary_corruption_is_caught_by_checksums(corpus, tmp_path, capsys):
    import shutil

    from fp4lightning.data import DataCorruptError, PreparedData, prepare

    data = shutil.copytree(corpus, tmp_path / "data")
    shard = data / "train-00000.bin"
    size = shard.stat().st_size
    _corrupt_in_vocabulary(shard, 512)
    assert shard.stat().st_size == size
    PreparedData(data)  # sizes agree: only the checksums can tell
    with pytest.raises(DataCorruptError, match=r"(?s)train-00000\.bin does not match its sha256.*--force"):
        PreparedData(data, verify=True)
    # training with --verify-data refuses, in one line naming the shard and the rebuild command
    rc = cli_main(["train", *tiny_overrides(data, tmp_path / "run"), "--verify-data"])
    err = capsys.readouterr().err
    assert rc == 2 and "train-00000.bin does not match its sha256" in err and "--force" in err
    # `data prepare` does not call it up to date: it rebuilds
    src = next(p for p in tmp_path.parents if (p / "stdlib_text").is_dir()) / "stdlib_text"
    prepare(str(src), data, vocab_size=512, val_fraction=0.05)
    out = capsys.readouterr().out
    assert "damaged" in out and "up to date" not in out
    PreparedData(data, verify=True)


@pytest.mark.parametrize("damage", ["truncated", "out_of_vocabulary"])
def test_corrupt_shard_at_train_time_is_one_line(corpus, tmp_path, capsys, damage):
    import shutil

    import numpy as np

    data = shutil.copytree(corpus, tmp_path / "data")
    shard = data / "train-00000.bin"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
    else:  # random bytes of the right size: ids far beyond the vocabulary
        np.random.default_rng().integers(1000, 65535, shard.stat().st_size // 2, dtype=np.uint16).tofile(shard)
    rc = cli_main(["train", *tiny_overrides(data, tmp_path / "run", "schedule.max_steps=2")])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    line = [x for x in err.splitlines() if x.startswith("fp4lightning train: error:")]
    assert line and "train-00000.bin" in line[0] and "Traceback" not in err
    assert "data prepare" in err and "--force" in err


def test_damaged_tokenizer_is_one_line(corpus, tmp_path, capsys):
    """A tokenizer.json that is not a tokenizer (a half-copied file, a stray edit) is "damaged; rebuild with"
    like the other data files, not the tokenizers library's bare `Exception: expected value`."""
    import shutil

    from fp4lightning.data import DataCorruptError, PreparedData

    data = shutil.copytree(corpus, tmp_path / "data")
    (data / "tokenizer.json").write_text("garbage\n")
    with pytest.raises(DataCorruptError, match=r"(?s)tokenizer\.json is damaged.*data prepare.*--force"):
        PreparedData(data)
    rc = cli_main(["train", *tiny_overrides(data, tmp_path / "run", "schedule.max_steps=2")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    line = [x for x in err.splitlines() if x.startswith("fp4lightning train: error:")]
    assert line and "tokenizer.json" in line[0] and "data prepare" in err and "--force" in err


def test_tokenizer_training_on_a_long_unbroken_input_is_bounded(tmp_path):
    """A 1 MB 'word' (no whitespace) trained for over 290 s before; now it is cut into bounded pieces."""
    import random
    import string

    from fp4lightning.data.tokenizer import MAX_RUN_CHARS, Tokenizer, bounded_pieces

    word = "".join(random.choices(string.ascii_letters, k=1_000_000))
    pieces = list(bounded_pieces([word, "plain text " * 10_000]))
    assert max(map(len, pieces)) <= 1 << 16 and all(" " in p or len(p) <= MAX_RUN_CHARS for p in pieces)
    # the word is one pre-token per 64 K piece: the trainer sees the first MAX_RUN_CHARS characters of each
    head = "".join(word[i:i + MAX_RUN_CHARS] for i in range(0, len(word), 1 << 16))
    assert "".join(pieces) == head + "plain text " * 10_000
    messages = []
    t0 = time.perf_counter()
    tok = Tokenizer.train(iter([word, "plain text " * 10_000]), vocab_size=300, progress=messages.append)
    elapsed = time.perf_counter() - t0
    assert elapsed < 120, elapsed  # measured ~4 s on a shared 2-core machine; over 290 s before
    assert messages and "1.1M characters in all" in messages[-1]
    assert tok.decode(tok.encode(word[:5000], bos=False)) == word[:5000]


# ------------------------------------------------------------------ 7. recipe numbers
@pytest.mark.parametrize("override,key", [
    ("optimizer.lr=inf", "optimizer.lr"), ("optimizer.lr=nan", "optimizer.lr"), ("optimizer.lr=-1", "optimizer.lr"),
    ("optimizer.weight_decay=nan", "optimizer.weight_decay"), ("optimizer.grad_clip=nan", "optimizer.grad_clip"),
    ("optimizer.grad_clip=inf", "optimizer.grad_clip"), ("optimizer.beta1=1.5", "optimizer.beta1"),
    ("optimizer.beta2=nan", "optimizer.beta2"), ("optimizer.eps=-1", "optimizer.eps"), ("optimizer.eps=0", "optimizer.eps"),
    ("seed=-5", "seed"), ("seed=100000000000000000000", "seed"), ("model.norm_eps=nan", "model.norm_eps"),
    ("model.init_std=inf", "model.init_std"), ("schedule.warmup_fraction=nan", "schedule.warmup_fraction"),
    ("trainer.max_nonfinite_skips=0", "trainer.max_nonfinite_skips"),
])
def test_bad_recipe_numbers_are_refused_naming_the_key(override, key, capsys):
    assert cli_main(["train", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp4lightning train: error:") and f"`{key}`" in err and "\n" not in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_gpu_accelerator_without_cuda_is_one_line(corpus, tmp_path, capsys):
    assert cli_main(["train", *tiny_overrides(corpus, tmp_path), "trainer.accelerator=gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "trainer.accelerator" in err and "no CUDA" in err and "\n" not in err


# ------------------------------------------------------------------ 14. output paths checked before the work
def test_output_path_that_is_a_file_is_refused_up_front(corpus, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert cli_main(["train", *tiny_overrides(corpus, blocker / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "out_dir" in err and "a_file exists and is not a folder" in err and "\n" not in err
    assert cli_main(["data", "prepare", "--source", str(tmp_path), "--out", str(blocker)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out" in err and "a_file exists and is not a folder" in err and "\n" not in err
    # export-hf / eval check OUT before they load anything: the checkpoint named here does not
    # even exist, and the error is still about the output path
    missing = str(tmp_path / "no.ckpt")
    assert cli_main(["export-hf", missing, str(blocker / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "OUT_DIR" in err and "a_file exists and is not a folder" in err and "\n" not in err
    assert cli_main(["eval", missing, "--out", str(blocker)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--out" in err and "a_file exists and is not a folder" in err and "\n" not in err
    assert cli_main(["import-hf", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a folder; name the checkpoint file" in err and "\n" not in err


# ------------------------------------------------------------------ 11. bad records and prepare arguments
def test_bad_records_name_file_line_and_field(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.test_data import stdlib_docs

    good = [json.dumps({"text": p}) for p in stdlib_docs("argparse").split("\n\n") if len(p) > 40][:60]
    cases = {
        "utf8.jsonl": ("\n".join(good[:3]) + "\n").encode() + b'{"text": "caf\xe9"}\n',
        "int.jsonl": ("\n".join(good[:3]) + '\n{"text": 123}\n').encode(),
        "null.jsonl": ("\n".join(good[:3]) + '\n{"text": null}\n').encode(),
        "random.parquet": os.urandom(2048),
        "binary.txt": b"\x7fELF\x00\x01" + os.urandom(500),
    }
    expect = {"utf8.jsonl": ":4: not valid UTF-8", "int.jsonl": ":4: field 'text' is int",
              "null.jsonl": ":4: field 'text' is NoneType", "random.parquet": "not a readable Parquet file",
              "binary.txt": "binary file"}
    for name, content in cases.items():
        src = tmp_path / name.replace(".", "_")
        src.mkdir()
        (src / name).write_bytes(content)
        capsys.readouterr()
        assert cli_main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "o"),
                         "--vocab-size", "300"]) == 2, name
        err = capsys.readouterr().err.strip()
        assert name in err and expect[name] in err and "\n" not in err, err
    src = tmp_path / "intcol"
    src.mkdir()
    pq.write_table(pa.table({"text": [1, 2, 3]}), src / "n.parquet")
    assert cli_main(["data", "prepare", "--source", str(src), "--out", str(tmp_path / "o")]) == 2
    assert "column 'text' holds int64, not strings" in capsys.readouterr().err
    # --on-bad-record skip drops and counts them
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_bytes(("\n".join(good) + '\n{"text": 123}\n{"text": null}\n').encode()
                                    + b'{"text": "\xff"}\n')
    assert cli_main(["data", "prepare", "--source", str(mixed), "--out", str(tmp_path / "m"), "--vocab-size", "300",
                     "--val-fraction", "0.3", "--on-bad-record", "skip"]) == 0
    assert "skipped 3 bad records" in capsys.readouterr().out
    # Latin-1 text: decoded with a warning and a count, not silently
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "l.txt").write_bytes("\n\n".join(json.loads(g)["text"] for g in good).encode() + "\n\ncafé".encode("latin-1"))
    assert cli_main(["data", "prepare", "--source", str(latin), "--out", str(tmp_path / "l"), "--vocab-size", "300",
                     "--val-fraction", "0.3"]) == 0
    assert "1 bytes are not valid UTF-8" in capsys.readouterr().out


@pytest.mark.parametrize("flag,value", [("--val-fraction", "0"), ("--vocab-size", "0"), ("--vocab-size", "100"),
                                        ("--max-tokens", "-1")])
def test_bad_prepare_arguments_are_refused(tmp_path, capsys, flag, value):
    assert cli_main(["data", "prepare", "--source", str(tmp_path), "--out", str(tmp_path / "o"), flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert flag in err and "\n" not in err and not (tmp_path / "o").exists()


# ------------------------------------------------------------------ 8, 15. overrides: no YAML tags, no environment
@pytest.mark.parametrize("override", ["name=!!python/object/apply:os.system ['touch /tmp/fp4l_pwned']",
                                      "name=*alias", "name=&a [1"])
def test_yaml_tags_and_aliases_in_overrides_are_one_line(override, capsys):
    assert cli_main(["train", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fp4lightning train: error: override") and "\n" not in err, err
    assert not Path("/tmp/fp4l_pwned").exists()


def test_environment_interpolation_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FP4L_TEST_SECRET", "hunter2")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: ${oc.env:FP4L_TEST_SECRET}\n")
    for args in (["train", str(recipe)], ["train", "name=${oc.env:FP4L_TEST_SECRET}"],
                 ["train", "data.source=x${oc.decode:${oc.env:FP4L_TEST_SECRET}}"]):
        assert cli_main(args) == 2
        err = capsys.readouterr().err
        assert "environment" in err and "hunter2" not in err
    assert load_recipe(None, ["name=abc"]).out_dir == "runs/abc"  # ordinary interpolation still works
