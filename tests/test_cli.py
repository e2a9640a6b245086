"""The command line: one error policy for every subcommand, --help without torch/Lightning."""

import subprocess
import sys
from pathlib import Path

import pytest

from fp4lightning.cli import COMMANDS, main
from fp4lightning.errors import EXIT_USAGE, UserError, run_command

# runs the CLI's --help in a fresh interpreter, then reports which heavy modules it loaded
_HELP_PROBE = """
import sys
from pathlib import Path
from fp4lightning.cli import main
try:
    main({argv!r})
except SystemExit as e:
    assert e.code == 0, e.code
heavy = sorted(m for m in ("torch", "lightning", "numpy", "lm_eval", "triton") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize("argv", [["--help"]] + [[c.name, "--help"] for c in COMMANDS] + [["data", "prepare", "--help"]])
def test_help_imports_no_heavy_module(argv):
    proc = subprocess.run([sys.executable, "-c", _HELP_PROBE.format(argv=argv)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: fp4lightning" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "HEAVY=", proc.stdout.splitlines()[-1]


def test_compare_bad_variant_is_one_line_exit_2(capsys):
    tiny = Path(__file__).parents[1] / "recipes" / "tiny.yaml"
    assert main(["compare", str(tiny), "--variants", "fp3"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4lightning compare: error: unknown variant 'fp3'"), err
    assert "bf16" in err[0]  # names the valid choices


def test_bug_keeps_its_traceback():
    def buggy(_):
        raise KeyError("internal")

    with pytest.raises(KeyError):
        run_command("fp4lightning x", buggy, None)


def test_user_error_classes_share_the_base():
    from fp4lightning.train.checkpoint import CheckpointError
    from fp4lightning.data import DataCorruptError, DataNotPreparedError, DataSourceError
    from fp4lightning.eval.run import HubUnavailableError
    from fp4lightning.train.init_weights import InitError
    from fp4lightning.train.recipe import RecipeError

    for cls in (CheckpointError, DataCorruptError, DataNotPreparedError, DataSourceError, HubUnavailableError,
                InitError, RecipeError):
        assert issubclass(cls, UserError), cls


# ----------------------------------------------------------------------------- train: resume and out_dir safety
# real tiny runs (tests/test_train.py's model) on the test corpus; every refusal happens before training
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from tests.test_data import prepared_test_corpus

    return prepared_test_corpus(tmp_path_factory)


def _run_overrides(corpus: Path, out: Path, *extra: str) -> list[str]:
    from tests.test_train import tiny_overrides

    return tiny_overrides(corpus, out, "schedule.max_steps=2", "trainer.loggers=csv",
                          "trainer.val_every_n_steps=100", "trainer.checkpoint_every_n_steps=100", *extra)


@pytest.fixture(scope="module")
def run2(corpus, tmp_path_factory) -> Path:
    """A finished 2-step run (micro-batch 4, global batch 4, seed 1234): checkpoints and one CSV log."""
    from fp4lightning.train.run import train
    from fp4lightning.train.recipe import load_recipe

    out = tmp_path_factory.mktemp("run2")
    train(load_recipe(None, _run_overrides(corpus, out)))
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


def _step(ckpt: Path) -> int:
    import torch

    return int(torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"])


def test_resume_refuses_changed_data_order_settings(corpus, run2, tmp_path, capsys):
    """Settings that decide which samples a step reads must not change on --resume (they re-read or
    skip data): each changed key is named with its saved and new value, and how to go on."""
    from fp4lightning.train.checkpoint import CheckpointError
    from fp4lightning.train.run import train
    from fp4lightning.train.recipe import load_recipe

    out = _copy(run2, tmp_path / "run")
    other = _other_data(corpus, tmp_path / "other_data")
    cases = {
        ("data.micro_batch_size=2",): [("data.micro_batch_size", 4, 2)],  # same global batch: accumulation 2
        ("data.global_batch_size=8",): [("data.global_batch_size", 4, 8)],
        ("data.seq_len=32",): [("data.seq_len", 64, 32)],
        ("seed=7",): [("seed", 1234, 7)],
        (f"data.dir={other}",): [("data.dir", str(corpus), str(other))],
        # another world size resumes (tests/test_resume_world_size.py); the micro-batch size does not
        ("trainer.devices=2", "data.micro_batch_size=2"): [("data.micro_batch_size", 4, 2)],
    }
    for extra, changed in cases.items():
        cfg = load_recipe(None, _run_overrides(corpus, out, "schedule.max_steps=4", *extra))
        with pytest.raises(CheckpointError) as e:
            train(cfg, resume=True)
        msg = str(e.value)
        for key, saved, new in changed:
            assert f"{key} = {saved!r} in the checkpoint, {new!r} now" in msg, (extra, msg)
            assert (key == "data.dir") == ("(holding other data)" in msg), msg
        assert str(out / "checkpoints" / "last.ckpt") in msg and "init.from_checkpoint=" in msg, msg
        assert "resume with the settings that wrote it" in msg.lower() and "new out_dir" in msg, msg
    # the command line: one line, exit 2; nothing was trained or written
    capsys.readouterr()
    assert main(["train", *_run_overrides(corpus, out, "schedule.max_steps=4", "data.micro_batch_size=2"),
                 "--resume"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4lightning train: error:") and "data.micro_batch_size" in err[0]
    assert _step(out / "checkpoints" / "last.ckpt") == 2
    assert len(list((out / "logs" / "csv").glob("version_*"))) == 1


def _other_data(corpus: Path, dst: Path) -> Path:
    """A copy of ``corpus`` whose training tokens differ (the first half of its shard, recorded in
    meta.json as ``data prepare`` records it): the same tokenizer, other data."""
    return _truncate_train_shard(_copy(corpus, dst))


def _truncate_train_shard(dst: Path) -> Path:
    import hashlib
    import json

    meta = json.loads((dst / "meta.json").read_text())
    shard = meta["splits"]["train"]["shards"][0]
    raw = (dst / shard["file"]).read_bytes()
    raw = raw[: len(raw) // 4 * 2]  # whole uint16 tokens
    (dst / shard["file"]).write_bytes(raw)
    shard["tokens"], shard["sha256"] = len(raw) // 2, hashlib.sha256(raw).hexdigest()
    meta["splits"]["train"]["tokens"] = shard["tokens"]
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


def test_resume_from_the_same_data_under_another_path(corpus, run2, tmp_path):
    """Moving or copying the prepared data is not a change: the checkpoint records a fingerprint of
    the tokens (fp4lightning.data.data_fingerprint), not only the path."""
    from fp4lightning.train.checkpoint import CheckpointError
    from fp4lightning.data import data_fingerprint
    from fp4lightning.train.run import train
    from fp4lightning.train.recipe import load_recipe

    out = _copy(run2, tmp_path / "run")
    moved = _copy(corpus, tmp_path / "moved")
    assert data_fingerprint(moved) == data_fingerprint(corpus) != data_fingerprint(_other_data(corpus, tmp_path / "o"))
    result = train(load_recipe(None, _run_overrides(corpus, out, "schedule.max_steps=3", f"data.dir={moved}")),
                   resume=True)
    assert not result.interrupted and _step(out / "checkpoints" / "last.ckpt") == 3
    # the same path prepared again (same tokenizer, other tokens): refused, saying so
    _truncate_train_shard(moved)
    with pytest.raises(CheckpointError, match="holds other tokens than when the checkpoint was written"):
        train(load_recipe(None, _run_overrides(corpus, out, "schedule.max_steps=4", f"data.dir={moved}")), resume=True)


def test_resume_checkpoint_without_recorded_settings(corpus, run2, tmp_path, capsys):
    """A checkpoint from before these checks (no recorded micro-batch, seed or tokenizer) still
    resumes, saying what it could not check; the resumed run's curve has both log versions."""
    import torch

    from fp4lightning.train.loss_log import read_losses
    from fp4lightning.train.run import train
    from fp4lightning.train.recipe import load_recipe

    out = _copy(run2, tmp_path / "run")
    last = out / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=True)
    del ckpt["hyper_parameters"]["recipe"]["data"]["micro_batch_size"], ckpt["hyper_parameters"]["recipe"]["seed"]
    del ckpt["tokenizer"]
    torch.save(ckpt, last)
    capsys.readouterr()
    result = train(load_recipe(None, _run_overrides(corpus, out, "schedule.max_steps=3")), resume=True)
    err = capsys.readouterr().err
    assert not result.interrupted and _step(last) == 3
    assert "does not record data.micro_batch_size, seed, tokenizer" in err and "tokenizer" in err, err
    assert sorted(read_losses(out)["train"]) == [1, 2, 3]  # versions 0 and 1 of the one run


