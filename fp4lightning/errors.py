"""One error policy for every ``fp4lightning`` subcommand.

A :class:`UserError` is caused by the user's input (a recipe key, a path, a command-line value):
its message names what to change, so a command prints it on one line and exits with
:data:`EXIT_USAGE`. Anything else is a bug and keeps its traceback. Every error class the
package raises for bad input (``RecipeError``, ``CheckpointError``, the data errors, ...)
derives from :class:`UserError`; this module imports nothing, so any layer may use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["UserError", "UsageError", "InputNotFoundError", "EXIT_USAGE", "run_command", "check_writable_dir"]

#: exit status of a command stopped by a user error (argparse uses the same for bad arguments)
EXIT_USAGE = 2


class UserError(Exception):
    """Bad input; the message says how to fix it. Commands print it without a traceback."""


class UsageError(UserError, ValueError):
    """A command-line or configuration value is invalid (the message names the option)."""


class InputNotFoundError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist or is not what it should be."""


def run_command(prog: str, fn: Callable[[Any], int | None], args: Any) -> int:
    """Run ``fn(args)`` under the policy: a :class:`UserError` prints ``prog: error: ...`` and
    returns :data:`EXIT_USAGE`; any other exception propagates (a bug: traceback). Set
    ``FP4LIGHTNING_DEBUG=1`` to see the traceback of a user error too."""
    try:
        return int(fn(args) or 0)
    except UserError as e:
        if os.environ.get("FP4LIGHTNING_DEBUG"):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def check_writable_dir(path: str | os.PathLike, what: str, error: type[UserError] = UsageError,
                       fix: str | None = None) -> None:
    """Raise ``error`` naming ``what`` (the key or option, e.g. ``"--out"``) unless ``path`` is a
    folder that can be written, or can be created: its nearest existing ancestor must be a
    writable folder. Commands call it before any long work, so a bad output path fails first."""
    fix = fix or f"choose another {what}"
    probe = os.path.abspath(os.fspath(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise error(f"{what} {os.fspath(path)}: {probe} exists and is not a folder; {fix}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise error(f"{what} {os.fspath(path)}: {probe} is not writable; {fix}")
