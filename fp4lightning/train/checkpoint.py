"""Load a training checkpoint as (model, tokenizer, recipe) for evaluation and export.

A checkpoint written by ``fp4lightning train`` is a Lightning ``.ckpt`` holding

* ``state_dict``: the LightningModule's, i.e. ``model.<Llama key>`` high-precision master
  weights (``FP4Linear`` keeps ``weight`` as an ordinary parameter, so FP4 and BF16 runs
  have the same keys);
* ``hyper_parameters``: the ``LlamaConfig`` fields (``model``), the FP4 spec (``fp4``:
  ``None`` or ``{"preset", "overrides"}``) and the resolved recipe (``recipe``);
* ``tokenizer``: the tokenizer JSON (the same file as ``<data_dir>/tokenizer.json`` and
  ``<run_dir>/tokenizer.json``).

FSDP runs save sharded checkpoint folders; they are consolidated in memory here.

Loading never runs code from the checkpoint: files are read with ``torch.load(weights_only=True)``,
and a sharded folder's pickled ``.metadata`` as data, checked against the folder's files
(:mod:`fp4lightning.train.dcp_metadata`), so what a load allocates and reads is bounded by those files.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from fp4lightning.errors import UserError
from fp4lightning.models.llama import Llama, LlamaConfig
from fp4lightning.lightning.nonfinite import NonFiniteError, params_nonfinite
from fp4lightning.data.tokenizer import Tokenizer
from fp4lightning.train.dcp_metadata import DcpMetadataError, read_dcp_metadata
from fp4lightning.train.recipe import fp4_config_from_spec, recipe_from_dict

__all__ = ["load_checkpoint", "read_checkpoint", "LoadedCheckpoint", "CheckpointError", "AtomicCheckpointIO",
           "TMP_GLOB", "LAST_CKPT", "resume_candidates"]

#: the checkpoint a run keeps up to date beside its newest numbered ``step=N.ckpt`` (``--resume`` reads it)
LAST_CKPT = "last.ckpt"
#: temporary files of an unfinished save (removed by the next run: see AtomicCheckpointIO)
TMP_GLOB = ".*.ckpt.*.tmp"

_PREFIX = "model."


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, unreadable or not an fp4lightning checkpoint (names the file)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO, made crash- and full-disk-safe (docs/training.md, "Checkpoints").

    Lightning's own writer goes through a temporary file that may live on another filesystem
    (``$TMPDIR``) and a move that falls back to copying into the destination, so a kill or a
    full disk in the middle leaves a truncated ``last.ckpt``. This one writes to a temporary
    file in the destination folder, flushes and fsyncs it, and ``os.replace``s it over the
    target (atomic on POSIX within one filesystem), then fsyncs the folder: the target is
    always either the previous complete checkpoint or the new complete one. On any failure
    the temporary file is removed and the previous file is left as it was. A checkpoint whose
    weights hold an inf/NaN is never written: that raises :class:`~fp4lightning.lightning.nonfinite.NonFiniteError`,
    except during the save-on-exception of a run that is stopping with one (it diverged), where the
    refusal is one line on stderr and the run's own error is the one reported.
    """

    _refused_step: Any = object()  # the step whose refusal was last printed (numbered and last.ckpt: one line)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("AtomicCheckpointIO does not take storage_options")
        path = Path(path)
        # the exception Lightning is handling when it calls this from ModelCheckpoint.on_exception
        # (save_on_exception=True); None on an ordinary save
        stopping = sys.exc_info()[1]
        bad = _nonfinite_weight(checkpoint)
        if bad is not None:
            step = checkpoint.get("global_step")
            if not isinstance(stopping, NonFiniteError):
                raise NonFiniteError(f"refusing to write checkpoint {path}: weight {bad} holds inf/NaN (step {step})",
                                     step=step)
            # the run is stopping because it diverged: that error and its advice are what the user must
            # see (raised here, the refusal would replace them), so the refusal is a secondary line
            if self._refused_step != step:
                self._refused_step = step
                print(f"note: no checkpoint written at step {step}: weight {bad} holds inf/NaN",
                      file=sys.stderr, flush=True)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; a checkpoint is shared like any output file
            with os.fdopen(fd, "wb") as f:
                self._write(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(e, Exception) and not isinstance(e, CheckpointError):
                # torch.save reports a failed write as RuntimeError("unexpected pos ...") from the OSError
                cause, chain = e, []
                while cause is not None and cause not in chain:
                    chain.append(cause)
                    cause = cause.__cause__ or cause.__context__
                oserr = next((c for c in chain if isinstance(c, OSError)), None)
                if oserr is not None and oserr.errno == errno.ENOSPC:
                    why = "the disk is full"
                else:
                    err = oserr or e
                    why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                raise CheckpointError(f"could not write checkpoint {path} ({why}); the previous {path.name} "
                                      "(if any) is unchanged and still loads") from e
            raise
        with contextlib.suppress(OSError):  # make the rename itself durable
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    @staticmethod
    def _write(checkpoint: dict[str, Any], f: Any) -> None:
        torch.save(checkpoint, f)


def _umask() -> int:
    # reading the umask means setting it; put it straight back
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _nonfinite_weight(checkpoint: dict[str, Any]) -> str | None:
    """The key of the first state-dict tensor of ``checkpoint`` that holds an inf/NaN (None: all finite)."""
    state = checkpoint.get("state_dict") or {}
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    if not params_nonfinite(tensors):
        return None
    return next(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
                and not bool(torch.isfinite(v).all()))


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete temporary files left by a save that was killed (``.last.ckpt.XXXX.tmp``)."""
    removed = []
    for p in Path(folder).glob(TMP_GLOB):
        with contextlib.suppress(OSError):
            p.unlink()
            removed.append(p)
    return removed


class LoadedCheckpoint(NamedTuple):
    model: Llama
    tokenizer: Tokenizer | None
    recipe: Any  # fp4lightning.train.recipe.RecipeConfig, or None for a checkpoint without one


def _resolve(path: Path) -> Path:
    if path.is_dir():
        for candidate in (path / LAST_CKPT, path / "checkpoints" / LAST_CKPT):
            if candidate.exists():
                return candidate
        if (path / ".metadata").is_file():
            return path  # a sharded (FSDP / torch.distributed.checkpoint) checkpoint folder
        raise CheckpointError(f"{path} is a folder without last.ckpt or checkpoints/last.ckpt")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} not found")
    return path


def _why(e: BaseException) -> str:
    """One line saying why a file did not load, in our words: never torch's advice to load it unsafely."""
    msg = str(e)
    if isinstance(e, DcpMetadataError):
        return msg
    # torch.load(weights_only=True) words its refusals over several lines that advise weights_only=False
    found = re.search(r"GLOBAL (\S+) (?:was not an allowed global|whose module)", msg)
    if found:
        name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"  # torch drops "builtins."
        return f"it holds a pickled {name}, code that loading would run; fp4lightning never runs code from a checkpoint"
    for pattern, why in _REFUSALS:
        found = re.search(pattern, msg)
        if found:
            return why.format(*found.groups())
    if "weights_only" in msg or "Weights only load failed" in msg:
        return "it holds objects other than tensors and plain data, which fp4lightning does not load"
    lines = msg.strip().splitlines()
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:300]}"


