"""The one file an export writes (``fp4lightning export-gguf``), never left half written.

The file is written as ``.<name>.export-<pid>`` beside the target and renamed over it only when complete,
so a full disk, an error or a kill leaves the target as it was (or absent); a temporary file of an export
that was killed is deleted by the next export into the same target. An existing target is refused unless
``overwrite``. The file gets the mode the umask gives.

Imports nothing heavy: the command line checks the target before it imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from fp4lightning.errors import UsageError, UserError, check_writable_dir
from fp4lightning.models.export_folder import pid_alive, process_umask

__all__ = ["check_export_file", "export_file"]


def check_export_file(out: str | os.PathLike, overwrite: bool = False, what: str = "OUT") -> None:
    """Raise :class:`~fp4lightning.errors.UsageError` naming ``what`` unless ``out`` can take a new file:
    absent (or an existing file, with ``overwrite``) in a writable folder."""
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"{what} {out} is a folder; name the file to write, e.g. {out / 'model.gguf'}")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise UsageError(f"{what} {out} exists; pass --overwrite to replace it, or choose another {what}")
    check_writable_dir(out.parent, f"the folder of {what}", fix=f"choose another {what}")


@contextlib.contextmanager
def export_file(out: str | os.PathLike, overwrite: bool = False, what: str = "OUT") -> Iterator[Path]:
    """Yield the temporary path to write the export to; when the block ends without an exception it
    becomes ``out``. A full disk (``ENOSPC``, ``EDQUOT``) inside the block raises a one-line
    :class:`~fp4lightning.errors.UserError`; the temporary file is deleted whatever happens."""
    out = Path(out)
    check_export_file(out, overwrite, what)
    _remove_dead_leftovers(out)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~process_umask())
        os.replace(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) or _short_write(e):
            raise UserError(f"no space left on device while writing {out} ({e.strerror or e}); nothing was "
                            f"written: free some space or choose another {what}") from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _short_write(e: OSError) -> bool:
    """numpy's ``tofile`` (which ``gguf`` writes tensors with) reports a full disk as an ``OSError`` without an
    errno: ``"<n> requested and <m> written"``."""
    return e.errno is None and " requested and " in str(e) and str(e).endswith(" written")


def _remove_dead_leftovers(out: Path) -> None:
    """Delete the temporary files of exports into ``out`` whose process is gone."""
    for path in out.parent.glob(f".{out.name}.export-*"):
        pid = path.name.rsplit("-", 1)[1]
        if pid.isdigit() and (int(pid) == os.getpid() or not pid_alive(int(pid))):
            path.unlink(missing_ok=True)

