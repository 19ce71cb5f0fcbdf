"""Dependency direction: lower layers never import upper ones, nothing imports the CLI or the package
root, the models/quant/calibrate edges point one way, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "llmopt"

# package -> packages it must never import
FORBIDDEN = {
    "layers": {"step", "engine", "serve", "bench", "eval", "calibrate", "recipe", "cli", "planning", "loading", "tune"},
    "quant": {"step", "engine", "serve", "bench", "eval", "recipe", "cli", "loading", "tune"},
    "models": {"step", "engine", "serve", "bench", "eval", "calibrate", "recipe", "cli", "loading", "quant", "tune"},
    "planning": {"step", "engine", "serve", "bench", "eval", "quant", "calibrate", "recipe", "cli", "tune"},
    # the decode step (layers lowered to native calls): above models and quant, below the engine
    "step": {"engine", "serve", "bench", "eval", "calibrate", "recipe", "cli", "loading", "tune"},
    "engine": {"serve", "bench", "eval", "recipe", "cli", "tune"},
    "bench": {"serve", "eval", "recipe", "cli", "tune"},
    "serve": {"bench", "eval", "recipe", "cli", "tune"},
    "eval": {"serve", "bench", "recipe", "cli", "tune"},
    "calibrate": {"serve", "bench", "eval", "recipe", "cli", "tune"},
    "loading": {"step", "engine", "serve", "bench", "eval", "calibrate", "recipe", "cli", "tune"},
    # searches that quantize and then evaluate: above quant and eval, below the recipe runner
    "tune": {"serve", "bench", "recipe", "cli"},
    # the HTML page builder is a leaf below the commands that build their sections with it
    "report": {"layers", "step", "quant", "models", "planning", "engine", "serve", "bench", "eval", "calibrate", "loading",
               "recipe", "cli"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("llmopt."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("llmopt."):
                    found.add(alias.name.split(".")[1])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    folder = PKG / package
    if not folder.is_dir():
        pytest.skip(f"llmopt/{package} does not exist")
    bad = []
    for f in folder.rglob("*.py"):
        hits = _imports(f) & FORBIDDEN[package]
        if hits:
            bad.append(f"{f.relative_to(PKG)} imports {sorted(hits)}")
    assert not bad, bad


def test_nothing_imports_the_cli():
    bad = [str(f.relative_to(PKG)) for f in PKG.rglob("*.py")
           if f.name not in ("cli.py", "__main__.py") and "cli" in _imports(f)]
    assert not bad, bad



# ------------------------------------------------------------------------------- the module graph


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(f): f for f in sorted(PKG.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST, top_level: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements below `node`; with `top_level`, only those that run when the module is
    imported: not inside functions, not under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif top_level and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        elif top_level and isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from _import_nodes(ast.Module(body=child.orelse, type_ignores=[]), top_level)
        else:
            yield from _import_nodes(child, top_level)


def _imported_names(module: str, top_level: bool) -> set[str]:
    """Every dotted name `module` imports (`from a.b import c` gives a.b and a.b.c), relative ones resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text()), top_level):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
        names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def _edges(module: str, top_level: bool = True) -> set[str]:
    """The llmopt modules that importing `module` runs: each imported module and the packages above it
    whose __init__ runs first, less `module`'s own packages (already being imported when it runs)."""
    found = {n for n in _imported_names(module, top_level) if n in MODULES}
    for name in list(found):
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts))}
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
    return found - own


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _subpackage(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_no_module_imports_the_package_root():
    """`llmopt/__init__.py` is for users (`from llmopt import LLM`); inside the package, import the
    submodule that defines a name (`llmopt._version`, `llmopt.engine.llm`) so no import runs in a circle
    through the root."""
    bad = []
    for module, path in MODULES.items():
        if module == "llmopt":
            continue
        for node in _import_nodes(ast.parse(path.read_text()), top_level=False):
            root = (isinstance(node, ast.Import) and any(a.name == "llmopt" for a in node.names)) or (
                isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "llmopt")
            if root:
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bad, bad


def test_no_import_cycles_at_module_level():
    """What runs at import time (top-level imports, TYPE_CHECKING and function bodies excluded) never
    comes back to a module that is still being imported."""
    cycles = _cycles({m: _edges(m) for m in MODULES})
    assert not cycles, cycles


def test_planning_has_no_internal_cycle_even_inside_functions():
    """vram and parallel share `planning.memory` instead of importing each other (lazily or not)."""
    graph = {m: {t for t in _edges(m, top_level=False) if t.startswith("llmopt.planning")}
             for m in MODULES if m.startswith("llmopt.planning")}
    assert not _cycles(graph), _cycles(graph)


def test_models_never_imports_quant_or_loading_even_inside_functions():
    """One way down: quant and loading build on models; models never reaches back up, not even lazily
    (a quantized checkpoint is loaded by llmopt.loading, which composes models' float fill with quant's
    weight formats)."""
    bad = [m for m in MODULES if _subpackage(m) == "models"
           and any(_subpackage(t) in ("quant", "loading") for t in _edges(m, top_level=False))]
    assert not bad, bad


def test_calibrate_uses_only_quant_observers():
    """quant's model-level pipeline (pipeline.py, sequential.py) builds on calibrate; calibrate uses only
    quant's observers, never the pipeline, the algorithms or the checkpoint formats."""
    bad = {}
    for m in MODULES:
        if _subpackage(m) == "calibrate":
            hits = {n for n in _imported_names(m, top_level=False)
                    if n.startswith("llmopt.quant") and n in MODULES} - {"llmopt.quant.observers"}
            if hits:
                bad[m] = sorted(hits)
    assert not bad, bad


def test_the_quant_namespace_never_reaches_calibrate():
    """Importing `llmopt.quant` (what `calibrate` pulls in with the observers) never runs calibrate: only
    the model-level modules that the namespace does not import may depend on it."""
    seen, todo = set(), ["llmopt.quant"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [t for t in _edges(m) if _subpackage(t) == "quant"]
    bad = {m: sorted(t for t in _edges(m) if _subpackage(t) == "calibrate") for m in sorted(seen)}
    bad = {m: hits for m, hits in bad.items() if hits}
    assert not bad, bad


# The one import against the order of subpackages: calibrate's statistics use quant's observers, a
# leaf of quant that never leads back to calibrate (the two tests above).
CALIBRATE_USES_QUANT = {"llmopt.quant", "llmopt.quant.observers"}


def test_no_cycles_among_subpackages():
    """Subpackages (and top-level modules) form a hierarchy at import time, apart from the observers edge."""
    graph: dict[str, set[str]] = defaultdict(set)
    for m in MODULES:
        for t in _edges(m):
            a, b = _subpackage(m), _subpackage(t)
            if a != b and not (a == "calibrate" and t in CALIBRATE_USES_QUANT):
                graph[a].add(b)
    assert not _cycles(graph), _cycles(graph)
