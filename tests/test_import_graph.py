"""The packages import each other without a cycle: every `import weft...` of every .py file
(function-local imports included) collapsed to its package (weft.components, weft.parallelisms,
weft.models, weft.layers, weft.recipe; a top-level module such as weft.train or weft.errors is its own
node) forms a graph with no cycle, so each package can be read, tested and changed above the ones it
uses; the transforms know no model; and no module of tests/ imports a test module (what tests share
lives in tests/support/ and conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.import_graph import find_cycle

ROOT = Path(__file__).resolve().parent.parent  # the repository root is the package weft
SKIPPED = {"tests", "benchmarks"}  # scripts and tests import everything; nothing imports them


def node_of_module(module: str, root: Path = ROOT) -> str | None:
    """The graph node of a dotted module name: weft.<package> or weft.<top-level module>."""
    parts = module.split(".")
    if parts[0] != "weft" or len(parts) == 1:
        return None
    return f"weft.{parts[1]}" if (root / parts[1]).is_dir() or (root / f"{parts[1]}.py").is_file() else None


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, at the top or inside a function, relative imports resolved."""
    package = ["weft", *path.relative_to(root).parent.parts]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from weft import train`
    return found


def package_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """weft.<package or top-level module> -> the nodes its files import."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in SKIPPED or parts == ("__init__.py",) or any(p.startswith(".") for p in parts):
            continue
        source = f"weft.{Path(parts[0]).stem}"
        targets = {node_of_module(module, root) for module in imported_modules(path, root)}
        graph.setdefault(source, set()).update(t for t in targets if t is not None and t != source)
    return graph


def test_the_graph_sees_function_local_and_relative_imports(tmp_path):
    for package in ("a", "b", "c"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "a" / "m.py").write_text("def f():\n    from weft.b.x import y\n")
    (tmp_path / "b" / "x.py").write_text("from ..c import z\nimport torch\n")
    (tmp_path / "c" / "z.py").write_text("import weft.a.m\n")
    graph = package_graph(tmp_path)
    assert graph == {"weft.a": {"weft.b"}, "weft.b": {"weft.c"}, "weft.c": {"weft.a"}}
    assert find_cycle(graph) == ["weft.a", "weft.b", "weft.c", "weft.a"]


def test_the_packages_import_each_other_without_a_cycle():
    graph = package_graph()
    assert {"weft.components", "weft.parallelisms", "weft.models", "weft.recipe", "weft.train"} <= set(graph)
    assert "weft.parallelisms" in graph["weft.components"]  # the reader sees the edges there are
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between packages: {' -> '.join(cycle)}"


def imported_test_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The test modules (tests.<...>.test_*) a file imports, at the top or inside a function, relative imports resolved."""
    modules = {m.removeprefix("weft.") for m in imported_modules(path, root)}  # relative ones resolve under weft.
    return {m for m in modules if m.split(".")[0] == "tests" and any(p.startswith("test_") for p in m.split(".")[1:])}


def test_the_test_import_check_sees_every_form_of_import(tmp_path):
    (tmp_path / "tests" / "models").mkdir(parents=True)
    forms = {"from tests.models.test_a import helper\n": {"tests.models.test_a", "tests.models.test_a.helper"},
             "import tests.test_b\n": {"tests.test_b"},
             "from tests.models import test_a\n": {"tests.models.test_a"},
             "def f():\n    from .test_a import helper\n": {"tests.models.test_a", "tests.models.test_a.helper"},
             "from ..support.helpers import test_data\n": {"tests.support.helpers.test_data"},  # a name: still refused
             "from tests.support.dist_utils import run_distributed\nimport pytest\n": set()}
    for source, expected in forms.items():
        (tmp_path / "tests" / "models" / "test_x.py").write_text(source)
        assert imported_test_modules(tmp_path / "tests" / "models" / "test_x.py", tmp_path) == expected, source


def test_no_test_module_imports_another():
    offenders = {str(path.relative_to(ROOT)): sorted(found) for path in sorted((ROOT / "tests").rglob("*.py"))
                 if (found := imported_test_modules(path))}
    assert not offenders, f"test modules imported (move what they share to tests/support/): {offenders}"


def test_the_transforms_import_no_model():
    """parallelisms/ and float8/ reach a model through what it declares (`tensor_parallel_plan`,
    `pipeline_units`) and what models share with them (weft.layers), as torchtitan's distributed code."""
    graph = package_graph()
    for transforms in ("weft.parallelisms", "weft.float8"):
        assert "weft.models" not in graph[transforms], f"{transforms} imports weft.models"


# The packages weft imports where they are used, inside functions: optional ones (pyproject's extras)
# and torchao's optional parts. Every other import is at the top of its module (ruff's PLC0415).
LAZY_PACKAGES = ("transformers", "torchft", "wandb", "tokenizers", "jinja2", "pyarrow", "zstandard", "torchao")


def imports_inside_functions(path: Path) -> set[str]:
    """The top-level package of every import statement inside a function of `path`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in inner.names}
                elif isinstance(inner, ast.ImportFrom):
                    found.add("." if inner.level else inner.module.split(".")[0])
    return found


def test_the_lazy_import_check_sees_nested_and_relative_imports(tmp_path):
    (tmp_path / "m.py").write_text("import os\n\ndef f():\n    def g():\n        import json.decoder\n"
                                   "    from . import x\n    from torchft import Manager\n")
    assert imports_inside_functions(tmp_path / "m.py") == {"json", ".", "torchft"}


def test_only_optional_packages_are_imported_inside_functions():
    library = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in ("tests", "benchmarks")
               and not p.relative_to(ROOT).parts[0].startswith(".")]
    lazy = {str(p.relative_to(ROOT)): imports_inside_functions(p) - set(LAZY_PACKAGES) for p in library}
    assert len(lazy) > 100 and {name: found for name, found in lazy.items() if found} == {}


def test_generation_sits_between_the_recipe_and_components():
    """The order train.py, generate.py, cli.py; recipe; generation; components; ...: the engine imports no
    recipe and no entry point, and reaches models through their spec only (weft.models, never a family)."""
    graph = package_graph()
    assert not graph["weft.generation"] & {"weft.recipe", "weft.train", "weft.generate", "weft.cli"}
    families = {f"weft.models.{path.name}" for path in (ROOT / "models").iterdir()
                if path.is_dir() and path.name not in ("common", "__pycache__")}
    for path in sorted((ROOT / "generation").rglob("*.py")):
        reached = {module for module in imported_modules(path) for family in families
                   if module == family or module.startswith(f"{family}.")}
        assert not reached, f"{path.name} imports a family folder: {sorted(reached)}"
