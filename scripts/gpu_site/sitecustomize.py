"""This checkout's ``fp4lightning`` importable without installing it (the GPU check; scripts/gpu_check.sh).

pyproject.toml ships the top-level ``kernels/`` and ``eval/`` folders as ``fp4lightning.kernels`` and
``fp4lightning.eval`` (setuptools ``package-dir``). A machine where the package is not installed
(the lent GPU machine) gets the same mapping from this file: with ``scripts/gpu_site`` on
``PYTHONPATH`` Python imports it at start-up, in every process the check starts (pytest, benchmarks,
compile workers); ``scripts/gpu_stage.py`` loads it itself. The checkout's root goes first on
``sys.path``, so this checkout wins over any installed copy.
"""
import importlib.abc
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_DIRS = {"fp4lightning.kernels": "kernels", "fp4lightning.eval": "eval"}


class PackageDirFinder(importlib.abc.MetaPathFinder):
    """Finds ``fp4lightning.kernels`` / ``fp4lightning.eval`` in this checkout's top-level folders."""

    def find_spec(self, name, path=None, target=None):
        if name not in PACKAGE_DIRS:
            return None
        folder = os.path.join(ROOT, PACKAGE_DIRS[name])
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def install() -> None:
    """Put the checkout first on ``sys.path`` and the finder first on ``sys.meta_path`` (once)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if not any(type(f).__name__ == "PackageDirFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, PackageDirFinder())


install()
