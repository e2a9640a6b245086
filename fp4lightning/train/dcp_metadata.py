"""A sharded checkpoint folder's ``.metadata``, read as data and checked against the folder's files.

torch.distributed.checkpoint pickles a ``Metadata`` object into ``<folder>/.metadata`` and reads it back
with plain ``pickle``, which runs whatever the file names. :func:`read_dcp_metadata` unpickles it into
stand-ins instead: each class or function the pickle may name (only the few torch writes there) becomes a
stand-in type made for this one load, so nothing in the file reaches a class, function or object of the
process. Pickle's BUILD (which sets attributes) is admitted only onto stand-in objects of torch's metadata
classes made by this load, never onto a class or a function. torch's ``Metadata`` is then rebuilt field by
field from the stand-ins' plain values, and checked against the folder before anything is allocated or read:

* every list index of a saved key path is below the number of entries (loading builds lists that long);
* every tensor chunk has its own stored entry at least as large as the chunk's bytes, and the chunks of a
  tensor hold at least as many elements as the tensor (loading allocates each tensor whole first);
* every shard path stays inside the folder (symlinks followed), every entry's byte range lies inside its
  file without overlapping another, and starts and ends like the zip file ``torch.save`` writes.

So what a load allocates and reads is bounded by the bytes the folder's files hold.
"""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

__all__ = ["DcpMetadataError", "read_dcp_metadata"]

_MD = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
#: torch's metadata classes, which it pickles as an object without arguments plus a BUILD of its fields
_BUILT = frozenset({f"{_MD}.Metadata", f"{_MD}.MetadataIndex", f"{_MD}.ChunkStorageMetadata",
                    f"{_MD}.TensorProperties", f"{_MD}.TensorStorageMetadata", f"{_MD}.BytesStorageMetadata",
                    f"{_MD}.StorageMeta", _STORAGE_INFO})