def test_resume_refuses_data_prepared_with_another_tokenizer(corpus, tmp_path_factory, tmp_path):
    from fp4lightning.train.checkpoint import CheckpointError
    from fp4lightning.data import prepare
    from fp4lightning.train.run import train
    from fp4lightning.train.recipe import load_recipe

    data = _copy(corpus, tmp_path / "data")
    out = tmp_path / "run"
    train(load_recipe(None, _run_overrides(data, out)))
    # the same folder prepared again with another tokenizer (`fp4lightning data prepare --vocab-size 300`)
    prepare(str(tmp_path_factory.getbasetemp() / "stdlib_text"), data, vocab_size=300, val_fraction=0.05)
    with pytest.raises(CheckpointError) as e:
        train(load_recipe(None, _run_overrides(data, out, "schedule.max_steps=4")), resume=True)
    msg = str(e.value)
    assert "different tokenizer" in msg and str(data / "tokenizer.json") in msg, msg
    assert str(out / "checkpoints" / "last.ckpt") in msg and "data prepare" in msg and "new out_dir" in msg, msg
    assert _step(out / "checkpoints" / "last.ckpt") == 2


def test_fresh_run_in_a_used_out_dir_needs_overwrite(corpus, run2, tmp_path, capsys):
    from fp4lightning.train.loss_log import read_losses

    out = _copy(run2, tmp_path / "run")
    last = out / "checkpoints" / "last.ckpt"
    overrides = _run_overrides(corpus, out, "schedule.max_steps=1")
    capsys.readouterr()
    assert main(["train", *overrides]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(out) in err[0], err
    assert "--overwrite" in err[0] and "--resume" in err[0] and "choose another out_dir" in err[0], err
    assert _step(last) == 2 and len(list((out / "logs" / "csv").glob("version_*"))) == 1  # untouched
    # --overwrite: the old checkpoints, logs and evaluation go (and the log says so); curve and
    # checkpoints are the new run's
    (out / "eval").mkdir()
    (out / "eval" / "results.md").write_text("the old checkpoint's scores")
    assert main(["train", *overrides, "--overwrite"]) == 0
    printed = capsys.readouterr().out
    assert "removed" in printed and str(out / "checkpoints") in printed and str(out / "logs") in printed
    assert str(out / "eval") in printed and not (out / "eval").exists()
    assert _step(last) == 1 and all(_step(p) == 1 for p in (out / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in (out / "logs" / "csv").glob("version_*")] == ["version_0"]
    assert sorted(read_losses(out)["train"]) == [1]


def test_gpu_requests_fail_before_the_data_is_read(tmp_path, monkeypatch):
    """trainer.accelerator=gpu without a GPU, or more devices than GPUs: one RecipeError naming the
    key, raised before the data folder (here missing) is looked at."""
    import torch

    from fp4lightning.train.run import build
    from fp4lightning.train.recipe import RecipeError, load_recipe

    def cfg(*extra):
        return load_recipe(None, [f"out_dir={tmp_path / 'run'}", f"data.dir={tmp_path / 'no-data'}", *extra])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError, match="`trainer.accelerator` = 'gpu' but this machine has no CUDA GPU"):
        build(cfg("trainer.accelerator=gpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RecipeError, match=r"`trainer.devices` = 2 but this machine has 1 CUDA GPU\(s\); set trainer.devices=1"):
        build(cfg("trainer.accelerator=cuda", "trainer.devices=2", "data.global_batch_size=32"))
    assert not (tmp_path / "run").exists()
    # num_nodes > 1 outside a multi-node launch would wait forever for the other nodes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "NODE_RANK", "MASTER_ADDR", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RecipeError, match="`trainer.num_nodes` = 2 but this process was not started as part of a "
                                          "multi-node job.*torchrun or srun"):
        build(cfg("trainer.num_nodes=2", "data.global_batch_size=32"))
    monkeypatch.setenv("NODE_RANK", "0")  # launched (here: by hand, Lightning's manual multi-node variables)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(Exception, match="no-data") as e:  # past the check: the missing data folder is next
        build(cfg("trainer.num_nodes=2", "data.global_batch_size=32"))
    assert not isinstance(e.value, RecipeError) or "num_nodes" not in str(e.value)


def test_resume_n_kv_heads_spelled_out_is_the_same_model(corpus, run2, tmp_path):
    """A checkpoint recording n_kv_heads=None (= n_heads) and a recipe spelling it out describe the same
    model: resume accepts it (the comparison normalizes both, LlamaConfig.normalized)."""
    import torch

    from fp4lightning.train.resume import check_resumable
    from fp4lightning.train.recipe import load_recipe

    ckpt = torch.load(run2 / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    model = ckpt["hyper_parameters"]["model"]
    kv = model["n_kv_heads"]
    model["n_heads"], model["n_kv_heads"] = kv, None  # recorded the other way: None meaning n_heads
    torch.save(ckpt, tmp_path / "mha.ckpt")
    check_resumable(tmp_path / "mha.ckpt", load_recipe(None, _run_overrides(
        corpus, run2, f"model.n_heads={kv}", f"model.n_kv_heads={kv}")))
