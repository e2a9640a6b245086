"""The ``fp4lightning`` command line.

Each subcommand is a module with ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Adding one is one line in :data:`COMMANDS`, e.g.
``("eval", "fp4lightning.eval.cli")``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["COMMANDS", "main", "build_parser"]

#: (subcommand, module implementing HELP / add_arguments / run), in --help order
COMMANDS: list[tuple[str, str]] = [
    ("data", "fp4lightning.data"),
    ("train", "fp4lightning.pretrain"),
    ("export-hf", "fp4lightning.models.hf"),
    ("import-hf", "fp4lightning.initialize"),
    ("eval", "fp4lightning.eval.run"),
    ("compare", "fp4lightning.compare"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp4lightning",
        description="FP4 (E2M1) pretraining of LLaMA models with PyTorch Lightning (arXiv 2501.17116).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    # errors caused by the user's input: print the message (it says how to fix it), no traceback
    from fp4lightning.checkpoint import CheckpointError
    from fp4lightning.data import DataNotPreparedError, DataSourceError
    from fp4lightning.recipe import RecipeError

    return (RecipeError, DataNotPreparedError, DataSourceError, CheckpointError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp4lightning`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except _user_errors() as e:
        if os.environ.get("FP4LIGHTNING_DEBUG"):
            raise
        print(f"fp4lightning {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
