"""The modules of jaxpage and serving import each other without cycles, and each layer imports only the layers
below it. Every import counts: inside functions and under ``if TYPE_CHECKING:`` too (a lazy or annotation-only
import hides a cycle; it does not remove it)."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxpage", "serving")
# Bottom to top. A module's layer is the first prefix it starts with; a layer may import its own and lower ones.
LAYERS = (
    ("base", ("jaxpage.config", "jaxpage.utils", "jaxpage.sampling_params", "jaxpage.structured_outputs",
              "jaxpage.outputs", "jaxpage.sequence")),
    ("distributed", ("jaxpage.distributed",)),
    ("attention", ("jaxpage.attention",)),
    ("models", ("jaxpage.models",)),
    ("structured", ("jaxpage.structured",)),
    ("core", ("jaxpage.core",)),
    ("worker", ("jaxpage.worker",)),
    ("engine", ("jaxpage.engine",)),
    ("entrypoints", ("jaxpage.entrypoints",)),
    ("serving", ("serving",)),
)


def _module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module, subpackages' too (a subpackage's __init__ is the subpackage; the top packages' own
    __init__ files, which only re-export, are left out)."""
    names = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if len(parts) > 1 and not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                names[".".join(parts)] = path
    return names


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the file imports anywhere (top level or in a function)."""
    found, stack = set(), [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
        stack.extend(ast.iter_child_nodes(node))
    return found & modules


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep, path + [dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_module_graph_has_no_cycle():
    names = _module_names()
    graph = {name: _imports(path, set(names)) - {name} for name, path in names.items()}
    assert graph["jaxpage.engine.llm_engine"] >= {"jaxpage.core.scheduler", "jaxpage.engine.output_processor"}, "graph misread"
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("name", sorted(_module_names()))
def test_each_module_imports_on_its_own(name):
    importlib.import_module(name)
