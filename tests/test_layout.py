"""The package's shape: imports run one way, no import circles, short files.

Imports are read from the source (``ast``), including those inside functions and
under ``TYPE_CHECKING``: a lazy import hides a circle from Python, not from a reader.
Layers, from the top: ``cli → compat, sweep → launch → run (and the eval command) → eval (the library), export →
training → objectives → data, models → parallel → base``; a module may import its own layer or any layer below
it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "scaletrain"
MAX_LINES = 450

# the longest matching prefix decides a module's layer (a pure-data module may sit below its package)
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (9, ("scaletrain.cli", "scaletrain.cli_hf", "scaletrain.__main__")),
    (8, ("scaletrain.compat", "scaletrain.sweep", "scaletrain.distributed")),
    (7, ("scaletrain.launch",)),
    (6, ("scaletrain.run", "scaletrain.recipe", "scaletrain.preflight", "scaletrain.plot", "scaletrain.rl",
         "scaletrain.preference", "scaletrain.eval_command", "scaletrain.eval_preference")),
    (5, ("scaletrain.eval", "scaletrain.export")),
    (4, ("scaletrain.training",)),
    (3, ("scaletrain.objectives",)),
    (2, ("scaletrain.data", "scaletrain.models", "scaletrain.peft", "scaletrain.generation", "scaletrain.arguments")),
    (1, ("scaletrain.parallel",)),
    (0, ("scaletrain.errors", "scaletrain.logs", "scaletrain._lazy", "scaletrain.compile_cache",
         "scaletrain.host_memory", "scaletrain.key_paths", "scaletrain.folders", "scaletrain.remote_storage",
         "scaletrain.argument_names", "scaletrain")),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("scaletrain") and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    matches = [(len(p), level) for level, prefixes in LAYERS for p in prefixes
               if module == p or module.startswith(p + ".")]
    if not matches:
        raise AssertionError(f"{module} has no layer: add it to LAYERS")
    return max(matches)[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_imports_never_run_up_the_layers():
    graph = _graph()
    upward = [f"{src} -> {dst}" for src, targets in sorted(graph.items()) for dst in sorted(targets)
              if _layer(dst) > _layer(src)]
    assert upward == []


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_stay_short(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.name}: split it by job"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The checker itself: an import inside a function and a relative import both count."""
    pkg = tmp_path / "scaletrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from scaletrain.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import a\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", pkg)
    assert _cycles(_graph()) == [["scaletrain.sub.a", "scaletrain.sub.b"]]
