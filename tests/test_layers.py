"""The package's layering (docs/design.md, "Layers"): no import runs from a lower layer to a higher one.

Every module's imports, including lazy ones inside functions, are read with ``ast`` and checked
against the layer table in docs/design.md. Also: the top-level ``kernels/`` and ``eval/`` folders
import only as ``fp4lightning.kernels`` / ``fp4lightning.eval`` (no second copy of a module), and
``import fp4lightning`` stays light.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package folder -> dotted package name (pyproject.toml's package-dir)
PACKAGE_DIRS = {"fp4lightning": "fp4lightning", "kernels": "fp4lightning.kernels", "eval": "fp4lightning.eval"}


def _layer_table() -> dict[str, tuple[int, str]]:
    """{module prefix (without ``fp4lightning.``): (rank, layer name)} from docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    m = re.search(r"<!-- layers:.*?-->(.*?)<!-- /layers -->", text, re.S)
    assert m, "docs/design.md has no <!-- layers: ... --> ... <!-- /layers --> table"
    table: dict[str, tuple[int, str]] = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([\w.]+)`", cells[2]):
            assert name not in table, f"docs/design.md lists `{name}` in two layers"
            table[name] = (int(cells[0]), cells[1])
    return table


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    out = {}
    for folder, pkg in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if any(p.startswith(".") for p in parts):
                continue
            name = ".".join((pkg, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Dotted names of the package modules ``name`` imports (anywhere in the file)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        found.update(t for t in targets if t == "fp4lightning" or t.startswith("fp4lightning."))
    return found


def _short(mod: str) -> str:
    return mod.removeprefix("fp4lightning.") if mod != "fp4lightning" else mod


def _layer(mod: str, table: dict[str, tuple[int, str]]) -> tuple[int, str] | None:
    short = _short(mod)
    while short:
        if short in table:
            return table[short]
        short = short.rpartition(".")[0]
    return None


def test_every_module_has_a_layer():
    table, modules = _layer_table(), _modules()
    missing = [_short(m) for m in modules if m != "fp4lightning" and _layer(m, table) is None]
    assert not missing, (f"modules missing from the layer table in docs/design.md: {missing}; "
                         "add each to the row of its layer")
    stale = [n for n in table if not any(_short(m) == n or _short(m).startswith(n + ".") for m in modules)]
    assert not stale, f"docs/design.md's layer table lists modules that do not exist: {stale}"


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    table, modules = _layer_table(), _modules()
    bad = []
    for mod, path in modules.items():
        if mod == "fp4lightning":
            continue  # the public surface re-exports from every layer (lazily)
        src = _layer(mod, table)
        for dep in _imports(mod, path, modules):
            if dep == "fp4lightning":
                bad.append(f"{_short(mod)} imports the package root `fp4lightning` (the public surface, above "
                           "every layer): import from the submodule instead")
                continue
            dst = _layer(dep, table)
            if src is None or dst is None or dst[0] <= src[0]:
                continue
            bad.append(f"{_short(mod)} ({src[1]}) imports {_short(dep)} ({dst[1]})")
    assert not bad, "imports from a lower layer to a higher one (docs/design.md, Layers):\n" + "\n".join(bad)


def test_the_check_sees_lazy_imports(tmp_path):
    """The parser finds an import inside a function body, relative or absolute."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .trainer import Trainer\n    import fp4lightning.cli\n")
    modules = {"fp4lightning.lightning.trainer": src, "fp4lightning.cli": src}
    assert _imports("fp4lightning.lightning.fabric", src, modules) == {"fp4lightning.lightning.trainer", "fp4lightning.cli"}


@pytest.mark.parametrize("folder, module", [("kernels", "kernels.gemm"), ("eval", "eval.run")])
def test_top_level_folders_refuse_a_second_name(folder, module):
    """``import kernels.gemm`` from the repository root would load a second copy of the module."""
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError") and f"import it as 'fp4lightning.{folder}'" in last, last


def test_import_fp4lightning_is_light():
    code = ("import sys, fp4lightning; "
            "print(sorted(m for m in ('lightning', 'omegaconf', 'lm_eval') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    import fp4lightning

    assert len(fp4lightning.__all__) <= 9
    for name in fp4lightning.__all__:
        assert getattr(fp4lightning, name) is not None


def _module_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {mod: {d for d in _imports(mod, path, modules) if d in modules and d != mod}
            for mod, path in modules.items() if mod != "fp4lightning"}


def test_no_import_circles():
    """No two modules import each other, directly or through others (Tarjan's strongly connected components)."""
    graph = _module_graph()
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(_short(m) for m in comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_no_private_names_across_modules():
    """A name starting with one underscore is its module's own: no other module imports it."""
    modules = _modules()
    bad = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = node.module or ""
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            if not src.startswith("fp4lightning"):
                continue
            bad += [f"{_short(mod)} imports {_short(src)}.{a.name}" for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported across modules (make them public or keep them home):\n" + "\n".join(bad)


#: issue 38's bounds: "no function over about 60 lines or 4 levels of nesting"
MAX_FUNCTION_LINES = 65
MAX_NESTING = 4
_BLOCKS = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)


def _nesting(node: ast.AST, depth: int = 0) -> int:
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # a nested function is measured on its own
        deepest = max(deepest, _nesting(child, depth + isinstance(child, _BLOCKS)))
    return deepest


def _is_triton_kernel(fn: ast.FunctionDef) -> bool:
    # a @triton.jit body is one GPU launch: splitting it would split the kernel
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def test_functions_are_short_and_shallow():
    bad = []
    for mod, path in _modules().items():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_triton_kernel(fn):
                continue
            lines, depth = fn.end_lineno - fn.lineno + 1, _nesting(fn)
            if lines > MAX_FUNCTION_LINES or depth > MAX_NESTING:
                bad.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}: {lines} lines, nesting {depth}")
    assert not bad, (f"functions over {MAX_FUNCTION_LINES} lines or {MAX_NESTING} levels deep "
                     "(split them by job):\n" + "\n".join(bad))
