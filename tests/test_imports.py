"""No import cycle among the package's modules: each module's imports, read from its source (AST, nothing is
imported), form a graph over specverify's own modules, and that graph must have no cycle.

Imports inside functions count too: a lazy import that closes a cycle still ties the two modules together (each
needs the other to be understood, and moving one breaks the other at run time rather than at import).
"""
from __future__ import annotations

import ast
from pathlib import Path

import specverify

PACKAGE = Path(specverify.__file__).resolve().parent
ROOT = PACKAGE.parent


def _module_files() -> dict[str, Path]:
    """specverify.* module name -> source file (the kernels live in specverify/kernels once installed, in
    kernels/ beside the package in a checkout)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    kernels = ROOT / "kernels"
    if not (PACKAGE / "kernels").is_dir() and kernels.is_dir():
        for path in kernels.glob("*.py"):
            name = "specverify.kernels" if path.stem == "__init__" else f"specverify.kernels.{path.stem}"
            files[name] = path
    return files


def _resolve(name: str, modules: set[str]) -> str | None:
    """The specverify module ``name`` refers to (a module, or the package holding an imported attribute)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [f"{prefix}.{a.name}" for a in node.names] or [prefix]
        for name in names:
            if not name.startswith("specverify"):
                continue
            target = _resolve(name, modules)
            if target and target != module and not (target == "specverify" and "." in name and
                                                    _resolve(name, modules - {"specverify"}) is None):
                out.add(target)
    return out


def _graph() -> dict[str, set[str]]:
    files = _module_files()
    modules = set(files)
    graph = {m: _imports(m, p, modules) for m, p in files.items()}
    # the package's __init__ loads public names lazily (a table of strings, no import statement): it adds no edge;
    # a submodule importing "specverify" for its version or envvars depends on the package, not on every module
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_sees_the_modules():
    graph = _graph()
    assert "specverify.attention" in graph and "specverify.kernels.tree_attention" in graph
    assert "specverify.kernels.tree_attention" in graph["specverify.attention"] or any(
        "specverify.kernels" in t for t in graph["specverify.attention"])


def test_finds_a_cycle_when_there_is_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
