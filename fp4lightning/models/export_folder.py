"""The folder an export writes (``fp4lightning export-hf``), never left half written.

The files go into a hidden folder beside the target, ``.<name>.export-<pid>``, which is renamed
into place only when complete, so a failure, Ctrl-C, SIGTERM or SIGKILL leaves the target as it was
(or absent). A target that holds files is refused unless ``overwrite``; then it is swapped with the
new folder in one step where the system can (Linux ``renameat2(RENAME_EXCHANGE)``), else by two
renames, and deleted. A swap killed between those two renames leaves the old folder at
``.<name>.old-<pid>``; the next export into the same target puts it back first. Folders of exports
that were killed are deleted by the next one. Every file and folder written gets the mode the
umask gives new files (safetensors creates its file 0600 whatever the umask). A full disk is one line
(:class:`~fp4lightning.errors.UserError`), the partial folder deleted.

Imports nothing heavy: the command line checks the target before it imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from fp4lightning.errors import UsageError, UserError, check_writable_dir

__all__ = ["check_export_target", "export_folder"]

#: entries named in the refusal of a non-empty target
_SHOWN = 4


def check_export_target(out_dir: str | os.PathLike, overwrite: bool = False, what: str = "OUT_DIR") -> None:
    """Raise :class:`~fp4lightning.errors.UsageError` naming ``what`` unless ``out_dir`` can take a new
    export: absent or an empty folder (or any folder with ``overwrite``), in a writable folder."""
    out = Path(out_dir)
    if out.is_symlink():
        raise UsageError(f"{what} {out} is a symbolic link; name the folder itself ({out.resolve()})")
    if out.exists() and not out.is_dir():
        raise UsageError(f"{what} {out} exists and is not a folder; choose another {what}")
    if out.is_dir() and not overwrite:
        entries = sorted(p.name for p in out.iterdir())
        if entries:
            shown = ", ".join(entries[:_SHOWN]) + (f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else "")
            raise UsageError(f"{what} {out} is not empty (it holds {shown}); pass --overwrite to replace the whole "
                             f"folder, or choose another {what}")
    check_writable_dir(out.parent, f"the folder of {what}", fix=f"choose another {what}")


@contextlib.contextmanager
def export_folder(out_dir: str | os.PathLike, overwrite: bool = False, what: str = "OUT_DIR") -> Iterator[Path]:
    """Yield an empty folder beside ``out_dir`` to write the export into; when the block ends without an
    exception it becomes ``out_dir`` (see the module docstring). Inside the block, SIGTERM raises
    ``SystemExit(143)`` (main thread, where no handler was set), so the partial folder is deleted."""
    out = Path(out_dir)
    _clean_leftovers(out)
    check_export_target(out, overwrite, what)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    _remove(tmp)
    tmp.mkdir(parents=True)
    try:
        with _sigterm_raises():
            yield tmp
            _follow_umask(tmp)
            _move_into_place(tmp, out, overwrite, what)
    except Exception as e:
        if _disk_full(e):
            raise UserError(f"no space left on device while writing {what} {out}; nothing was written and {out} is as "
                            f"it was: free some space or choose another {what}") from e
        raise
    finally:
        _remove(tmp)  # the partial export, or after a swap the old folder


def _disk_full(e: BaseException) -> bool:
    """Whether ``e`` or an exception it came from says the disk (or quota) is full: an ``OSError``, or the
    writers of safetensors and tokenizers, which report it in words (``... (os error 28)``)."""
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e) for m in ("No space left on device", "Disk quota exceeded")):
            return True
        e = e.__cause__ or e.__context__
    return False


def _move_into_place(tmp: Path, out: Path, overwrite: bool, what: str) -> None:
    try:
        os.rename(tmp, out)  # out absent or an empty folder: replaced in one step
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if not overwrite:  # filled since it was checked
        check_export_target(out, overwrite, what)
    if _exchange(tmp, out):
        return  # tmp now holds the old folder
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(tmp, out)
    _remove(old)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where the C
    library, the kernel or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def _clean_leftovers(out: Path) -> None:
    """Put back a folder that a killed swap left aside (when the target is absent), and delete the
    folders of exports into ``out`` whose process is gone."""
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.iterdir()):
        kind, _, pid = path.name.removeprefix(f".{out.name}.").partition("-")
        if not path.name.startswith(f".{out.name}.") or kind not in ("old", "export") or not pid.isdigit():
            continue
        if int(pid) != os.getpid() and pid_alive(int(pid)):
            continue  # another export at work
        if kind == "old" and not out.exists() and not out.is_symlink():
            os.rename(path, out)
            print(f"put back {out}, which an export killed while replacing it had moved to {path}", flush=True)
        else:
            _remove(path)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def process_umask() -> int:
    """This process's umask (read from /proc where it can be: setting it to read it races other threads)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _follow_umask(root: Path) -> None:
    """Folders ``0o777`` and files ``0o666`` less the umask, as if each had been created plainly."""
    mask = process_umask()
    os.chmod(root, 0o777 & ~mask)
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(folder, name), 0o666 & ~mask)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(128 + SIGTERM)`` inside the block, so ``finally`` clauses run; only
    in the main thread and where SIGTERM still has its default action (a caller's handler is kept)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
