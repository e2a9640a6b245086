"""How a command printed for the user names this package's console scripts, so it runs as printed.

``fp4lightning`` is on ``PATH`` once its environment is activated (``source .venv/bin/activate``).
``scripts/main.sh`` runs ``.venv/bin/fp4lightning`` without activating anything, so a hint saying
``fp4lightning train ... --resume`` would answer "command not found" in the shell that ran it.
Every command the package prints for the user to run (the command that resumes a run, the one
that prepares missing data, ...) starts with :func:`program`: the bare name where the shell finds
this very script under it, else the script's path.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import sysconfig

__all__ = ["program"]


def program(name: str = "fp4lightning") -> str:
    """The shell word(s) that run console script ``name`` of this installation.

    ``name`` itself when ``PATH`` finds the script this process runs (or, from Python, the one
    installed beside its interpreter); otherwise that script's path, relative to the working
    directory when it lies inside it (``.venv/bin/fp4lightning``). Without an installed script
    ``fp4lightning`` becomes ``PYTHON -m fp4lightning.cli``.
    """
    script = _running_script(name) or _installed_script(name)
    if script is None:
        return f"{shlex.quote(sys.executable)} -m fp4lightning.cli" if name == "fp4lightning" else name
    found = shutil.which(name)
    if found is not None and _same_file(found, script):
        return name
    return shlex.quote(_shown(script))


def _running_script(name: str) -> str | None:
    """The console script ``name`` this process was started as (``sys.argv[0]``), if it was."""
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) in (name, f"{name}.exe") and os.path.isfile(argv0):
        return os.path.abspath(argv0)
    return None


def _installed_script(name: str) -> str | None:
    """Console script ``name`` installed with this interpreter (``python -m ...``, the Python API)."""
    for folder in (os.path.dirname(os.path.abspath(sys.executable)), sysconfig.get_path("scripts")):
        path = os.path.join(folder, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _shown(path: str) -> str:
    """``path`` relative to the working directory when inside it (``./x`` for a file there: a bare
    word would be looked up on ``PATH``), else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive
        return path
    if rel.startswith(os.pardir):
        return path
    return rel if os.sep in rel else os.path.join(os.curdir, rel)
