"""The packages import each other without a cycle: every `import weft...` of every .py file
(function-local imports included) collapsed to its package (weft.components, weft.parallelisms,
weft.models, weft.float8, weft.recipe; a top-level module is its own node) forms a graph with no
cycle, so each package can be read, tested and changed above the ones it uses."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package weft
SKIPPED = {"tests", "benchmarks"}  # scripts and tests import everything; nothing imports them


def node_of_module(module: str) -> str | None:
    """The graph node of a dotted module name: weft.<package> or weft.<top-level module>."""
    parts = module.split(".")
    if parts[0] != "weft":
        return None
    return ".".join(parts[:2]) if len(parts) > 1 else "weft"


def node_of_file(path: Path) -> str:
    relative = path.relative_to(ROOT).with_suffix("")
    parts = relative.parts
    return "weft" if parts == ("__init__",) else f"weft.{parts[0]}"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function, relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ["weft", *path.relative_to(ROOT).parent.parts]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from weft import float8`
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] in SKIPPED or any(part.startswith(".") for part in relative.parts):
            continue
        source = node_of_file(path)
        edges = graph.setdefault(source, set())
        for module in imported_modules(path):
            target = node_of_module(module)
            if target is not None and target != source and (target == "weft" or _exists(target)):
                edges.add(target)
    return graph


def _exists(node: str) -> bool:
    name = node.split(".", 1)[1]
    return (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as its nodes in order (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from weft.models import spec\n    from . import x\n")
    # resolved as if the file sat at the root: `from . import x` is weft.x
    assert {"weft.models", "weft.models.spec", "weft.x"} <= {m for m in _imports_as_root(source)}


def _imports_as_root(path: Path) -> set[str]:
    global ROOT
    saved, ROOT = ROOT, path.parent
    try:
        return imported_modules(path)
    finally:
        ROOT = saved


def test_the_packages_import_each_other_without_a_cycle():
    graph = package_graph()
    assert {"weft.components", "weft.parallelisms", "weft.models", "weft.recipe"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"