#: torch.load(weights_only=True)'s other refusals (pattern -> what it found, from the pattern's groups)
_REFUSALS = (
    (r"Trying to call reduce for unrecognized function (\S+)",
     "it calls {} while loading, which tensors and plain data never do; fp4lightning never runs code from a checkpoint"),
    (r"Can only create new object for .* but got (\S+)",
     "it makes a {} object while loading, which tensors and plain data never do"),
    (r"Unsupported operand (\d+)", "its pickle uses opcode {}, which tensors and plain data never need"),
    (r"``(\S+)`` must be imported to load", "it holds {} objects, which fp4lightning checkpoints never contain"),
    (r"(TorchScript) archives", "it is a {} archive (a compiled model), not a training checkpoint"),
    (r"(legacy \.tar) format", "it is in PyTorch's {} format, which cannot be read without running code from it"),
)


def _corrupt(what: str | Path, e: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {what} is corrupt or not a PyTorch checkpoint ({_why(e)}); "
                           "use another checkpoint (e.g. the numbered one beside last.ckpt) or retrain")


def _read_dcp_metadata(folder: Path) -> Any:
    """A sharded folder's pickled ``.metadata``, read as data and checked against the folder's files
    (:func:`~fp4lightning.train.dcp_metadata.read_dcp_metadata`)."""
    md_file = folder / ".metadata"
    try:
        return read_dcp_metadata(folder)
    except Exception as e:
        raise _corrupt(md_file, e) from e


