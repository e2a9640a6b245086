"""`fp4lightning export-hf` never loses the user's files and never leaves half a folder (issue 46,
item 6): a folder that holds files is refused without --overwrite and left as it was, --overwrite
replaces it whole, a SIGTERM or SIGKILL in the middle of an export leaves the old folder (or none),
and every file written follows the umask."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fp4lightning.cli import main as cli_main
from fp4lightning.data.tokenizer import Tokenizer
from fp4lightning.models.hf import PAUSE_ENV, save_hf
from fp4lightning.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

_TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on in the sun. " * 40
_SHAPE = dict(vocab_size=300, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=32)

#: what export-hf runs once it has loaded the checkpoint (a child process without Lightning's import time)
_EXPORT = """
import sys
from fp4lightning.data.tokenizer import Tokenizer
from fp4lightning.models.hf import save_hf
from fp4lightning.models.llama import Llama, LlamaConfig
save_hf(Llama(LlamaConfig(**{shape})), sys.argv[1], Tokenizer.from_file(sys.argv[2]), overwrite=True)
"""


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return Llama(LlamaConfig(**_SHAPE)), Tokenizer.train([_TEXT], vocab_size=300)


@pytest.fixture(scope="module")
def ckpt(model_and_tokenizer, tmp_path_factory) -> Path:
    """A checkpoint export-hf reads (written by import-hf from a first export)."""
    model, tok = model_and_tokenizer
    base = tmp_path_factory.mktemp("export")
    save_hf(model, base / "hf0", tok)
    assert cli_main(["import-hf", str(base / "hf0"), str(base / "model.ckpt")]) == 0
    return base / "model.ckpt"


def _snapshot(folder: Path) -> dict:
    """Every file of ``folder``: bytes, modification time, mode."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode) for p in sorted(folder.iterdir())}


def _beside(target: Path) -> list[str]:
    """What an export left next to ``target`` (its temporary or set-aside folders)."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def _user_folder(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"mine": true}')
    (path / "notes.txt").write_text("my notes")
    return path


def test_a_folder_that_holds_files_is_refused_and_left_as_it_was(ckpt, tmp_path, capsys):
    target = _user_folder(tmp_path / "mine")
    before = _snapshot(target)
    capsys.readouterr()
    assert cli_main(["export-hf", str(ckpt), str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp4lightning export-hf: error: OUT_DIR"), err
    assert str(target) in err[0] and "not empty" in err[0] and "notes.txt" in err[0] and "--overwrite" in err[0]
    assert _snapshot(target) == before and _beside(target) == []


def test_overwrite_replaces_the_whole_folder(ckpt, tmp_path, capsys):
    target = _user_folder(tmp_path / "mine")
    assert cli_main(["export-hf", str(ckpt), str(target), "--overwrite"]) == 0
    names = {p.name for p in target.iterdir()}
    assert "notes.txt" not in names and {"config.json", "model.safetensors", "fp4lightning.json"} <= names, names
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    transformers.AutoModelForCausalLM.from_pretrained(target)
    assert _beside(target) == []
    # an empty folder, or none, needs no --overwrite
    (tmp_path / "empty").mkdir()
    for fresh in (tmp_path / "empty", tmp_path / "new" / "hf"):
        assert cli_main(["export-hf", str(ckpt), str(fresh)]) == 0
        assert (fresh / "model.safetensors").is_file() and _beside(fresh) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_every_file_follows_the_umask(model_and_tokenizer, tmp_path, umask):
    model, tok = model_and_tokenizer
    old = os.umask(umask)
    try:
        out = save_hf(model, tmp_path / "hf", tok)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~umask)}, modes


def _earlier_export(ckpt: Path, target: Path) -> dict:
    assert cli_main(["export-hf", str(ckpt), str(target)]) == 0
    (target / "notes.txt").write_text("an earlier export, with a note")
    return _snapshot(target)


def _wait_for_weights(partial: Path, proc: subprocess.Popen | None = None) -> None:
    """Until the export writing ``partial`` has begun its weights (it then sleeps PAUSE_ENV seconds)."""
    deadline = time.monotonic() + 120
    while not (partial / "model.safetensors").is_file():
        assert proc is None or proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_sigterm_mid_export_leaves_the_old_folder(model_and_tokenizer, ckpt, tmp_path, monkeypatch):
    """A real SIGTERM to this process while it exports with overwrite over a complete earlier export,
    paused (PAUSE_ENV) after the weights and before the tokenizer: SystemExit(143), the old folder
    as it was, the partial one deleted."""
    model, tok = model_and_tokenizer
    target = tmp_path / "hf"
    before = _earlier_export(ckpt, target)
    monkeypatch.setenv(PAUSE_ENV, "60")

    def terminate():
        _wait_for_weights(target.parent / f".{target.name}.export-{os.getpid()}")
        if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:  # else SIGTERM would end the test run itself
            os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate, daemon=True)
    killer.start()
    with pytest.raises(SystemExit) as stopped:
        save_hf(model, target, tok, overwrite=True)
    killer.join()
    assert stopped.value.code == 128 + signal.SIGTERM
    assert _snapshot(target) == before and _beside(target) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the export's handler is gone


def test_sigkill_mid_export_leaves_the_old_folder(model_and_tokenizer, ckpt, tmp_path):
    """A real process exporting with overwrite over a complete earlier export, killed (SIGKILL) while it
    writes: the old folder as it was; the next export deletes the partial one it left."""
    model_and_tokenizer[1].save(tmp_path / "tokenizer.json")
    target = tmp_path / "hf"
    before = _earlier_export(ckpt, target)
    proc = subprocess.Popen([sys.executable, "-c", _EXPORT.format(shape=_SHAPE), str(target),
                             str(tmp_path / "tokenizer.json")], env={**os.environ, PAUSE_ENV: "120"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[1])
    _wait_for_weights(target.parent / f".{target.name}.export-{proc.pid}", proc)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _snapshot(target) == before
    assert _beside(target) == [f".{target.name}.export-{proc.pid}"]
    assert cli_main(["export-hf", str(ckpt), str(target), "--overwrite"]) == 0
    assert _beside(target) == [] and not (target / "notes.txt").exists()


def _dead_pid() -> int:
    """A pid no process has now."""
    pid = 999_999
    while Path(f"/proc/{pid}").exists() or pid == os.getpid():
        pid -= 1
    return pid


def test_without_an_exchange_two_renames_replace_the_folder(tmp_path, monkeypatch):
    """Where renameat2's exchange is missing (another OS, a filesystem without it): the old folder is
    moved aside, the new one renamed in, the old one deleted."""
    from fp4lightning.models import export_folder as ef

    monkeypatch.setattr(ef, "_exchange", lambda a, b: False)
    target = _user_folder(tmp_path / "hf")
    with ef.export_folder(target, overwrite=True) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["config.json"] and _beside(target) == []


def test_a_folder_a_killed_swap_set_aside_is_put_back(tmp_path, capsys):
    """A swap killed between its two renames leaves no target and the old folder at `.<name>.old-<pid>`:
    the next export puts it back first (and then refuses it, as it holds files)."""
    from fp4lightning.errors import UsageError
    from fp4lightning.models.export_folder import export_folder

    target = tmp_path / "hf"
    aside = _user_folder(tmp_path / f".hf.old-{_dead_pid()}")
    before = _snapshot(aside)
    with pytest.raises(UsageError, match="not empty"):
        with export_folder(target):
            pass
    assert _snapshot(target) == before and _beside(target) == []
    assert "put back" in capsys.readouterr().out