#: the other classes and functions torch pickles there, called with arguments (REDUCE)
_CALLED = frozenset({f"{_MD}._MEM_FORMAT_ENCODING", "torch.serialization._get_layout", "torch.Size",
                     *(f"pathlib.{n}" for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"))})
#: builtin containers it may name: their classes cannot be changed, and their objects take no attributes
_CONTAINERS = {"collections.OrderedDict": dict, "builtins.set": set, "builtins.frozenset": frozenset}

_MAX_DIMS = 64  # of a tensor (torch allows 64) and of a saved key path
_ZIP_HEAD, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"  # a zip's first local header; its end-of-directory record
_ZIP_END_LEN = 22  # bytes of the end-of-directory record without a comment (torch.save writes none)


class DcpMetadataError(ValueError):
    """``.metadata`` is refused; the message says why, in one line, without the file's name."""


_NO_STATE = object()


class _StateOntoInstances:
    """``__setstate__`` of the stand-ins, which pickle's BUILD looks up on what it builds: an object of a
    metadata class made by this load keeps the state; a class or function (whose attributes are the whole
    process's), or any other object, is refused."""

    def __get__(self, obj: Any, cls: type) -> Any:
        if obj is None:
            raise DcpMetadataError(f"it sets attributes of {cls.name}, which torch's metadata never does")
        if cls.name not in _BUILT or obj.state is not _NO_STATE:
            raise DcpMetadataError(f"it sets attributes of a {cls.name} object, which torch's metadata never does")
        return obj.keep_state


class _StandIn:
    """What an admitted class or function of the pickle becomes: a subclass made for one load, whose
    objects record the arguments they were made with (NEWOBJ, REDUCE) and their BUILD state."""

    __slots__ = ("args", "state")
    name = ""  # the dotted name it stands for

    def __new__(cls, *args: Any) -> _StandIn:
        obj = super().__new__(cls)
        obj.args, obj.state = args, _NO_STATE
        return obj

    __setstate__ = _StateOntoInstances()

    def keep_state(self, state: Any) -> None:
        self.state = state


class _Unpickler(pickle.Unpickler):
    """Names resolve to this load's stand-ins, torch dtypes to stand-in objects, the builtin containers to
    themselves; any other name is refused before anything is made from it."""

    def __init__(self, file: Any):
        super().__init__(file)
        self.stand_ins: dict[str, type] = {}

    def stand_in(self, dotted: str) -> type:
        if dotted not in self.stand_ins:
            self.stand_ins[dotted] = type(dotted.rpartition(".")[2], (_StandIn,), {"__slots__": (), "name": dotted})
        return self.stand_ins[dotted]

    def find_class(self, module: str, name: str) -> Any:
        dotted = f"{module}.{name}"
        if dotted in _BUILT or dotted in _CALLED:
            return self.stand_in(dotted)
        if dotted in _CONTAINERS:
            return _CONTAINERS[dotted]
        if module == "torch" and isinstance(_torch_name(name), torch.dtype):
            return self.stand_in(dotted)()
        raise DcpMetadataError(f"it holds a pickled {dotted}, code that loading would run; "
                               "fp4lightning never runs code from a checkpoint")


def _torch_name(name: str) -> Any:
    """``torch.<name>`` if the module defines it (never imports a submodule, as ``getattr(torch, ...)`` may)."""
    return vars(torch).get(name)


# ---------------------------------------------------------------- plain values of the stand-ins
def _what(obj: Any) -> str:
    return obj.name if isinstance(obj, _StandIn) else type(obj).__name__


def _fields(obj: Any, name: str, where: str, required: tuple = (), optional: tuple = ()) -> dict:
    """The BUILD state of ``obj``, a stand-in of ``name`` made without arguments: a dict holding the
    ``required`` keys and no others than ``optional``."""
    if not isinstance(obj, _StandIn) or obj.name != name or obj.args:
        raise DcpMetadataError(f"{where} is a {_what(obj)}, not a {name.rpartition('.')[2]}")
    state = {} if obj.state is _NO_STATE else obj.state
    if type(state) is not dict or not set(required) <= state.keys() <= {*required, *optional}:
        raise DcpMetadataError(f"{where} ({name.rpartition('.')[2]}) holds unexpected fields")
    return state


def _called(obj: Any, name: str, where: str) -> tuple:
    """The arguments ``obj``, a stand-in of ``name`` made by a call and never BUILT, was made with."""
    if not isinstance(obj, _StandIn) or obj.name != name or obj.state is not _NO_STATE:
        raise DcpMetadataError(f"{where} is a {_what(obj)}, not a {name.rpartition('.')[2]}")
    return obj.args


def _typed(value: Any, types: tuple, where: str) -> Any:
    if type(value) not in types:
        raise DcpMetadataError(f"{where} is a {_what(value)}, not a {' or '.join(t.__name__ for t in types)}")
    return value


def _count(value: Any, where: str, below: int | None = None) -> int:
    if type(value) is not int or value < 0 or (below is not None and value >= below):
        raise DcpMetadataError(f"{where} = {value!r} is not a count{f' below {below}' if below is not None else ''}")
    return value


def _size(obj: Any, where: str) -> torch.Size:
    args = _called(obj, "torch.Size", where)
    dims = args[0] if len(args) == 1 else None
    if type(dims) not in (tuple, list) or len(dims) > _MAX_DIMS:
        raise DcpMetadataError(f"{where} is not a tensor shape")
    return torch.Size([_count(d, f"{where}[{i}]") for i, d in enumerate(dims)])


def _dtype(obj: Any, where: str) -> torch.dtype:
    if not isinstance(obj, _StandIn) or not obj.name.startswith("torch.") or obj.args or obj.state is not _NO_STATE:
        raise DcpMetadataError(f"{where} is a {_what(obj)}, not a torch dtype")
    dtype = _torch_name(obj.name[len("torch."):])
    if not isinstance(dtype, torch.dtype):
        raise DcpMetadataError(f"{where} is a {obj.name}, not a torch dtype")
    return dtype


def _tensor_properties(obj: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    if not isinstance(obj, _StandIn) or obj.name != f"{_MD}.TensorProperties" or obj.args:
        raise DcpMetadataError(f"{where} is a {_what(obj)}, not a TensorProperties")
    state = obj.state
    if type(state) is not tuple or len(state) != 5:
        raise DcpMetadataError(f"{where} (TensorProperties) holds unexpected fields")
    dtype, layout, requires_grad, memory_format, pin_memory = state
    name = _called(layout, "torch.serialization._get_layout", f"{where}.layout")  # ("torch.strided",)
    layout = _torch_name(name[0].removeprefix("torch.")) if len(name) == 1 and type(name[0]) is str else None
    encoding = _called(memory_format, f"{_MD}._MEM_FORMAT_ENCODING", f"{where}.memory_format")
    formats = (torch.contiguous_format, torch.channels_last, torch.preserve_format)  # the encoding's values 0, 1, 2
    if not isinstance(layout, torch.layout) or len(encoding) != 1 or encoding[0] not in range(len(formats)):
        raise DcpMetadataError(f"{where} names an unknown layout or memory format")
    return TensorProperties(dtype=_dtype(dtype, f"{where}.dtype"), layout=layout,
                            requires_grad=_typed(requires_grad, (bool,), f"{where}.requires_grad"),
                            memory_format=formats[encoding[0]], pin_memory=_typed(pin_memory, (bool,), f"{where}.pin_memory"))


def _entry(obj: Any, key: str) -> Any:
    """One ``state_dict_metadata`` value: a TensorStorageMetadata (chunks left as stand-ins) or BytesStorageMetadata."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    where = f"entry {key}"
    if isinstance(obj, _StandIn) and obj.name == f"{_MD}.BytesStorageMetadata":
        _fields(obj, obj.name, where)
        return BytesStorageMetadata()
    f = _fields(obj, f"{_MD}.TensorStorageMetadata", where, ("properties", "size", "chunks"))
    return TensorStorageMetadata(_tensor_properties(f["properties"], f"{where}.properties"),
                                 _size(f["size"], f"{where}.size"), _typed(f["chunks"], (list,), f"{where}.chunks"))


def _chunk(obj: Any, where: str) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    f = _fields(obj, f"{_MD}.ChunkStorageMetadata", where, ("offsets", "sizes"))
    return ChunkStorageMetadata(_size(f["offsets"], f"{where}.offsets"), _size(f["sizes"], f"{where}.sizes"))


def _storage_item(key: Any, value: Any, n_items: int) -> tuple[Any, Any]:
    """One ``storage_data`` item: (MetadataIndex, _StorageInfo)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    k = _fields(key, f"{_MD}.MetadataIndex", "a storage key", ("fqn",), ("offset", "index"))
    fqn = _typed(k["fqn"], (str,), "a storage key's fqn")
    where = f"the storage of entry {fqn}"
    offset = None if k.get("offset") is None else _size(k["offset"], f"{where}: offset")
    index = None if k.get("index") is None else _count(k["index"], f"{where}: index", n_items)
    v = _fields(value, _STORAGE_INFO, where, ("relative_path", "offset", "length"), ("transform_descriptors",))
    if v.get("transform_descriptors"):
        raise DcpMetadataError(f"{where} is stored through {v['transform_descriptors']!r} (compressed or transformed), "
                               "which fp4lightning does not read")
    info = _StorageInfo(_typed(v["relative_path"], (str,), f"{where}: path"), _count(v["offset"], f"{where}: offset"),
                        _count(v["length"], f"{where}: length"))
    return MetadataIndex(fqn, offset, index), info


def _key_path(path: Any, key: str, n_entries: int) -> tuple:
    """One ``planner_data`` value: the key path of a flattened entry, its list indices below ``n_entries``."""
    where = f"the key path of entry {key}"
    if type(path) is not tuple or not 0 < len(path) <= _MAX_DIMS:
        raise DcpMetadataError(f"{where} is not a key path")
    for part in path:
        if type(part) is int and not 0 <= part < n_entries:
            raise DcpMetadataError(f"{where} holds list index {part}, but the checkpoint has {n_entries} entries")
        _typed(part, (str, int), where)
    return path


def _storage_meta(obj: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    if obj is None:
        return None
    f = _fields(obj, f"{_MD}.StorageMeta", "storage_meta", (), ("checkpoint_id", "save_id", "load_id", "modules"))
    ckpt_id = f.get("checkpoint_id")
    if isinstance(ckpt_id, _StandIn) and ckpt_id.name.startswith("pathlib."):
        parts = [_typed(p, (str,), "storage_meta.checkpoint_id") for p in _called(ckpt_id, ckpt_id.name, "checkpoint_id")]
        ckpt_id = str((PureWindowsPath if "Windows" in ckpt_id.name else PurePosixPath)(*parts))
    ids = [_typed(x, (str, type(None)), f"storage_meta.{k}")
           for k, x in (("checkpoint_id", ckpt_id), ("save_id", f.get("save_id")), ("load_id", f.get("load_id")))]
    modules = [_typed(m, (str,), "storage_meta.modules") for m in _typed(f.get("modules", []), (list,), "storage_meta.modules")]
    return StorageMeta(*ids, modules=modules)


# ---------------------------------------------------------------- the metadata, its bounds, the files
def _rebuild(root: Any) -> Any:
    """torch's Metadata from the unpickled stand-ins, checked for what loading it would allocate."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    f = _fields(root, f"{_MD}.Metadata", "the file", ("state_dict_metadata", "storage_data"),
                ("planner_data", "storage_meta", "version"))
    raw_entries = _typed(f["state_dict_metadata"], (dict,), "state_dict_metadata")
    raw_storage = _typed(f["storage_data"], (dict,), "storage_data")
    entries = {_typed(k, (str,), "an entry's name"): _entry(v, k) for k, v in raw_entries.items()}
    n_chunks = sum(len(e.chunks) for e in entries.values() if isinstance(e, TensorStorageMetadata))
    if n_chunks > len(raw_storage):
        raise DcpMetadataError(f"its tensors have {n_chunks} chunks but only {len(raw_storage)} stored entries")
    storage = dict(_storage_item(k, v, len(raw_storage)) for k, v in raw_storage.items())
    for key, e in entries.items():
        if isinstance(e, TensorStorageMetadata):
            e.chunks = [_chunk(c, f"entry {key} chunk {i}") for i, c in enumerate(e.chunks)]
            _check_chunks(key, e, storage)
    planner = {_typed(k, (str,), "a key path's name"): _key_path(v, k, len(entries))
               for k, v in _typed(f.get("planner_data", {}), (dict,), "planner_data").items()}
    return Metadata(state_dict_metadata=entries, planner_data=planner, storage_data=storage,
                    storage_meta=_storage_meta(f.get("storage_meta")),
                    version=_typed(f.get("version"), (str, type(None)), "version"))


def _check_chunks(key: str, entry: Any, storage: dict) -> None:
    """Each chunk of tensor ``key`` lies inside it and has its own stored entry holding at least its bytes, and
    the chunks hold at least the tensor's elements: the memory loading allocates is what the files hold."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    itemsize, seen, covered = entry.properties.dtype.itemsize, set(), 0
    for chunk in entry.chunks:
        index = MetadataIndex(key, chunk.offsets)
        inside = len(chunk.offsets) == len(chunk.sizes) == len(entry.size) and all(
            o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size))
        if not inside or index in seen or index not in storage:
            raise DcpMetadataError(f"a chunk of tensor {key} at {list(chunk.offsets)} lies outside it, repeats, or has no "
                                   "stored entry")
        seen.add(index)
        covered += chunk.sizes.numel()
        if chunk.sizes.numel() * itemsize > storage[index].length:
            raise DcpMetadataError(f"a chunk of tensor {key} has {chunk.sizes.numel() * itemsize} bytes but its stored "
                                   f"entry only {storage[index].length}")
    if covered < entry.size.numel():
        raise DcpMetadataError(f"tensor {key} has {entry.size.numel()} elements but its chunks only {covered}")


def _check_files(folder: Path, storage: dict) -> None:
    """Every stored entry lies in a regular file inside ``folder`` (symlinks followed), inside the file, apart
    from the others, and starts and ends like a ``torch.save`` zip: checked with a few bytes read per entry."""
    root = folder.resolve()
    by_file: dict[Path, list] = {}
    for index, info in storage.items():
        rel = info.relative_path
        if not rel or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts or "\\" in rel:
            raise DcpMetadataError(f"entry {index.fqn} is stored at {rel!r}, which leaves the checkpoint folder")
        real = (root / rel).resolve()
        if not real.is_relative_to(root):
            raise DcpMetadataError(f"shard {rel} of entry {index.fqn} is a link to {real}, outside the checkpoint folder")
        by_file.setdefault(real, []).append((info.offset, info.length, index.fqn))
    for real, ranges in by_file.items():
        rel = real.relative_to(root)
        try:
            st = real.stat()
        except OSError as e:
            raise DcpMetadataError(f"shard {rel} cannot be read ({e.strerror or type(e).__name__})") from e
        if not stat.S_ISREG(st.st_mode):
            raise DcpMetadataError(f"shard {rel} is not a regular file")
        ranges.sort()
        end = 0
        for offset, length, fqn in ranges:
            if offset < end or offset + length > st.st_size:
                raise DcpMetadataError(f"entry {fqn} at bytes {offset}-{offset + length} of shard {rel} ({st.st_size} "
                                       "bytes) lies outside it or over another entry")
            end = offset + length
        _check_zip_bounds(real, rel, ranges)


def _check_zip_bounds(real: Path, rel: Path, ranges: list) -> None:
    with open(real, "rb") as f:
        for offset, length, fqn in ranges:
            f.seek(offset)
            head = f.read(len(_ZIP_HEAD))
            f.seek(offset + length - _ZIP_END_LEN)
            end = f.read(len(_ZIP_END)) if length >= _ZIP_END_LEN + len(_ZIP_HEAD) else b""
            if head != _ZIP_HEAD or end != _ZIP_END:
                raise DcpMetadataError(f"entry {fqn} at bytes {offset}-{offset + length} of shard {rel} is not a "
                                       "torch.save file")


def read_dcp_metadata(folder: str | os.PathLike) -> Any:
    """``<folder>/.metadata`` as torch's ``Metadata``, unpickled without running code from it and checked against
    the folder's files (see the module docstring). Raises :class:`DcpMetadataError` saying why it is refused;
    ``OSError`` / ``pickle.UnpicklingError`` / ``EOFError`` ... for a file that cannot be read or unpickled."""
    folder = Path(folder)
    if not stat.S_ISREG(os.stat(folder / ".metadata").st_mode):  # a pipe or device would block or never end
        raise DcpMetadataError("it is not a regular file")
    with open(folder / ".metadata", "rb") as f:
        root = _Unpickler(f).load()
    metadata = _rebuild(root)
    _check_files(folder, metadata.storage_data)
    return metadata