def _safe_reader_and_planner(folder: Path, metadata: Any) -> tuple[Any, Any]:
    """torch's FileSystemReader and load planner for ``folder``, the reader serving ``metadata`` (read safely
    already) and the planner loading every non-tensor entry with ``weights_only=True``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # what FileSystemReader.read_metadata returns, from the metadata read above
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except Exception as e:
                raise _corrupt(f"{folder} (entry {read_item.dest_index.fqn})", e) from e
            # the base class unpickles with weights_only=False: give it bytes written here from the plain data
            plain = io.BytesIO()
            torch.save(obj, plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return Reader(folder), Planner()


def _as_ckpt_file_layout(ckpt: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A sharded folder's entries plus Lightning's ``meta.pt`` under the keys a ``.ckpt`` file has."""
    extra = folder / "meta.pt"  # Lightning's file of everything but the weights and optimizer states
    if extra.is_file() and not extra.resolve().is_relative_to(folder.resolve()):
        raise CheckpointError(f"checkpoint {extra} is a link to {extra.resolve()}, outside the checkpoint folder; use "
                              "another checkpoint (e.g. the numbered one beside last.ckpt) or retrain")
    if extra.is_file():
        try:
            rest = torch.load(extra, map_location="cpu", weights_only=True)
        except Exception as e:
            raise _corrupt(extra, e) from e
        if not isinstance(rest, dict):
            raise CheckpointError(f"{extra} is not a Lightning checkpoint's meta.pt (it holds a {type(rest).__name__})")
        ckpt.update(rest)
    # Lightning's layout: FSDPStrategy saves the weights as "model", ModelParallelStrategy (FSDP2) as "state_dict";
    # both save "optimizer_<i>", where a .ckpt file has the list "optimizer_states"
    if "state_dict" not in ckpt and "model" in ckpt:
        ckpt["state_dict"] = ckpt.pop("model")
    optimizers = sorted((k for k in ckpt if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k.split("_")[1]))
    if optimizers:
        ckpt["optimizer_states"] = [ckpt.pop(k) for k in optimizers]
    return ckpt


