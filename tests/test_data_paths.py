"""A prepared data folder's ``meta.json`` cannot make training read files outside the folder.

``meta.json`` names the tokenizer and every token shard; a shard named by an absolute path, a path
through ``..`` or a symlink resolving outside the folder was memory-mapped and trained on. Such an
entry is refused in one line naming ``meta.json`` and the entry, by ``PreparedData`` (what training,
eval and the benchmarks read) and by ``fp4lightning train``; ``data prepare`` prepares such a folder again.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fp4lightning.cli import main as cli_main
from fp4lightning.data import DataCorruptError, PreparedData, shard_problems
from tests.test_data import prepared_test_corpus
from tests.test_train import tiny_overrides


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return prepared_test_corpus(tmp_path_factory)


def _pointing_outside(corpus: Path, tmp_path: Path, how: str, entry: str = "shard") -> tuple[Path, str]:
    """A copy of the prepared ``corpus`` whose train shard (or tokenizer) is taken from a copy outside the
    folder, named ``how``: by absolute path, through ``..``, or through a symlink inside the folder."""
    data = shutil.copytree(corpus, tmp_path / "data")
    meta_path = data / "meta.json"
    meta = json.loads(meta_path.read_text())
    shard = meta["splits"]["train"]["shards"][0]
    name = shard["file"] if entry == "shard" else meta["tokenizer"]
    outside = shutil.copy(data / name, tmp_path / f"outside-{name}")  # intact: sizes and sha256 still match
    value = {"absolute": str(outside), "dotdot": f"../outside-{name}", "symlink": name}[how]
    if how == "symlink":
        (data / name).unlink()
        (data / name).symlink_to(outside)
    if entry == "shard":
        shard["file"] = value
    else:
        meta["tokenizer"] = value
    meta_path.write_text(json.dumps(meta))
    return data, "splits.train.shards[0].file" if entry == "shard" else "tokenizer"


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_shard_outside_the_data_folder_is_refused(corpus, tmp_path, how):
    data, key = _pointing_outside(corpus, tmp_path, how)
    with pytest.raises(DataCorruptError) as e:
        PreparedData(data)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{data / 'meta.json'}: {key} = "), msg
    assert ("outside the data folder" if how == "symlink" else "leaves the data folder") in msg, msg
    assert "prepare it again with:" in msg and "--force" in msg, msg
    # prepare's up-to-date check reports it without reading the file outside
    assert shard_problems(data, json.loads((data / "meta.json").read_text()), checksums=True) == [
        msg.split("; a prepared folder")[0]]


def test_a_tokenizer_outside_the_data_folder_is_refused(corpus, tmp_path):
    data, key = _pointing_outside(corpus, tmp_path, "dotdot", entry="tokenizer")
    with pytest.raises(DataCorruptError, match=r"^.*meta\.json: tokenizer = '\.\./outside-tokenizer\.json' leaves"):
        PreparedData(data)


def test_train_refuses_a_shard_outside_the_data_folder(corpus, tmp_path, capsys):
    data, key = _pointing_outside(corpus, tmp_path, "absolute")
    capsys.readouterr()
    assert cli_main(["train", *tiny_overrides(data, tmp_path / "run", "schedule.max_steps=2")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("fp4lightning train: error: "), err
    assert f"{data / 'meta.json'}: {key} = " in err[0] and "leaves the data folder" in err[0], err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_files_linked_inside_the_folder_still_load(corpus, tmp_path):
    """A symlink that stays inside the folder (and a data folder that is itself a link) are fine."""
    data = shutil.copytree(corpus, tmp_path / "real")
    meta = json.loads((data / "meta.json").read_text())
    name = meta["splits"]["train"]["shards"][0]["file"]
    (data / name).rename(data / f"kept-{name}")
    (data / name).symlink_to(f"kept-{name}")
    (tmp_path / "link").symlink_to(data)
    assert PreparedData(tmp_path / "link").num_tokens("train") == meta["splits"]["train"]["tokens"]
