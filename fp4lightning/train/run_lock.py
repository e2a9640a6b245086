"""One run at a time in a run folder: ``fp4lightning train`` locks ``<out_dir>`` while it runs.

The lock is an ``flock`` on ``<out_dir>/run.lock``, a file that names the holder (pid, host,
command). A second ``train`` into the folder, fresh, ``--resume`` or ``--overwrite``, is refused in
one line naming that process (:class:`RunInUseError`, exit status 2) before it reads or changes
anything there: ``--overwrite`` deleting a live run's checkpoints and logs, and two runs writing one
``metrics.csv``, cannot happen. The kernel drops an ``flock`` when its process ends, however it ends
(SIGKILL, a crash), so the file a killed run leaves names a process that no longer holds it, and the
next run takes it over; a run that ends deletes it.

With several processes only the one that started the run holds it (rank 0 of node 0): the ranks
Lightning starts, and those torchrun or SLURM start, have their rank variables set and skip it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from fp4lightning.errors import UserError

__all__ = ["LOCK_FILE", "RunInUseError", "run_lock", "check_not_in_use", "holds_lock"]

#: the lock file inside the run folder
LOCK_FILE = "run.lock"
#: variables a launcher sets for each process it starts; a process where any is not "0" is not the run's first
_RANK_VARS = ("LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK", "SLURM_PROCID")
#: longest command quoted in the refusal
_MAX_COMMAND = 300


class RunInUseError(UserError):
    """The run folder is locked by a run that is still going (the message names its process)."""


def holds_lock() -> bool:
    """Whether this process is the one that locks the run folder: not a rank another process started."""
    return all(os.environ.get(var, "0") == "0" for var in _RANK_VARS)


def check_not_in_use(out_dir: str | os.PathLike, what: str = "recipe key `out_dir` =") -> None:
    """Raise :class:`RunInUseError` if a run holds the lock of ``out_dir`` now; creates and changes
    nothing. The command line calls it before its heavy imports; :func:`run_lock` takes the lock."""
    import fcntl

    path = Path(out_dir) / LOCK_FILE
    if not holds_lock() or not path.is_file():
        return
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)  # refused while a run holds it exclusively
        except BlockingIOError:
            raise RunInUseError(_in_use(path.parent, f.read(), what)) from None


@contextlib.contextmanager
def run_lock(out_dir: str | os.PathLike, what: str = "recipe key `out_dir` =") -> Iterator[None]:
    """Hold the lock of run folder ``out_dir`` (created if absent) inside the block; raise
    :class:`RunInUseError` naming ``what`` and the holder if another process holds it. A folder this
    call created and the run left empty is removed again. Does nothing in a rank another process started."""
    if not holds_lock():
        yield
        return
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    lock = _acquire(out / LOCK_FILE, what)
    try:
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": _command()}) + "\n")
        lock.flush()
        yield
    finally:
        _release(out / LOCK_FILE, lock)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only if the run wrote nothing


def _acquire(path: Path, what: str):
    """The lock file at ``path``, opened and locked (non-blocking)."""
    import fcntl

    while True:
        # O_CLOEXEC: processes this one starts (Lightning's other ranks) do not inherit the lock
        lock = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666), "r+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read()
            lock.close()
            raise RunInUseError(_in_use(path.parent, holder, what)) from None
        try:
            current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            return lock
        lock.close()  # its holder deleted it as it let go: lock the file now at the path


def _release(path: Path, lock) -> None:
    import fcntl

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # still held: a process waiting on this file finds it gone and opens the path again
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()


def _in_use(out: Path, holder: str, what: str) -> str:
    """The refusal's one line, naming the process in the lock file's ``holder`` text."""
    try:
        info = json.loads(holder)
        pid, host, command = int(info["pid"]), str(info["host"]), str(info.get("command") or "")
    except (ValueError, KeyError, TypeError):
        return (f"{what} {out} is in use by another run (its lock {out / LOCK_FILE} is held, by a process that "
                "has not written its name yet); wait for that run to end, or choose another out_dir")
    where = "" if host == socket.gethostname() else f" on host {host}"
    command = command if len(command) <= _MAX_COMMAND else command[:_MAX_COMMAND] + " ..."
    return (f"{what} {out} is in use by a run that is still going: pid {pid}{where}"
            + (f" ({' '.join(command.split())})" if command else "")
            + f"; wait for it to end or stop it (kill {pid}: it saves a checkpoint), or choose another out_dir")


def _command() -> str:
    """This process's command line, as a shell would take it."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("fp4lightning", "cli.py", "__main__.py"):
        argv[0] = "fp4lightning"
    return shlex.join(argv)