def _read_sharded(folder: Path) -> dict[str, Any]:
    """A sharded checkpoint folder (torch.distributed.checkpoint shards + ``.metadata``, Lightning's ``meta.pt``)
    as one checkpoint dict on CPU, read without running code from it.

    torch's FileSystemReader unpickles ``.metadata`` with plain ``pickle`` and its load planner the non-tensor
    entries with ``weights_only=False``; Lightning's reader loads ``meta.pt`` with torch's default. Here
    ``.metadata`` is read as data (:func:`_read_dcp_metadata`), entries and ``meta.pt`` through ``weights_only=True``.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    # what Lightning's and torch's own consolidation use: the public load() fills only keys already present
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader, planner = _safe_reader_and_planner(folder, _read_dcp_metadata(folder))
    ckpt: dict[str, Any] = {}
    try:
        _load_state_dict(ckpt, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as e:  # torch collects each rank's error (one rank here) into this BaseException
        err = next(iter(e.failures.values()))[0]
        if isinstance(err, CheckpointError):
            raise err from None
        raise _corrupt(folder, err) from err
    except Exception as e:
        raise _corrupt(folder, e) from e
    return _as_ckpt_file_layout(ckpt, folder)


def read_checkpoint(path: str | Path) -> tuple[dict[str, Any], Path]:
    """The raw checkpoint dict (on CPU) and the resolved file it came from.

    ``path`` may be a ``.ckpt`` file, a run folder (``runs/<name>``), a checkpoints folder
    or a sharded FSDP checkpoint folder. Nothing in the file is run: anything but tensors and plain
    data is refused with :class:`CheckpointError`.
    """
    path = _resolve(Path(path))
    if path.is_dir():
        ckpt = _read_sharded(path)
    else:
        try:
            # our checkpoints hold tensors and plain containers only, so the safe loader suffices
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises RuntimeError / UnpicklingError / EOFError / ... for bad files
            raise _corrupt(path, e) from e
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "model" not in ckpt.get("hyper_parameters", {}):
        raise CheckpointError(f"{path} is not an fp4lightning training checkpoint (no state_dict / model hyperparameters)")
    return ckpt, path


def _recorded_step(path: Path) -> int | None:
    """The global step a checkpoint records, read without loading its tensors (None: unreadable)."""
    try:
        if path.is_dir():
            meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
        else:
            meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        step = meta.get("global_step")
    except Exception:
        return None
    return step if isinstance(step, int) else None


def resume_candidates(ckpt_dir: Path) -> list[Path]:
    """The checkpoints of a run's ``checkpoints`` folder, in the order ``--resume`` tries them.

    Newest first by the global step recorded inside, not by name: a run killed between the numbered
    save and the ``last.ckpt`` save leaves ``last.ckpt`` one save behind ``step=N.ckpt``. On a tie
    ``last.ckpt`` comes first. A checkpoint whose step cannot be read sorts where its name puts it
    (``last.ckpt``: newest), so it is tried, and reported as unusable, before older ones.
    """
    def key(p: Path) -> tuple:
        is_last = p.name == LAST_CKPT
        step = _recorded_step(p)
        if step is None:
            try:
                step = float("inf") if is_last else int(p.stem.split("=", 1)[1].split("-")[0])
            except (IndexError, ValueError):
                step = -1
        return step, is_last, p.stat().st_mtime

    found = [p for p in (ckpt_dir / LAST_CKPT, *ckpt_dir.glob("step=*.ckpt")) if p.exists()]
    return sorted(found, key=key, reverse=True)


def _state_mismatch(expected: dict, got: dict) -> str:
    """What differs between a model's state dict and a checkpoint's, in one line ('' when nothing)."""
    parts = []
    missing = [k for k in expected if k not in got]
    unexpected = [k for k in got if k not in expected]
    shapes = [f"{k} {tuple(got[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
              if k in got and tuple(got[k].shape) != tuple(v.shape)]
    for what, keys in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)):
        if keys:
            parts.append(f"{what}: {', '.join(keys[:3])}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else ""))
    return "; ".join(parts)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", fp4: bool = False) -> LoadedCheckpoint:
    """Load ``(model, tokenizer, recipe)`` from an ``fp4lightning train`` checkpoint.

    Args:
        path: a ``.ckpt`` file, a run folder (``runs/<name>`` -> ``checkpoints/last.ckpt``)
            or a sharded FSDP checkpoint folder.
        map_location: device for the model.
        fp4: if the run trained in FP4, convert the model's linear layers with the run's
            FP4 preset (``convert_to_fp4``) so it computes like it did in training; by
            default the model is the plain high-precision ``Llama`` with the master weights.

    Returns:
        ``LoadedCheckpoint(model, tokenizer, recipe)`` (a NamedTuple): the
        :class:`~fp4lightning.models.llama.Llama` in eval mode, fp32, weights loaded; the
        :class:`~fp4lightning.data.tokenizer.Tokenizer` (``encode``, ``decode``, ``bos_id``,
        ``eos_id``); the resolved :class:`~fp4lightning.train.recipe.RecipeConfig`.

    Raises:
        CheckpointError: naming the file, if it is missing, corrupt or not ours.
    """
    ckpt, path = read_checkpoint(path)
    hp = ckpt["hyper_parameters"]
    try:
        config = LlamaConfig(**hp["model"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: stored model config is invalid: {e}") from e
    with torch.device("meta"):
        model = Llama(config)
    state = {k[len(_PREFIX):]: v for k, v in ckpt["state_dict"].items() if k.startswith(_PREFIX)}
    if config.tie_embeddings:
        state.setdefault("lm_head.weight", state.get("embed_tokens.weight"))
    mismatch = _state_mismatch(model.state_dict(), state)
    if mismatch:
        raise CheckpointError(f"{path}: weights do not match the stored model config ({mismatch}); "
                              "the file was edited or written by another version: use the run's own checkpoint")
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.float().to(map_location).eval()
    if fp4 and hp.get("fp4"):
        # here alone: reading a checkpoint (eval, export) does not need the FP4 layers' modules
        from fp4lightning.nn.convert import convert_to_fp4

        convert_to_fp4(model, fp4_config_from_spec(hp["fp4"]))  # the spec the run recorded

    tokenizer = None
    if ckpt.get("tokenizer"):
        tokenizer = Tokenizer.from_str(ckpt["tokenizer"])
    else:
        for candidate in (path.parent / "tokenizer.json", path.parent.parent / "tokenizer.json"):
            if candidate.is_file():
                tokenizer = Tokenizer.from_file(candidate)
                break

    recipe = recipe_from_dict(hp["recipe"]) if hp.get("recipe") else None
    return LoadedCheckpoint(model, tokenizer, recipe)
